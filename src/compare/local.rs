//! The stage-local view: every stage recomputed in fp64 from the optimized path's *own stored inputs*
//! to that stage (weights rounded to the run's dtype, as the path stores them), with the noise the
//! path's own roundings predict (`noise.rs`). A stage's allowance is then its own rounding only, not
//! everything upstream, so an error a couple of times the noise at one stage is caught there.
//!
//! Inputs of each stage, as the serving path has them:
//! - `attn_in` ← the layer input in the dtype; `q_nope`, `q_pe`, `kv_latent`, `k_pe` ← `attn_in`;
//! - `cache_rows` ← `kv_latent`, `k_pe` (an exact copy; in a quantized cache format, the trace's
//!   `cache_format`, within the format's rounding bound per element, `kv_format::Codec::bound`; the
//!   stages below read the stored, dequantized rows, so they carry the cache's rounding themselves);
//! - `q_absorbed` ← `q_nope`; `split_out`/`split_lse` ← `q_absorbed`, `q_pe`, `cache_rows`;
//!   `attn_latent`, `lse[decode]` ← the splits (or, when the backend does not expose them, the whole
//!   decode attention from `q_nope`, `q_pe`, `cache_rows`); `attn_heads[decode]` ← `attn_latent`;
//! - `lse[prefill]`, `attn_heads[prefill]` ← `q_nope`, `q_pe`, the chunk's own `kv_latent`/`k_pe` and
//!   the context's `cache_rows` (decompressed with W_UK/W_UV, as prefill does);
//! - `attn_out` ← `attn_heads`.

use super::noise::{acc_var, Store, EXP_REL_VAR, F32_OP, U32};
use crate::backend::cpu::front::RopeF32;
use crate::faults::Active;
use crate::model::{LayerWeights, MlaConfig, QProj};
use crate::precision::{Dtype, ScoreSum};
use crate::rope::{pair, RopeTables};
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage, StageSet};
use ndarray::{s, Array1, Array2, ArrayView1, ArrayView2, Zip};
use rayon::prelude::*;

mod simd;
pub mod sparse;
pub use sparse::Sparse;

/// fp64 of each stage from the optimized path's inputs, and the variance its hidden roundings and f32
/// arithmetic predict (the output's own rounding is added by the judge, from the stored values).
#[derive(Debug, Clone, Default)]
pub struct Local {
    pub stages: Vec<LocalStage>,
}

#[derive(Debug, Clone)]
pub struct LocalStage {
    pub stage: Stage,
    pub values: Vec<f64>,
    pub hidden_var: Vec<f64>,
    /// Per row of the last axis, where its errors share sources (an attention row: each key's P
    /// rounding moves the whole row): the part of the row's hidden variance that does, and how many
    /// independent sources it has. The judge's degrees of freedom come from it.
    pub coherent: Option<Vec<(f64, f64)>>,
    /// A copy of values already stored in their type (the cache): must match exactly (within `bound`).
    pub exact: bool,
    /// Per element: the largest error a quantized cache format's rounding allows (`cache_rows` in a
    /// format other than the dtype); any element beyond it fails the check.
    pub bound: Option<Vec<f64>>,
    /// Per element: the bias a truncating tensor-core accumulator puts into the scores, carried here,
    /// at κ = 1 (`noise::Prediction::truncation`); `None` where the backend's accumulators round to
    /// nearest or the stage does not depend on scores.
    pub truncation: Option<Vec<f64>>,
    /// The type the backend stores this stage in by contract, where it has one (our kernels keep every
    /// LSE in f32); `None`: inferred from the values, as for a runner that returns what it likes. A
    /// contract keeps an LSE rounded to bf16 from being judged as a bf16 tensor (#35: the fault
    /// `split_lse_bf16` passed every run while the type was inferred).
    pub store: Option<Store>,
}

impl Local {
    pub fn get(&self, s: Stage) -> Option<&LocalStage> {
        self.stages.iter().find(|l| l.stage == s)
    }
    fn push(&mut self, stage: Stage, values: Vec<f64>, hidden_var: Vec<f64>) {
        debug_assert_eq!(values.len(), hidden_var.len());
        self.stages.push(LocalStage {
            stage,
            values,
            hidden_var,
            coherent: None,
            exact: false,
            bound: None,
            truncation: None,
            store: None,
        });
    }
    fn push_rows(
        &mut self,
        stage: Stage,
        values: Vec<f64>,
        hidden_var: Vec<f64>,
        rows: Vec<(f64, f64)>,
    ) {
        self.push(stage, values, hidden_var);
        self.stages.last_mut().expect("pushed").coherent = Some(rows);
    }
    /// The stage last pushed is stored in `store` by the backend's contract (`Some`), or of a type
    /// inferred from its values (`None`).
    fn with_store(&mut self, store: Option<Store>) {
        self.stages.last_mut().expect("pushed").store = store;
    }
    /// Attach the truncation bias to the stage last pushed (where the backend truncates).
    fn with_truncation(&mut self, on: bool, bias: Vec<f64>) {
        if on {
            self.stages.last_mut().expect("pushed").truncation = Some(bias);
        }
    }
}

/// What the local view needs besides the optimized trace: the layer's weights and the rest.
pub struct Inputs<'a> {
    pub weights: &'a LayerWeights,
    pub frame: Frame<'a>,
}

/// What the local view needs besides the optimized trace and the layer's weights.
#[derive(Clone, Copy)]
pub struct Frame<'a> {
    pub cfg: &'a MlaConfig,
    pub rope: &'a RopeTables,
    pub sched: &'a Schedule,
    /// The layer input `[T, hidden]` before attn_norm (the path rounds it to `dtype`).
    pub x: &'a Array2<f64>,
    pub dtype: Dtype,
    /// The stages the backend provides: a decode attention without exposed splits is recomputed whole.
    pub provided: StageSet,
    /// `Backend::known_attention`: an online softmax, and `attn_latent` merged from the stored partials.
    pub known_attention: bool,
    /// `Backend::score_sum`: how its attention scores are summed.
    pub score_sum: ScoreSum,
}

/// `a` widened, rounded to `round` first where the weights are the file's (`Stored`).
fn f64s<D: ndarray::Dimension>(
    a: &ndarray::Array<f32, D>,
    round: Option<Dtype>,
) -> ndarray::Array<f64, D> {
    match round {
        Some(dt) => a.mapv(|v| dt.round(v) as f64),
        None => a.mapv(|v| v as f64),
    }
}

/// Variance of storing `y` in the path's dtype (a rounding the trace does not show).
fn hidden_round(dt: Dtype, y: f64) -> f64 {
    Store::from(dt).round_var(y)
}

/// `y = a·wᵀ` in fp64 and the variance of computing it with f32 accumulation.
fn linear(a: ArrayView2<f64>, w: &Array2<f64>) -> (Array2<f64>, Array2<f64>) {
    linear_var(a, w, None)
}

/// [`linear`], with the input variances `var_a` propagated through `y = a·wᵀ` added to the variance:
/// `a²·(w²)ᵀ` and `var_a·(w²)ᵀ` in one product of the rows stacked (one pass over `w²`).
fn linear_var(
    a: ArrayView2<f64>,
    w: &Array2<f64>,
    var_a: Option<&Array2<f64>>,
) -> (Array2<f64>, Array2<f64>) {
    let y = crate::linalg::mat_mul_t(a, w.view());
    let (t, n) = a.dim();
    let sq = crate::linalg::mat_mul_t(squares_in(a, var_a).view(), w.mapv(|v| v * v).view());
    let var = variance(n, t, &y, &sq, var_a.is_some());
    (y, var)
}

