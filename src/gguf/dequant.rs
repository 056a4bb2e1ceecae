//! Turning a tensor's bytes into f32 values.
//!
//! Plain float types are converted directly; block-quantized types go through candle's CPU dequantizers,
//! a bounded number of rows at a time so that peak memory stays close to the size of the f32 result.
//! The low-bit types candle lacks (IQ*, TQ*, MXFP4, NVFP4) go through fuel-quantized (`fuel`).
//! The error for an unsupported type names the tensor and the type, and is raised only when that tensor
//! is actually needed.

use super::dtype::GgmlType;
use super::file::GgufFile;
use super::tensor::{TensorInfo, TensorType};
use crate::error::{Error, Result};
use candle_core::quantized::{QStorage, QTensor};
use candle_core::Device;
use std::borrow::Cow;

/// Elements dequantized per candle call: bounds the temporary buffers (about 2 × 4 MiB per thread: the
/// chunks run in parallel).
const CHUNK_ELEMS: usize = 1 << 20;

/// Dequantize a whole tensor to f32, in file (row-major, `ne` reversed) order.
pub fn dequantize_f32(file: &GgufFile, t: &TensorInfo) -> Result<Vec<f32>> {
    dequantize_f32_into(file, t, Vec::new())
}

/// [`dequantize_f32`] into `buf`, which a block-quantized tensor of as many values as `buf` holds
/// overwrites in place: a run's layers have the same shapes, and a layer's weights are hundreds of MB
/// (0.66 GB at GLM-5's dims) that fresh memory would fault in and zero again every layer (#39). The
/// values are the same: every value is written.
pub fn dequantize_f32_into(file: &GgufFile, t: &TensorInfo, buf: Vec<f32>) -> Result<Vec<f32>> {
    let ty = dequantizable_type(t)?;
    let bytes = file.tensor_bytes(t)?;
    dequantize_bytes(t, ty, bytes, buf)
}

/// The dequantizable ggml type of a tensor, or an error naming it.
fn dequantizable_type(t: &TensorInfo) -> Result<GgmlType> {
    match t.ty {
        TensorType::Known(ty) if ty.dequantizable() => Ok(ty),
        other => {
            let supported: Vec<&str> = GgmlType::all()
                .iter()
                .filter(|t| t.dequantizable())
                .map(|t| t.name)
                .collect();
            Err(Error::Unsupported(format!(
                "tensor {:?} has type {other}, which mla-diff cannot dequantize (supported: {})",
                t.name,
                supported.join(", ")
            )))
        }
    }
}

/// Dequantize selected rows (`ne[1]` indices, each `ne[0]` values) of a 2-D tensor, reading only those
/// rows' bytes: e.g. the embeddings of a few token ids out of a large `token_embd`.
pub fn dequantize_rows(file: &GgufFile, t: &TensorInfo, rows: &[usize]) -> Result<Vec<f32>> {
    let ty = dequantizable_type(t)?;
    if t.ne.len() != 2 {
        return Err(Error::Tensor(format!(
            "tensor {:?} has {} dimensions; row access needs 2",
            t.name,
            t.ne.len()
        )));
    }
    let (width, n_rows) = (t.ne[0] as usize, t.ne[1] as usize);
    let row_bytes = ty.bytes_for(width as u64).ok_or_else(|| {
        Error::Tensor(format!(
            "tensor {:?}: rows of {width} values are not whole {} blocks",
            t.name, ty.name
        ))
    })? as usize;
    let bytes = file.tensor_bytes(t)?;
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        if r >= n_rows {
            return Err(Error::Usage(format!(
                "row {r} of tensor {:?} is out of range (it has {n_rows} rows)",
                t.name
            )));
        }
        let b = &bytes[r * row_bytes..(r + 1) * row_bytes];
        out.extend(dequantize_bytes(t, ty, b, Vec::new())?);
    }
    Ok(out)
}

