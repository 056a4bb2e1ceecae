//! A decode score summed as an fp8 tensor core sums it (`Judging::decode_qk_acc`, a runner's
//! `conventions.qk_acc: "e8mN"`): FlashMLA's dense fp8 decode issues its QKᵀ as 18 WGMMA k-steps of
//! 32 over the 576 columns into one register accumulator, never promoted to f32 in between
//! (docs/runners.md, FlashMLA fp8 row), and Hopper's fp8 MMA is modelled (Khattak & Mikaitis, arXiv
//! 2512.07004) as: products exact; at each k-step the running sum and the 32 products aligned to the
//! largest exponent among them and each truncated toward zero there, to N fraction bits; their sum
//! truncated toward zero to N fraction bits of its own binade (e8m13 for N = 13).
//!
//! The noise of one score, per k-step i with running sum a_i (after the step) and largest term
//! T_i = max(|a_{i−1}|, |p_j|), u = 2^−N:
//! - the sum's truncation loses a fraction of its last bit, toward zero: at most u·|a_i| (the bit is
//!   2^−N of the binade, ≤ |a_i|). Its mean is the one-signed bias −κ·(u/2)·a_i with κ ∈ (0, 2], which
//!   the judge fits over a check (`Score::trunc`, `noise::KAPPA_MAX`); its spread about that mean is
//!   uniform within the bit, (u·a_i)²/12.
//! - the alignment: a term whose bits reach below the step's quantum q_i = 2^−N·binade(T_i) ≤ u·T_i
//!   loses up to min(q_i, |term|). A product of two e4m3 values has at most 8 significant bits (its
//!   last at ≥ 2^−7·|p|), so one of |p| ≥ 2^(7−N)·T_i is exact; the smaller ones lose up to
//!   min(u·T_i, |p|) each, toward zero of products of either sign: taken as zero-mean with the second
//!   moment of a loss uniform there, b²/3 (its mean included). The running sum, where it is not the
//!   largest term, loses up to q_i toward zero likewise: (u·T_i)²/3.
//!
//! Every bound is taken at |value|, not its binade: in value space the two descales (q's power of two,
//! the cache's amax/448) shift binades by less than 2×, and |value| ≥ its binade either way. The f32
//! products by the descales and the softmax scale afterwards add an f32 rounding each.

use super::score::{score, Dot, Score};
use crate::precision::ScoreSum;

/// The k-step of Hopper's fp8 WGMMA (k = 32 for 8-bit operands).
const STEP: usize = 32;

