//! One attention score `x·y + xr·yr` as the path computes it: its value, the variance of its f32 sum
//! (as the backend sums: `ScoreSum`) and a truncating accumulator's bias.

use super::super::noise::{acc_var, F32_OP, U32};
#[cfg(target_arch = "x86_64")]
use super::simd;
use crate::precision::ScoreSum;

/// A score `x·y + xr·yr` in one pass, with Σ(xᵢyᵢ)² (for its f32 sum's rounding) and Σxᵢ²·wᵢ, the
/// variance that y's hidden rounding (variance `w`) adds to it.
/// A score's dot product `x·y + xr·yr` in fp64, with what its f32 computation's noise needs.
pub(super) struct Dot {
    pub(super) value: f64,
    /// x's hidden variance carried through: Σ x²·w.
    pub(super) prop: f64,
    /// The variance of its f32 sum, as the backend sums (`ScoreSum`).
    pub(super) acc: f64,
    /// Σ of the partial sums after each 16-wide k-step of a tensor-core MMA, in the kernels' K order
    /// (x's part, then xr's): a truncating accumulator's bias per unit κ, up to −u (`Score::trunc`).
    pub(super) steps: f64,
}

/// The noise of the mirror's `ops::dot`: 8 interleaved lanes, each a sequential f32 sum, then a pairwise
/// tree; every product, partial sum and tree sum rounded once (≤ u²/3 of its square: F32_OP).
pub(super) fn lanes8(x: &[f64], y: &[f64]) -> (f64, f64) {
    let mut acc = [0.0f64; 8];
    // Per lane: Σ (product² + partial sum²), summed across lanes at the end (one chain would make
    // this loop latency-bound; a noise model's sum needs no particular order).
    let mut v8 = [0.0f64; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let (xt, yt) = (xc.remainder(), yc.remainder());
    for (a, b) in xc.zip(yc) {
        for l in 0..8 {
            let xy = a[l] * b[l];
            acc[l] += xy;
            v8[l] += xy * xy + acc[l] * acc[l];
        }
    }
    for (l, (a, b)) in xt.iter().zip(yt).enumerate() {
        let xy = a * b;
        acc[l] += xy;
        v8[l] += xy * xy + acc[l] * acc[l];
    }
    lanes8_finish(&acc, &v8)
}

/// [`lanes8`]'s tree over its lanes' sums `acc` and their terms `v8`.
#[inline(always)]
pub(super) fn lanes8_finish(acc: &[f64; 8], v8: &[f64; 8]) -> (f64, f64) {
    let p: [f64; 4] = std::array::from_fn(|k| acc[k] + acc[k + 4]);
    let (a, b) = (p[0] + p[1], p[2] + p[3]);
    let t = a + b;
    let v = v8.iter().sum::<f64>() + p.iter().map(|x| x * x).sum::<f64>() + a * a + b * b + t * t;
    (t, F32_OP * v)
}

/// Σ x·y and Σ (x·y)² over a few elements, four lanes wide (the products' order within a 16-wide
/// k-step does not matter to the model; one sequential chain would bound the loop by add latency).
#[inline]
pub(super) fn part(x: &[f64], y: &[f64]) -> (f64, f64) {
    let (mut s, mut q) = ([0.0f64; 4], [0.0f64; 4]);
    let (xc, yc) = (x.chunks_exact(4), y.chunks_exact(4));
    let (xt, yt) = (xc.remainder(), yc.remainder());
    for (a, b) in xc.zip(yc) {
        for l in 0..4 {
            let p = a[l] * b[l];
            s[l] += p;
            q[l] += p * p;
        }
    }
    for (a, b) in xt.iter().zip(yt) {
        let p = a * b;
        s[0] += p;
        q[0] += p * p;
    }
    ((s[0] + s[1]) + (s[2] + s[3]), (q[0] + q[1]) + (q[2] + q[3]))
}

/// The score `x·y + xr·yr` (the kernels' K order: x's part, then xr's) with its variance terms, summed
/// 16-wide k-step by k-step: the partial sums after each step are the truncation model's.
pub(super) fn dot_var(
    x: &[f64],
    y: &[f64],
    w: &[f64],
    xr: &[f64],
    yr: &[f64],
    sum: ScoreSum,
) -> Dot {
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(16)
        && xr.len().is_multiple_of(16)
        && y.len() == x.len()
        && w.len() >= x.len()
        && yr.len() == xr.len()
        && simd::avx2()
    {
        // SAFETY: the CPU has AVX2; the lengths are checked above.
        let f = unsafe { simd::dot_terms(x, y, w, xr, yr) };
        return dot_of(f, x.len() + xr.len(), sum);
    }
    let lanes = sum == ScoreSum::Lanes8;
    dot_of(
        terms_scalar(x, y, w, xr, yr, lanes),
        x.len() + xr.len(),
        sum,
    )
}

/// [`dot_var`]'s terms without SIMD ([`lanes8`]'s only where `lanes`).
pub(super) fn terms_scalar(
    x: &[f64],
    y: &[f64],
    w: &[f64],
    xr: &[f64],
    yr: &[f64],
    lanes: bool,
) -> Terms {
    let (mut a, mut sq, mut steps, mut steps2) = (0.0, 0.0, 0.0, 0.0);
    let n = x.len();
    let k = n + xr.len();
    let mut i = 0;
    while i < k {
        let end = ((i / 16 + 1) * 16).min(k);
        let (s, q) = if end <= n {
            part(&x[i..end], &y[i..end])
        } else if i >= n {
            part(&xr[i - n..end - n], &yr[i - n..end - n])
        } else {
            let (s0, q0) = part(&x[i..], &y[i..]);
            let (s1, q1) = part(&xr[..end - n], &yr[..end - n]);
            (s0 + s1, q0 + q1)
        };
        a += s;
        sq += q;
        steps += a;
        steps2 += a * a;
        i = end;
    }
    // x's hidden variance carried through, four lanes wide.
    let mut p4 = [0.0f64; 4];
    let (xc, wc) = (x.chunks_exact(4), w[..n].chunks_exact(4));
    let (xt, wt) = (xc.remainder(), wc.remainder());
    for (xv, wv) in xc.zip(wc) {
        for l in 0..4 {
            p4[l] += xv[l] * xv[l] * wv[l];
        }
    }
    for (xv, wv) in xt.iter().zip(wt) {
        p4[0] += xv * xv * wv;
    }
    let prop = (p4[0] + p4[1]) + (p4[2] + p4[3]);
    let lanes = match lanes {
        true => (lanes8(x, y).1, lanes8(xr, yr).1),
        false => (0.0, 0.0),
    };
    Terms {
        a,
        sq,
        steps,
        steps2,
        prop,
        lanes,
    }
}

/// What [`dot_var`] sums over a score's elements, each in its own fixed order (the SIMD path's sums
/// are the scalar path's, lane for lane: the same bits).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Terms {
    pub(super) a: f64,
    pub(super) sq: f64,
    pub(super) steps: f64,
    pub(super) steps2: f64,
    pub(super) prop: f64,
    /// [`lanes8`]'s variance of x·y and of xr·yr (`ScoreSum::Lanes8` only; else unused).
    pub(super) lanes: (f64, f64),
}

