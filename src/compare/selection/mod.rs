//! Comparing DSA selections: the optimized path's top-k index sets against the reference's, tie-aware.
//!
//! Per query `t` with reference scores `s` (fp64, over the visible keys `0..=t`) and the reference's
//! selection of `k` keys: let key `a` hold the k-th largest score and `b` the (k+1)-th (none when every
//! key is selected). A key `j` the optimized path selects but the reference does not is *within the
//! noise margin* when `s_a − s_j ≤ MARGIN_SIGMAS · σ(s_a − s_j)`; a key the reference selects but the
//! optimized path drops, when `s_j − s_b ≤ MARGIN_SIGMAS · σ(s_j − s_b)`. σ is the statistical noise of
//! that score difference at the optimized indexer's precision (`ScoreNoise`): the square root of the
//! sum of its per-term rounding variances, not a worst-case bound (which at GLM-5's 32 heads of 128 is
//! wider than the whole spread of the scores). A near-tie may flip at the engine's precision (axolotl
//! PR #3832), a key beyond it may not. A different count of keys is a failure by itself (a top-k
//! boundary bug can hide inside the margin otherwise). NaN scores never pass.

use crate::backend::cpu::indexer::hadamard;
use crate::compare::noise::{acc_var, F32_OP};
use crate::precision::{Dtype, KeyPrecision};
use crate::reference::indexer::IndexerOut;
use crate::reference::sparse::Selection;
use ndarray::{s, Array2, Array3};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Standard deviations of a score difference a flip may be blamed on. The largest of N Gaussian
/// near-ties is about √(2 ln N) σ: 4.3 σ for the ~10⁴ near-ties of a 3k-token layer; 6 σ leaves room
/// for the model's approximations (measured on the golden: `tests/it/dsa.rs`).
pub const MARGIN_SIGMAS: f64 = 6.0;

/// The flip-count test: a key that changed sides at more than `FLIP_SIGMAS` σ of its score difference
/// from the threshold is a *far flip*. Counted per query (a swap flips two keys at once: one event): the
/// queries with a far flip, against the number the noise model expects (per query the union bound
/// Σ Φ(−z) over its keys, at most 1, so the expectation errs high). A layer whose count has a Poisson
/// probability below `FLIP_P` fails. It catches what moves many keys by a few σ each, none beyond the
/// per-key margin (a dropped fp8 block scale: a few percent per key).
pub const FLIP_SIGMAS: f64 = 3.0;
pub const FLIP_P: f64 = 1e-6;
/// Keys further than this from the threshold add nothing to the expected count (Φ(−8) ≈ 6e-16).
const FLIP_WALK_SIGMAS: f64 = 8.0;

/// fp8 e4m3's unit roundoff (3 mantissa bits).
pub const FP8_UNIT: f64 = 1.0 / 16.0;

/// The noise of the optimized indexer's scores, from the reference's fp64 tensors: per element of q and
/// k the variance of its roundings (in the Hadamard-rotated basis for fp8 keys, where the fp8 rounding
/// happens), carried through ReLU's pass/cut of each head, and the f32 sums.
#[derive(Debug, Clone)]
pub struct ScoreNoise {
    /// `[T, Hi, Di]` (with the logit's `Di^-0.5`), `[T, Di]`, `[T, Hi]`: the reference's (rotated for
    /// fp8), and q's and k's per-element rounding variances.
    q: Array3<f64>,
    k: Array2<f64>,
    w: Array2<f64>,
    vq: Array3<f64>,
    vk: Array2<f64>,
    /// `[T, Hi]`: the weights' variance (attn_in's and the layer input's roundings through W_proj).
    vw: Array2<f64>,
}

/// The reference's tensors the noise model reads (`IndexerOut`'s, or the k-pool indexer's
/// `KpoolOut`'s): q `[T, Hi, Di]`, k `[T, Di]` with LayerNorm's input and gain, the weights `[T, Hi]` and
/// their squares, the hidden size and q-LoRA rank.
struct Parts<'a> {
    q: &'a Array3<f64>,
    k: &'a Array2<f64>,
    k_lin: &'a Array2<f64>,
    k_gain: &'a Array2<f64>,
    weights: &'a Array2<f64>,
    weights_sq: &'a Array2<f64>,
    in_dims: (usize, usize),
}

