//! Writing GGUF v3 files, streamed: the header (metadata in insertion order, tensor infos with offsets
//! computed up front) goes out first, then each tensor's bytes in declaration order, so a multi-GB file
//! never has to be held in memory. Used by the fixture generator and by tests that need odd files.
//!
//! Also here: turning f32 values into the bytes of a ggml type (`quantize`) and llama.cpp's choice of a
//! compatible type when a row does not fit the requested block size (`storage_type`).

use super::dtype::GgmlType;
use super::reader::GGUF_MAGIC;
use super::value::{Array, Value};
use crate::error::{Error, Result};
use std::io::Write;

/// GGUF's default alignment (llama.cpp, gguf-py), used unless `general.alignment` is added.
pub const ALIGNMENT: u64 = 32;

/// One tensor as it will appear in the header.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub name: String,
    /// ggml order: `ne[0]` is the contiguous dimension (the reverse of the torch shape).
    pub ne: Vec<u64>,
    pub type_id: u32,
    pub n_bytes: u64,
    /// Offset from the start of the data section (a multiple of the alignment).
    pub offset: u64,
}

/// The header of a GGUF file being built: metadata and tensor infos, in the order they were added.
#[derive(Debug, Default, Clone)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PlannedTensor>,
    data_size: u64,
    /// From `general.alignment`; 0 means the default `ALIGNMENT`.
    alignment: u64,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Usage(format!("GGUF writer: {}", msg.into()))
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a metadata entry. Keys must be unique. `general.alignment` (a power of two, added before any
    /// tensor) sets the alignment of the data section and of every tensor, as readers expect.
    pub fn add(&mut self, key: impl Into<String>, value: Value) -> Result<()> {
        let key = key.into();
        if self.metadata.iter().any(|(k, _)| *k == key) {
            return Err(bad(format!("metadata key {key:?} added twice")));
        }
        if key == "general.alignment" {
            match value.as_u64() {
                Some(a) if a.is_power_of_two() && self.tensors.is_empty() => self.alignment = a,
                _ => {
                    return Err(bad(
                        "general.alignment must be a power of two added before any tensor",
                    ))
                }
            }
        }
        self.metadata.push((key, value));
        Ok(())
    }

    fn align(&self) -> u64 {
        if self.alignment == 0 {
            ALIGNMENT
        } else {
            self.alignment
        }
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }
    pub fn tensors(&self) -> &[PlannedTensor] {
        &self.tensors
    }

    /// Declare a tensor of a known type; its byte size follows from `ne` and the type.
    pub fn add_tensor(&mut self, name: impl Into<String>, ne: &[u64], ty: GgmlType) -> Result<()> {
        let name = name.into();
        let n: u64 = ne.iter().product();
        if ne
            .first()
            .is_none_or(|&d| !d.is_multiple_of(ty.block as u64))
        {
            return Err(bad(format!(
                "tensor {name:?}: row length {:?} is not a multiple of the {ty} block size {}",
                ne.first(),
                ty.block
            )));
        }
        let n_bytes = ty
            .bytes_for(n)
            .ok_or_else(|| bad(format!("tensor {name:?}: size overflows")))?;
        self.add_tensor_raw(name, ne, ty.id, n_bytes)
    }

    /// Declare a tensor with any type id (also ones unknown to this build) and an explicit byte size.
    pub fn add_tensor_raw(
        &mut self,
        name: impl Into<String>,
        ne: &[u64],
        type_id: u32,
        n_bytes: u64,
    ) -> Result<()> {
        let name = name.into();
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(bad(format!("tensor {name:?} added twice")));
        }
        let offset = self.data_size;
        self.data_size = offset + n_bytes.div_ceil(self.align()) * self.align();
        self.tensors.push(PlannedTensor {
            name,
            ne: ne.to_vec(),
            type_id,
            n_bytes,
            offset,
        });
        Ok(())
    }

    /// The header bytes, padded to the alignment: exactly what precedes the data section.
    pub fn header_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(GGUF_MAGIC);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut b, k);
            b.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut b, v);
        }
        for t in &self.tensors {
            put_str(&mut b, &t.name);
            b.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.type_id.to_le_bytes());
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        let padded = (b.len() as u64).div_ceil(self.align()) * self.align();
        b.resize(padded as usize, 0);
        b
    }

    /// Total file size once every tensor is written.
    pub fn file_size(&self) -> u64 {
        self.header_bytes().len() as u64 + self.data_size
    }

    /// Write the header and return a sink that takes the tensors' bytes in declaration order.
    pub fn start<W: Write>(self, mut w: W) -> Result<TensorSink<W>> {
        w.write_all(&self.header_bytes())
            .map_err(|e| Error::io("writing GGUF header", e))?;
        let mut sink = TensorSink {
            w,
            alignment: self.align(),
            tensors: self.tensors,
            current: 0,
            done_in_current: 0,
        };
        sink.skip_empty();
        Ok(sink)
    }
}

