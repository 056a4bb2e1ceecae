//! The DSA lightning indexer at the engine's precision (the CPU mirror's; the fp64 one is
//! `reference::indexer`).
//!
//! - `q = round(q_lora_latent · W_q_bᵀ)` (the mirror's stored, normed q-LoRA latent), per head rope on its
//!   first R dims in f32, rounded;
//! - `k = round(LayerNorm_f32(round(attn_in · W_kᵀ)) · w + b)`, rope likewise;
//! - `w = attn_in · W_projᵀ` with `W_proj` kept in f32 (transformers' `_keep_in_fp32_modules`, vLLM),
//!   scaled by `(Hi·Di)^-0.5` once (llama.cpp's pre-scaling; equal to the model's two scalings since
//!   ReLU is positively homogeneous);
//! - with `Fp8Keys`: q and k rotated by the normalised Hadamard matrix (exact in the maths: `Hq·Hk = q·k`)
//!   and stored as fp8 e4m3 with one f32 scale `amax/448` per 128 values (vLLM's indexer cache:
//!   `DeepseekV32IndexerCache`, 132 B per token for Di 128); the logit is `dot(q8, k8)·s_q·s_k`;
//! - `score[t, j] = Σ_h w[t, h] · ReLU(logit)` in f32; top `min(top_k, t+1)` of `0..=t`, ties to the
//!   lower key.
//!
//! Planted indexer bugs come in as a `Reading` (the rope pairing swapped, no causal cut before the
//! top-k, no ReLU, top-k one short) and `Fp8Fault` (the key scale dropped).

use super::front::RopeF32;
use super::ops::{dot, linear, rms_norm, round_all, stored};
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::model::{IndexerConfig, IndexerWeights, LayerWeights, MlaConfig, QProj, RopePairing};
use crate::precision::{Dtype, KeyPrecision};
use crate::reference::indexer::Reading;
use crate::reference::sparse::Selection;
use crate::rope::RopeTables;
use ndarray::{s, Array2, Array3, Axis};

/// The optimized indexer's plan for a layer's planted faults (the indexer rows of the catalogue).
pub fn plan_for(fx: crate::faults::Active, keys: KeyPrecision) -> Plan {
    use crate::faults::Fault;
    Plan {
        keys,
        reading: Reading {
            swap_rope: fx.on(Fault::IndexerRopeSwap),
            no_relu: fx.on(Fault::IndexerNoRelu),
            top_k_minus_one: fx.on(Fault::IndexerTopkOffByOne),
            non_causal: fx.on(Fault::IndexerNonCausal),
            ..Reading::default()
        },
        fp8_scale_dropped: fx.on(Fault::IndexerFp8Scale),
    }
}

/// The fp8 e4m3 block of the indexer cache: values per scale.
pub const FP8_BLOCK: usize = 128;
/// Largest finite e4m3 value.
pub const FP8_MAX: f32 = 448.0;

/// Round to fp8 e4m3 (saturating at ±448 as `__NV_SATFINITE`; 3 mantissa bits, subnormals below 2^-6),
/// through the `float8` crate (cuda_fp8.hpp's conversion); infinities and NaN pass unchanged.
pub fn fp8_e4m3(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    float8::F8E4M3::from_f32(x).to_f32()
}

/// A float the Hadamard rotation runs in: f32 here, f64 for the selection check's noise model
/// (`compare::selection`), each scaling in its own precision.
pub trait HadamardFloat:
    Copy + std::ops::Add<Output = Self> + std::ops::Sub<Output = Self> + std::ops::MulAssign
{
    /// `n^-0.5`.
    fn inv_sqrt(n: usize) -> Self;
}

impl HadamardFloat for f32 {
    fn inv_sqrt(n: usize) -> f32 {
        (n as f32).sqrt().recip()
    }
}

impl HadamardFloat for f64 {
    fn inv_sqrt(n: usize) -> f64 {
        (n as f64).sqrt().recip()
    }
}