/// `Parts` of a reference output that holds the seven tensors under these names (`IndexerOut`,
/// `KpoolOut`): the one build both noise models use (a macro: the two are distinct types of
/// `reference`, with no common trait to read the fields through).
macro_rules! parts_of {
    ($o:expr) => {
        Parts {
            q: &$o.q,
            k: &$o.k,
            k_lin: &$o.k_lin,
            k_gain: &$o.k_gain,
            weights: &$o.weights,
            weights_sq: &$o.weights_sq,
            in_dims: $o.in_dims,
        }
    };
}

fn mean_sq(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>() / x.len().max(1) as f64
}

impl ScoreNoise {
    /// The noise of scores computed with q and k stored in `dt` (and, for `KeyPrecision::Fp8`,
    /// Hadamard-rotated to fp8 with per-block scales). Each rounding has variance ≤ u²/3 of its value's
    /// square. q: its own storage and rope roundings (∝ q_i²) and those of the layer input, attn_in,
    /// the q-LoRA projection and its norm, which reach q_i through `W_q_b` (∝ the head's mean q²,
    /// not q_i²: a small q_i is a cancelling sum). k: its own two (∝ k_i²), and the LayerNorm input's
    /// own, attn_in's and the layer input's, times the norm's gain (the centring cancels).
    pub fn new(o: &IndexerOut, dt: Dtype, keys: KeyPrecision) -> ScoreNoise {
        let mut n = ScoreNoise::tokens(&parts_of!(o), dt);
        // A power-of-two Di is checked where the fp8 indexer runs; a rotation of any other would not
        // be orthogonal.
        if keys == KeyPrecision::Fp8 && n.q.dim().2.is_power_of_two() {
            n.rotate_to_fp8();
        }
        n
    }

    /// The noise of per-token scores in `dt`, before any fp8 rotation (`new`).
    fn tokens(o: &Parts, dt: Dtype) -> ScoreNoise {
        let u2 = dt.round_unit().powi(2) / 3.0;
        let (t, hi, di) = o.q.dim();
        // The linears' f32 sums (`noise::acc_var` of n random terms: ~(5/3)·n roundings of the
        // output's mean square): over E for attn_in's projections, E + Lq for q.
        let (e, lq) = (o.in_dims.0 as f64, o.in_dims.1 as f64);
        let sum_e = F32_OP * 5.0 / 3.0 * e;
        let q = o.q.mapv(|v| v / (di as f64).sqrt());
        let mut vq = Array3::zeros((t, hi, di));
        for tt in 0..t {
            for h in 0..hi {
                let qh = q.slice(s![tt, h, ..]);
                let ms = mean_sq(qh.as_slice().expect("contiguous"));
                for i in 0..di {
                    vq[[tt, h, i]] =
                        u2 * (2.0 * qh[i] * qh[i] + 4.0 * ms) + F32_OP * 5.0 / 3.0 * (e + lq) * ms;
                }
            }
        }
        let mut vk = Array2::zeros((t, di));
        for tt in 0..t {
            let x = o.k_lin.row(tt);
            let ms = mean_sq(x.as_slice().expect("contiguous"));
            for i in 0..di {
                let (k, g) = (o.k[[tt, i]], o.k_gain[[tt, i]]);
                vk[[tt, i]] =
                    u2 * (2.0 * k * k + g * g * (x[i] * x[i] + 2.0 * ms)) + sum_e * g * g * ms;
            }
        }
        ScoreNoise {
            q,
            k: o.k.clone(),
            w: o.weights.clone(),
            vq,
            vk,
            vw: o.weights_sq.mapv(|v| (2.0 * u2 + sum_e) * v),
        }
    }

