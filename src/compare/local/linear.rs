//! The view's linear algebra in fp64 with the noise of the path's f32 arithmetic: products against the
//! weights as the path stores them, RMSNorm and rope, each with its variance.

use super::super::noise::{acc_var, Store, F32_OP};
use crate::backend::cpu::front::RopeF32;
use crate::precision::Dtype;
use crate::rope::pair;
use ndarray::{s, Array1, Array2, ArrayView1, ArrayView2, Zip};

/// `a` widened, rounded to `round` first where the weights are the file's (`Stored`).
pub(super) fn f64s<D: ndarray::Dimension>(
    a: &ndarray::Array<f32, D>,
    round: Option<Dtype>,
) -> ndarray::Array<f64, D> {
    match round {
        Some(dt) => a.mapv(|v| dt.round(v) as f64),
        None => a.mapv(|v| v as f64),
    }
}

/// Variance of storing `y` in the path's dtype (a rounding the trace does not show).
pub(super) fn hidden_round(dt: Dtype, y: f64) -> f64 {
    Store::from(dt).round_var(y)
}

/// `y = a·wᵀ` in fp64 and the variance of computing it with f32 accumulation.
pub(super) fn linear(a: ArrayView2<f64>, w: &Array2<f64>) -> (Array2<f64>, Array2<f64>) {
    linear_var(a, w, None)
}

/// [`linear`], with the input variances `var_a` propagated through `y = a·wᵀ` added to the variance:
/// `a²·(w²)ᵀ` and `var_a·(w²)ᵀ` in one product of the rows stacked (one pass over `w²`).
pub(super) fn linear_var(
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
pub(super) fn squares_in(a: ArrayView2<f64>, var_a: Option<&Array2<f64>>) -> Array2<f64> {
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
pub(super) fn variance(
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
pub(super) fn propagate(var_a: &Array2<f64>, w: &Array2<f64>) -> Array2<f64> {
    crate::linalg::mat_mul_t(var_a.view(), w.mapv(|v| v * v).view())
}

/// [`linear_var`] for a weight `w [out, in]` as the path stores it: `w` itself, or `w` rounded to
/// `round` (`linalg::linear_f32`: never a whole f64 copy on the host, or on the GPU a run installed).
pub(super) fn linear_stored(
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
pub(super) fn rms_norm(
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
pub(super) fn rope_rows(
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
pub(super) fn rows_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// A row of a standard-layout array (or a contiguous view) as a slice.
pub(super) fn row(a: &Array2<f64>, i: usize) -> &[f64] {
    sl(a.row(i))
}
pub(super) fn sl(a: ArrayView1<'_, f64>) -> &[f64] {
    a.to_slice().expect("a contiguous row")
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
