//! One attention score `x·y + xr·yr` as the path computes it: its value, the variance of its f32 sum
//! (as the backend sums: `ScoreSum`) and a truncating accumulator's bias.

use super::super::noise::{acc_var, Store, F32_OP, U32};
#[cfg(target_arch = "x86_64")]
use super::simd;
use crate::precision::{Dtype, ScoreSum};

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

/// The noise of the mirror's `ops::dot` over operands stored in `dt` (its score's operands are: the
/// cache, q_absorbed, prefill's decompressed keys): 8 interleaved lanes, each a sequential f32 sum,
/// then a pairwise tree; each product, partial sum and tree sum rounded by [`on_grid`]. Operands of a
/// short type make most of them exact (bf16 × bf16 fits f32's 24 bits; a partial sum stays exact while
/// its terms' bits fit below its top bit): measured on the deepseek-v3 fixture's decode scores, the
/// actual error was 377 u², this model 507 u², the earlier `F32_OP`-per-operation model 3149 u².
pub(super) fn lanes8(x: &[f64], y: &[f64], dt: Dtype) -> (f64, f64) {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2() {
        // SAFETY: the CPU has AVX2.
        return unsafe { lanes8_avx2(x, y, dt) };
    }
    lanes8_body(x, y, dt)
}

/// [`lanes8`] compiled for AVX2: its eight lanes are independent and their steps elementwise, so the
/// compiler widens them (two registers of four) with every operation, and so every bit, the same.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lanes8_avx2(x: &[f64], y: &[f64], dt: Dtype) -> (f64, f64) {
    lanes8_body(x, y, dt)
}

/// [`lanes8`]: element i goes to lane i mod 8, eight at a time.
#[inline(always)]
fn lanes8_body(x: &[f64], y: &[f64], dt: Dtype) -> (f64, f64) {
    let q = 2.0 * dt.round_unit();
    let (mut acc, mut grid, mut v8) = ([0.0f64; 8], [f64::INFINITY; 8], [0.0f64; 8]);
    let n = x.len().min(y.len());
    let (xc, yc) = (x[..n].chunks_exact(8), y[..n].chunks_exact(8));
    let (xt, yt) = (xc.remainder(), yc.remainder());
    for (a, b) in xc.zip(yc) {
        for l in 0..8 {
            lane8_step((&mut acc[l], &mut grid[l], &mut v8[l]), a[l], b[l], q);
        }
    }
    for (l, (&a, &b)) in xt.iter().zip(yt).enumerate() {
        lane8_step((&mut acc[l], &mut grid[l], &mut v8[l]), a, b, q);
    }
    lanes8_finish(&acc, &grid, &v8)
}

/// One product `a·b` added to a lane (its sum, the sum's grid, its variance); `q`: twice the operands'
/// unit roundoff.
#[inline(always)]
fn lane8_step((acc, grid, v): (&mut f64, &mut f64, &mut f64), a: f64, b: f64, q: f64) {
    let xy = a * b;
    // The exact product's grid: the operands' (∞ for a zero product, which adds nothing).
    let g = match xy == 0.0 {
        true => f64::INFINITY,
        false => binade(a) * q * (binade(b) * q),
    };
    let (vp, gp) = on_grid(xy, g);
    *acc += xy;
    let (vs, gs) = on_grid(*acc, grid.min(gp));
    *grid = gs;
    *v += vp + vs;
}

/// 2^⌊log2 |y|⌋ (0 for 0, ∞/NaN for ∞/NaN): y's exponent bits.
#[inline(always)]
pub(super) fn binade(y: f64) -> f64 {
    f64::from_bits(y.to_bits() & 0x7ff0_0000_0000_0000)
}

/// Rounding to f32 a result `r` whose exact value lies on the grid `g` (a power of two; ∞: no
/// constraint): exact where f32's spacing at r is no coarser than g, else the variance of dropping
/// the bits below that spacing `u`, (u² + 2g²)/12 (uniform residues on g's grid, ties to even); and
/// the grid the rounded result lies on.
#[inline(always)]
pub(super) fn on_grid(r: f64, g: f64) -> (f64, f64) {
    let u = binade(r) * F32_SPACING;
    match u > g {
        true => ((u * u + 2.0 * g * g) / 12.0, u),
        false => (0.0, g),
    }
}