    /// Into the Hadamard basis: independent errors of variances v_i become each of variance mean(v);
    /// then the fp8 rounding of each rotated value (relative: the block scale puts it in e4m3's
    /// normal range).
    fn rotate_to_fp8(&mut self) {
        let f8 = FP8_UNIT * FP8_UNIT / 3.0;
        let rot = |x: &mut [f64], v: &mut [f64]| {
            hadamard(x);
            let m = v.iter().sum::<f64>() / v.len() as f64;
            v.iter_mut()
                .zip(x.iter())
                .for_each(|(v, x)| *v = m + f8 * x * x);
        };
        for (mut x, mut v) in self.q.rows_mut().into_iter().zip(self.vq.rows_mut()) {
            rot(
                x.as_slice_mut().expect("contiguous"),
                v.as_slice_mut().expect("contiguous"),
            );
        }
        for (mut x, mut v) in self.k.rows_mut().into_iter().zip(self.vk.rows_mut()) {
            rot(
                x.as_slice_mut().expect("contiguous"),
                v.as_slice_mut().expect("contiguous"),
            );
        }
    }

    /// Per head of query `t`, key `j`: `w_h` where ReLU may pass the logit (0 where it surely cuts
    /// it), and the f32 sums' variance of the score. A logit within `KINK_SIGMAS` of its own noise
    /// below 0 counts as passing: its rounding may carry it over ReLU's kink.
    fn heads(&self, t: usize, j: usize) -> (Vec<f64>, Vec<f64>, f64) {
        const KINK_SIGMAS: f64 = 4.0;
        let (hi, di) = (self.q.dim().1, self.q.dim().2);
        let (kj, vkj) = (self.k.row(j), self.vk.row(j));
        let mut wa = vec![0.0; hi];
        let mut relu = vec![0.0; hi];
        let (mut acc, mut sq, mut total) = (0.0, 0.0, 0.0);
        for (h, wah) in wa.iter_mut().enumerate() {
            let (qh, vqh) = (self.q.slice(s![t, h, ..]), self.vq.slice(s![t, h, ..]));
            let l = qh.dot(&kj);
            let (mut terms, mut var_l) = (0.0, 0.0);
            for i in 0..di {
                terms += (qh[i] * kj[i]).powi(2);
                var_l += vqh[i] * kj[i] * kj[i] + vkj[i] * qh[i] * qh[i];
            }
            if l > -KINK_SIGMAS * var_l.sqrt() {
                let w = self.w[[t, h]];
                *wah = w;
                let l = l.max(0.0);
                relu[h] = l;
                acc += w * w * acc_var(di, terms, l);
                sq += (w * l).powi(2);
                total += w * l;
            }
        }
        (
            wa,
            relu,
            acc + acc_var(hi, sq, total) + F32_OP * total * total,
        )
    }

    /// σ of `s_a − s_b` for query `t` (`b` `None`: of `s_a` alone). q's rounding is shared by both
    /// scores (it moves them along `k_a − k_b`, per head where ReLU passes); each key's is its own.
    pub fn sigma(&self, t: usize, a: usize, b: Option<usize>) -> f64 {
        let di = self.q.dim().2;
        let (wa, ra, acc_a) = self.heads(t, a);
        let (wb, rb, acc_b) = match b {
            Some(b) => self.heads(t, b),
            None => (vec![0.0; wa.len()], vec![0.0; wa.len()], 0.0),
        };
        let (ka, kb) = (self.k.row(a), self.k.row(b.unwrap_or(a)));
        // The weights' roundings, shared by both scores: Σ_h var(w_h)·(ReLU(l_ha) − ReLU(l_hb))².
        let mut var: f64 = (0..wa.len())
            .map(|h| self.vw[[t, h]] * (ra[h] - rb[h]).powi(2))
            .sum();
        // q's roundings: Σ_h Σ_i var(q_hi)·(w_ha k_ai − w_hb k_bi)².
        for (h, (&xa, &xb)) in wa.iter().zip(&wb).enumerate() {
            if xa == 0.0 && xb == 0.0 {
                continue;
            }
            let vqh = self.vq.slice(s![t, h, ..]);
            var += vqh
                .iter()
                .zip(ka.iter().zip(kb))
                .map(|(&v, (&x, &y))| v * (xa * x - xb * y).powi(2))
                .sum::<f64>();
        }
        // Each key's roundings: Σ_i var(k_i)·(Σ_h w_h q_hi)².
        let along = |wk: &[f64], vk: ndarray::ArrayView1<f64>| {
            let mut g = vec![0.0; di];
            for (h, &w) in wk.iter().enumerate().filter(|(_, w)| **w != 0.0) {
                let qh = self.q.slice(s![t, h, ..]);
                g.iter_mut().zip(qh).for_each(|(g, &q)| *g += w * q);
            }
            g.iter().zip(vk).map(|(g, &v)| g * g * v).sum::<f64>()
        };
        var += along(&wa, self.vk.row(a));
        if let Some(b) = b {
            var += along(&wb, self.vk.row(b));
        }
        (var + acc_a + acc_b).sqrt()
    }
}