/// `x · H / sqrt(n)` with `H` the Sylvester Hadamard matrix (fast Walsh–Hadamard transform), in the
/// precision of `T`.
pub fn hadamard<T: HadamardFloat>(x: &mut [T]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = T::inv_sqrt(n);
    x.iter_mut().for_each(|v| *v *= s);
}

/// Quantize a vector to fp8 in blocks of `FP8_BLOCK`; returns the per-block scales (`amax/448`).
pub fn quantize_fp8(x: &mut [f32]) -> Vec<f32> {
    x.chunks_mut(FP8_BLOCK)
        .map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sc = if amax > 0.0 { amax / FP8_MAX } else { 1.0 };
            b.iter_mut().for_each(|v| *v = fp8_e4m3(*v / sc));
            sc
        })
        .collect()
}

/// The mirror indexer's tensors and selection.
#[derive(Debug, Clone)]
pub struct MirrorIndexer {
    /// `[T, T]` f32 scores over all keys (only `j ≤ t` is visible).
    pub scores: Array2<f32>,
    pub selection: Selection,
}

/// What the mirror's indexer computes: the model (`Reading::default()`) or a planted misreading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plan {
    pub keys: KeyPrecision,
    pub reading: Reading,
    /// Fp8 only: the key scale dropped from the logit (the cache read as if its values were unscaled).
    pub fp8_scale_dropped: bool,
}

/// The scores' operands as the engine stores them (the CUDA indexer takes the same ones,
/// `backend::cuda::indexer`): q and k in the run's dtype, or fp8 e4m3 values (exact in f32) with their
/// per-block scales.
#[derive(Debug, Clone)]
pub struct Operands {
    /// `[T, Hi, Di]`, roped (and, with fp8 keys, Hadamard-rotated and quantized, scale not applied).
    pub q: Array3<f32>,
    /// `[T, Di]`, likewise.
    pub k: Array2<f32>,
    /// `[T, Hi, Di / FP8_BLOCK]` and `[T, Di / FP8_BLOCK]`: the fp8 block scales (empty blocks axis
    /// without fp8: nothing to scale).
    pub q_scales: Array3<f32>,
    pub k_scales: Array2<f32>,
    /// `[T, Hi]` f32, pre-scaled by `(Hi·Di)^-0.5`.
    pub weights: Array2<f32>,
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    cfg: &MlaConfig,
    ic: &IndexerConfig,
    iw: &IndexerWeights,
    w: &LayerWeights,
    rope: &RopeTables,
    x: &Array2<f64>,
    dt: Dtype,
    plan: Plan,
) -> Result<MirrorIndexer> {
    let ops = operands(cfg, ic, iw, w, rope, x, dt, plan)?;
    Ok(score_and_select(&ops, ic.top_k, plan))
}

