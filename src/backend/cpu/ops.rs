//! Primitive operations of the mirror at the engine's precision: values are stored in the dtype (f32
//! holding exactly representable values), every product is accumulated in f32, and `Dtype::round` marks
//! each point where a kernel writes a result to memory.

use crate::model::RopePairing;
use crate::precision::Dtype;
use crate::rope::pair;
use ndarray::{Array, Array1, Array2, ArrayView2, Dimension};

/// Round every element to the dtype.
pub fn round_all<D: Dimension>(mut a: Array<f32, D>, dt: Dtype) -> Array<f32, D> {
    match a.as_slice_memory_order_mut() {
        Some(v) => dt.round_slice(v),
        None => a.mapv_inplace(|v| dt.round(v)),
    }
    a
}

/// A weight or input in the dtype (one pass over it: a whole layer's weights are hundreds of MB).
pub fn stored<D: Dimension>(a: &Array<f32, D>, dt: Dtype) -> Array<f32, D> {
    match dt {
        Dtype::F32 => a.clone(),
        _ => a.mapv(|v| dt.round(v)),
    }
}

/// f32 dot product with eight partial sums (the lane-parallel order a vector unit or a warp uses).
#[inline]
/// A score's rope term `q_pe · k_pe` as a kernel computes it over the cache row's rope part: the query
/// zero-padded to that width where the row is wider (a NoPE model's row padded to DeepSeek's 576, fault
/// `nope_pad_as_rope`: 0 · the pad, NaN where the pad was never written).
pub fn rope_dot(q: &[f32], k: &[f32]) -> f32 {
    if q.len() == k.len() {
        return dot(q, k);
    }
    let mut padded = vec![0f32; k.len()];
    padded[..q.len()].copy_from_slice(q);
    dot(&padded, k)
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    for (k, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[k] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `round(x / sqrt(mean(x²) + eps) · w)` per row, statistics in f32.
pub fn rms_norm(x: ArrayView2<f32>, w: &Array1<f32>, eps: f64, dt: Dtype) -> Array2<f32> {
    let w = w.as_slice().expect("contiguous");
    let mut y = x.to_owned();
    for mut row in y.rows_mut() {
        let row = row.as_slice_mut().expect("contiguous");
        let ms = dot(row, row) / row.len() as f32;
        let r = 1.0 / (ms + eps as f32).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = dt.round(*v * r * g);
        }
    }
    y
}

/// `round(x · Wᵀ)` for `W [out, in]`, accumulated in f32 (a GEMM with f32 accumulators).
pub fn linear(x: ArrayView2<f32>, w: ArrayView2<f32>, dt: Dtype) -> Array2<f32> {
    round_all(x.dot(&w.t()), dt)
}

/// Rotate one rope vector in f32 with f32 cos/sin (`half` entries each) and round the result.
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], pairing: RopePairing, dt: Dtype) {
    let dim = x.len();
    for i in 0..dim / 2 {
        let (a, b) = pair(pairing, dim, i);
        let (x0, x1) = (x[a], x[b]);
        x[a] = dt.round(x0 * cos[i] - x1 * sin[i]);
        x[b] = dt.round(x0 * sin[i] + x1 * cos[i]);
    }
}