/// One selected key outside the margin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Miss {
    pub query: usize,
    /// The key token.
    pub key: usize,
    /// `true`: selected by the optimized path only; `false`: dropped by it.
    pub extra: bool,
    /// Distance to the reference's threshold (`s_k − s_j` or `s_j − s_k1`), absolute.
    pub gap: f64,
    pub margin: f64,
}

/// The verdict on one layer's selections.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectionResult {
    pub queries: usize,
    /// Queries whose reference selection drops a visible key (where DSA differs from dense).
    pub sparse_queries: usize,
    /// `|opt ∩ ref| / |ref|`, worst query and mean.
    pub recall_min: f64,
    pub recall_mean: f64,
    /// Keys in the symmetric differences, in all queries.
    pub differing: usize,
    /// Of those, within the noise margin.
    pub within_margin: usize,
    /// Queries whose key count differs from the reference's.
    pub count_mismatch: usize,
    /// The largest gap outside the margin (by `gap / margin`).
    pub worst: Option<Miss>,
    /// Queries with a key flipped more than `FLIP_SIGMAS` σ from the threshold, the number the noise
    /// model expects, and the Poisson probability of at least as many (`FLIP_P`: below it, a failure).
    #[serde(default)]
    pub far_flip_queries: usize,
    #[serde(default)]
    pub far_flip_expected: f64,
    #[serde(default = "one")]
    pub far_flip_p: f64,
    /// glm5-next's k-pool indexer: the counts above are of pools, not keys (`kpool::compare`), and
    /// here the queries whose keys are not whole pools plus the visible tail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<kpool::PoolLayout>,
    pub pass: bool,
}

fn one() -> f64 {
    1.0
}

/// Φ(−z) for z ≥ 0 (erfc by Numerical Recipes' Chebyshev fit, relative error < 1.2e-7).
pub fn upper_tail(z: f64) -> f64 {
    let x = z / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * x);
    let y = t
        * (-x * x - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398
                                    + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    0.5 * y
}

/// `x ≤ lim`, false when either is NaN (NaN never passes).
fn at_most(x: f64, lim: f64) -> bool {
    matches!(
        x.partial_cmp(&lim),
        Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
    )
}

/// P(N ≥ n) for N ~ Poisson(λ).
pub fn poisson_tail(n: usize, lambda: f64) -> f64 {
    if n == 0 {
        return 1.0;
    }
    if lambda <= 0.0 {
        return 0.0;
    }
    // The first term e^−λ λ^n / n! in logs, then the series' terms in turn until negligible.
    let ln_fact: f64 = (1..=n).map(|i| (i as f64).ln()).sum();
    let mut term = (-lambda + n as f64 * lambda.ln() - ln_fact).exp();
    let mut sum = 0.0;
    let mut i = n;
    while term > sum * 1e-17 && i < n + 100_000 {
        sum += term;
        i += 1;
        term *= lambda / i as f64;
    }
    sum.min(1.0)
}

