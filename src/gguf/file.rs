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

use super::dtype::GgmlType;
use crate::error::{quote, Error, Result};
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
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array, held compactly as a `Vec` of its element type (a u8 array costs one byte an
/// element). GGUF stores the element type once per array, so elements can never be of mixed types.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// Arrays of arrays; each inner array has its own element type.
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

macro_rules! array_from {
    ($($t:ty => $v:ident),*) => {$(
        impl From<Vec<$t>> for Array {
            fn from(v: Vec<$t>) -> Array {
                Array::$v(v)
            }
        }
    )*};
}
array_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, Array => Array, u64 => U64, i64 => I64, f64 => F64);

impl Array {
    /// The GGUF type id of the elements.
    pub fn elem_type_id(&self) -> u32 {
        match self {
            Array::U8(_) => 0,
            Array::I8(_) => 1,
            Array::U16(_) => 2,
            Array::I16(_) => 3,
            Array::U32(_) => 4,
            Array::I32(_) => 5,
            Array::F32(_) => 6,
            Array::Bool(_) => 7,
            Array::String(_) => 8,
            Array::Array(_) => 9,
            Array::U64(_) => 10,
            Array::I64(_) => 11,
            Array::F64(_) => 12,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element `i` as a `Value` (a copy; strings and inner arrays are cloned).
    pub fn get(&self, i: usize) -> Option<Value> {
        Some(match self {
            Array::U8(v) => Value::U8(*v.get(i)?),
            Array::I8(v) => Value::I8(*v.get(i)?),
            Array::U16(v) => Value::U16(*v.get(i)?),
            Array::I16(v) => Value::I16(*v.get(i)?),
            Array::U32(v) => Value::U32(*v.get(i)?),
            Array::I32(v) => Value::I32(*v.get(i)?),
            Array::F32(v) => Value::F32(*v.get(i)?),
            Array::Bool(v) => Value::Bool(*v.get(i)?),
            Array::String(v) => Value::String(v.get(i)?.clone()),
            Array::Array(v) => Value::Array(v.get(i)?.clone()),
            Array::U64(v) => Value::U64(*v.get(i)?),
            Array::I64(v) => Value::I64(*v.get(i)?),
            Array::F64(v) => Value::F64(*v.get(i)?),
        })
    }
    /// The elements as `Value`s.
    pub fn iter(&self) -> impl Iterator<Item = Value> + '_ {
        (0..self.len()).map(|i| self.get(i).expect("index in range"))
    }
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
            Value::String(s) => quote(s),
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
    map: memmap2::Mmap,
}

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

/// One parsed file, before shards are put together.
pub(super) struct Parsed {
    pub metadata: Vec<(String, Value)>,
    pub meta_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    pub shard: Shard,
}

impl Parsed {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

/// Fixed-size little-endian elements of a metadata array.
fn elems<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    b.chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunk of N")))
        .collect()
}

/// A label for an error message: our own labels ("tensor count") as they are, anything that came from
/// the file (a key or tensor name: control characters, megabytes of junk) escaped and cut by `quote`.
fn label(what: &str) -> String {
    let plain = what.len() <= 80 && what.bytes().all(|b| (0x20..0x7f).contains(&b));
    if plain {
        what.to_string()
    } else {
        quote(what)
    }
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
                "truncated: needs {n} bytes for {} at byte {}, but the file ends at byte {}",
                label(what),
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
                "{}: string length {len} at byte {} exceeds the {} bytes left in the file",
                label(what),
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
            9 => Value::Array(self.array(key, depth)?),
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.arr(key)?)),
            other => {
                return Err(self.err(format!(
                    "metadata key {}: unknown value type {other}",
                    quote(key)
                )))
            }
        })
    }
    /// An array value (element type, length, elements), read straight into its compact form.
    fn array(&mut self, key: &str, depth: usize) -> Result<Array> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.err(format!(
                "metadata key {}: arrays nested deeper than {MAX_ARRAY_DEPTH}",
                quote(key)
            )));
        }
        let elem = self.u32(key)?;
        let len = self.u64(key)?;
        // The least bytes one element takes in the file: the length must fit in what is left before
        // anything is allocated.
        let min_size: u64 = match elem {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12, // element type + length of an empty inner array
            other => {
                return Err(self.err(format!(
                    "metadata key {}: unknown array element type {other}",
                    quote(key)
                )))
            }
        };
        if len
            .checked_mul(min_size)
            .is_none_or(|b| b > self.remaining() as u64)
        {
            return Err(self.err(format!(
                "metadata key {}: array length {len} exceeds the {} bytes left in the file",
                quote(key),
                self.remaining()
            )));
        }
        let n = len as usize;
        let fixed = |r: &mut Self| r.take(n * min_size as usize, key);
        Ok(match elem {
            0 => Array::U8(fixed(self)?.to_vec()),
            1 => Array::I8(elems(fixed(self)?, |[b]| b as i8)),
            2 => Array::U16(elems(fixed(self)?, u16::from_le_bytes)),
            3 => Array::I16(elems(fixed(self)?, i16::from_le_bytes)),
            4 => Array::U32(elems(fixed(self)?, u32::from_le_bytes)),
            5 => Array::I32(elems(fixed(self)?, i32::from_le_bytes)),
            6 => Array::F32(elems(fixed(self)?, f32::from_le_bytes)),
            7 => Array::Bool(elems(fixed(self)?, |[b]| b != 0)),
            10 => Array::U64(elems(fixed(self)?, u64::from_le_bytes)),
            11 => Array::I64(elems(fixed(self)?, i64::from_le_bytes)),
            12 => Array::F64(elems(fixed(self)?, f64::from_le_bytes)),
            8 => {
                let mut v = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    v.push(self.string(key)?);
                }
                Array::String(v)
            }
            _ => {
                let mut v = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    v.push(self.array(key, depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}

/// Open a path only if it is a regular file: a FIFO or a device would block or never end.
fn open_regular(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let not_regular = || {
        Error::format(
            path.display(),
            "not a regular file (a GGUF model must be a plain file)",
        )
    };
    let meta = std::fs::metadata(path)
        .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    // O_NONBLOCK: should the path have turned into a FIFO since the check, open must not wait for a
    // writer; it changes nothing for a regular file.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

/// Parse one file's header and check its tensors' ranges.
pub(super) fn parse_file(path: &Path) -> Result<Parsed> {
    let file = open_regular(path)?;
    let file_size = file
        .metadata()
        .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?
        .len();
    if file_size < 24 {
        return Err(Error::format(
            path.display(),
            format!("not a GGUF file: {file_size} bytes is smaller than the 24-byte GGUF header"),
        ));
    }
    // SAFETY: the map is read-only; a file truncated underneath us while mapped is outside our contract,
    // as for every mmap-based model loader.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| Error::io(format!("cannot map {}", path.display()), e))?;
    parse(path, map, file_size)
}

fn parse(path: &Path, map: memmap2::Mmap, file_size: u64) -> Result<Parsed> {
    let mut r = Reader {
        buf: &map[..],
        pos: 0,
        path,
    };
    let magic = r.arr::<4>("magic")?;
    if &magic != GGUF_MAGIC {
        return Err(r.err(format!(
            "not a GGUF file: magic is {}, expected \"GGUF\"",
            quote(&String::from_utf8_lossy(&magic))
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
            return Err(r.err(format!("metadata key {} appears twice", quote(&key))));
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
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = r.string(&format!("tensor #{i} name"))?;
        let n_dims = r.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.err(format!(
                "tensor {}: {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})",
                quote(&name)
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
            return Err(r.err(format!("tensor {}: absurd dimensions {ne:?}", quote(&name))));
        }
        let type_id = r.u32(&name)?;
        let ty = GgmlType::from_id(type_id)
            .map(TensorType::Known)
            .unwrap_or(TensorType::Unknown(type_id));
        let offset = r.u64(&name)?;
        if !names.insert(name.clone()) {
            return Err(r.err(format!("tensor {} appears twice", quote(&name))));
        }
        tensors.push(TensorInfo {
            name,
            ne,
            ty,
            offset,
            shard: 0, // set when shards are put together
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
    let shard = Shard {
        path: path.to_path_buf(),
        version,
        alignment,
        data_offset,
        file_size,
        n_tensors: tensors.len(),
        map,
    };
    check_tensor_ranges(&shard, &tensors)?;
    Ok(Parsed {
        metadata,
        meta_index,
        tensors,
        shard,
    })
}

fn check_tensor_ranges(s: &Shard, tensors: &[TensorInfo]) -> Result<()> {
    let err = |msg: String| Error::format(s.path.display(), msg);
    for t in tensors {
        let name = quote(&t.name);
        if t.offset % s.alignment != 0 {
            return Err(err(format!(
                "tensor {name}: data offset {} is not a multiple of the alignment {}",
                t.offset, s.alignment
            )));
        }
        if let TensorType::Known(ty) = t.ty {
            let Some(bytes) = ty.bytes_for(t.n_elements()) else {
                return Err(err(format!(
                    "tensor {name}: {} elements is not a whole number of {} blocks of {}",
                    t.n_elements(),
                    ty,
                    ty.block
                )));
            };
            if t.ne[0] % ty.block as u64 != 0 {
                return Err(err(format!(
                    "tensor {name}: row length {} is not a multiple of the {} block size {}",
                    t.ne[0], ty, ty.block
                )));
            }
            let end = s
                .data_offset
                .checked_add(t.offset)
                .and_then(|x| x.checked_add(bytes));
            if end.is_none_or(|e| e > s.file_size) {
                return Err(err(format!(
                    "truncated: tensor {name} ({bytes} bytes at data offset {}) extends past the end of the file ({} bytes)",
                    t.offset, s.file_size
                )));
            }
        }
    }
    Ok(())
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

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(|v| v.as_str())
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
