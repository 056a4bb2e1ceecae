//! Tensors to and from a runner: safetensors files, floats in the run's storage dtype (the values the
//! optimized path stored, exactly), integers as i32.

use crate::error::{Error, Result};
use crate::precision::Dtype;
use safetensors::tensor::{Dtype as St, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// The dtypes that cross the protocol in memory (crates/mla-diff-py hands tensors over as (dtype name,
/// shape, bytes)): the run's floats, outputs in f64, i32 indices (and i64, which a Python runner may
/// return for indices), by their safetensors names.
pub const WIRE: [St; 6] = [St::BF16, St::F16, St::F32, St::F64, St::I32, St::I64];

/// A wire dtype's name, as safetensors spells it ("BF16", "F32", …).
pub fn wire_name(d: St) -> String {
    format!("{d:?}")
}

/// The wire dtype of that name; `None` for any other (U8, BOOL, … never cross the protocol).
pub fn wire_parse(s: &str) -> Option<St> {
    WIRE.into_iter().find(|&d| wire_name(d) == s)
}

/// The protocol version this build speaks (`describe.protocol`, the files' `__metadata__`).
pub const PROTOCOL: u32 = 1;

/// One named input.
pub struct Named {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
    pub dtype: St,
}

/// Floats already rounded to `dt` (so the conversion is exact), stored as `dt`.
pub fn floats(name: &'static str, shape: Vec<usize>, v: &[f32], dt: Dtype) -> Named {
    debug_assert_eq!(shape.iter().product::<usize>(), v.len());
    let (bytes, dtype) = match dt {
        Dtype::Bf16 => (
            v.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            St::BF16,
        ),
        Dtype::F16 => (
            v.iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            St::F16,
        ),
        Dtype::F32 => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), St::F32),
    };
    Named {
        name,
        shape,
        bytes,
        dtype,
    }
}

/// bf16 values as their bit patterns (a device buffer read back as is).
pub fn bf16_bits(name: &'static str, shape: Vec<usize>, v: &[u16]) -> Named {
    Named {
        name,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        dtype: St::BF16,
    }
}

pub fn ints(name: &'static str, shape: Vec<usize>, v: &[i32]) -> Named {
    Named {
        name,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        dtype: St::I32,
    }
}

pub fn write(path: &Path, tensors: &[Named]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|v| (t.name, v))
                .map_err(|e| Error::Usage(format!("runner input {}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>>>()?;
    // Every input file carries the protocol version it was written for.
    let meta = HashMap::from([("mla_diff_protocol".to_string(), PROTOCOL.to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(meta), path)
        .map_err(|e| Error::Environment(format!("writing {}: {e}", path.display())))
}

/// One output as f64 values, with the dtype the runner wrote it in.
pub struct Output {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
    pub dtype: &'static str,
}

/// The runner's output file: every float tensor by name.
pub struct Outputs {
    pub tensors: HashMap<String, Output>,
    runner: String,
}

impl Outputs {
    pub fn read(path: &Path, runner: &str) -> Result<Outputs> {
        let bad =
            |m: String| Error::Environment(format!("runner {runner}: {}: {m}", path.display()));
        let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let raw = st
            .tensors()
            .into_iter()
            .map(|(name, t)| (name, t.dtype(), t.shape().to_vec(), t.data()));
        Outputs::from_raw(raw, runner).map_err(bad)
    }

    /// Outputs from (name, dtype, shape, little-endian bytes), as an in-process runner hands them over.
    pub fn from_raw<'a>(
        raw: impl IntoIterator<Item = (String, St, Vec<usize>, &'a [u8])>,
        runner: &str,
    ) -> std::result::Result<Outputs, String> {
        let mut tensors = HashMap::new();
        for (name, st_dtype, shape, d) in raw {
            let want = shape.iter().product::<usize>() * st_dtype.bitsize() / 8;
            if d.len() != want {
                return Err(format!(
                    "output {name} has {} bytes, its shape {shape:?} and dtype {st_dtype:?} need {want}",
                    d.len()
                ));
            }
            let (data, dtype): (Vec<f64>, &str) = match st_dtype {
                St::BF16 => (
                    d.chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
                        .collect(),
                    "bf16",
                ),
                St::F16 => (
                    d.chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
                        .collect(),
                    "fp16",
                ),
                St::F32 => (
                    d.chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64)
                        .collect(),
                    "f32",
                ),
                St::F64 => (
                    d.chunks_exact(8)
                        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .collect(),
                    "f64",
                ),
                other => {
                    return Err(format!(
                        "output {name} has dtype {other:?}; outputs are bf16, fp16, f32 or f64"
                    ))
                }
            };
            tensors.insert(name, Output { shape, data, dtype });
        }
        Ok(Outputs {
            tensors,
            runner: runner.to_string(),
        })
    }

    /// Output `name`, which must have `shape`.
    pub fn take(&mut self, name: &str, shape: &[usize], op: &str) -> Result<Output> {
        let o = self.tensors.remove(name).ok_or_else(|| {
            Error::Environment(format!(
                "runner {}: the {op} output has no tensor '{name}'",
                self.runner
            ))
        })?;
        if o.shape != shape {
            return Err(Error::Environment(format!(
                "runner {}: {op} output '{name}' has shape {:?}, expected {shape:?}",
                self.runner, o.shape
            )));
        }
        Ok(o)
    }
}

/// The inputs of `path` (as the runner left it) whose bytes differ from what was sent, with how many of
/// their values changed; a file the runner removed or truncated changes every input.
pub fn changed(path: &Path, sent: &[Named]) -> Result<Vec<(&'static str, usize)>> {
    let all = || {
        sent.iter()
            .map(|t| (t.name, t.bytes.len() / width(t.dtype)))
            .collect()
    };
    let Ok(bytes) = std::fs::read(path) else {
        return Ok(all());
    };
    let Ok(st) = safetensors::SafeTensors::deserialize(&bytes) else {
        return Ok(all());
    };
    Ok(sent
        .iter()
        .filter_map(|t| {
            let w = width(t.dtype);
            let n = match st.tensor(t.name) {
                Ok(v) if v.data().len() == t.bytes.len() => v
                    .data()
                    .chunks(w)
                    .zip(t.bytes.chunks(w))
                    .filter(|(a, b)| a != b)
                    .count(),
                _ => t.bytes.len() / w,
            };
            (n > 0).then_some((t.name, n))
        })
        .collect())
}

fn width(d: St) -> usize {
    (d.bitsize() / 8).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_are_safetensors_names_and_only_the_protocols() {
        for d in WIRE {
            assert_eq!(wire_parse(&wire_name(d)), Some(d));
        }
        assert_eq!(wire_name(St::BF16), "BF16");
        assert_eq!(wire_parse("I32"), Some(St::I32));
        // Dtypes that never cross the protocol stay refused, as before.
        for other in ["U8", "BOOL", "F8_E4M3", "bf16", ""] {
            assert_eq!(wire_parse(other), None, "{other}");
        }
    }
}
