//! GGUF container parsing over a memory map: header, metadata and tensor infos.
//!
//! Our own parser rather than candle's `Content::read`, because candle rejects a whole file when any one
//! tensor has a type it does not know (IQ*, TQ*, MXFP4 ...), and real DeepSeek/GLM quants contain such
//! tensors. Nothing here reads tensor data: opening a 400 GB file touches only its header pages.
//! Every count and length is checked against the bytes actually left, so a corrupt header can never
//! trigger a huge allocation.

use super::dtype::GgmlType;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4; // GGML_MAX_DIMS
const MAX_ARRAY_DEPTH: usize = 8;

/// A metadata value, as typed in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    /// Any integer type as u64 (negative values are `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// Any numeric type as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v as f64),
            Value::I16(v) => Some(v as f64),
            Value::I32(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// A short human form; long arrays are summarised.
    pub fn display_short(&self) -> String {
        match self {
            Value::String(s) if s.len() > 80 => format!("{:?}…", &s[..s.floor_char_boundary(80)]),
            Value::String(s) => format!("{s:?}"),
            Value::Array(a) if a.len() > 8 => format!("[{} items]", a.len()),
            Value::Array(a) => format!(
                "[{}]",
                a.iter()
                    .map(|v| v.display_short())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(v) => format!("{v}"),
            other => other
                .as_u64()
                .map(|v| v.to_string())
                .or_else(|| other.as_f64().map(|v| v.to_string()))
                .unwrap_or_default(),
        }
    }
    /// JSON form (arrays of more than 64 items are summarised by length).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Value::String(s) => json!(s),
            Value::Bool(b) => json!(b),
            Value::F32(v) => json!(*v as f64),
            Value::F64(v) => json!(v),
            Value::Array(a) if a.len() > 64 => json!({ "array_len": a.len() }),
            Value::Array(a) => serde_json::Value::Array(a.iter().map(|v| v.to_json()).collect()),
            Value::I8(_) | Value::I16(_) | Value::I32(_) | Value::I64(_) => {
                json!(self.as_f64().unwrap_or(0.0) as i64)
            }
            other => json!(other.as_u64().unwrap_or(0)),
        }
    }
}

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
    /// Offset from the start of the data section.
    pub offset: u64,
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

/// An opened GGUF file: parsed header plus a memory map of the whole file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub file_size: u64,
    map: memmap2::Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::format(self.path.display(), msg)
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: needs {n} bytes for {what} at byte {}, but the file ends at byte {}",
                self.pos,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("length checked"))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(self.err(format!(
                "{what}: string length {len} at byte {} exceeds the {} bytes left in the file",
                self.pos - 8,
                self.remaining()
            )));
        }
        let bytes = self.take(len as usize, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.arr::<1>(key)?[0]),
            1 => Value::I8(self.arr::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.arr(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.arr(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.arr(key)?)),
            7 => Value::Bool(self.arr::<1>(key)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!(
                        "metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let elem = self.u32(key)?;
                let len = self.u64(key)?;
                // Every element takes at least one byte: a length beyond what is left is corrupt.
                if len > self.remaining() as u64 {
                    return Err(self.err(format!(
                        "metadata key {key:?}: array length {len} exceeds the {} bytes left in the file",
                        self.remaining()
                    )));
                }
                let mut items = Vec::with_capacity((len as usize).min(1 << 16));
                for _ in 0..len {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.arr(key)?)),
            other => {
                return Err(self.err(format!("metadata key {key:?}: unknown value type {other}")))
            }
        })
    }
}