/// [`Dot`] from its terms, `k` elements in all.
#[inline(always)]
pub(super) fn dot_of(f: Terms, k: usize, sum: ScoreSum) -> Dot {
    let Terms {
        a,
        sq,
        steps,
        steps2,
        prop,
        lanes,
    } = f;
    let acc = match sum {
        // Tensor cores: one rounding of the accumulator per k-step (a truncation's spread is at most
        // its ulp, ≤ 2u of the partial sum: ≤ F32_OP of its square), doubled for the MMA's internal
        // alignment; the products are exact.
        ScoreSum::TensorCore => 2.0 * F32_OP * steps2,
        // The mirror: two `ops::dot`s (x's part, xr's), then their sum.
        ScoreSum::Lanes8 => lanes.0 + lanes.1 + F32_OP * a * a,
        // Unknown: a sequential sum's, conservative for any order.
        ScoreSum::Sequential => acc_var(k, sq, a),
    };
    Dot {
        value: a,
        prop,
        acc,
        steps,
    }
}

/// One score as the path computes it: its value, its variance, and the bias at κ = 1 of a tensor-core
/// accumulator that truncates toward zero after each 16-wide k-step: each step loses ~κ·u of its
/// partial sum, so the score moves by −κ·u·Σ partial sums (Fasi et al., "Numerical behavior of NVIDIA
/// tensor cores", 2021; on the H200 this direction explains 86 % of a GLM-5 split_lse's bias, with
/// κ ≈ 0.5–0.6: `bench/probes/split_lse.py`). Zero where the backend rounds to nearest.
#[derive(Debug, Clone, Copy)]
pub(super) struct Score {
    pub(super) s: f64,
    pub(super) var: f64,
    pub(super) trunc: f64,
}

pub(super) fn score(d: Dot, scale: f64, sum: ScoreSum) -> Score {
    let s = d.value * scale;
    Score {
        s,
        var: scale * scale * (d.prop + d.acc) + s * s * 2.0 * F32_OP,
        trunc: match sum.truncates() {
            true => -U32 * scale * d.steps,
            false => 0.0,
        },
    }
}