/// Dequantize whole rows of `t` held in `bytes`; a block type's values written over `buf` where it
/// holds as many (see [`dequantize_f32_into`]).
fn dequantize_bytes(t: &TensorInfo, ty: GgmlType, bytes: &[u8], buf: Vec<f32>) -> Result<Vec<f32>> {
    let row = t.ne[0] as usize;
    let row_bytes = ty.bytes_for(row as u64).expect("checked at open") as usize;
    let n = bytes.len() / row_bytes * row;
    if ty.fuel().is_some() {
        return super::fuel::dequantize(&t.name, ty, bytes);
    }
    match ty.name {
        "F32" => Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()),
        "F64" => Ok(bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32)
            .collect()),
        "F16" => Ok(bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()),
        "BF16" => Ok(bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()),
        _ => {
            let dtype = ty
                .candle()
                .expect("dequantizable block type has a candle dtype");
            let rows_per_chunk = (CHUNK_ELEMS / row).max(1);
            let direct = direct_dequantizer(dtype);
            // Chunks in parallel, each into its own part of the output.
            use rayon::prelude::*;
            // A buffer of another length is dropped for fresh zeroed memory (calloc: pages zeroed as
            // the writes below fault them in, not by a pass of its own).
            let mut out = match buf.len() == n {
                true => buf,
                false => vec![0f32; n],
            };
            out.par_chunks_mut(rows_per_chunk * row)
                .enumerate()
                .try_for_each(|(c, dst)| -> Result<()> {
                    let (r0, r1) = (c * rows_per_chunk, c * rows_per_chunk + dst.len() / row);
                    let mut scratch = Vec::new();
                    let chunk = aligned(&bytes[r0 * row_bytes..r1 * row_bytes], &mut scratch);
                    match direct {
                        Some(to_f32) => to_f32(chunk, dst),
                        None => through_tensor(t, ty, dtype, chunk, dst)?,
                    }
                    Ok(())
                })?;
            Ok(out)
        }
    }
}

/// One chunk of whole blocks through a candle `QTensor` (its dequantize, then the values copied into
/// `dst`): for a block type [`direct_dequantizer`] does not name.
fn through_tensor(
    t: &TensorInfo,
    ty: GgmlType,
    dtype: candle_core::quantized::GgmlDType,
    chunk: &[u8],
    dst: &mut [f32],
) -> Result<()> {
    let storage = QStorage::from_data(Cow::Borrowed(chunk), &Device::Cpu, dtype)
        .map_err(|e| Error::Unsupported(format!("tensor {:?}: {e}", t.name)))?;
    let q = QTensor::new(storage, (dst.len(),))
        .map_err(|e| Error::Unsupported(format!("tensor {:?}: {e}", t.name)))?;
    let v = q
        .dequantize(&Device::Cpu)
        .and_then(|x| x.to_vec1::<f32>())
        .map_err(|e| {
            Error::Unsupported(format!("tensor {:?}: dequantizing {}: {e}", t.name, ty))
        })?;
    dst.copy_from_slice(&v);
    Ok(())
}

/// candle's own per-block dequantizer of `dtype` (`GgmlType::to_float`, the function its
/// `QTensor::dequantize` calls on the CPU), writing straight into the output: the same values, without
/// the chunk's copy of the blocks, its tensor and the values' second copy (three passes over a layer's
/// 0.66 GB at GLM-5's dims, each into fresh pages, on the run loop's path: #39).
fn direct_dequantizer(dtype: candle_core::quantized::GgmlDType) -> Option<BlocksToF32> {
    use candle_core::quantized::k_quants as k;
    use candle_core::quantized::GgmlDType as D;
    Some(match dtype {
        D::Q4_0 => blocks_to_f32::<k::BlockQ4_0>,
        D::Q4_1 => blocks_to_f32::<k::BlockQ4_1>,
        D::Q5_0 => blocks_to_f32::<k::BlockQ5_0>,
        D::Q5_1 => blocks_to_f32::<k::BlockQ5_1>,
        D::Q8_0 => blocks_to_f32::<k::BlockQ8_0>,
        D::Q2K => blocks_to_f32::<k::BlockQ2K>,
        D::Q3K => blocks_to_f32::<k::BlockQ3K>,
        D::Q4K => blocks_to_f32::<k::BlockQ4K>,
        D::Q5K => blocks_to_f32::<k::BlockQ5K>,
        D::Q6K => blocks_to_f32::<k::BlockQ6K>,
        _ => return None,
    })
}