/// q, k and the head weights of the mirror's indexer (everything before the scores). The rope pairing
/// misreading (`Reading::swap_rope`) is applied here; the others act on the scores and the top-k.
#[allow(clippy::too_many_arguments)]
pub fn operands(
    cfg: &MlaConfig,
    ic: &IndexerConfig,
    iw: &IndexerWeights,
    w: &LayerWeights,
    rope: &RopeTables,
    x: &Array2<f64>,
    dt: Dtype,
    plan: Plan,
) -> Result<Operands> {
    let r = plan.reading;
    let (hi, di, rd) = (ic.heads, ic.head_dim, ic.rope_dim);
    if plan.keys == KeyPrecision::Fp8 && !di.is_power_of_two() {
        return Err(Error::Usage(format!(
            "fp8 indexer keys need a power-of-two head dim for the Hadamard rotation, the file has {di}"
        )));
    }
    let held = w.stored_made(dt);
    let attn_in = attn_in(cfg, w, x, dt);
    let t = attn_in.nrows();
    let attn_in = attn_in.view();
    let qr = match (&w.q, held.map(|h| &h.q)) {
        (QProj::Lora { a, a_norm, .. }, held_q) => {
            let (ha, hn) = match held_q {
                Some(QProj::Lora { a, a_norm, .. }) => (Some(a), Some(a_norm)),
                _ => (None, None),
            };
            let qa = match ha {
                Some(ha) => linear(attn_in, ha.view(), dt),
                None => linear(attn_in, stored(a, dt).view(), dt),
            };
            rms_norm(qa.view(), &st(hn, a_norm, dt), cfg.lora_norm_eps, dt)
        }
        (QProj::Plain { .. }, _) => unreachable!("a DSA indexer needs q-LoRA"),
    };
    let mut tables = RopeF32::new(rope, Active::NONE);
    tables.pairing = match (r.swap_rope, ic.rope) {
        (false, p) => p,
        (true, RopePairing::Norm) => RopePairing::Neox,
        (true, RopePairing::Neox) => RopePairing::Norm,
    };
    let mut q = linear(qr.view(), stored(&iw.q_b, dt).view(), dt)
        .into_shape_with_order((t, hi, di))
        .expect("[T, Hi·Di]");
    for (tt, mut tok) in q.axis_iter_mut(Axis(0)).enumerate() {
        for mut head in tok.axis_iter_mut(Axis(0)) {
            tables.rotate(tt, &mut head.as_slice_mut().expect("contiguous")[..rd], dt);
        }
    }
    let mut k = layer_norm(
        linear(attn_in, stored(&iw.k, dt).view(), dt),
        &stored(&iw.k_norm, dt),
        &stored(&iw.k_norm_bias, dt),
        dt,
    );
    for (tt, mut row) in k.axis_iter_mut(Axis(0)).enumerate() {
        tables.rotate(tt, &mut row.as_slice_mut().expect("contiguous")[..rd], dt);
    }
    let scale = ((hi * di) as f32).sqrt().recip();
    let weights = attn_in.dot(&iw.proj.t()) * scale;
    let (q_scales, k_scales) = match plan.keys {
        KeyPrecision::Fp8 => fp8_rows(&mut q, &mut k),
        KeyPrecision::Storage => (Array3::zeros((t, hi, 0)), Array2::zeros((t, 0))),
    };
    Ok(Operands {
        q,
        k,
        q_scales,
        k_scales,
        weights,
    })
}

/// The mirror's scores `[T, T]` (f32; the scales multiplied into the fp8 values first, the key scale
/// left out with `Plan::fp8_scale_dropped`) and its top-k.
pub fn score_and_select(ops: &Operands, top_k: usize, plan: Plan) -> MirrorIndexer {
    let r = plan.reading;
    let (mut q, mut k) = (ops.q.clone(), ops.k.clone());
    let (t, hi, _) = q.dim();
    if ops.q_scales.dim().2 > 0 {
        for (mut row, sc) in q.rows_mut().into_iter().zip(ops.q_scales.rows()) {
            scale_blocks(row.as_slice_mut().expect("contiguous"), sc);
        }
        if !plan.fp8_scale_dropped {
            for (mut row, sc) in k.rows_mut().into_iter().zip(ops.k_scales.rows()) {
                scale_blocks(row.as_slice_mut().expect("contiguous"), sc);
            }
        }
    }
    let weights = &ops.weights;
    let mut scores = Array2::<f32>::zeros((t, t));
    for tt in 0..t {
        for j in 0..t {
            let kj = k.row(j);
            let kj = kj.as_slice().expect("contiguous");
            let mut acc = 0f32;
            for h in 0..hi {
                let qh = &q.slice(s![tt, h, ..]);
                let l = dot(qh.as_slice().expect("contiguous"), kj);
                acc += weights[[tt, h]] * if r.no_relu { l } else { l.max(0.0) };
            }
            scores[[tt, j]] = acc;
        }
    }
    let selection = crate::reference::indexer::select(&scores.mapv(f64::from), top_k, r);
    MirrorIndexer { scores, selection }
}

/// A vector as the mirror stores it: its rounded copy of the layer (`LayerWeights::stored`) where it
/// was made; never made here (a CUDA run holds no second copy), rounded as it is read then.
fn st<'a>(
    held: Option<&'a ndarray::Array1<f32>>,
    a: &ndarray::Array1<f32>,
    dt: Dtype,
) -> std::borrow::Cow<'a, ndarray::Array1<f32>> {
    match held {
        Some(h) => std::borrow::Cow::Borrowed(h),
        None => std::borrow::Cow::Owned(stored(a, dt)),
    }
}