/// Compare `opt` with `reference` under the reference's fp64 `scores` (`[T, T]`, visible `j ≤ t`) and
/// the optimized indexer's score noise.
pub fn compare(
    scores: &Array2<f64>,
    noise: &ScoreNoise,
    reference: &Selection,
    opt: &Selection,
) -> SelectionResult {
    compare_rows(
        scores,
        &|q| q + 1,
        &|q, a, b| noise.sigma(q, a, Some(b)),
        reference,
        opt,
    )
}

/// `compare` over candidates of any kind (keys, or glm5-next's pools): query `q` ranks the first
/// `visible(q)` of its row of `scores`; `sigma(q, a, b)` is σ of `s_a − s_b`.
pub fn compare_rows(
    scores: &Array2<f64>,
    visible: &(dyn Fn(usize) -> usize + Sync),
    sigma: &(dyn Fn(usize, usize, usize) -> f64 + Sync),
    reference: &Selection,
    opt: &Selection,
) -> SelectionResult {
    let t = reference.n_queries();
    let mut r = SelectionResult::start(reference);
    if opt.n_queries() != t || scores.nrows() != t {
        r.pass = false;
        r.count_mismatch = t.abs_diff(opt.n_queries());
        r.recall_min = 0.0;
        return r;
    }
    // Per query: recall, count mismatch, and each differing key's (gap, margin); in parallel.
    let per_query: Vec<(f64, bool, Vec<Miss>, f64)> = (0..t)
        .into_par_iter()
        .map(|q| {
            let (rk, ok) = (&reference.keys[q], &opt.keys[q]);
            let n = visible(q);
            let row: Vec<f64> = scores.row(q).iter().take(n).copied().collect();
            let k = rk.len();
            // Every visible key by rank: the flip-count test walks out from the threshold.
            let ranked = crate::reference::indexer::top_keys(&row, n, n);
            // The threshold keys: the k-th (for an extra key) and the (k+1)-th (for a dropped one).
            let (th_in, th_out) = (
                k.checked_sub(1)
                    .and_then(|i| ranked.get(i))
                    .map(|&j| j as usize),
                ranked.get(k).map(|&j| j as usize),
            );
            let common = ok.iter().filter(|j| rk.binary_search(j).is_ok()).count();
            let recall = if k == 0 {
                1.0
            } else {
                common as f64 / k as f64
            };
            let extra = ok
                .iter()
                .filter(|j| rk.binary_search(j).is_err())
                .map(|&j| (j as usize, true));
            let dropped = rk
                .iter()
                .filter(|j| ok.binary_search(j).is_err())
                .map(|&j| (j as usize, false));
            let misses = extra
                .chain(dropped)
                .map(|(j, is_extra)| {
                    let (gap, th) = match is_extra {
                        true => (th_in.map_or(f64::INFINITY, |a| row[a] - row[j]), th_in),
                        false => (th_out.map_or(f64::INFINITY, |b| row[j] - row[b]), th_out),
                    };
                    let margin = match th {
                        Some(a) => MARGIN_SIGMAS * sigma(q, a, j),
                        None => 0.0,
                    };
                    Miss {
                        query: q,
                        key: j,
                        extra: is_extra,
                        gap,
                        margin,
                    }
                })
                .collect();
            let expected = expected_far_flips(&row, &ranked, k, |a, b| sigma(q, a, b));
            (recall, ok.len() != k, misses, expected)
        })
        .collect();
    let mut worst_ratio = 0.0;
    for (recall, mismatch, misses, expected) in per_query {
        r.far_flip_expected += expected.min(1.0);
        r.far_flip_queries += misses
            .iter()
            .any(|m| !at_most(m.gap, FLIP_SIGMAS / MARGIN_SIGMAS * m.margin))
            as usize;
        r.recall_min = r.recall_min.min(recall);
        r.recall_mean += recall / t as f64;
        if mismatch {
            r.count_mismatch += 1;
            r.pass = false;
        }
        for m in misses {
            r.differing += 1;
            // NaN anywhere (score, margin) is outside: `gap <= margin` is false.
            if m.gap <= m.margin {
                r.within_margin += 1;
                continue;
            }
            r.pass = false;
            let ratio = if m.margin > 0.0 {
                m.gap / m.margin
            } else {
                f64::INFINITY
            };
            if r.worst.is_none() || ratio > worst_ratio || ratio.is_nan() {
                worst_ratio = ratio;
                r.worst = Some(m);
            }
        }
    }
    r.far_flip_p = poisson_tail(r.far_flip_queries, r.far_flip_expected);
    if r.far_flip_p < FLIP_P {
        r.pass = false;
    }
    r
}

