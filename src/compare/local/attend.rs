//! One softmax attention over scored keys in fp64 with the noise of the path's computation, and the
//! merge of attention parts by their lse.

use super::super::noise::{acc_var, Store, F32_OP};
use super::f32ops::{e4m3_worst_round_var, exp_var, lse_last, lse_rounding, sum_rel_var_seq};
use super::linear::hidden_round;
use super::score::Score;
#[cfg(target_arch = "x86_64")]
use super::simd;
use super::Local;
use crate::precision::{Dtype, ScoreSum};
use crate::trace::Stage;
use ndarray::ArrayView2;

/// cos² between the rows of `a` (`[T, D]`, f32 to halve the memory): what an attention row's degrees
/// of freedom need (`attend`).
pub(super) fn cos2(a: ArrayView2<f64>) -> Vec<f32> {
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
pub(super) struct Path {
    pub(super) dt: Dtype,
    pub(super) online: bool,
    pub(super) sum: ScoreSum,
    /// P rounded to float8 e4m3 (unscaled, against a running max) before P·V instead of to `dt`
    /// (`Judging::decode_p_e4m3`); the row sum from P unrounded.
    pub(super) p_e4m3: bool,
}

/// One attention over `keys`: output, its variance, lse and its variance.
pub(super) struct Attn {
    pub(super) out: Vec<f64>,
    pub(super) var: Vec<f64>,
    pub(super) lse: f64,
    pub(super) var_lse: f64,
    /// Σ over the row of the variance shared through the keys' P, and the keys' effective number.
    pub(super) coh: f64,
    pub(super) n_eff: f64,
    /// The scores' truncation bias carried to the output and the lse (`Score::trunc`).
    pub(super) bias_out: Vec<f64>,
    pub(super) bias_lse: f64,
    /// The part of `var_lse` that is the lse's own last rounding, where the path stores it as
    /// computed (the mirror: `m + ln l` in f32 is the stored value): an lse stage leaves it to the
    /// judge, which counts the stored value's rounding; a merge counts it in its inputs.
    pub(super) lse_last: f64,
}

impl Attn {
    pub(super) fn empty(dim: usize) -> Attn {
        Attn {
            out: vec![0.0; dim],
            var: vec![0.0; dim],
            lse: f64::NEG_INFINITY,
            var_lse: 0.0,
            coh: 0.0,
            n_eff: 1.0,
            bias_out: vec![0.0; dim],
            bias_lse: 0.0,
            lse_last: 0.0,
        }
    }
    pub(super) fn nan(dim: usize) -> Attn {
        Attn {
            out: vec![f64::NAN; dim],
            var: vec![0.0; dim],
            lse: f64::NAN,
            var_lse: 0.0,
            coh: 0.0,
            n_eff: 1.0,
            bias_out: vec![0.0; dim],
            bias_lse: 0.0,
            lse_last: 0.0,
        }
    }
}

/// One key's pass over the value columns in [`attend`] (`f` = its P rounding's, its score's and its p):
/// each column's terms added to `a`, `sq`, `tot`, and the key's own sum in four lanes (column mod 4).
#[inline(always)]
pub(super) fn key_cols(
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
pub(super) fn key_cols_scalar(
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
pub(super) fn key_cols_from(
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
pub(super) fn attend(
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
pub(super) struct Gram<'a> {
    pub(super) g: &'a [f32],
    pub(super) stride: usize,
    pub(super) keys: &'a [usize],
}

/// [`attend`]'s body (compiled twice: for the host's baseline and, where the CPU has it, AVX2).
#[inline(always)]
pub(super) fn attend_in(
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
        .zip(&p)
        .map(|(sc, &pj)| sc.var + exp_var(path.sum, sc.s - m, pj))
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
    let (bias_out, bias_lse) = truncation_bias(&p, v, scores, &out, l, path.sum.truncates());
    let n = p.len();
    let tiles = n.div_ceil(64) as f64;
    // The key holding the maximum has p = exp(0) = 1 exactly in every online softmax. Keys in tiles
    // before the maximum's were rounded against a smaller running max, so where in their binade they
    // sat is unknown: the largest relative rounding is assumed for them.
    // Without an online softmax (`Judging::known_attention`), every P at the worst place.
    let rv: Vec<f64> = (0..n)
        .map(|j| match j {
            _ if path.p_e4m3 => e4m3_worst_round_var(p[j]),
            _ if !online || j < early_end => Store::from(dt).worst_round_var(p[j]),
            _ if j == arg_max => 0.0,
            _ => hidden_round(dt, p[j]),
        })
        .collect();
    let inv_l2 = 1.0 / (l * l);
    let (mut var, per_key) = columns(&p, &pv, &rv, v, vv, &out, inv_l2);
    let sp: f64 = p.iter().zip(&pv).map(|(a, b)| a * a * b).sum();
    let sq: f64 = p.iter().map(|a| a * a).sum();
    // The f32 sum l scales the whole row. Added to a running sum that already holds the maximum's 1,
    // a p below half its ulp is lost entirely (a bias, all of one sign), larger ones lose their low
    // bits (random): what a sequential sum can lose, with its other rounding.
    let l_rel = match path.sum {
        ScoreSum::Lanes8 => sum_rel_var_seq(&p, l),
        _ => sum_rel_var(&p, arg_max, l, sq),
    };
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
        Some(g) => keys2_gram(g, &per_key),
        None => keys2_common(v, &rv, &per_key, dim, inv_l2, keys),
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
        lse_last: lse_last(path.sum, m + l.ln()),
    }
}

/// [`attend_in`]'s variance per value column (P's roundings, the scores' through p, the values' own;
/// the f32 sum's) and each key's part of the row's, over `l²` (`inv_l2`).
#[inline(always)]
fn columns(
    p: &[f64],
    pv: &[f64],
    rv: &[f64],
    v: &[&[f64]],
    vv: Option<&[&[f64]]>,
    out: &[f64],
    inv_l2: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (n, dim) = (p.len(), out.len());
    let tiles = n.div_ceil(64) as f64;
    // Per value column: P's roundings, the scores' (through p), the values' own; the f32 sum's terms.
    let (mut a, mut sq, mut tot) = (vec![0.0; dim], vec![0.0; dim], vec![0.0; dim]);
    let mut per_key = vec![0.0; n];
    for j in 0..n {
        let (round, pj) = (rv[j], p[j]);
        let ppv = pj * pj * pv[j];
        let key4 = key_cols(
            &v[j][..dim],
            out,
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
    let var: Vec<f64> = (0..dim)
        .map(|d| {
            (a[d] + acc_var(n, sq[d], tot[d])) * inv_l2 + out[d] * out[d] * (tiles + 2.0) * F32_OP
        })
        .collect();
    (var, per_key)
}

/// [`attend_in`]'s truncation bias (where the sum truncates, `on`): ∂/∂κ of the output, Σ p_j t_j (v_j −
/// o) / l, and of the lse, Σ p_j t_j / l.
#[inline(always)]
fn truncation_bias(
    p: &[f64],
    v: &[&[f64]],
    scores: &[Score],
    out: &[f64],
    l: f64,
    on: bool,
) -> (Vec<f64>, f64) {
    let mut bias_out = vec![0.0; out.len()];
    let mut bias_lse = 0.0;
    if on {
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
            .zip(out)
            .for_each(|(b, o)| *b = *b / l - bias_lse * o);
    }
    (bias_out, bias_lse)
}

/// [`attend_in`]'s relative variance of the f32 sum `l` of `p` (`sq` = Σ p²), whose maximum's 1 sits at
/// `arg_max`.
#[inline(always)]
fn sum_rel_var(p: &[f64], arg_max: usize, l: f64, sq: f64) -> f64 {
    let n = p.len();
    let ulp_l = Store::F32.ulp(l);
    let (lost, kept) = p.iter().enumerate().filter(|&(j, _)| j != arg_max).fold(
        (0.0, 0usize),
        |(s, k), (_, &pj)| match pj < ulp_l / 2.0 {
            true => (s + pj, k),
            false => (s, k + 1),
        },
    );
    (lost * lost + kept as f64 * ulp_l * ulp_l / 12.0 + acc_var(n, sq, l)) / (l * l)
}

/// tr Σ² of [`attend_in`]'s keys' part from the values' Gram matrix: the 256 largest keys pairwise, the
/// rest as independent.
#[inline(always)]
fn keys2_gram(g: Gram, per_key: &[f64]) -> f64 {
    let n = per_key.len();
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

/// tr Σ² of [`attend_in`]'s keys' part without the values' Gram matrix: their common direction as one
/// source, the rest per key.
#[inline(always)]
fn keys2_common(
    v: &[&[f64]],
    rv: &[f64],
    per_key: &[f64],
    dim: usize,
    inv_l2: f64,
    keys: f64,
) -> f64 {
    // P's roundings act along the values: where the values share a direction (latent rows
    // often do), their sum along it is one source, not one per key.
    let r_tot: f64 = rv.iter().sum();
    let mut common = vec![0.0; dim];
    if r_tot > 0.0 {
        for (vj, &r) in v.iter().zip(rv) {
            let w = r / r_tot;
            common.iter_mut().zip(*vj).for_each(|(c, &x)| *c += w * x);
        }
    }
    let c_sq: f64 = common.iter().map(|c| c * c).sum();
    let along = (r_tot * c_sq * inv_l2).min(keys);
    let own = keys - along;
    along * along
        + per_key.iter().map(|c| c * c).sum::<f64>() * (own / keys.max(f64::MIN_POSITIVE)).powi(2)
}

/// Attention rows of a stage being assembled: values, variances, and each row's shared variance.
pub(super) struct Rows {
    pub(super) dim: usize,
    pub(super) out: Vec<f64>,
    pub(super) var: Vec<f64>,
    pub(super) coh: Vec<(f64, f64)>,
    /// The truncation bias, made only once a row brings one other than +0: on a path that rounds to
    /// nearest every bias is +0 and the stage has none (`Local::with_truncation`), so the whole stage's
    /// worth of zeros (split_out's: 132 MiB on a covering GLM-5 layer) is never allocated (#39).
    bias: Vec<f64>,
}

impl Rows {
    pub(super) fn new(rows: usize, dim: usize) -> Rows {
        Rows {
            dim,
            out: vec![0.0; rows * dim],
            var: vec![0.0; rows * dim],
            coh: vec![(0.0, 1.0); rows],
            bias: Vec::new(),
        }
    }
    pub(super) fn put(&mut self, i: usize, a: &Attn) {
        let at = i * self.dim..(i + 1) * self.dim;
        self.out[at.clone()].copy_from_slice(&a.out);
        self.var[at.clone()].copy_from_slice(&a.var);
        // Bits, not values: a −0 bias is kept as it was before the lazy allocation.
        if self.bias.is_empty() && a.bias_out.iter().any(|b| b.to_bits() != 0) {
            self.bias = vec![0.0; self.out.len()];
        }
        if !self.bias.is_empty() {
            self.bias[at].copy_from_slice(&a.bias_out);
        }
        self.coh[i] = (a.coh, a.n_eff);
    }
    pub(super) fn push_to(mut self, local: &mut Local, stage: Stage, truncating: bool) {
        if truncating && self.bias.is_empty() {
            self.bias = vec![0.0; self.out.len()];
        }
        local.push_rows(stage, self.out, self.var, self.coh);
        local.with_truncation(truncating, self.bias);
    }
}

/// Merge parts by their lse (vLLM's `merge_attn_states`), propagating the parts' variances.
pub(super) fn merge(parts: &[Attn], sum: ScoreSum) -> Attn {
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
    // `m + ln Σw`: the mirror's ln and sum rounded where they land (the sum's own last rounding is
    // the stored value's: `lse_last`), and Σw's additions; others one f32 operation.
    let lse_out = m + total.ln();
    let mut var_lse = match sum {
        ScoreSum::Lanes8 => {
            let mut run = 0.0;
            let mut adds = 0.0;
            for &wk in w.iter().filter(|&&x| x > 0.0) {
                if run > 0.0 {
                    adds += Store::F32.round_var(run + wk);
                }
                run += wk;
            }
            Store::F32.round_var(total.ln())
                + Store::F32.round_var(lse_out)
                + adds / (total * total)
        }
        _ => F32_OP,
    };
    // The row's shared variance: the parts' own (with their numbers of sources) and the lse shifts.
    let (mut coh, mut coh2, mut shifts) = (0.0, 0.0, 0.0);
    for (p, &wk) in parts.iter().zip(&w) {
        if wk == 0.0 {
            continue;
        }
        let a = wk / total;
        let lv = p.var_lse + exp_var(sum, p.lse - m, wk);
        var_lse += a * a * lv;
        let (mut shift, mut weight) = (0.0, 0.0);
        // Squares as products, not `powi(2)` (a call per element; the same bits: `1·(x·x)`).
        for d in 0..dim {
            let (o, diff) = (p.out[d], p.out[d] - out[d]);
            let dev = lv * (diff * diff);
            shift += dev;
            // The part's weight `w/Σw` is rounded once for the whole row: a shared scaling of its o.
            let wr = F32_OP * (o * o);
            weight += wr;
            var[d] += a * a * (p.var[d] + dev + wr + 2.0 * F32_OP * (o * o));
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
        let r = n_sum * F32_OP * o * o;
        *v += r;
        total_round += r;
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
        lse: lse_out,
        var_lse,
        coh,
        n_eff: if coh2 > 0.0 {
            (coh * coh / coh2).max(1.0)
        } else {
            1.0
        },
        bias_out,
        bias_lse,
        lse_last: lse_last(sum, lse_out),
    }
}