/// The score `(x·y + xr·yr)·scale` (the kernels' K order: x's part, then xr's; y's hidden variance
/// `w`, carried through x) summed in an accumulator of `nb` fraction bits (module doc).
pub(super) fn score_acc(
    x: &[f64],
    y: &[f64],
    w: &[f64],
    xr: &[f64],
    yr: &[f64],
    nb: u32,
    scale: f64,
) -> Score {
    let u = 2f64.powi(-(nb as i32));
    let exact_from = 2f64.powi(7 - nb as i32);
    let n = x.len().min(y.len());
    let k = n + xr.len().min(yr.len());
    let prod = |i: usize| match i < n {
        true => x[i] * y[i],
        false => xr[i - n] * yr[i - n],
    };
    let (mut a, mut var, mut steps) = (0.0f64, 0.0f64, 0.0f64);
    let mut i = 0;
    let mut ps = [0.0f64; STEP];
    while i < k {
        let end = (i + STEP).min(k);
        let ps = &mut ps[..end - i];
        ps.iter_mut().zip(i..end).for_each(|(p, j)| *p = prod(j));
        let top = ps.iter().fold(a.abs(), |t, p| t.max(p.abs()));
        let q = u * top;
        if a.abs() < top {
            var += q * q / 3.0;
        }
        for &p in ps.iter() {
            if p.abs() < exact_from * top {
                let b = q.min(p.abs());
                var += b * b / 3.0;
            }
            a += p;
        }
        var += (u * a).powi(2) / 12.0;
        steps += a;
        i = end;
    }
    let prop: f64 = x.iter().zip(w).map(|(&xv, &wv)| xv * xv * wv).sum();
    // The product by the scale as every non-mirror path's (`score` with a sum that adds no bias of
    // its own), then the accumulator's bias.
    let dot = Dot {
        value: a,
        prop,
        acc: var,
        steps: 0.0,
    };
    Score {
        trunc: -u / 2.0 * scale * steps,
        ..score(dot, scale, ScoreSum::Sequential)
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::noise::F32_OP;
    use super::*;
    use crate::kv_format::{e4m3_bits, e4m3_value};
    use rand::SeedableRng;
    use rand_distr::{Distribution, StandardNormal};

    /// `x` truncated toward zero to `nb` fraction bits of the binade of `top` (of its own: top = x).
    fn trunc_at(x: f64, top: f64, nb: u32) -> f64 {
        if top == 0.0 {
            return x;
        }
        let q = 2f64.powi(top.abs().log2().floor() as i32 - nb as i32);
        (x / q).trunc() * q
    }

    /// The accumulator as the module doc describes it, over e4m3 codes (values), by k-steps of 32.
    fn emulate(a: &[f64], b: &[f64], nb: u32) -> f64 {
        let mut acc = 0.0f64;
        for (ca, cb) in a.chunks(STEP).zip(b.chunks(STEP)) {
            let prods: Vec<f64> = ca.iter().zip(cb).map(|(x, y)| x * y).collect();
            let top = prods.iter().fold(acc.abs(), |t, p| t.max(p.abs()));
            let s =
                trunc_at(acc, top, nb) + prods.iter().map(|&p| trunc_at(p, top, nb)).sum::<f64>();
            acc = trunc_at(s, s, nb);
        }
        acc
    }

    /// Random decode-like scores in the kernel's terms: q and k e4m3 codes (k with outlier columns,
    /// as latent rows have), the cache's scale not a power of two. Returns per score the emulated
    /// error against fp64 and the model's score (over the values: codes times the scales).
    fn trial(nb_kernel: u32, nb_model: u32) -> Vec<(f64, Score)> {
        let mut g = rand::rngs::StdRng::seed_from_u64(38);
        let (sq, sk) = (2f64.powi(-6), 0.0173);
        let e4 = |v: f64| f64::from(e4m3_value(e4m3_bits(v as f32)));
        let mut out = Vec::new();
        for _ in 0..400 {
            let mut v = |big: f64| -> Vec<f64> {
                (0..576)
                    .map(|c| {
                        let r: f64 = StandardNormal.sample(&mut g);
                        e4(r * if c % 97 == 3 { big } else { 40.0 })
                    })
                    .collect()
            };
            let (qc, kc) = (v(200.0), v(400.0));
            let exact: f64 = qc.iter().zip(&kc).map(|(a, b)| a * b).sum::<f64>() * sq * sk;
            let err = emulate(&qc, &kc, nb_kernel) * sq * sk - exact;
            let (qv, kv): (Vec<f64>, Vec<f64>) = (
                qc.iter().map(|c| c * sq).collect(),
                kc.iter().map(|c| c * sk).collect(),
            );
            let zero = vec![0.0; 512];
            let sc = score_acc(
                &kv[..512],
                &qv[..512],
                &zero,
                &kv[512..],
                &qv[512..],
                nb_model,
                1.0,
            );
            out.push((err, sc));
        }
        out
    }

    /// The error energy left after the best one-signed bias κ·trunc (κ ∈ [0, 2], as the judge fits
    /// it), over the predicted variance.
    fn energy_after_fit(t: &[(f64, Score)]) -> f64 {
        let (mut best, mut k) = (f64::INFINITY, 0.0);
        while k <= 2.0 {
            let e: f64 = t.iter().map(|(e, s)| (e - k * s.trunc).powi(2)).sum();
            best = best.min(e);
            k += 0.01;
        }
        best / t.iter().map(|(_, s)| s.var).sum::<f64>()
    }

    /// The model explains the emulated e8m13 accumulator: its error is toward zero of the partial sums
    /// (a bias the fit takes out) and what is left is within the predicted variance, not far below it
    /// (the bounds are not loose by orders). An accumulator of 9 bits judged as 13 is far outside.
    #[test]
    fn the_e8m13_model_explains_the_emulated_accumulator() {
        let t = trial(13, 13);
        let (err, trunc): (f64, f64) = t
            .iter()
            .fold((0.0, 0.0), |(a, b), (e, s)| (a + e, b + s.trunc));
        assert!(
            err * trunc > 0.0,
            "the error is not toward zero: {err} vs {trunc}"
        );
        let r = energy_after_fit(&t);
        assert!(
            (0.05..1.0).contains(&r),
            "e8m13: energy {r:.3} of the predicted"
        );
        let r9 = energy_after_fit(&trial(9, 13));
        assert!(
            r9 > 20.0,
            "e8m9 judged as e8m13: only {r9:.2}× the predicted"
        );
        // Without the model (an f32 sum's noise, ~2⁻⁴⁸ of the score²) the same error is ~10⁶× off.
        let f32_var: f64 = t.iter().map(|(_, s)| s.s * s.s * 2.0 * F32_OP).sum();
        let e: f64 = t.iter().map(|(e, _)| e * e).sum();
        assert!(e / f32_var > 1e4, "{}", e / f32_var);
    }

    /// A NaN operand makes the score NaN (the attention then NaN: never a pass).
    #[test]
    fn nan_stays_nan() {
        let mut x = vec![1.0; 512];
        x[100] = f64::NAN;
        let s = score_acc(
            &x,
            &[1.0; 512],
            &[0.0; 512],
            &[1.0; 64],
            &[1.0; 64],
            13,
            1.0,
        );
        assert!(s.s.is_nan());
    }
}