impl GgufFile {
    /// Open and parse a GGUF file. Fails only on a malformed or truncated file, never on tensor types.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path)
            .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
        let file_size = file
            .metadata()
            .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?
            .len();
        if file_size < 24 {
            return Err(Error::format(
                path.display(),
                format!(
                    "not a GGUF file: {file_size} bytes is smaller than the 24-byte GGUF header"
                ),
            ));
        }
        // SAFETY: the map is read-only; a file truncated underneath us while mapped is outside our contract,
        // as for every mmap-based model loader.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| Error::io(format!("cannot map {}", path.display()), e))?;
        Self::parse(path, map, file_size)
    }

    fn parse(path: &Path, map: memmap2::Mmap, file_size: u64) -> Result<GgufFile> {
        let mut r = Reader {
            buf: &map[..],
            pos: 0,
            path,
        };
        let magic = r.arr::<4>("magic")?;
        if &magic != GGUF_MAGIC {
            return Err(r.err(format!(
                "not a GGUF file: magic is {:?}, expected \"GGUF\"",
                String::from_utf8_lossy(&magic)
            )));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(r.err(format!(
                "unsupported GGUF version {version} (this tool reads versions 2 and 3)"
            )));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Smallest metadata entry: 8 (key len) + 1 (key) + 4 (type) + 1 (value) bytes.
        if n_kv > r.remaining() as u64 / 14 {
            return Err(r.err(format!(
                "metadata count {n_kv} is impossible for a file of {file_size} bytes (truncated or corrupt)"
            )));
        }
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&key)?;
            let value = r.value(ty, &key, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(r.err(format!("metadata key {key:?} appears twice")));
            }
            metadata.push((key, value));
        }
        // Smallest tensor info: 8 + 1 (name) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset).
        if n_tensors > r.remaining() as u64 / 33 {
            return Err(r.err(format!(
                "tensor count {n_tensors} is impossible for a file of {file_size} bytes (truncated or corrupt)"
            )));
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor #{i} name"))?;
            let n_dims = r.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.err(format!(
                    "tensor {name:?}: {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"
                )));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(r.u64(&name)?);
            }
            let n_el = ne.iter().try_fold(1u64, |acc, &d| {
                acc.checked_mul(d).filter(|&v| v < (1u64 << 62))
            });
            if ne.contains(&0) || n_el.is_none() {
                return Err(r.err(format!("tensor {name:?}: absurd dimensions {ne:?}")));
            }
            let type_id = r.u32(&name)?;
            let ty = GgmlType::from_id(type_id)
                .map(TensorType::Known)
                .unwrap_or(TensorType::Unknown(type_id));
            let offset = r.u64(&name)?;
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(r.err(format!("tensor {name:?} appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                ne,
                ty,
                offset,
            });
        }
        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(r.err(format!(
                        "general.alignment is {}, not a power of two",
                        v.display_short()
                    )))
                }
            },
        };
        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let f = GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
            file_size,
            map,
        };
        f.check_tensor_ranges()?;
        Ok(f)
    }

    fn check_tensor_ranges(&self) -> Result<()> {
        for t in &self.tensors {
            if t.offset % self.alignment != 0 {
                return Err(Error::format(
                    self.path.display(),
                    format!(
                        "tensor {:?}: data offset {} is not a multiple of the alignment {}",
                        t.name, t.offset, self.alignment
                    ),
                ));
            }
            if let TensorType::Known(ty) = t.ty {
                let Some(bytes) = ty.bytes_for(t.n_elements()) else {
                    return Err(Error::format(
                        self.path.display(),
                        format!(
                            "tensor {:?}: {} elements is not a whole number of {} blocks of {}",
                            t.name,
                            t.n_elements(),
                            ty,
                            ty.block
                        ),
                    ));
                };
                if t.ne[0] % ty.block as u64 != 0 {
                    return Err(Error::format(
                        self.path.display(),
                        format!(
                            "tensor {:?}: row length {} is not a multiple of the {} block size {}",
                            t.name, t.ne[0], ty, ty.block
                        ),
                    ));
                }
                let end = self
                    .data_offset
                    .checked_add(t.offset)
                    .and_then(|s| s.checked_add(bytes));
                if end.is_none_or(|e| e > self.file_size) {
                    return Err(Error::format(
                        self.path.display(),
                        format!(
                            "truncated: tensor {:?} ({} bytes at data offset {}) extends past the end of the file ({} bytes)",
                            t.name, bytes, t.offset, self.file_size
                        ),
                    ));
                }
            }
        }
        Ok(())
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
    /// The raw bytes of a tensor whose type is known.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Result<&[u8]> {
        let n = t.n_bytes().ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor {:?} has {}: its size is unknown",
                t.name, t.ty
            ))
        })?;
        let start = (self.data_offset + t.offset) as usize;
        Ok(&self.map[start..start + n as usize])
    }
}
