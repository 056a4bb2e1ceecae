//! A GGUF file parsed leniently for mutation: every count and length kept as written (so a mutation can
//! make them lie), written back byte for byte.

/// A scalar's raw bytes, a string, or an array; the declared type id lives in the parent.
#[derive(Debug, Clone)]
pub enum Val {
    Raw(Vec<u8>),
    Str {
        len: u64,
        bytes: Vec<u8>,
    },
    Arr {
        elem: u32,
        len: u64,
        items: Vec<Val>,
    },
}

#[derive(Debug, Clone)]
pub struct Kv {
    pub key: Vec<u8>,
    pub key_len: u64,
    pub ty: u32,
    pub val: Val,
}

#[derive(Debug, Clone)]
pub struct Ti {
    pub name: Vec<u8>,
    pub name_len: u64,
    pub n_dims: u32,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub offset: u64,
}

/// A GGUF file as written: header fields, metadata, tensor infos, then the data section, re-padded to
/// `pad` on writing so that tensor offsets keep pointing at the same data when the header changes size.
#[derive(Debug, Clone)]
pub struct Doc {
    pub magic: [u8; 4],
    pub version: u32,
    pub n_tensors: u64,
    pub n_kv: u64,
    pub kvs: Vec<Kv>,
    pub tensors: Vec<Ti>,
    pub pad: u64,
    pub data: Vec<u8>,
}

struct Cur<'a> {
    b: &'a [u8],
    p: usize,
}

impl Cur<'_> {
    fn take(&mut self, n: u64) -> Option<&[u8]> {
        let n = usize::try_from(n).ok()?;
        let end = self.p.checked_add(n)?;
        let s = self.b.get(self.p..end)?;
        self.p = end;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<(u64, Vec<u8>)> {
        let len = self.u64()?;
        Some((len, self.take(len)?.to_vec()))
    }
    fn val(&mut self, ty: u32, depth: usize) -> Option<Val> {
        let width = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                let (len, bytes) = self.str()?;
                return Some(Val::Str { len, bytes });
            }
            9 if depth < 8 => {
                let elem = self.u32()?;
                let len = self.u64()?;
                if len > self.b.len() as u64 {
                    return None;
                }
                let items = (0..len)
                    .map(|_| self.val(elem, depth + 1))
                    .collect::<Option<_>>()?;
                return Some(Val::Arr { elem, len, items });
            }
            _ => return None,
        };
        Some(Val::Raw(self.take(width)?.to_vec()))
    }
}

pub(super) fn scalar_width(ty: u32) -> Option<usize> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

impl Doc {
    /// Parse a well-formed GGUF file; `None` for anything else.
    pub fn parse(b: &[u8]) -> Option<Doc> {
        let mut c = Cur { b, p: 0 };
        let magic: [u8; 4] = c.take(4)?.try_into().ok()?;
        let version = c.u32()?;
        let n_tensors = c.u64()?;
        let n_kv = c.u64()?;
        if n_kv > b.len() as u64 || n_tensors > b.len() as u64 {
            return None;
        }
        let mut kvs = Vec::new();
        for _ in 0..n_kv {
            let (key_len, key) = c.str()?;
            let ty = c.u32()?;
            let val = c.val(ty, 0)?;
            kvs.push(Kv {
                key,
                key_len,
                ty,
                val,
            });
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let (name_len, name) = c.str()?;
            let n_dims = c.u32()?;
            if n_dims > 8 {
                return None;
            }
            let dims = (0..n_dims).map(|_| c.u64()).collect::<Option<_>>()?;
            let ty = c.u32()?;
            let offset = c.u64()?;
            tensors.push(Ti {
                name,
                name_len,
                n_dims,
                dims,
                ty,
                offset,
            });
        }
        let pad = kvs
            .iter()
            .find(|kv| kv.key == b"general.alignment")
            .and_then(|kv| match &kv.val {
                Val::Raw(r) if r.len() == 4 => {
                    Some(u32::from_le_bytes(r[..].try_into().ok()?) as u64)
                }
                Val::Raw(r) if r.len() == 8 => Some(u64::from_le_bytes(r[..].try_into().ok()?)),
                _ => None,
            })
            .filter(|a| a.is_power_of_two() && *a <= 1 << 16)
            .unwrap_or(32);
        let start = (c.p as u64).div_ceil(pad) * pad;
        let data = b.get(start as usize..).unwrap_or_default().to_vec();
        Some(Doc {
            magic,
            version,
            n_tensors,
            n_kv,
            kvs,
            tensors,
            pad,
            data,
        })
    }

    pub fn write(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(self.data.len() + 4096);
        o.extend_from_slice(&self.magic);
        o.extend_from_slice(&self.version.to_le_bytes());
        o.extend_from_slice(&self.n_tensors.to_le_bytes());
        o.extend_from_slice(&self.n_kv.to_le_bytes());
        fn val(o: &mut Vec<u8>, v: &Val) {
            match v {
                Val::Raw(r) => o.extend_from_slice(r),
                Val::Str { len, bytes } => {
                    o.extend_from_slice(&len.to_le_bytes());
                    o.extend_from_slice(bytes);
                }
                Val::Arr { elem, len, items } => {
                    o.extend_from_slice(&elem.to_le_bytes());
                    o.extend_from_slice(&len.to_le_bytes());
                    items.iter().for_each(|i| val(o, i));
                }
            }
        }
        for kv in &self.kvs {
            o.extend_from_slice(&kv.key_len.to_le_bytes());
            o.extend_from_slice(&kv.key);
            o.extend_from_slice(&kv.ty.to_le_bytes());
            val(&mut o, &kv.val);
        }
        for t in &self.tensors {
            o.extend_from_slice(&t.name_len.to_le_bytes());
            o.extend_from_slice(&t.name);
            o.extend_from_slice(&t.n_dims.to_le_bytes());
            t.dims
                .iter()
                .for_each(|d| o.extend_from_slice(&d.to_le_bytes()));
            o.extend_from_slice(&t.ty.to_le_bytes());
            o.extend_from_slice(&t.offset.to_le_bytes());
        }
        let pad = self.pad.max(1);
        let start = (o.len() as u64).div_ceil(pad) * pad;
        o.resize(start as usize, 0);
        o.extend_from_slice(&self.data);
        o
    }

    pub(super) fn arch(&self) -> String {
        self.kvs
            .iter()
            .find(|kv| kv.key == b"general.architecture")
            .and_then(|kv| match &kv.val {
                Val::Str { bytes, .. } => Some(String::from_utf8_lossy(bytes).into_owned()),
                _ => None,
            })
            .unwrap_or_else(|| "deepseek2".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lenient parse writes a generated fixture back byte for byte, so mutations start from the real
    /// layout (padding and offsets included).
    #[test]
    fn doc_roundtrip() {
        let dir = tempfile_dir();
        let p = dir.join("t.gguf");
        let mut spec = crate::fixture::Preset::Tiny.spec();
        spec.layers = 1;
        crate::fixture::write(&spec, &p).unwrap();
        let b = std::fs::read(&p).unwrap();
        let d = Doc::parse(&b).expect("fixture parses");
        assert_eq!(d.kvs.len() as u64, d.n_kv);
        assert!(!d.tensors.is_empty());
        assert!(d.write() == b, "re-written bytes differ");
        std::fs::remove_dir_all(dir).ok();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("mla-diff-mutate-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