/// f32's spacing at 1 (2⁻²³).
const F32_SPACING: f64 = 2.0 * U32;

/// [`lanes8`]'s tree over its lanes' sums `acc` (on grids `grid`) and their variances `v8`: the score's
/// sum and its variance.
#[inline(always)]
pub(super) fn lanes8_finish(acc: &[f64; 8], grid: &[f64; 8], v8: &[f64; 8]) -> (f64, f64) {
    let add = |(a, ga): (f64, f64), (b, gb): (f64, f64), v: &mut f64| {
        let s = a + b;
        let (vs, g) = on_grid(s, ga.min(gb));
        *v += vs;
        (s, g)
    };
    let mut v = v8.iter().sum::<f64>();
    let p: [(f64, f64); 4] =
        std::array::from_fn(|k| add((acc[k], grid[k]), (acc[k + 4], grid[k + 4]), &mut v));
    let a = add(p[0], p[1], &mut v);
    let b = add(p[2], p[3], &mut v);
    let t = add(a, b, &mut v);
    (t.0, v)
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
    dt: Dtype,
) -> Dot {
    // The mirror's lanes, over its operands' grids (a pass of their own: the SIMD loops below
    // sum in the kernels' k-steps).
    let lanes = match sum {
        ScoreSum::Lanes8 => (lanes8(x, y, dt).1, lanes8(xr, yr, dt).1),
        _ => (0.0, 0.0),
    };
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
        return dot_of(f, lanes, x.len() + xr.len(), sum);
    }
    dot_of(
        terms_scalar(x, y, w, xr, yr),
        lanes,
        x.len() + xr.len(),
        sum,
    )
}