/// The union bound on one query's far flips (`ranked`: its visible keys by reference score, `k`
/// selected): Σ Φ(−z) over the keys `FLIP_SIGMAS`..`FLIP_WALK_SIGMAS` σ from the threshold on either
/// side, z their score's distance from the nearest key across it (the k-th for an unselected key,
/// the (k+1)-th for a selected one) in σ of that difference. Walks out from the threshold and stops at
/// the first key beyond `FLIP_WALK_SIGMAS` (the gaps grow with the rank).
fn expected_far_flips(
    row: &[f64],
    ranked: &[u32],
    k: usize,
    sigma: impl Fn(usize, usize) -> f64,
) -> f64 {
    if k == 0 || k >= ranked.len() {
        return 0.0;
    }
    let (a, b) = (ranked[k - 1] as usize, ranked[k] as usize);
    let mut sum = 0.0;
    let mut side = |keys: &mut dyn Iterator<Item = usize>, above: bool| {
        for j in keys {
            let (hi, lo) = if above { (j, b) } else { (a, j) };
            // An exact tie (both scores 0: every head cut by ReLU) is no distance at all.
            let gap = row[hi] - row[lo];
            let z = if gap == 0.0 { 0.0 } else { gap / sigma(hi, lo) };
            // NaN (a NaN score or σ) ends the walk: the per-key check fails such a query already.
            if !at_most(z, FLIP_WALK_SIGMAS) {
                break;
            }
            if z > FLIP_SIGMAS {
                sum += upper_tail(z);
            }
        }
    };
    side(&mut ranked[..k].iter().rev().map(|&j| j as usize), true);
    side(&mut ranked[k..].iter().map(|&j| j as usize), false);
    sum
}

impl SelectionResult {
    /// Before any query is compared: passing, nothing differing.
    fn start(reference: &Selection) -> SelectionResult {
        SelectionResult {
            queries: reference.n_queries(),
            sparse_queries: reference.sparse_queries(),
            recall_min: 1.0,
            recall_mean: 0.0,
            differing: 0,
            within_margin: 0,
            count_mismatch: 0,
            worst: None,
            far_flip_queries: 0,
            far_flip_expected: 0.0,
            far_flip_p: 1.0,
            pools: None,
            pass: true,
        }
    }

    /// One line for reports and test output.
    pub fn summary(&self) -> String {
        let (unit, layout) = match &self.pools {
            Some(p) => ("pools", p.summary()),
            None => ("keys", String::new()),
        };
        let mut s = format!(
            "selection {}{layout}: recall min {:.4} mean {:.4}, {} differing {unit} ({} within the noise margin), {} count mismatches, {}/{} sparse queries",
            if self.pass { "PASS" } else { "FAIL" },
            self.recall_min,
            self.recall_mean,
            self.differing,
            self.within_margin,
            self.count_mismatch,
            self.sparse_queries,
            self.queries
        );
        s += &format!(
            ", far flips (> {FLIP_SIGMAS} σ) in {} queries ({:.2} expected, p {:.1e})",
            self.far_flip_queries, self.far_flip_expected, self.far_flip_p
        );
        if let Some(m) = &self.worst {
            s += &format!(
                "; worst: query {} {} {} {} the reference's selection, score gap {:.3e} > margin {:.3e}",
                m.query,
                if self.pools.is_some() { "pool" } else { "key" },
                m.key,
                if m.extra { "selected outside" } else { "dropped from" },
                m.gap,
                m.margin
            );
        }
        s
    }
}

pub mod kpool;
#[cfg(test)]
mod tests;
