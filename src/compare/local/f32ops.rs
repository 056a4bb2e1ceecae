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
/// kernel does against its running max m' ≤ m, where P' = p·e^(m − m') ≥ p: the error, scaled back by
/// p / P', is at most half a step wherever P' sits in its binade: 2⁻⁴·p in e4m3's normal range, and
/// at most 2⁻¹⁰ (half the 2⁻⁹ subnormal step) and at most p below it. Uniform within that half-step
/// (variance bound²/3), except below 2⁻¹⁰, where P' may round to 0 and the error is −p itself.
pub(super) fn e4m3_worst_round_var(p: f64) -> f64 {
    let p = p.abs();
    let half = 2f64.powi(-10);
    match p < half {
        true => p * p,
        false => {
            let bound = (p * 2f64.powi(-4)).max(half);
            bound * bound / 3.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::e4m3_worst_round_var;

    /// P rounded to e4m3 (the `float8` crate, cuda_fp8.hpp's conversion) against a running max no
    /// larger than the row's, scaled back: its error is within the modelled half step, √(3·var) (p
    /// itself below 2⁻¹⁰), over every binade a P reaches.
    #[test]
    fn p_rounded_to_e4m3_stays_within_the_modelled_half_step() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        for _ in 0..100_000 {
            let p = 2f64.powf(-16.0 * next());
            let r = 2f64.powf(16.0 * next()).min(1.0 / p);
            let err = (float8::F8E4M3::from_f64(p * r).to_f64() - p * r).abs() / r;
            let v = e4m3_worst_round_var(p);
            let half = match p < 2f64.powi(-10) {
                true => v.sqrt(),
                false => (3.0 * v).sqrt(),
            };
            assert!(err <= half * (1.0 + 1e-12), "p {p} r {r}: {err} > {half}");
        }
    }
}
