//! GGUF container parsing over a memory map: header, metadata and tensor infos.
//!
//! Our own parser rather than candle's `Content::read`, because candle rejects a whole file when any one
//! tensor has a type it does not know (IQ*, TQ*, MXFP4 ...), and real DeepSeek/GLM quants contain such
//! tensors. Nothing here reads tensor data: opening a 400 GB file touches only its header pages.
//! Every count and length is checked against the bytes actually left, so a corrupt header can never
//! trigger a huge allocation; metadata arrays are held as one `Vec` of their element type.
//!
//! A model split by llama.cpp's `gguf-split` (or gguf-py) into `NAME-00001-of-0000N.gguf` shards opens as
//! one file from any of its shards: metadata from the first, tensors from all (see `split.rs`).

use super::reader::{parse_file, Parsed};
use super::tensor::{Shard, TensorInfo};
use super::value::Value;
use crate::error::{quote, Error, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// An opened GGUF model: the parsed header(s) plus memory maps. A split model (several shards) reads
/// as one: metadata from the first shard, tensors from all of them.
pub struct GgufFile {
    /// The path as given (any shard of a split model).
    pub path: PathBuf,
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    /// Tensor infos in file order (shard by shard).
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Alignment and data section offset of the first shard.
    pub alignment: u64,
    pub data_offset: u64,
    /// Total bytes over all shards.
    pub file_size: u64,
    /// The files, in split order; one for an unsplit model.
    pub shards: Vec<Shard>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .field("shards", &self.shards.len())
            .finish()
    }
}

impl GgufFile {
    /// Open and parse a GGUF file, or all shards of a split model given any one of them. Fails only on
    /// a malformed, truncated or inconsistent file (or shard set), never on tensor types.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let first = parse_file(path)?;
        let parts = super::split::gather(path, first)?;
        Self::assemble(path, parts)
    }

    /// One logical file from its shards (in split order): metadata of the first, tensors of all.
    fn assemble(path: &Path, parts: Vec<Parsed>) -> Result<GgufFile> {
        let mut shards = Vec::with_capacity(parts.len());
        let mut tensors = Vec::new();
        let mut tensor_index = HashMap::new();
        let mut head = None;
        for (i, p) in parts.into_iter().enumerate() {
            for mut t in p.tensors {
                t.shard = i;
                if let Some(&j) = tensor_index.get(&t.name) {
                    let other: &TensorInfo = &tensors[j];
                    return Err(Error::format(
                        p.shard.path.display(),
                        format!(
                            "tensor {} is in shard {} and again in shard {} of the split model",
                            quote(&t.name),
                            other.shard + 1,
                            i + 1
                        ),
                    ));
                }
                tensor_index.insert(t.name.clone(), tensors.len());
                tensors.push(t);
            }
            if head.is_none() {
                head = Some((p.metadata, p.meta_index));
            }
            shards.push(p.shard);
        }
        let (metadata, meta_index) = head.expect("at least one shard");
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: shards[0].version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            alignment: shards[0].alignment,
            data_offset: shards[0].data_offset,
            file_size: shards.iter().map(|s| s.file_size).sum(),
            shards,
        })
    }

    /// The header's identity, as a capture's manifest records it (docs/captures.md): the byte count up
    /// to the tensor data of the first shard and the SHA-256 of those bytes (lowercase hex). gguf-py's
    /// `GGUFReader.data_offset` is the same count (`tests/it/capture.rs` holds them together).
    pub fn header_sha256(&self) -> (u64, String) {
        use sha2::{Digest, Sha256};
        let s = &self.shards[0];
        let end = (s.data_offset as usize).min(s.map.len());
        let digest = Sha256::digest(&s.map[..end]);
        let hex = digest.iter().map(|b| format!("{b:02x}")).collect();
        (end as u64, hex)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(|v| v.as_str())
    }
    /// Give back the resident pages of these tensors' bytes: the file is mapped, and every page read
    /// stays in the process's resident set until released (a whole model's worth by the last layer).
    /// Pages touched again are read back from the file, so this is only ever a hint; it fails silently.
    pub fn release<'a>(&self, tensors: impl IntoIterator<Item = &'a TensorInfo>) {
        for t in tensors {
            let (Some(s), Some(n)) = (self.shards.get(t.shard), t.n_bytes()) else {
                continue;
            };
            let start = s.data_offset.saturating_add(t.offset) as usize;
            if start.saturating_add(n as usize) > s.map.len() {
                continue;
            }
            #[cfg(unix)]
            // SAFETY: a read-only shared mapping of a file nobody writes: MADV_DONTNEED drops this
            // process's pages and a later read faults the same bytes back in from the file.
            let _ = unsafe {
                s.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, n as usize)
            };
        }
    }

    /// The raw bytes of a tensor whose type is known (from whichever shard holds it). They may sit at
    /// any address the file's alignment allows (even an odd one), so read them as bytes.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Result<&[u8]> {
        let n = t.n_bytes().ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor {} has {}: its size is unknown",
                quote(&t.name),
                t.ty
            ))
        })?;
        let s = self.shards.get(t.shard);
        let range = s.and_then(|s| {
            let start = s.data_offset.checked_add(t.offset)?;
            let end = start.checked_add(n)?;
            s.map.get(start as usize..end as usize)
        });
        range.ok_or_else(|| {
            Error::Tensor(format!(
                "tensor {} is not inside its file (a tensor info from another file?)",
                quote(&t.name)
            ))
        })
    }
}
