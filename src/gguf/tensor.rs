//! What the header says of each tensor (`TensorInfo`, its `TensorType`) and of each file of a model
//! (`Shard`): below both the reader that fills them and the file that serves them.

use super::dtype::GgmlType;
use std::path::PathBuf;

/// The type of a tensor: a known ggml type or an id this build has never heard of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    Known(GgmlType),
    Unknown(u32),
}

impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorType::Known(t) => write!(f, "{t}"),
            TensorType::Unknown(id) => write!(f, "unknown ggml type {id}"),
        }
    }
}

/// One tensor's header entry. `ne` is ggml order: `ne[0]` is the contiguous dimension.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub ne: Vec<u64>,
    pub ty: TensorType,
    /// Offset from the start of the data section of its shard.
    pub offset: u64,
    /// Index of the shard holding the data in `GgufFile::shards` (0 for an unsplit file).
    pub shard: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }
    /// Byte size, when the type is known.
    pub fn n_bytes(&self) -> Option<u64> {
        match self.ty {
            TensorType::Known(t) => t.bytes_for(self.n_elements()),
            TensorType::Unknown(_) => None,
        }
    }
    /// Shape in row-major (numpy / torch) order: `ne` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
}

/// One file of a model: its own header fields and a memory map of it.
pub struct Shard {
    pub path: PathBuf,
    pub version: u32,
    pub alignment: u64,
    /// Absolute offset of this file's data section.
    pub data_offset: u64,
    pub file_size: u64,
    /// How many of the model's tensors this file holds.
    pub n_tensors: usize,
    pub(super) map: memmap2::Mmap,
}
