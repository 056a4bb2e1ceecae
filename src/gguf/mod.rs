//! GGUF files: the container (`file`, read by `reader` into `tensor` infos and shards, metadata `value`s), the ggml type table (`dtype`), dequantization (`dequant`) and
//! writing (`write`, used by the fixture generator).

pub mod dequant;
pub mod dtype;
pub mod file;
mod fuel;
mod reader;
mod split;
mod tensor;
pub mod value;
pub mod write;

pub use dequant::{dequantize_f32, dequantize_f32_into, dequantize_rows};
pub use dtype::GgmlType;
pub use file::GgufFile;
pub use reader::GGUF_MAGIC;
pub use tensor::{Shard, TensorInfo, TensorType};
pub use value::{Array, Value};
