//! GGUF files: the container (`file`), the ggml type table (`dtype`), dequantization (`dequant`) and
//! writing (`write`, used by the fixture generator).

pub mod dequant;
pub mod dtype;
pub mod file;
mod fuel;
mod split;
pub mod write;

pub use dequant::{dequantize_f32, dequantize_rows};
pub use dtype::GgmlType;
pub use file::{Array, GgufFile, Shard, TensorInfo, TensorType, Value};