/// A block type's dequantizer: whole blocks' bytes into one f32 per value.
type BlocksToF32 = fn(&[u8], &mut [f32]);

/// Whole blocks of `T` in `bytes` (aligned by [`aligned`]) dequantized into `dst`, one value per slot.
fn blocks_to_f32<T: candle_core::quantized::k_quants::GgmlType>(bytes: &[u8], dst: &mut [f32]) {
    let size = std::mem::size_of::<T>();
    assert!(
        bytes.len().is_multiple_of(size)
            && (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()),
        "whole, aligned blocks"
    );
    assert_eq!(
        bytes.len() / size * T::BLCK_SIZE,
        dst.len(),
        "one value per slot"
    );
    // SAFETY: candle's block types are `repr(C)` structs of integers, integer arrays and f16 (every
    // bit pattern is a value), and `bytes` is checked above to hold whole blocks at their alignment;
    // the view lives no longer than `bytes`. candle's `from_data` makes the same view.
    let blocks =
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) };
    T::to_float(blocks, dst);
}

/// `b` itself when it sits at an 8-byte aligned address, else a copy in `scratch` that does. candle views
/// block bytes as block structs (which need up to 4-byte alignment) and panics on a misaligned pointer,
/// while GGUF allows any power-of-two `general.alignment`, down to 1, so data may start at odd offsets.
fn aligned<'a>(b: &'a [u8], scratch: &'a mut Vec<u64>) -> &'a [u8] {
    if (b.as_ptr() as usize).is_multiple_of(8) {
        return b;
    }
    scratch.clear();
    scratch.resize(b.len().div_ceil(8), 0);
    let dst: &mut [u8] = bytemuck::cast_slice_mut(scratch);
    dst[..b.len()].copy_from_slice(b);
    &dst[..b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block-quantized tensor dequantized into a buffer of its length is written over it (the same
    /// buffer back, every value the fresh dequantization's); with one of another length the values are
    /// the same.
    #[test]
    fn into_a_buffer_of_its_length_writes_over_it() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/deepseek-v3-yarn-q4_k.gguf");
        let f = GgufFile::open(&path).unwrap();
        let t = f.tensor("blk.0.attn_output.weight").unwrap();
        assert!(matches!(t.ty, TensorType::Known(ty) if ty.candle().is_some()));
        let fresh = dequantize_f32(&f, t).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for n in [fresh.len(), fresh.len() - 1, 0] {
            let buf = vec![f32::NAN; n];
            let at = buf.as_ptr();
            let got = dequantize_f32_into(&f, t, buf).unwrap();
            assert_eq!(bits(&got), bits(&fresh), "{n}");
            assert!(got.as_ptr() == at || n != fresh.len(), "a fresh buffer");
        }
    }

    /// The direct dequantizers give, bit for bit, what the path through a candle tensor gives, on
    /// random block bytes (any scale, NaN and infinity included) of every type they name.
    #[test]
    fn direct_is_through_tensor() {
        use candle_core::quantized::GgmlDType as D;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        let ty = GgmlType::all()[0]; // named in errors only
        let info = TensorInfo {
            name: "t".into(),
            ne: vec![],
            ty: TensorType::Known(ty),
            offset: 0,
            shard: 0,
        };
        let mut named = 0;
        for dtype in [
            D::Q4_0,
            D::Q4_1,
            D::Q5_0,
            D::Q5_1,
            D::Q8_0,
            D::Q8_1,
            D::Q2K,
            D::Q3K,
            D::Q4K,
            D::Q5K,
            D::Q6K,
            D::Q8K,
        ] {
            let Some(direct) = direct_dequantizer(dtype) else {
                continue;
            };
            named += 1;
            let blocks = 37;
            let bytes: Vec<u8> = (0..blocks * dtype.type_size()).map(|_| next()).collect();
            let mut scratch = Vec::new();
            let chunk = aligned(&bytes, &mut scratch);
            let n = blocks * dtype.block_size();
            let (mut a, mut b) = (vec![0f32; n], vec![1f32; n]);
            direct(chunk, &mut a);
            through_tensor(&info, ty, dtype, chunk, &mut b).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{dtype:?}");
        }
        assert_eq!(named, 10, "every block type candle dequantizes here");
    }
}