/// The rows multiplied by `w²`: `a²`, then `var_a` below it where given.
fn squares_in(a: ArrayView2<f64>, var_a: Option<&Array2<f64>>) -> Array2<f64> {
    let (t, n) = a.dim();
    let mut sq_in = Array2::zeros((t * if var_a.is_some() { 2 } else { 1 }, n));
    Zip::from(sq_in.slice_mut(s![..t, ..]))
        .and(&a)
        .for_each(|d, &v| *d = v * v);
    if let Some(va) = var_a {
        sq_in.slice_mut(s![t.., ..]).assign(va);
    }
    sq_in
}

/// The variance of `y = a·wᵀ` (inner dimension `n`, `t` rows) from `sq` = [`squares_in`]`·(w²)ᵀ`: f32
/// accumulation's, plus the inputs' propagated where they were given.
fn variance(
    n: usize,
    t: usize,
    y: &Array2<f64>,
    sq: &Array2<f64>,
    with_var_a: bool,
) -> Array2<f64> {
    let mut var = Zip::from(sq.slice(s![..t, ..]))
        .and(y)
        .map_collect(|&s, &t| acc_var(n, s, t));
    if with_var_a {
        var += &sq.slice(s![t.., ..]);
    }
    var
}

/// Input variances through `y = a·wᵀ`.
#[cfg(test)]
fn propagate(var_a: &Array2<f64>, w: &Array2<f64>) -> Array2<f64> {
    crate::linalg::mat_mul_t(var_a.view(), w.mapv(|v| v * v).view())
}

/// [`linear_var`] for a weight `w [out, in]` as the path stores it: `w` itself, or `w` rounded to
/// `round` (`linalg::linear_f32`: never a whole f64 copy on the host, or on the GPU a run installed).
fn linear_stored(
    a: ArrayView2<f64>,
    w: ArrayView2<f32>,
    round: Option<Dtype>,
    var_a: Option<&Array2<f64>>,
) -> (Array2<f64>, Array2<f64>) {
    let (t, n) = a.dim();
    let sq_in = squares_in(a, var_a);
    let l = crate::linalg::linear_f32(a, Some(sq_in.view()), w, round);
    let sq = l.sq.expect("asked for");
    let var = variance(n, t, &l.y, &sq, var_a.is_some());
    (l.y, var)
}

/// RMSNorm per row with f32 statistics: values, and variance from the input's (`vx`) and the
/// arithmetic's, including the norm factor's error, common to the row.
fn rms_norm(
    x: ArrayView2<f64>,
    vx: ArrayView2<f64>,
    w: &Array1<f64>,
    eps: f64,
) -> (Array2<f64>, Array2<f64>) {
    let mut y = x.to_owned();
    let mut v = vx.to_owned();
    let n = x.ncols();
    for ((mut yr, mut vr), xr) in y.rows_mut().into_iter().zip(v.rows_mut()).zip(x.rows()) {
        let s2: f64 = xr.iter().map(|a| a * a).sum();
        let s4: f64 = xr.iter().map(|a| a.powi(4)).sum();
        let r = 1.0 / (s2 / n as f64 + eps).sqrt();
        let den = s2 + n as f64 * eps;
        let prop: f64 = xr
            .iter()
            .zip(vr.iter())
            .map(|(a, va)| 4.0 * a * a * va)
            .sum();
        let rel_r = (prop + acc_var(n, s4, s2)) / (4.0 * den * den) + F32_OP;
        for ((yv, vv), &g) in yr.iter_mut().zip(vr.iter_mut()).zip(w) {
            let out = *yv * r * g;
            *vv = (r * g).powi(2) * *vv + out * out * (rel_r + 2.0 * F32_OP);
            *yv = out;
        }
    }
    (y, v)
}

/// Rotate the rope part of each row (columns `cols` of `x`) with the f32 tables a kernel gets.
fn rope_rows(
    x: &mut Array2<f64>,
    v: &mut Array2<f64>,
    rope: &RopeF32,
    cols: std::ops::Range<usize>,
    // The row index → token index (for per-head rows, `row / heads`).
    token_of: impl Fn(usize) -> usize,
) {
    let dim = cols.len();
    for (row, (mut xr, mut vr)) in x.rows_mut().into_iter().zip(v.rows_mut()).enumerate() {
        let t = token_of(row);
        let mut xs = xr.slice_mut(s![cols.clone()]);
        let mut vs = vr.slice_mut(s![cols.clone()]);
        for i in 0..dim / 2 {
            let (a, b) = pair(rope.pairing, dim, i);
            let c = rope.cos[t * rope.half + i] as f64;
            let sn = rope.sin[t * rope.half + i] as f64;
            let (x0, x1, v0, v1) = (xs[a], xs[b], vs[a], vs[b]);
            let ya = x0 * c - x1 * sn;
            let yb = x0 * sn + x1 * c;
            let arith = |y: f64| ((x0 * c).powi(2) + (x1 * sn).powi(2) + y * y) * F32_OP;
            vs[a] = c * c * v0 + sn * sn * v1 + arith(ya);
            vs[b] = sn * sn * v0 + c * c * v1 + arith(yb);
            xs[a] = ya;
            xs[b] = yb;
        }
    }
}

/// Stored values (f32-exact) as f32.
fn rows_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// A row of a standard-layout array (or a contiguous view) as a slice.
fn row(a: &Array2<f64>, i: usize) -> &[f64] {
    sl(a.row(i))
}
fn sl(a: ArrayView1<'_, f64>) -> &[f64] {
    a.to_slice().expect("a contiguous row")
}

/// A score `x·y + xr·yr` in one pass, with Σ(xᵢyᵢ)² (for its f32 sum's rounding) and Σxᵢ²·wᵢ, the
/// variance that y's hidden rounding (variance `w`) adds to it.
/// A score's dot product `x·y + xr·yr` in fp64, with what its f32 computation's noise needs.
struct Dot {
    value: f64,
    /// x's hidden variance carried through: Σ x²·w.
    prop: f64,
    /// The variance of its f32 sum, as the backend sums (`ScoreSum`).
    acc: f64,
    /// Σ of the partial sums after each 16-wide k-step of a tensor-core MMA, in the kernels' K order
    /// (x's part, then xr's): a truncating accumulator's bias per unit κ, up to −u (`Score::trunc`).
    steps: f64,
}