/// [`dot_var`]'s terms without SIMD.
pub(super) fn terms_scalar(x: &[f64], y: &[f64], w: &[f64], xr: &[f64], yr: &[f64]) -> Terms {
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
    Terms {
        a,
        sq,
        steps,
        steps2,
        prop,
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
}

/// [`Dot`] from its terms and, for the mirror, [`lanes8`]'s variances of x·y and xr·y; `k` elements
/// in all.
#[inline(always)]
pub(super) fn dot_of(f: Terms, lanes: (f64, f64), k: usize, sum: ScoreSum) -> Dot {
    let Terms {
        a,
        sq,
        steps,
        steps2,
        prop,
    } = f;
    let acc = match sum {
        // Tensor cores: one rounding of the accumulator per k-step (a truncation's spread is at most
        // its ulp, ≤ 2u of the partial sum: ≤ F32_OP of its square), doubled for the MMA's internal
        // alignment; the products are exact.
        ScoreSum::TensorCore => 2.0 * F32_OP * steps2,
        // The mirror: two `ops::dot`s (x's part, xr's), then their sum (rounded where it lands).
        ScoreSum::Lanes8 => lanes.0 + lanes.1 + Store::F32.round_var(a),
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
        var: scale * scale * (d.prop + d.acc)
            + match sum {
                // The mirror's one product by the scale, rounded where it lands.
                ScoreSum::Lanes8 => Store::F32.round_var(s),
                _ => s * s * 2.0 * F32_OP,
            },
        trunc: match sum.truncates() {
            true => -U32 * scale * d.steps,
            false => 0.0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::ops::dot;
    use rand::SeedableRng;
    use rand_distr::{Distribution, StandardNormal};

    /// [`lanes8`] as it was written first, one element at a time: what the widened one must equal.
    fn lanes8_one_by_one(x: &[f64], y: &[f64], dt: Dtype) -> (f64, f64) {
        let q = 2.0 * dt.round_unit();
        let (mut acc, mut grid, mut v8) = ([0.0f64; 8], [f64::INFINITY; 8], [0.0f64; 8]);
        for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
            let l = i % 8;
            let xy = a * b;
            let g = match xy == 0.0 {
                true => f64::INFINITY,
                false => binade(a) * q * (binade(b) * q),
            };
            let (vp, gp) = on_grid(xy, g);
            acc[l] += xy;
            let (vs, gs) = on_grid(acc[l], grid[l].min(gp));
            grid[l] = gs;
            v8[l] += vp + vs;
        }
        lanes8_finish(&acc, &grid, &v8)
    }

    /// The widened [`lanes8`] gives the one-by-one loop's bits on random values with zeros,
    /// infinities, NaN (as one value: Rust leaves a NaN's sign and payload unspecified), tiny and huge
    /// magnitudes, at every length up to 40 and at the models' 64, 512 and 576, x and y of unequal
    /// length too.
    #[test]
    fn lanes8_widened_is_bit_for_bit_the_loop() {
        let mut g = rand::rngs::StdRng::seed_from_u64(9);
        let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let mut val = |k: u32| -> f64 {
            let r: f64 = StandardNormal.sample(&mut g);
            match k % 23 {
                0 => 0.0,
                1 => f64::INFINITY,
                2 => f64::NAN,
                3 => r * 1e-30,
                4 => r * 1e30,
                5 => -0.0,
                _ => Dtype::Bf16.round(r as f32) as f64,
            }
        };
        let mut k = 0u32;
        for n in (0..=40).chain([64, 512, 576]) {
            for trial in 0..6 {
                let mut v = |m: usize, special: bool| -> Vec<f64> {
                    (0..m)
                        .map(|_| {
                            k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                            val(if special { (k >> 16) % 23 } else { 22 })
                        })
                        .collect()
                };
                let special = trial % 2 == 1;
                let (x, y) = (v(n, special), v(n + trial / 4, special));
                for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
                    let (a, b) = (lanes8(&x, &y, dt), lanes8_one_by_one(&x, &y, dt));
                    assert!(
                        same(a.0, b.0) && same(a.1, b.1),
                        "{n} {trial} {dt:?}: {a:?} {b:?}"
                    );
                }
            }
        }
    }

    /// [`lanes8`]'s variance against the mirror's own `ops::dot` over 512-wide operands: the mean
    /// squared error of 2000 dots, operands in bf16 (q_absorbed · a cache row) and in f32. The model of
    /// one f32 rounding per operation at its worst place (`F32_OP` × the value²) predicted 8× the bf16
    /// error and 1.9× the f32 one.
    #[test]
    fn lanes8_predicts_the_mirrors_dot_error() {
        for dt in [Dtype::Bf16, Dtype::F32] {
            let mut g = rand::rngs::StdRng::seed_from_u64(3);
            let (mut err, mut pred) = (0.0, 0.0);
            for _ in 0..2000 {
                let mut v = || -> Vec<f32> {
                    (0..512)
                        .map(|_| dt.round(StandardNormal.sample(&mut g)))
                        .collect()
                };
                let (x, y) = (v(), v());
                let exact: f64 = x.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
                err += (dot(&x, &y) as f64 - exact).powi(2);
                let w = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
                pred += lanes8(&w(&x), &w(&y), dt).1;
            }
            let r = pred / err;
            assert!((0.8..1.6).contains(&r), "{dt:?}: predicted/actual {r:.2}");
        }
    }

    /// A sum whose terms' bits all fit below its top bit is exact; one that drops a bit is not.
    #[test]
    fn on_grid_is_exact_where_the_bits_fit() {
        assert_eq!(on_grid(1.5, 2f64.powi(-10)), (0.0, 2f64.powi(-10)));
        let (v, g) = on_grid(1.5, 2f64.powi(-30));
        assert_eq!(g, 2f64.powi(-23));
        assert!(v > 0.0 && v <= 2f64.powi(-46) / 12.0 * 1.01);
        assert_eq!(on_grid(0.0, f64::INFINITY).0, 0.0);
    }
}
