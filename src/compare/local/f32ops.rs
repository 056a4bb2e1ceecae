//! The f32 roundings of a softmax's scalars as each path makes them (`ScoreSum`): p = exp(s − m), the
//! sum l, the lse `m + ln l`, and P rounded to e4m3 where a kernel declares it. The CPU mirror's are
//! modelled where each result lands (its order and its libm are known); other paths' by
//! per-operation bounds.

use super::super::noise::{Store, EXP_REL_VAR, F32_OP, U32};
use crate::precision::ScoreSum;

/// [`attend_in`]'s relative variance of the mirror's f32 sum `l` of `p` (its `l += p`, key by key):
/// a p below half the running sum's spacing is lost (a bias, all of one sign), each other addition
/// rounds where its sum lands (p, an f32 exp, has all 24 bits). Measured on the deepseek-v3 fixture's
/// split lse: the sum's error is under 1 u² of the lse's 27 u², where the sequential model over the
/// final sum's spacing ([`sum_rel_var`], for kernels of unknown order) gives 8 u².
#[inline(always)]
pub(super) fn sum_rel_var_seq(p: &[f64], l: f64) -> f64 {
    let (mut run, mut lost, mut var) = (0.0, 0.0, 0.0);
    for &pj in p {
        let before = run;
        run += pj;
        if before == 0.0 {
            continue;
        }
        match pj < Store::F32.ulp(run) / 2.0 {
            true => lost += pj,
            false => var += Store::F32.round_var(run),
        }
    }
    (lost * lost + var) / (l * l)
}

/// The relative variance of p = exp(d), d = s − m, as the path computes it in f32: the subtraction's
/// rounding and the exp's. The mirror's `f32::exp` (libm, ≤ ~0.5 ulp) rounds where p lands; other
/// kernels get `EXP_REL_VAR` (a GPU's `ex2.approx` is a few ulp) and a worst-case subtraction.
#[inline(always)]
pub(super) fn exp_var(sum: ScoreSum, d: f64, p: f64) -> f64 {
    match sum {
        ScoreSum::Lanes8 if p > 0.0 => Store::F32.round_var(d) + Store::F32.round_var(p) / (p * p),
        _ => EXP_REL_VAR + (d * U32).powi(2),
    }
}

/// [`Attn::lse_last`]: the mirror's lse `m + ln l` is the f32 it stores.
pub(super) fn lse_last(sum: ScoreSum, lse: f64) -> f64 {
    match sum {
        ScoreSum::Lanes8 => Store::F32.round_var(lse),
        _ => 0.0,
    }
}

/// The variance of forming lse from the row max m and the sum l in f32: the mirror's `m + ln l` (two
/// roundings, each where its result lands: ln's and the sum's, the stored value's, [`lse_last`]), the
/// CUDA kernels' `(m₂ + log2 l)·ln 2` (m₂ in log2 units; two at the lse's magnitude and an approximate
/// log2), unknown kernels three at the lse's magnitude.
pub(super) fn lse_rounding(sum: ScoreSum, m: f64, l: f64) -> f64 {
    let lse = m + l.ln();
    match sum {
        ScoreSum::Lanes8 => Store::F32.round_var(l.ln()) + Store::F32.round_var(lse),
        ScoreSum::TensorCore => F32_OP * (2.0 * lse * lse + 4.0 * l.ln().powi(2)),
        ScoreSum::Sequential => 3.0 * F32_OP * lse * lse,
    }
}

/// The variance of rounding P = exp(s − m) (≤ 1, `p` against the row's max m) to float8 e4m3 as a
/// kernel does against its running max (`kv_format::p_e4m3_half_step`, the most it moves p): uniform
/// within that half step (variance bound²/3), except below 2⁻¹⁰, where P' may round to 0 and the error
/// is −p itself.
pub(super) fn e4m3_worst_round_var(p: f64) -> f64 {
    let p = p.abs();
    match p < 2f64.powi(-10) {
        true => p * p,
        false => crate::kv_format::p_e4m3_half_step(p).powi(2) / 3.0,
    }
}