/// The noise of the mirror's `ops::dot`: 8 interleaved lanes, each a sequential f32 sum, then a pairwise
/// tree; every product, partial sum and tree sum rounded once (≤ u²/3 of its square: F32_OP).
fn lanes8(x: &[f64], y: &[f64]) -> (f64, f64) {
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
fn lanes8_finish(acc: &[f64; 8], v8: &[f64; 8]) -> (f64, f64) {
    let p: [f64; 4] = std::array::from_fn(|k| acc[k] + acc[k + 4]);
    let (a, b) = (p[0] + p[1], p[2] + p[3]);
    let t = a + b;
    let v = v8.iter().sum::<f64>() + p.iter().map(|x| x * x).sum::<f64>() + a * a + b * b + t * t;
    (t, F32_OP * v)
}

/// Σ x·y and Σ (x·y)² over a few elements, four lanes wide (the products' order within a 16-wide
/// k-step does not matter to the model; one sequential chain would bound the loop by add latency).
#[inline]
fn part(x: &[f64], y: &[f64]) -> (f64, f64) {
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
fn dot_var(x: &[f64], y: &[f64], w: &[f64], xr: &[f64], yr: &[f64], sum: ScoreSum) -> Dot {
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
fn terms_scalar(x: &[f64], y: &[f64], w: &[f64], xr: &[f64], yr: &[f64], lanes: bool) -> Terms {
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
struct Terms {
    a: f64,
    sq: f64,
    steps: f64,
    steps2: f64,
    prop: f64,
    /// [`lanes8`]'s variance of x·y and of xr·yr (`ScoreSum::Lanes8` only; else unused).
    lanes: (f64, f64),
}

/// [`Dot`] from its terms, `k` elements in all.
#[inline(always)]
fn dot_of(f: Terms, k: usize, sum: ScoreSum) -> Dot {
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
struct Score {
    s: f64,
    var: f64,
    trunc: f64,
}

fn score(d: Dot, scale: f64, sum: ScoreSum) -> Score {
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

/// cos² between the rows of `a` (`[T, D]`, f32 to halve the memory): what an attention row's degrees
/// of freedom need (`attend`).
fn cos2(a: ArrayView2<f64>) -> Vec<f32> {
    let t = a.nrows();
    let g = a.dot(&a.t());
    let d = g.diag().to_owned();
    let mut c = vec![0f32; t * t];
    for ((j, k), &x) in g.indexed_iter() {
        let den = d[j] * d[k];
        c[j * t + k] = if den > 0.0 { (x * x / den) as f32 } else { 0.0 };
    }
    c
}

/// How the path computes an attention: P's type, whether its softmax is online (`known_attention`), and
/// how it sums scores.
#[derive(Debug, Clone, Copy)]
struct Path {
    dt: Dtype,
    online: bool,
    sum: ScoreSum,
}

/// One attention over `keys`: output, its variance, lse and its variance.
struct Attn {
    out: Vec<f64>,
    var: Vec<f64>,
    lse: f64,
    var_lse: f64,
    /// Σ over the row of the variance shared through the keys' P, and the keys' effective number.
    coh: f64,
    n_eff: f64,
    /// The scores' truncation bias carried to the output and the lse (`Score::trunc`).
    bias_out: Vec<f64>,
    bias_lse: f64,
}

impl Attn {
    fn empty(dim: usize) -> Attn {
        Attn {
            out: vec![0.0; dim],
            var: vec![0.0; dim],
            lse: f64::NEG_INFINITY,
            var_lse: 0.0,
            coh: 0.0,
            n_eff: 1.0,
            bias_out: vec![0.0; dim],
            bias_lse: 0.0,
        }
    }
    fn nan(dim: usize) -> Attn {
        Attn {
            out: vec![f64::NAN; dim],
            var: vec![0.0; dim],
            lse: f64::NAN,
            var_lse: 0.0,
            coh: 0.0,
            n_eff: 1.0,
            bias_out: vec![0.0; dim],
            bias_lse: 0.0,
        }
    }
}

/// One key's pass over the value columns in [`attend`] (`f` = its P rounding's, its score's and its p):
/// each column's terms added to `a`, `sq`, `tot`, and the key's own sum in four lanes (column mod 4).
#[inline(always)]
fn key_cols(
    vj: &[f64],
    out: &[f64],
    a: &mut [f64],
    sq: &mut [f64],
    tot: &mut [f64],
    f: [f64; 3],
) -> [f64; 4] {
    let mut key4 = [0.0f64; 4];
    #[cfg(target_arch = "x86_64")]
    if simd::avx2() {
        // SAFETY: the CPU has AVX2 (the slices' lengths are checked there).
        let d0 = unsafe { simd::key_cols(vj, out, a, sq, tot, f, &mut key4) };
        key_cols_from(vj, out, a, sq, tot, f, &mut key4, d0);
        return key4;
    }
    key_cols_from(vj, out, a, sq, tot, f, &mut key4, 0);
    key4
}

/// [`key_cols`] without SIMD.
#[cfg(test)]
fn key_cols_scalar(
    vj: &[f64],
    out: &[f64],
    a: &mut [f64],
    sq: &mut [f64],
    tot: &mut [f64],
    f: [f64; 3],
) -> [f64; 4] {
    let mut key4 = [0.0f64; 4];
    key_cols_from(vj, out, a, sq, tot, f, &mut key4, 0);
    key4
}

/// [`key_cols`]' scalar loop from column `d0` (a multiple of 4) on.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn key_cols_from(
    vj: &[f64],
    out: &[f64],
    a: &mut [f64],
    sq: &mut [f64],
    tot: &mut [f64],
    f: [f64; 3],
    key4: &mut [f64; 4],
    d0: usize,
) {
    let [round, ppv, pj] = f;
    let dim = vj.len();
    let col = |x: f64, o: f64, ad: &mut f64, sqd: &mut f64, td: &mut f64| {
        let dev = (x - o) * (x - o);
        // P's rounding moves the numerator only, or numerator and sum (kernels differ): the larger.
        let c = round * (x * x).max(dev) + ppv * dev;
        *ad += c;
        let px = pj * x;
        *sqd += px * px;
        *td += px;
        c
    };
    let cols = vj[d0..]
        .chunks_exact(4)
        .zip(out[d0..].chunks_exact(4))
        .zip(a[d0..].chunks_exact_mut(4))
        .zip(
            sq[d0..]
                .chunks_exact_mut(4)
                .zip(tot[d0..].chunks_exact_mut(4)),
        );
    for (((xc, oc), ac), (sqc, tc)) in cols {
        for l in 0..4 {
            key4[l] += col(xc[l], oc[l], &mut ac[l], &mut sqc[l], &mut tc[l]);
        }
    }
    for d in (dim - dim % 4).max(d0)..dim {
        key4[0] += col(vj[d], out[d], &mut a[d], &mut sq[d], &mut tot[d]);
    }
}

/// Softmax attention in fp64 of pre-computed scores `(s, var_s)` over values `v` (with their hidden
/// variances `vv`, if any): P is rounded to `dt` before P·V (the kernels' MMA input), the rest is f32.
fn attend(
    scores: &[Score],
    v: &[&[f64]],
    vv: Option<&[&[f64]]>,
    dim: usize,
    path: Path,
    gram: Option<Gram>,
) -> Attn {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2() {
        // SAFETY: the CPU has AVX2.
        return unsafe { simd::attend(scores, v, vv, dim, path, gram) };
    }
    attend_in(scores, v, vv, dim, path, gram)
}

/// cos² between the values of an attention's keys `j`, `k`: `g[keys[j]·stride + keys[k]]`.
#[derive(Clone, Copy)]
struct Gram<'a> {
    g: &'a [f32],
    stride: usize,
    keys: &'a [usize],
}

/// [`attend`]'s body (compiled twice: for the host's baseline and, where the CPU has it, AVX2).
#[inline(always)]
fn attend_in(
    scores: &[Score],
    v: &[&[f64]],
    vv: Option<&[&[f64]]>,
    dim: usize,
    path: Path,
    gram: Option<Gram>,
) -> Attn {
    let (dt, online) = (path.dt, path.online);
    if scores.is_empty() {
        return Attn::empty(dim);
    }
    let m = scores.iter().map(|s| s.s).fold(f64::NEG_INFINITY, f64::max);
    if m.is_nan() || scores.iter().any(|s| s.s.is_nan()) {
        return Attn::nan(dim);
    }
    let p: Vec<f64> = scores.iter().map(|s| (s.s - m).exp()).collect();
    let arg_max = scores.iter().position(|s| s.s == m).unwrap_or(0);
    // Keys before the maximum's 32-key block (a kernel's smallest key tile, a warpgroup's half).
    let early_end = arg_max / 32 * 32;
    // Relative error variance of each p: its score's, the exp's, the subtraction's.
    let pv: Vec<f64> = scores
        .iter()
        .map(|sc| sc.var + EXP_REL_VAR + ((sc.s - m) * U32).powi(2))
        .collect();
    let l: f64 = p.iter().sum();
    let mut out = vec![0.0; dim];
    // ∂/∂κ of the output: Σ p_j t_j (v_j − o) / l, and of the lse: Σ p_j t_j / l.
    for (pj, vj) in p.iter().zip(v) {
        for (o, &x) in out.iter_mut().zip(*vj) {
            *o += pj * x;
        }
    }
    out.iter_mut().for_each(|o| *o /= l);
    // Only where the sum may truncate: elsewhere every score's bias is 0 (a second pass over the
    // values, off the mirror's hot path).
    let mut bias_out = vec![0.0; dim];
    let mut bias_lse = 0.0;
    if path.sum.truncates() {
        for ((pj, vj), sc) in p.iter().zip(v).zip(scores) {
            let pt = pj * sc.trunc;
            bias_lse += pt;
            bias_out
                .iter_mut()
                .zip(*vj)
                .for_each(|(b, &x)| *b += pt * x);
        }
        bias_lse /= l;
        bias_out
            .iter_mut()
            .zip(&out)
            .for_each(|(b, o)| *b = *b / l - bias_lse * o);
    }
    let n = p.len();
    let tiles = n.div_ceil(64) as f64;
    // The key holding the maximum has p = exp(0) = 1 exactly in every online softmax. Keys in tiles
    // before the maximum's were rounded against a smaller running max, so where in their binade they
    // sat is unknown: the largest relative rounding is assumed for them.
    // Without an online softmax (`Backend::known_attention`), every P at the worst place.
    let rv: Vec<f64> = (0..n)
        .map(|j| match j {
            _ if !online || j < early_end => Store::from(dt).worst_round_var(p[j]),
            _ if j == arg_max => 0.0,
            _ => hidden_round(dt, p[j]),
        })
        .collect();
    let inv_l2 = 1.0 / (l * l);
    // Per value column: P's roundings, the scores' (through p), the values' own; the f32 sum's terms.
    let (mut a, mut sq, mut tot) = (vec![0.0; dim], vec![0.0; dim], vec![0.0; dim]);
    let mut per_key = vec![0.0; n];
    for j in 0..n {
        let (round, pj) = (rv[j], p[j]);
        let ppv = pj * pj * pv[j];
        let key4 = key_cols(
            &v[j][..dim],
            &out,
            &mut a,
            &mut sq,
            &mut tot,
            [round, ppv, pj],
        );
        let key = (key4[0] + key4[1]) + (key4[2] + key4[3]);
        if let Some(vv) = vv {
            a.iter_mut()
                .zip(vv[j])
                .for_each(|(ad, &w)| *ad += pj * pj * w);
        }
        per_key[j] = key * inv_l2;
    }
    let mut var: Vec<f64> = (0..dim)
        .map(|d| {
            (a[d] + acc_var(n, sq[d], tot[d])) * inv_l2 + out[d] * out[d] * (tiles + 2.0) * F32_OP
        })
        .collect();
    let sp: f64 = p.iter().zip(&pv).map(|(a, b)| a * a * b).sum();
    let sq: f64 = p.iter().map(|a| a * a).sum();
    // The f32 sum l scales the whole row. Added to a running sum that already holds the maximum's 1,
    // a p below half its ulp is lost entirely (a bias, all of one sign), larger ones lose their low
    // bits (random): what a sequential sum can lose, with its other rounding.
    let ulp_l = Store::F32.ulp(l);
    let (lost, kept) = p.iter().enumerate().filter(|&(j, _)| j != arg_max).fold(
        (0.0, 0usize),
        |(s, k), (_, &pj)| match pj < ulp_l / 2.0 {
            true => (s + pj, k),
            false => (s, k + 1),
        },
    );
    let l_rel = (lost * lost + kept as f64 * ulp_l * ulp_l / 12.0 + acc_var(n, sq, l)) / (l * l);
    let l_part: f64 = out.iter().map(|o| o * o * l_rel).sum();
    var.iter_mut()
        .zip(&out)
        .for_each(|(v, o)| *v += o * o * l_rel);
    let keys: f64 = per_key.iter().sum();
    // The row's degrees of freedom: key j's error lies along v_j, so the keys' part has covariance
    // Σ = Σ_j c_j v̂_j v̂_jᵀ and (tr Σ)²/tr Σ² of them, tr Σ² = Σ_jk c_j c_k cos²(v_j, v_k). Latent rows
    // span few directions (a few outlier dims carry most of their energy: measured on the H200, 60 %
    // of a split_out row's error in 16 of 512 dims), so that is far fewer than the keys. The 256
    // largest keys pairwise, the rest as independent. Without the values' Gram matrix: their common
    // direction as one source, the rest per key.
    let keys2 = match gram {
        Some(g) => {
            let mut idx: Vec<usize> = (0..n).collect();
            idx.sort_unstable_by(|&a, &b| per_key[b].total_cmp(&per_key[a]));
            let (top, rest) = idx.split_at(n.min(256));
            let mut t2: f64 = rest.iter().map(|&j| per_key[j] * per_key[j]).sum();
            for (a, &j) in top.iter().enumerate() {
                t2 += per_key[j] * per_key[j];
                let (twice, row) = (2.0 * per_key[j], &g.g[g.keys[j] * g.stride..]);
                for &k in &top[a + 1..] {
                    t2 += twice * per_key[k] * row[g.keys[k]] as f64;
                }
            }
            t2
        }
        None => {
            // P's roundings act along the values: where the values share a direction (latent rows
            // often do), their sum along it is one source, not one per key.
            let r_tot: f64 = rv.iter().sum();
            let mut common = vec![0.0; dim];
            if r_tot > 0.0 {
                for (vj, &r) in v.iter().zip(&rv) {
                    let w = r / r_tot;
                    common.iter_mut().zip(*vj).for_each(|(c, &x)| *c += w * x);
                }
            }
            let c_sq: f64 = common.iter().map(|c| c * c).sum();
            let along = (r_tot * c_sq * inv_l2).min(keys);
            let own = keys - along;
            along * along
                + per_key.iter().map(|c| c * c).sum::<f64>()
                    * (own / keys.max(f64::MIN_POSITIVE)).powi(2)
        }
    };
    // Sources: the keys' (above), the sum l (one).
    let coh = keys + l_part;
    let coh2 = keys2 + l_part * l_part;
    Attn {
        out,
        var,
        lse: m + l.ln(),
        var_lse: sp / (l * l) + l_rel + tiles * F32_OP + lse_rounding(path.sum, m, l),
        coh,
        n_eff: if coh2 > 0.0 { coh * coh / coh2 } else { 1.0 },
        bias_out,
        bias_lse,
    }
}

/// The variance of forming lse from the row max m and the sum l in f32: the mirror's `m + ln l` (two
/// roundings), the CUDA kernels' `(m₂ + log2 l)·ln 2` (m₂ in log2 units; two at the lse's magnitude and
/// an approximate log2), unknown kernels three at the lse's magnitude.
fn lse_rounding(sum: ScoreSum, m: f64, l: f64) -> f64 {
    let lse = m + l.ln();
    match sum {
        ScoreSum::Lanes8 => F32_OP * (lse * lse + l.ln().powi(2)),
        ScoreSum::TensorCore => F32_OP * (2.0 * lse * lse + 4.0 * l.ln().powi(2)),
        ScoreSum::Sequential => 3.0 * F32_OP * lse * lse,
    }
}

/// Attention rows of a stage being assembled: values, variances, and each row's shared variance.
struct Rows {
    dim: usize,
    out: Vec<f64>,
    var: Vec<f64>,
    coh: Vec<(f64, f64)>,
    bias: Vec<f64>,
}

impl Rows {
    fn new(rows: usize, dim: usize) -> Rows {
        Rows {
            dim,
            out: vec![0.0; rows * dim],
            var: vec![0.0; rows * dim],
            coh: vec![(0.0, 1.0); rows],
            bias: vec![0.0; rows * dim],
        }
    }
    fn put(&mut self, i: usize, a: &Attn) {
        let at = i * self.dim..(i + 1) * self.dim;
        self.out[at.clone()].copy_from_slice(&a.out);
        self.var[at.clone()].copy_from_slice(&a.var);
        self.bias[at].copy_from_slice(&a.bias_out);
        self.coh[i] = (a.coh, a.n_eff);
    }
    fn push_to(self, local: &mut Local, stage: Stage, truncating: bool) {
        local.push_rows(stage, self.out, self.var, self.coh);
        local.with_truncation(truncating, self.bias);
    }
}

/// Merge parts by their lse (vLLM's `merge_attn_states`), propagating the parts' variances.
fn merge(parts: &[Attn]) -> Attn {
    let dim = parts.first().map_or(0, |p| p.out.len());
    if parts.iter().any(|p| p.lse.is_nan()) {
        return Attn::nan(dim);
    }
    let m = parts
        .iter()
        .map(|p| p.lse)
        .fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return Attn::empty(dim);
    }
    let w: Vec<f64> = parts.iter().map(|p| (p.lse - m).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut out = vec![0.0; dim];
    let mut bias_lse = 0.0;
    for (p, &wk) in parts.iter().zip(&w) {
        for (o, &x) in out.iter_mut().zip(&p.out) {
            *o += wk / total * x;
        }
        bias_lse += wk / total * p.bias_lse;
    }
    // ∂/∂κ: the parts' own, and their weights' (∂a_k = a_k·(∂lse_k − ∂lse)).
    let mut bias_out = vec![0.0; dim];
    for (p, &wk) in parts.iter().zip(&w) {
        let a = wk / total;
        for ((b, &x), &bx) in bias_out.iter_mut().zip(&p.out).zip(&p.bias_out) {
            *b += a * (bx + (p.bias_lse - bias_lse) * x);
        }
    }
    let mut var = vec![0.0; dim];
    let mut var_lse = F32_OP;
    // The row's shared variance: the parts' own (with their numbers of sources) and the lse shifts.
    let (mut coh, mut coh2, mut shifts) = (0.0, 0.0, 0.0);
    for (p, &wk) in parts.iter().zip(&w) {
        if wk == 0.0 {
            continue;
        }
        let a = wk / total;
        let lv = p.var_lse + EXP_REL_VAR + ((p.lse - m) * U32).powi(2);
        var_lse += a * a * lv;
        let (mut shift, mut weight) = (0.0, 0.0);
        for d in 0..dim {
            let dev = lv * (p.out[d] - out[d]).powi(2);
            shift += dev;
            // The part's weight `w/Σw` is rounded once for the whole row: a shared scaling of its o.
            let wr = F32_OP * p.out[d].powi(2);
            weight += wr;
            var[d] += a * a * (p.var[d] + dev + wr + 2.0 * F32_OP * p.out[d].powi(2));
        }
        let own = a * a * p.coh;
        coh += own;
        if own > 0.0 {
            coh2 += own * own / p.n_eff.max(1.0);
        }
        shifts += a * a * shift;
        coh += a * a * weight;
        coh2 += (a * a * weight).powi(2);
    }
    // Σw's roundings (one per part added) scale the whole merged row: one source.
    let n_sum = w.iter().filter(|&&x| x > 0.0).count().saturating_sub(1) as f64;
    let mut total_round = 0.0;
    for (v, &o) in var.iter_mut().zip(&out) {
        *v += n_sum * F32_OP * o * o;
        total_round += n_sum * F32_OP * o * o;
    }
    coh += total_round;
    coh2 += total_round * total_round;
    // A part's lse error moves the whole row along its output's difference from the merged one; with
    // two parts both move it along one direction (a₁(o₁ − o) = −a₂(o₂ − o)): all of them one source.
    coh += shifts;
    coh2 += shifts * shifts;
    Attn {
        out,
        var,
        lse: m + total.ln(),
        var_lse,
        coh,
        n_eff: if coh2 > 0.0 {
            (coh * coh / coh2).max(1.0)
        } else {
            1.0
        },
        bias_out,
        bias_lse,
    }
}

/// The optimized trace's stage as a 2-D `[rows, last axes…]` f64 array.
fn opt2(tr: &LayerTrace, s: Stage) -> Option<Array2<f64>> {
    let t = tr.get(s)?;
    let rows = *t.shape.first()?;
    let cols = t.data.len().checked_div(rows).unwrap_or(0);
    Array2::from_shape_vec((rows, cols), t.data.clone()).ok()
}

/// Compute the local view of every stage whose inputs the optimized trace holds.
pub fn compute(inp: &Inputs, opt: &LayerTrace) -> Local {
    let pre = prepare(inp.frame.cfg, inp.weights, inp.frame.dtype, opt);
    finish(inp.frame, opt, pre, None)
}

/// The local view of a DSA layer (`sparse::Sparse`): every attention over the keys the path attended
/// over, in the path's form of sparse prefill.
pub fn compute_sparse(inp: &Inputs, opt: &LayerTrace, sp: sparse::Sparse) -> Local {
    let pre = prepare(inp.frame.cfg, inp.weights, inp.frame.dtype, opt);
    finish(inp.frame, opt, pre, Some(sp))
}

/// What of the layer's weights the view uses, made first ([`prepare`]): its products against the
/// large matrices (q, kv_a, o) and the rest as the path stores them, widened. A run frees the layer's
/// weights between [`prepare`] and [`finish`], so that a judge in flight holds no copy of them.
pub struct Prepared {
    attn_norm: Array1<f64>,
    kv_a_norm: Array1<f64>,
    /// q and its variance `[T, H·(P+R)]`, from the stored attn_in (`None`: not in the trace).
    q: Option<(Array2<f64>, Array2<f64>)>,
    /// kv_a's product and variance `[T, Lkv+R]` from the stored attn_in, before it is stored.
    kv: Option<(Array2<f64>, Array2<f64>)>,
    /// `[H·P, Lkv]` and `[H·Dv, Lkv]`.
    w_uk: Array2<f64>,
    w_uv: Array2<f64>,
    /// attn_out and its variance from the stored heads.
    o: Option<(Array2<f64>, Array2<f64>)>,
}

/// The view's uses of the layer's weights ([`Prepared`]), from the path's storage `dt` and the stored
/// attn_in and heads of its trace `opt`.
pub fn prepare(cfg: &MlaConfig, weights: &LayerWeights, dt: Dtype, opt: &LayerTrace) -> Prepared {
    // The weights as the path stores them: the layer's rounded copy where the CPU mirror made one
    // (`LayerWeights::stored`), else the file's values rounded as they are read (a GPU run then holds
    // no second copy of the layer).
    let (w, round) = match weights.stored_made(dt) {
        Some(s) => (s, None),
        None => (weights, Some(dt)),
    };
    let attn_in = opt2(opt, Stage::AttnIn);
    // q ← attn_in (q-LoRA's latent stored and normed on the way).
    let q = attn_in.as_ref().map(|attn_in| match &w.q {
        QProj::Lora { a, a_norm, b } => {
            let (qa, mut vqa) = linear_stored(attn_in.view(), a.view(), round, None);
            Zip::from(&mut vqa)
                .and(&qa)
                .for_each(|v, &y| *v += hidden_round(dt, y));
            let a_norm = f64s(a_norm, round);
            let (qn, mut vqn) = rms_norm(qa.view(), vqa.view(), &a_norm, cfg.lora_norm_eps);
            Zip::from(&mut vqn)
                .and(&qn)
                .for_each(|v, &y| *v += hidden_round(dt, y));
            linear_stored(qn.view(), b.view(), round, Some(&vqn))
        }
        QProj::Plain { q } => linear_stored(attn_in.view(), q.view(), round, None),
    });
    let kv = attn_in.map(|a| linear_stored(a.view(), w.kv_a.view(), round, None));
    let (h, lkv) = (cfg.n_head, cfg.kv_lora_rank);
    let flat = |m: &ndarray::Array3<f32>, d: usize| {
        f64s(m, round)
            .into_shape_with_order((h * d, lkv))
            .expect("[H, d, Lkv]")
    };
    // attn_out ← the stored heads.
    let o = opt2(opt, Stage::AttnHeads)
        .map(|o_heads| linear_stored(o_heads.view(), w.o.view(), round, None));
    Prepared {
        attn_norm: f64s(&w.attn_norm, round),
        kv_a_norm: f64s(&w.kv_a_norm, round),
        q,
        kv,
        w_uk: flat(&w.w_uk, cfg.qk_nope),
        w_uv: flat(&w.w_uv, cfg.v_head_dim),
        o,
    }
}

/// The view from what [`prepare`] made of the weights.
pub fn finish(f: Frame, opt: &LayerTrace, pre: Prepared, sp: Option<sparse::Sparse>) -> Local {
    // DSA: the keys query t attends to (all visible ones on a dense layer).
    let keep = |t: usize, j: usize| sp.is_none_or(|sp| sp.selection.allows(t, j));
    let (cfg, dt, sched) = (f.cfg, f.dtype, f.sched);
    // Each stage's storage type: the backend's declared one (a capture's `stage_dtypes`), else the
    // run's. The attention computes in the type of the cache it reads (ggml converts the query to K's
    // type, MMA kernels take their operands in it): its P, keys, values and a wider query's rounding.
    let dt_of = |st: Stage| opt.dtype_of(st, dt);
    let adt = dt_of(Stage::CacheRows);
    let rope = RopeF32::new(f.rope, Active::NONE);
    let (h, p, r, dv, lkv) = (
        cfg.n_head,
        cfg.qk_nope,
        cfg.qk_rope,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    );
    let t_all = sched.total_tokens();
    let mut out = Local::default();

    // attn_in ← the layer input, as the path stores it.
    let x = f.x.mapv(|v| dt.round(v as f32) as f64);
    let zero = Array2::<f64>::zeros(x.dim());
    let (ai, vai) = rms_norm(x.view(), zero.view(), &pre.attn_norm, cfg.rms_eps);
    out.push(
        Stage::AttnIn,
        ai.into_raw_vec_and_offset().0,
        vai.into_raw_vec_and_offset().0,
    );

    let (Some((q, vq)), Some((mut kv, mut vkv))) = (pre.q, pre.kv) else {
        return out;
    };
    // Per head rows `[T·H, P+R]`.
    let dk = p + r;
    let mut q = q.into_shape_with_order((t_all * h, dk)).expect("[T, H·Dk]");
    let mut vq = vq
        .into_shape_with_order((t_all * h, dk))
        .expect("[T, H·Dk]");
    let q_nope = q.slice(s![.., ..p]).to_owned();
    out.push(
        Stage::QNope,
        q_nope.iter().copied().collect(),
        vq.slice(s![.., ..p]).iter().copied().collect(),
    );
    // q is stored before rope.
    Zip::from(vq.slice_mut(s![.., p..]))
        .and(q.slice(s![.., p..]))
        .for_each(|v, &y| *v += hidden_round(dt_of(Stage::QPe), y));
    rope_rows(&mut q, &mut vq, &rope, p..dk, |row| row / h);
    out.push(
        Stage::QPe,
        q.slice(s![.., p..]).iter().copied().collect(),
        vq.slice(s![.., p..]).iter().copied().collect(),
    );

    // kv ← attn_in: stored, then the latent normed and k_pe roped.
    for (cols, st) in [
        (s![.., ..lkv], Stage::KvLatent),
        (s![.., lkv..], Stage::KPe),
    ] {
        Zip::from(vkv.slice_mut(cols))
            .and(kv.slice(cols))
            .for_each(|v, &y| *v += hidden_round(dt_of(st), y));
    }
    let (lat, vlat) = rms_norm(
        kv.slice(s![.., ..lkv]),
        vkv.slice(s![.., ..lkv]),
        &pre.kv_a_norm,
        cfg.lora_norm_eps,
    );
    out.push(
        Stage::KvLatent,
        lat.iter().copied().collect(),
        vlat.iter().copied().collect(),
    );
    rope_rows(&mut kv, &mut vkv, &rope, lkv..lkv + r, |row| row);
    out.push(
        Stage::KPe,
        kv.slice(s![.., lkv..]).iter().copied().collect(),
        vkv.slice(s![.., lkv..]).iter().copied().collect(),
    );

    let (Some(o_lat), Some(o_kpe)) = (opt2(opt, Stage::KvLatent), opt2(opt, Stage::KPe)) else {
        return out;
    };
    // cache_rows ← the stored latent and k_pe: a copy.
    let mut rows = Vec::with_capacity(t_all * (lkv + r));
    for t in 0..t_all {
        rows.extend(o_lat.row(t).iter().chain(o_kpe.row(t).iter()));
    }
    // In a cache of a type of its own (an f16 cache of f32 rows): a copy rounded to it.
    if let Some(c) = opt.declared(Stage::CacheRows) {
        rows.iter_mut().for_each(|v| *v = Store::from(c).round(*v));
    }
    let n_rows = rows.len();
    // A quantized cache: each element within the format's rounding bound b, its variance b²/3 (rounding
    // uniform over a step of 2b).
    let bound = (!opt.cache_format.is_auto()).then(|| {
        let codec = crate::kv_format::Codec::new(opt.cache_format, lkv, r)
            .with_tensor_scale(crate::kv_format::tensor_scale(&rows_f32(&rows)));
        rows.chunks(lkv + r)
            .flat_map(|x| codec.bound(x))
            .collect::<Vec<f64>>()
    });
    let var = match &bound {
        Some(b) => b.iter().map(|b| b * b / 3.0).collect(),
        None => vec![0.0; n_rows],
    };
    out.push(Stage::CacheRows, rows, var);
    let last = out.stages.last_mut().expect("pushed");
    last.exact = true;
    last.bound = bound;

    let (Some(o_qn), Some(o_qpe), Some(cache)) = (
        opt2(opt, Stage::QNope),
        opt2(opt, Stage::QPe),
        opt2(opt, Stage::CacheRows),
    ) else {
        return out;
    };
    // `[T·H, ·]` views of the per-head query parts.
    let o_qn = o_qn
        .into_shape_with_order((t_all * h, p))
        .expect("[T, H, P]");
    let o_qpe = o_qpe
        .into_shape_with_order((t_all * h, r))
        .expect("[T, H, R]");
    let scale = cfg.softmax_scale;
    let (w_uk, w_uv) = (&pre.w_uk, &pre.w_uv);
    let mut heads = Rows::new(t_all * h, dv);
    let mut lse = vec![0.0; t_all * h];
    let mut vlse = vec![0.0; t_all * h];
    let mut blse = vec![0.0; t_all * h];
    let sum = f.score_sum;
    let tc = sum.truncates();
    // Our kernels (the mirror's and CUDA's) store every LSE, split or merged, in f32.
    let lse_store = f.known_attention.then_some(Store::F32);
    let path = Path {
        dt: adt,
        online: f.known_attention,
        sum,
    };
    // A query stored wider than the attention's type is rounded to it on the way in: the variance
    // that adds to a score against key `(k, kr)` (nothing where q is stored in the attention's type).
    let widen = |qs: Stage| dt_of(qs).round_unit() < adt.round_unit();
    let (qn_wide, qp_wide) = (widen(Stage::QNope), widen(Stage::QPe));
    let q_round = |wide: bool, q: &[f64], k: &[f64]| -> f64 {
        match wide {
            true => q
                .iter()
                .zip(k)
                .map(|(&a, &b)| b * b * hidden_round(adt, a))
                .sum(),
            false => 0.0,
        }
    };
    // An engine whose attention is unknown, over a cache in a type of its own, may attend in latent
    // space (llama.cpp's absorbed MLA prefill: P·V over the cache's latent rows, summed in its type,
    // then W_UV): each key's value rounded there, carried through W_UV, as well as in v space.
    let latent_values = !f.known_attention && opt.declared(Stage::CacheRows).is_some();
    // attn_heads[decode] needs the stored attn_latent.
    let mut heads_ok = true;

    // Prefill, chunk by chunk: own keys from the chunk's fresh latent, context keys from the cache.
    let pl = sched.prompt_len;
    if pl > 0 {
        // Each head's prefill: independent, so in parallel.
        let per_head: Vec<Vec<Attn>> = (0..h)
            .into_par_iter()
            .map(|hh| {
                let mut rows = Vec::with_capacity(pl);
                let uk = w_uk.slice(s![hh * p..(hh + 1) * p, ..]).to_owned();
                let uv = w_uv.slice(s![hh * dv..(hh + 1) * dv, ..]).to_owned();
                let decompress = |lat: ArrayView2<f64>| {
                    let (k, mut vk) = linear(lat, &uk);
                    Zip::from(&mut vk)
                        .and(&k)
                        .for_each(|v, &y| *v += hidden_round(adt, y));
                    let (v, mut vv) = linear(lat, &uv);
                    Zip::from(&mut vv)
                        .and(&v)
                        .for_each(|x, &y| *x += hidden_round(adt, y));
                    if latent_values {
                        let r = lat.mapv(|y| Store::from(adt).worst_round_var(y));
                        vv += &r.dot(&uv.mapv(|w| w * w).t());
                    }
                    (k, vk, v, vv)
                };
                let own = decompress(o_lat.slice(s![..pl, ..]));
                // cos² between this head's values, for a row's degrees of freedom (`attend`); the
                // context's, decompressed from the cache, are the same rows rounded alike.
                let gram = (pl <= 2048).then(|| cos2(own.2.view()));
                // Context keys only where a chunk has context.
                let ctx = (sched.prefill_chunks().len() > 1)
                    .then(|| decompress(cache.slice(s![..pl, ..lkv])));
                let kpe_own = o_kpe.slice(s![..pl, ..]);
                let kpe_ctx = cache.slice(s![..pl, lkv..]);
                for c in sched.prefill_chunks() {
                    for t in c.clone() {
                        let qi = t * h + hh;
                        let (qn, qp) = (o_qn.row(qi), o_qpe.row(qi));
                        let part = |keys: std::ops::Range<usize>,
                                    (k, vk, v, vv): &(
                            Array2<f64>,
                            Array2<f64>,
                            Array2<f64>,
                            Array2<f64>,
                        ),
                                    kpe: &ArrayView2<f64>| {
                            let keys: Vec<usize> = keys.filter(|&j| keep(t, j)).collect();
                            let sc: Vec<Score> = keys
                                .iter()
                                .map(|&j| {
                                    let d = dot_var(
                                        sl(qn),
                                        sl(k.row(j)),
                                        sl(vk.row(j)),
                                        sl(qp),
                                        sl(kpe.row(j)),
                                        sum,
                                    );
                                    let mut sc = score(d, scale, sum);
                                    sc.var += scale
                                        * scale
                                        * (q_round(qn_wide, sl(qn), sl(k.row(j)))
                                            + q_round(qp_wide, sl(qp), sl(kpe.row(j))));
                                    sc
                                })
                                .collect();
                            let g = gram.as_ref().map(|g| Gram {
                                g,
                                stride: pl,
                                keys: &keys,
                            });
                            let vals: Vec<&[f64]> = keys
                                .iter()
                                .map(|&j| v.row(j).to_slice().expect("row"))
                                .collect();
                            let vvs: Vec<&[f64]> = keys
                                .iter()
                                .map(|&j| vv.row(j).to_slice().expect("row"))
                                .collect();
                            attend(&sc, &vals, Some(&vvs), dv, path, g)
                        };
                        let mine = part(c.start..t + 1, &own, &kpe_own);
                        let res = if c.start > 0 {
                            // Each part's output is stored before the merge.
                            let ctx = ctx.as_ref().expect("a chunk with context");
                            let mut parts = [part(0..c.start, ctx, &kpe_ctx), mine];
                            for pa in parts.iter_mut() {
                                for (v, &o) in pa.var.iter_mut().zip(&pa.out) {
                                    *v += hidden_round(adt, o);
                                }
                            }
                            merge(&parts)
                        } else {
                            mine
                        };
                        rows.push(res);
                    }
                }
                rows
            })
            .collect();
        for (hh, rows) in per_head.into_iter().enumerate() {
            // Chunks cover the prompt in order, so row t is token t.
            for (t, res) in rows.into_iter().enumerate() {
                heads.put(t * h + hh, &res);
                lse[t * h + hh] = res.lse;
                vlse[t * h + hh] = res.var_lse;
                blse[t * h + hh] = res.bias_lse;
            }
        }
    }

    // Decode: q_absorbed, the splits, their merge and the up-projection.
    let nd = sched.decode_tokens();
    if nd > 0 {
        let o_qabs = opt2(opt, Stage::QAbsorbed)
            .filter(|_| f.provided.contains(Stage::QAbsorbed))
            .map(|a| a.into_shape_with_order((nd * h, lkv)).expect("[D, H, Lkv]"));
        let mut qabs = Array2::<f64>::zeros((nd * h, lkv));
        let mut vqabs = Array2::<f64>::zeros((nd * h, lkv));
        for hh in 0..h {
            let uk = w_uk.slice(s![hh * p..(hh + 1) * p, ..]).to_owned();
            let rows: Vec<usize> = (0..nd).map(|d| (pl + d) * h + hh).collect();
            let qn = o_qn.select(ndarray::Axis(0), &rows);
            let (a, va) = linear(qn.view(), &uk.t().to_owned());
            for d in 0..nd {
                qabs.row_mut(d * h + hh).assign(&a.row(d));
                vqabs.row_mut(d * h + hh).assign(&va.row(d));
            }
        }
        out.push(
            Stage::QAbsorbed,
            qabs.iter().copied().collect(),
            vqabs.iter().copied().collect(),
        );
        // The query the splits see: the stored q_absorbed when exposed, else ours with its rounding.
        let (qa_used, vqa_used) = match &o_qabs {
            Some(o) => (o.clone(), Array2::zeros(o.dim())),
            None => {
                let mut v = vqabs.clone();
                Zip::from(&mut v)
                    .and(&qabs)
                    .for_each(|x, &y| *x += hidden_round(adt, y));
                (qabs.clone(), v)
            }
        };
        let ns = sched.num_splits;
        // cos² between the cache's latent rows (the decode values), once per layer: what a split
        // row's degrees of freedom need (`attend`); up to 4096 tokens (64 MB), else the old estimate.
        let gram: Option<Vec<f32>> = (t_all <= 4096).then(|| cos2(cache.slice(s![.., ..lkv])));
        let mut split_out = Rows::new(nd * h * ns, lkv);
        let mut split_lse = vec![0.0; nd * h * ns];
        let mut vsplit_lse = vec![0.0; nd * h * ns];
        let mut bsplit_lse = vec![0.0; nd * h * ns];
        let mut latent = Rows::new(nd * h, lkv);
        let o_split = match (opt.get(Stage::SplitOut), opt.get(Stage::SplitLse)) {
            (Some(o), Some(l))
                if f.provided.contains(Stage::SplitOut) && f.provided.contains(Stage::SplitLse) =>
            {
                Some((o, l))
            }
            _ => None,
        };
        // The types the stored partials were returned in (inferred from their values, as the judge
        // infers every stored type).
        let stored_types = o_split
            .filter(|_| !f.known_attention)
            .map(|(o, l)| (Store::infer(&o.data), Store::infer(&l.data)));
        for d in 0..nd {
            let t = pl + d;
            let seq_len = pl + (d / sched.q_len + 1) * sched.q_len;
            let splits = sched.split_ranges(seq_len);
            // Each head's splits and combine: independent, so in parallel.
            let per_head: Vec<(Vec<Attn>, Attn)> = (0..h)
                .into_par_iter()
                .map(|hh| {
                    let qi = d * h + hh;
                    let (qa, vqa, qp) = (
                        row(&qa_used, qi),
                        row(&vqa_used, qi),
                        row(&o_qpe, t * h + hh),
                    );
                    let score_of = |j: usize| {
                        let (lt, kp) = row(&cache, j).split_at(lkv);
                        let mut sc = score(dot_var(lt, qa, vqa, kp, qp, sum), scale, sum);
                        sc.var += scale * scale * q_round(qp_wide, qp, kp);
                        sc
                    };
                    let parts: Vec<Attn> = splits
                        .iter()
                        .map(|sr| {
                            let keys: Vec<usize> = (sr.start..sr.end.min(t + 1))
                                .filter(|&j| keep(t, j))
                                .collect();
                            let sc: Vec<Score> = keys.iter().map(|&j| score_of(j)).collect();
                            let vals: Vec<&[f64]> =
                                keys.iter().map(|&j| &row(&cache, j)[..lkv]).collect();
                            let g = gram.as_ref().map(|g| Gram {
                                g,
                                stride: t_all,
                                keys: &keys,
                            });
                            attend(&sc, &vals, None, lkv, path, g)
                        })
                        .collect();
                    // The combine, from the stored partials when the backend exposes them.
                    // (Exact when the path merges what it stored; else with a fresh computation's noise.)
                    let merged = match o_split {
                        Some((o, l)) => {
                            let stored: Vec<Attn> = (0..ns)
                                .map(|k| {
                                    let out = o.data[(qi * ns + k) * lkv..(qi * ns + k + 1) * lkv]
                                        .to_vec();
                                    let lse = l.data[qi * ns + k];
                                    match f.known_attention {
                                        true => Attn {
                                            out,
                                            lse,
                                            ..Attn::empty(lkv)
                                        },
                                        // An external kernel merges its own (unstored) partials:
                                        // ours carry a fresh computation's noise plus the rounding
                                        // of the type it returned them in (a bf16 split_lse moves
                                        // the weights by up to 2⁻⁹·|lse|).
                                        false => {
                                            let (so, sl) = stored_types.expect("with splits");
                                            let mut var = parts[k].var.clone();
                                            var.iter_mut()
                                                .zip(&out)
                                                .for_each(|(v, &o)| *v += so.round_var(o));
                                            Attn {
                                                var_lse: parts[k].var_lse + sl.round_var(lse),
                                                out,
                                                lse,
                                                var,
                                                bias_out: parts[k].bias_out.clone(),
                                                ..parts[k]
                                            }
                                        }
                                    }
                                })
                                .collect();
                            merge(&stored)
                        }
                        None => merge(&parts),
                    };
                    (parts, merged)
                })
                .collect();
            for (hh, (parts, merged)) in per_head.into_iter().enumerate() {
                let qi = d * h + hh;
                for (k, pa) in parts.iter().enumerate() {
                    split_out.put(qi * ns + k, pa);
                    split_lse[qi * ns + k] = pa.lse;
                    vsplit_lse[qi * ns + k] = pa.var_lse;
                    bsplit_lse[qi * ns + k] = pa.bias_lse;
                }
                latent.put(qi, &merged);
                lse[t * h + hh] = merged.lse;
                vlse[t * h + hh] = merged.var_lse;
                blse[t * h + hh] = merged.bias_lse;
            }
        }
        split_out.push_to(&mut out, Stage::SplitOut, tc);
        out.push(Stage::SplitLse, split_lse, vsplit_lse);
        out.with_truncation(tc, bsplit_lse);
        out.with_store(lse_store);
        latent.push_to(&mut out, Stage::AttnLatent, tc);
        // attn_heads[decode] ← the stored attn_latent, in the run's dtype: what W_UV multiplies (an
        // engine stores the latent in it; a runner may return it wider, and is then rounded the same
        // way, `runner::decode::put_decode_outputs`). A no-op for paths that store it in the dtype.
        if let Some(o_att) = opt2(opt, Stage::AttnLatent) {
            let o_att = o_att
                .mapv(|v| dt_of(Stage::AttnLatent).round(v as f32) as f64)
                .into_shape_with_order((nd * h, lkv))
                .expect("[D, H, Lkv]");
            for hh in 0..h {
                let uv = w_uv.slice(s![hh * dv..(hh + 1) * dv, ..]).to_owned();
                let rows: Vec<usize> = (0..nd).map(|d| d * h + hh).collect();
                let (y, v) = linear(o_att.select(ndarray::Axis(0), &rows).view(), &uv);
                for d in 0..nd {
                    let at = ((pl + d) * h + hh) * dv;
                    heads.out[at..at + dv].copy_from_slice(y.row(d).as_slice().expect("row"));
                    heads.var[at..at + dv].copy_from_slice(v.row(d).as_slice().expect("row"));
                }
            }
        } else {
            heads_ok = false;
        }
    }
    out.push(Stage::Lse, lse, vlse);
    out.with_truncation(tc, blse);
    out.with_store(lse_store);
    if heads_ok {
        heads.push_to(&mut out, Stage::AttnHeads, tc);
    }

    if let Some((y, v)) = pre.o {
        out.push(
            Stage::AttnOut,
            y.into_raw_vec_and_offset().0,
            v.into_raw_vec_and_offset().0,
        );
    }
    // A declared storage type is the stage's contract (as our kernels' f32 LSE is).
    for l in out.stages.iter_mut().filter(|l| l.store.is_none()) {
        l.store = opt.declared(l.stage).map(Store::from);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weights widened block by block give the products of the whole f64 copy, bit for bit (the
    /// reports do not change), with blocks that cut the output columns unevenly.
    #[test]
    fn blocked_linear_is_the_whole_product() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (t, n_in, n_out) = (7, 300, 9000);
        let a = Array2::from_shape_fn((t, n_in), |_| rng.random_range(-2.0..2.0));
        let va = Array2::from_shape_fn((t, n_in), |_| rng.random_range(0.0..1e-6));
        let w = Array2::from_shape_fn((n_out, n_in), |_| rng.random_range(-1.0f32..1.0));
        assert!(
            crate::linalg::BLOCK_BYTES / 8 / n_in < n_out,
            "more than one block"
        );
        for dt in [Dtype::Bf16, Dtype::F32] {
            let whole = w.mapv(|v| dt.round(v) as f64);
            let (y, v) = linear(a.view(), &whole);
            let ws = w.mapv(|v| dt.round(v));
            for (wv, round) in [(&ws, None), (&w, Some(dt))] {
                let (yb, vb) = linear_stored(a.view(), wv.view(), round, None);
                assert!(y == yb && v == vb, "{dt:?}");
                let (_, vp) = linear_stored(a.view(), wv.view(), round, Some(&va));
                assert!(vp == &v + &propagate(&va, &whole), "{dt:?} propagated");
            }
        }
    }
}