/// Receives tensor data after the header, in declaration order; pads each tensor to the alignment.
pub struct TensorSink<W: Write> {
    w: W,
    alignment: u64,
    tensors: Vec<PlannedTensor>,
    current: usize,
    done_in_current: u64,
}

impl<W: Write> TensorSink<W> {
    /// The tensor the next bytes belong to, `None` when all are complete.
    pub fn current(&self) -> Option<&PlannedTensor> {
        self.tensors.get(self.current)
    }

    /// Append bytes to the current tensor. A chunk never spans two tensors.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let t = self
            .tensors
            .get(self.current)
            .ok_or_else(|| bad("more tensor data than declared"))?;
        let left = t.n_bytes - self.done_in_current;
        if bytes.len() as u64 > left {
            return Err(bad(format!(
                "tensor {:?}: {} bytes written, only {left} left of {}",
                t.name,
                bytes.len(),
                t.n_bytes
            )));
        }
        let pad = if bytes.len() as u64 == left {
            t.n_bytes.div_ceil(self.alignment) * self.alignment - t.n_bytes
        } else {
            0
        };
        let name = t.name.clone();
        self.w
            .write_all(bytes)
            .and_then(|_| self.w.write_all(&vec![0u8; pad as usize]))
            .map_err(|e| Error::io(format!("writing tensor {name}"), e))?;
        self.done_in_current += bytes.len() as u64;
        if self.done_in_current == self.tensors[self.current].n_bytes {
            self.current += 1;
            self.done_in_current = 0;
            self.skip_empty();
        }
        Ok(())
    }

    /// Zero-sized tensors have no bytes to wait for.
    fn skip_empty(&mut self) {
        while self
            .tensors
            .get(self.current)
            .is_some_and(|t| t.n_bytes == 0)
        {
            self.current += 1;
        }
    }

    /// Check every tensor is complete, flush, and hand back the writer.
    pub fn finish(mut self) -> Result<W> {
        if let Some(t) = self.tensors.get(self.current) {
            return Err(bad(format!(
                "tensor {:?} incomplete: {} of {} bytes written",
                t.name, self.done_in_current, t.n_bytes
            )));
        }
        self.w
            .flush()
            .map_err(|e| Error::io("flushing GGUF file", e))?;
        Ok(self.w)
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => b.push(*x),
        Value::I8(x) => b.push(*x as u8),
        Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => b.push(*x as u8),
        Value::String(s) => put_str(b, s),
        Value::Array(a) => put_array(b, a),
        Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(b: &mut Vec<u8>, a: &Array) {
    b.extend_from_slice(&a.elem_type_id().to_le_bytes());
    b.extend_from_slice(&(a.len() as u64).to_le_bytes());
    match a {
        Array::U8(v) => b.extend_from_slice(v),
        Array::Array(v) => v.iter().for_each(|x| put_array(b, x)),
        other => other.iter().for_each(|x| put_value(b, &x)),
    }
}

/// The type a tensor is actually stored in when `want` is requested, following llama.cpp:
/// 1-D tensors (norms, rope factors) stay F32 (`llama-quant.cpp` quantizes only ≥ 2-D tensors, and the
/// converter keeps 1-D tensors in F32); a row length that is not a multiple of the block size falls back
/// as `llama_tensor_get_type` does (Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0, Q2_K/Q3_K→IQ4_NL, then F16).
/// IQ4_NL cannot be produced here (no quantizer in candle), so Q4_0 — same 18-byte block of 32 — stands in.
pub fn storage_type(ne: &[u64], want: GgmlType) -> GgmlType {
    let t = |n: &str| GgmlType::from_name(n).expect("type in table");
    if ne.len() < 2 {
        return t("F32");
    }
    let fits = |ty: GgmlType| ne[0].is_multiple_of(ty.block as u64);
    if fits(want) {
        return want;
    }
    let fallback = match want.name {
        "Q4_K" => t("Q5_0"),
        "Q5_K" => t("Q5_1"),
        "Q6_K" => t("Q8_0"),
        "Q2_K" | "Q3_K" | "IQ4_XS" | "IQ4_NL" => t("Q4_0"),
        _ => t("F16"),
    };
    if fits(fallback) {
        fallback
    } else {
        t("F16")
    }
}

/// The types `quantize` can produce.
pub fn can_quantize(ty: GgmlType) -> bool {
    ty.candle().is_some()
}

/// Encode f32 values (whole rows of `ne0` elements, row-major) as the bytes of `ty`.
/// Plain float types are converted directly (round-to-nearest-even); block types go through candle's
/// CPU quantizers.
pub fn quantize(data: &[f32], ne0: usize, ty: GgmlType) -> Result<Vec<u8>> {
    if ne0 == 0 || !data.len().is_multiple_of(ne0) || !ne0.is_multiple_of(ty.block) {
        return Err(bad(format!(
            "cannot encode {} values as {ty}: rows of {ne0} must be whole and a multiple of the block size {}",
            data.len(),
            ty.block
        )));
    }
    Ok(match ty.name {
        "F32" => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        "F16" => data
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        "BF16" => data
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        _ => {
            use candle_core::quantized::QTensor;
            use candle_core::{Device, Tensor};
            let dtype = ty.candle().ok_or_else(|| {
                Error::Unsupported(format!(
                    "cannot quantize to {ty}: no quantizer for it (use F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or Q2_K..Q6_K)"
                ))
            })?;
            let t = Tensor::from_slice(data, (data.len(),), &Device::Cpu)?;
            let q = QTensor::quantize(&t, dtype)?;
            q.data()?.into_owned()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufFile, TensorType};

    fn ty(n: &str) -> GgmlType {
        GgmlType::from_name(n).unwrap()
    }

    #[test]
    fn every_value_type_and_tensor_round_trips_through_the_reader() {
        let meta = vec![
            ("general.architecture", Value::String("deepseek2".into())),
            ("a.u8", Value::U8(250)),
            ("a.i8", Value::I8(-7)),
            ("a.u16", Value::U16(65000)),
            ("a.i16", Value::I16(-30000)),
            ("a.u32", Value::U32(4_000_000_000)),
            ("a.i32", Value::I32(-2_000_000_000)),
            ("a.f32", Value::F32(0.1)),
            ("a.bool", Value::Bool(true)),
            ("a.str", Value::String("γ ünïcode".into())),
            ("a.u64", Value::U64(u64::MAX - 1)),
            ("a.i64", Value::I64(i64::MIN + 1)),
            ("a.f64", Value::F64(-1e300)),
            (
                "a.strs",
                Value::Array(vec!["x".to_string(), "".into()].into()),
            ),
            ("a.f32s", Value::Array(vec![1.5f32, -0.0].into())),
            ("a.u8s", Value::Array(vec![0u8, 255, 7].into())),
            ("a.bools", Value::Array(vec![true, false].into())),
            ("a.i64s", Value::Array(vec![i64::MIN, -1].into())),
            ("a.empty", Value::Array(Vec::<u16>::new().into())),
            (
                "a.nested",
                Value::Array(Array::Array(vec![
                    vec![1i32].into(),
                    vec!["s".to_string()].into(),
                ])),
            ),
        ];
        let mut w = GgufWriter::new();
        for (k, v) in &meta {
            w.add(*k, v.clone()).unwrap();
        }
        // Sizes that are not multiples of the alignment, so padding is exercised.
        let a: Vec<f32> = (0..3 * 5).map(|i| i as f32 * 0.25).collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
        w.add_tensor("a.weight", &[5, 3], ty("F32")).unwrap();
        w.add_tensor("b.weight", &[32, 2], ty("Q8_0")).unwrap();
        w.add_tensor("c.weight", &[7], ty("F16")).unwrap();
        let bytes_a = quantize(&a, 5, ty("F32")).unwrap();
        let bytes_b = quantize(&b, 32, ty("Q8_0")).unwrap();
        let bytes_c = quantize(&[1.0; 7], 7, ty("F16")).unwrap();
        let expect_size = w.file_size();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut sink = w.start(std::fs::File::create(&path).unwrap()).unwrap();
        assert_eq!(sink.current().unwrap().name, "a.weight");
        sink.write(&bytes_a[..20]).unwrap();
        sink.write(&bytes_a[20..]).unwrap();
        sink.write(&bytes_b).unwrap();
        sink.write(&bytes_c).unwrap();
        assert!(sink.current().is_none());
        sink.finish().unwrap();

        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.file_size, expect_size);
        let got: Vec<(&str, &Value)> = f.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let want: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        assert_eq!(got, want);
        assert_eq!(f.data_offset % ALIGNMENT, 0);
        let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a.weight", "b.weight", "c.weight"]);
        assert_eq!(f.tensors[1].ty, TensorType::Known(ty("Q8_0")));
        assert_eq!(f.tensors[0].ne, [5, 3]);
        for t in &f.tensors {
            assert_eq!(t.offset % ALIGNMENT, 0);
        }
        assert_eq!(f.tensor_bytes(&f.tensors[0]).unwrap(), &bytes_a[..]);
        assert_eq!(f.tensor_bytes(&f.tensors[1]).unwrap(), &bytes_b[..]);
        let back = crate::gguf::dequantize_f32(&f, &f.tensors[0]).unwrap();
        assert_eq!(back, a);
        let c = crate::gguf::dequantize_f32(&f, &f.tensors[2]).unwrap();
        assert_eq!(c, [1.0; 7]);
    }

    #[test]
    fn misuse_is_an_error_not_a_corrupt_file() {
        let mut w = GgufWriter::new();
        w.add("k", Value::U32(1)).unwrap();
        assert!(w.add("k", Value::U32(2)).is_err(), "duplicate key");
        assert!(w.add("general.alignment", Value::U32(3)).is_err());
        assert!(
            w.add_tensor("q", &[48, 2], ty("Q8_0")).is_err(),
            "row not a whole block"
        );
        w.add_tensor("t", &[4], ty("F32")).unwrap();
        assert!(
            w.add_tensor("t", &[4], ty("F32")).is_err(),
            "duplicate tensor"
        );
        let mut sink = w.clone().start(Vec::new()).unwrap();
        assert!(
            sink.write(&[0; 20]).is_err(),
            "more bytes than the tensor has"
        );
        let mut sink2 = w.start(Vec::new()).unwrap();
        sink2.write(&[0; 8]).unwrap();
        assert!(sink2.finish().is_err(), "incomplete tensor");
        drop(sink);
    }

    #[test]
    fn storage_type_follows_llama_cpp_fallbacks() {
        let st = |ne: &[u64], want: &str| storage_type(ne, ty(want)).name;
        assert_eq!(st(&[7168], "Q4_K"), "F32", "1-D tensors stay F32");
        assert_eq!(st(&[512, 64], "BF16"), "BF16");
        assert_eq!(st(&[7168, 1536], "Q4_K"), "Q4_K");
        assert_eq!(st(&[128, 512, 128], "Q4_K"), "Q5_0", "attn_k_b rows of 128");
        assert_eq!(st(&[128, 512], "Q5_K"), "Q5_1");
        assert_eq!(st(&[192, 512], "Q6_K"), "Q8_0");
        assert_eq!(st(&[192, 512], "Q3_K"), "Q4_0", "IQ4_NL stand-in");
        assert_eq!(st(&[48, 4], "Q4_K"), "F16", "no 32-block fits either");
        assert_eq!(st(&[48, 4], "Q8_0"), "F16");
    }

    #[test]
    fn float_encodings_round_to_nearest_even() {
        let x = [1.0f32, -2.5, 1.0 + 1.0 / 4096.0, 70000.0];
        let f16 = quantize(&x, 4, ty("F16")).unwrap();
        assert_eq!(&f16[..2], &[0x00, 0x3c]);
        assert_eq!(&f16[6..8], &[0x00, 0x7c], "f16 overflows to +inf");
        let bf16 = quantize(&x, 4, ty("BF16")).unwrap();
        assert_eq!(&bf16[..2], &[0x80, 0x3f]);
        // 1 + 2^-12 is below bf16's half-ulp (2^-8): rounds to 1.0.
        assert_eq!(&bf16[4..6], &[0x80, 0x3f]);
        assert!(matches!(
            quantize(&[0.5; 256], 256, ty("IQ2_XXS")),
            Err(Error::Unsupported(_))
        ));
    }
}
