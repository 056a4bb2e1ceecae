//! The block types candle lacks (IQ1–IQ4, TQ1_0/TQ2_0, MXFP4, NVFP4), dequantized by fuel-quantized.
//!
//! fuel-quantized was checked bit-exact against gguf-py 0.19 on random blocks of every type
//! (tests/it/gguf_crosscheck.rs), NaN and Inf scales included. It copies misaligned bytes itself.

use super::dtype::GgmlType;
use crate::error::{Error, Result};

/// Dequantize `bytes`, a whole number of `ty` blocks of tensor `name`, to f32.
pub(super) fn dequantize(name: &str, ty: GgmlType, bytes: &[u8]) -> Result<Vec<f32>> {
    let dtype = ty.fuel().expect("called for fuel types only");
    let out = fuel_quantized::dequant_ggml_bytes(bytes, dtype, name)
        .map_err(|e| Error::Unsupported(format!("tensor {name:?}: dequantizing {ty}: {e}")))?;
    // fuel drops a partial trailing block; our callers pass whole rows, so that would be our bug.
    let want = bytes.len() / ty.type_size * ty.block;
    if out.len() != want || !bytes.len().is_multiple_of(ty.type_size) {
        return Err(Error::Tensor(format!(
            "tensor {name:?}: {} bytes are not whole {ty} blocks",
            bytes.len()
        )));
    }
    Ok(out)
}
