//! Reading one GGUF file's header: magic, metadata and tensor infos, every count and length checked
//! against the bytes actually left before anything is allocated.

use super::dtype::GgmlType;
use super::tensor::{Shard, TensorInfo, TensorType};
use super::value::{Array, Value};
use crate::error::{quote, Error, Result};
use std::collections::HashMap;
use std::path::Path;

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4; // GGML_MAX_DIMS
const MAX_ARRAY_DEPTH: usize = 8;

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