/// The layer input and attn_norm as the mirror's front computes them (`front::input`, `attn_in`).
pub fn attn_in(cfg: &MlaConfig, w: &LayerWeights, x: &Array2<f64>, dt: Dtype) -> Array2<f32> {
    let held = w.stored_made(dt);
    rms_norm(
        super::front::input(x, dt).view(),
        &st(held.map(|h| &h.attn_norm), &w.attn_norm, dt),
        cfg.rms_eps,
        dt,
    )
}

/// Each `FP8_BLOCK` of `v` times its scale.
pub(crate) fn scale_blocks(v: &mut [f32], scales: ndarray::ArrayView1<f32>) {
    for (b, &sc) in v.chunks_mut(FP8_BLOCK).zip(scales) {
        b.iter_mut().for_each(|x| *x *= sc);
    }
}

/// Hadamard-rotate and fp8-quantize q (per token and head) and k (per token) in place, leaving each
/// value in e4m3 (its scale not applied); returns the scales, `[T, Hi, blocks]` and `[keys, blocks]`
/// (the k-pool mirror's keys are pools).
pub(crate) fn fp8_rows(q: &mut Array3<f32>, k: &mut Array2<f32>) -> (Array3<f32>, Array2<f32>) {
    let (t, hi, di) = q.dim();
    let nb = di.div_ceil(FP8_BLOCK);
    let fp8 = |v: &mut [f32]| {
        hadamard(v);
        quantize_fp8(v)
    };
    let qs: Vec<f32> = q
        .rows_mut()
        .into_iter()
        .flat_map(|mut row| fp8(row.as_slice_mut().expect("contiguous")))
        .collect();
    let ks: Vec<f32> = k
        .rows_mut()
        .into_iter()
        .flat_map(|mut row| fp8(row.as_slice_mut().expect("contiguous")))
        .collect();
    (
        Array3::from_shape_vec((t, hi, nb), qs).expect("one scale per block"),
        Array2::from_shape_vec((k.nrows(), nb), ks).expect("one scale per block"),
    )
}

/// `round(LayerNorm_f32(x) · w + b)` per row (population variance, eps 1e-6).
fn layer_norm(
    mut x: Array2<f32>,
    w: &ndarray::Array1<f32>,
    b: &ndarray::Array1<f32>,
    dt: Dtype,
) -> Array2<f32> {
    let eps = crate::model::indexer::K_NORM_EPS as f32;
    for mut row in x.rows_mut() {
        let n = row.len() as f32;
        let mean = row.sum() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
        let r = (var + eps).sqrt().recip();
        for ((v, &g), &bb) in row.iter_mut().zip(w.iter()).zip(b.iter()) {
            *v = dt.round((*v - mean) * r * g + bb);
        }
    }
    round_all(x, dt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_rounds_to_three_mantissa_bits_and_saturates() {
        assert_eq!(fp8_e4m3(1.0), 1.0);
        assert_eq!(fp8_e4m3(1.0625), 1.0); // halfway to 1.125: ties to even
        assert_eq!(fp8_e4m3(1.1), 1.125);
        assert_eq!(fp8_e4m3(-300.0), -288.0);
        assert_eq!(fp8_e4m3(1000.0), 448.0);
        assert_eq!(fp8_e4m3(2f32.powi(-9)), 2f32.powi(-9)); // smallest subnormal
    }

    #[test]
    fn hadamard_is_orthogonal() {
        let a: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).sin()).collect();
        let b: Vec<f32> = (0..8).map(|i| (i as f32 * 1.3).cos()).collect();
        let (mut ha, mut hb) = (a.clone(), b.clone());
        hadamard(&mut ha);
        hadamard(&mut hb);
        assert!((dot(&a, &b) - dot(&ha, &hb)).abs() < 1e-5);
    }
}
