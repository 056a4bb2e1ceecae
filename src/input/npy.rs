//! A reader for the `.npy` files numpy writes (format versions 1–3): float16/32/64 in either byte order,
//! C or Fortran order. The header is parsed and the shape checked against the expected one and against
//! the file size before any data is read, so a bad header can never size an allocation.

use crate::error::{Error, Result};
use ndarray::{ArrayD, IxDyn, ShapeBuilder};
use std::io::Read;
use std::path::Path;

/// The parsed header of a `.npy` file.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    /// Element size in bytes: 2, 4 or 8 (all floats).
    pub item: usize,
    pub big_endian: bool,
    pub fortran_order: bool,
    pub shape: Vec<usize>,
    /// Byte offset of the data.
    pub data_start: usize,
}

const MAGIC: &[u8] = b"\x93NUMPY";

/// Read and parse the header (at most the first 64 KiB plus the header length the preamble states).
pub fn read_header(path: &Path) -> Result<Header> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let mut pre = [0u8; 12];
    let n = read_up_to(&mut f, &mut pre, path)?;
    let bad = |m: String| {
        Error::Usage(format!(
            "{}: not a readable .npy array: {m}",
            path.display()
        ))
    };
    if n < 10 || &pre[..6] != MAGIC {
        return Err(bad("no .npy magic (\\x93NUMPY)".into()));
    }
    let (len, start) = match pre[6] {
        1 => (u16::from_le_bytes([pre[8], pre[9]]) as usize, 10),
        2 | 3 if n == 12 => (
            u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]) as usize,
            12,
        ),
        2 | 3 => return Err(bad("the file ends inside the header".into())),
        v => return Err(bad(format!("format version {v} is not 1, 2 or 3"))),
    };
    // numpy pads headers to 64 bytes; real ones are a few hundred bytes at most.
    if len > 1 << 16 {
        return Err(bad(format!("header length {len} is implausible")));
    }
    let total = start + len;
    let mut text = vec![0u8; total];
    let have = n.min(total);
    text[..have].copy_from_slice(&pre[..have]);
    if have < total && read_up_to(&mut f, &mut text[have..], path)? < total - have {
        return Err(bad("the file ends inside the header".into()));
    }
    let text = std::str::from_utf8(&text[start..]).map_err(|_| bad("header is not text".into()))?;
    parse_dict(text)
        .map(|(descr, fortran_order, shape)| (descr, fortran_order, shape, start + len))
        .map_err(bad)
        .and_then(|(descr, fortran_order, shape, data_start)| {
            let (big_endian, item) = match descr.as_str() {
                "<f2" => (false, 2),
                "<f4" => (false, 4),
                "<f8" => (false, 8),
                ">f2" => (true, 2),
                ">f4" => (true, 4),
                ">f8" => (true, 8),
                d => {
                    return Err(Error::Usage(format!(
                        "{}: element type {d:?} is not supported; save the activations as float16, float32 or float64",
                        path.display()
                    )))
                }
            };
            Ok(Header {
                item,
                big_endian,
                fortran_order,
                shape,
                data_start,
            })
        })
}

fn read_up_to(f: &mut std::fs::File, buf: &mut [u8], path: &Path) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        }
    }
    Ok(got)
}

/// The three keys of the header dict: `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`.
fn parse_dict(text: &str) -> std::result::Result<(String, bool, Vec<usize>), String> {
    let body = text
        .trim_end_matches(['\n', ' ', '\0'])
        .trim()
        .strip_prefix('{')
        .and_then(|s| s.strip_suffix('}'))
        .ok_or("the header is not a {...} dict")?;
    let value = |key: &str| -> std::result::Result<&str, String> {
        let at = ["'", "\""]
            .iter()
            .find_map(|q| body.find(&format!("{q}{key}{q}")))
            .ok_or(format!("the header has no {key:?}"))?;
        let rest = body[at + key.len() + 2..].trim_start();
        rest.strip_prefix(':')
            .map(str::trim_start)
            .ok_or(format!("no ':' after {key:?} in the header"))
    };
    let descr = value("descr")?;
    let q = descr.chars().next().filter(|c| *c == '\'' || *c == '"');
    let descr = q
        .and_then(|q| descr[1..].split_once(q))
        .map(|(d, _)| d.to_string())
        .ok_or("'descr' is not a quoted type string (structured arrays are not supported)")?;
    let fo = value("fortran_order")?;
    let fortran_order = if fo.starts_with("True") {
        true
    } else if fo.starts_with("False") {
        false
    } else {
        return Err("'fortran_order' is neither True nor False".into());
    };
    let shape = value("shape")?;
    let inner = shape
        .strip_prefix('(')
        .and_then(|s| s.split_once(')'))
        .map(|(s, _)| s)
        .ok_or("'shape' is not a tuple")?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim_end_matches('L')
                .parse::<usize>()
                .map_err(|_| format!("shape entry {s:?} is not a size"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((descr, fortran_order, shape))
}

/// The data of a file whose header `h` was read and whose shape the caller accepted: checked against
/// the file size first, then read and converted to f64 in standard (C) layout.
pub fn read_data(path: &Path, h: &Header) -> Result<ArrayD<f64>> {
    let shown = path.display();
    let count = h
        .shape
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .and_then(|c| c.checked_mul(h.item));
    let size = std::fs::metadata(path)
        .map_err(|e| Error::io(format!("reading {shown}"), e))?
        .len();
    let have = size.saturating_sub(h.data_start as u64);
    match count {
        Some(c) if c as u64 == have => {}
        _ => {
            return Err(Error::Usage(format!(
                "{shown}: the header's shape {:?} of {}-byte values does not match the {have} data bytes in the file",
                h.shape, h.item
            )))
        }
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(format!("reading {shown}"), e))?;
    let data = &bytes[h.data_start..];
    if data.len() as u64 != have {
        return Err(Error::Usage(format!(
            "{shown}: the file changed while being read"
        )));
    }
    let be = h.big_endian;
    let v: Vec<f64> = match h.item {
        2 => data
            .chunks_exact(2)
            .map(|c| {
                let b = [c[0], c[1]];
                let bits = if be {
                    u16::from_be_bytes(b)
                } else {
                    u16::from_le_bytes(b)
                };
                half::f16::from_bits(bits).to_f64()
            })
            .collect(),
        4 => data
            .chunks_exact(4)
            .map(|c| {
                let b = [c[0], c[1], c[2], c[3]];
                f64::from(if be {
                    f32::from_be_bytes(b)
                } else {
                    f32::from_le_bytes(b)
                })
            })
            .collect(),
        _ => data
            .chunks_exact(8)
            .map(|c| {
                let b: [u8; 8] = c.try_into().expect("8 bytes");
                if be {
                    f64::from_be_bytes(b)
                } else {
                    f64::from_le_bytes(b)
                }
            })
            .collect(),
    };
    let shape = IxDyn(&h.shape);
    let a = if h.fortran_order {
        ArrayD::from_shape_vec(shape.f(), v)
    } else {
        ArrayD::from_shape_vec(shape, v)
    }
    .map_err(|e| Error::Usage(format!("{shown}: {e}")))?;
    // The optimized path reads rows as contiguous slices: always hand out C order.
    Ok(if h.fortran_order {
        a.as_standard_layout().into_owned()
    } else {
        a
    })
}
