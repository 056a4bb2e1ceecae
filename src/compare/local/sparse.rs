//! The stage-local view of a DSA layer (docs/dsa.md): the path attended over a selection
//! (`LayerCtx::selection`), so each of its attentions is recomputed over the same keys. The decode
//! splits and the mirror's decompressed prefill (own chunk + context, merged) are the dense view's with
//! the unselected keys left out (`local::compute_with`); a prefill in the absorbed form (CUDA's
//! `sparse_attn`, as FlashMLA's sparse prefill) is here: `q_abs = W_UKᵀ·q_nope` stored, one attention
//! over the selected cache rows (the values are the latents), the latent stored, then `W_UV`.

use super::{
    attend, cos2, dot_var, hidden_round, linear, linear_var, row, score, Attn, Path, Score,
};
use crate::reference::sparse::Selection;
use ndarray::{s, Array2, Axis, Zip};
use rayon::prelude::*;

/// What a sparse layer's path attended over, and how its prefill computes.
#[derive(Debug, Clone, Copy)]
pub struct Sparse<'a> {
    /// The selection the optimized path was given (shadow mode: the reference's; the DSA check's
    /// own-selection path: its own indexer's).
    pub selection: &'a Selection,
    /// Prefill in the absorbed form over the cache (`Backend::sparse_prefill_absorbed`), not the
    /// decompressed own chunk + context.
    pub absorbed_prefill: bool,
}

/// The stored inputs of an absorbed sparse prefill.
pub(super) struct Prefill<'a> {
    pub sel: &'a Selection,
    /// `[T·H, P]`, `[T·H, R]`: the stored query parts.
    pub q_nope: &'a Array2<f64>,
    pub q_pe: &'a Array2<f64>,
    /// `[T, Lkv + R]`: the stored cache rows.
    pub cache: &'a Array2<f64>,
    /// `[H·P, Lkv]`, `[H·Dv, Lkv]`: W_UK and W_UV as stored.
    pub w_uk: &'a Array2<f64>,
    pub w_uv: &'a Array2<f64>,
    pub heads: usize,
    pub pl: usize,
    pub scale: f64,
}

/// Each prompt row `t·H + h`: `attn_heads` (values, variance, truncation bias, shared variance) and
/// `lse`, as an `Attn` in the heads' space.
pub(super) fn prefill_absorbed(p: &Prefill, path: Path) -> Vec<Attn> {
    let (h, pl) = (p.heads, p.pl);
    let lkv = p.w_uk.ncols();
    let (dk, dv) = (p.w_uk.nrows() / h, p.w_uv.nrows() / h);
    let cache = p.cache;
    // cos² between the cache's latents (the values), once: a row's degrees of freedom (`attend`).
    let gram = (cache.nrows() <= 4096).then(|| cos2(cache.slice(s![.., ..lkv])));
    let t_all = cache.nrows();
    let per_head: Vec<Vec<Attn>> = (0..h)
        .into_par_iter()
        .map(|hh| {
            let uk = p.w_uk.slice(s![hh * dk..(hh + 1) * dk, ..]).to_owned();
            let uv = p.w_uv.slice(s![hh * dv..(hh + 1) * dv, ..]).to_owned();
            let rows: Vec<usize> = (0..pl).map(|t| t * h + hh).collect();
            // q_abs, stored in the dtype before the attention reads it.
            let (qa, mut vqa) = linear(p.q_nope.select(Axis(0), &rows).view(), &uk.t().to_owned());
            Zip::from(&mut vqa)
                .and(&qa)
                .for_each(|v, &y| *v += hidden_round(path.dt, y));
            (0..pl)
                .map(|t| {
                    let keys: Vec<usize> = p.sel.keys[t].iter().map(|&j| j as usize).collect();
                    let qp = row(p.q_pe, t * h + hh);
                    let sc: Vec<Score> = keys
                        .iter()
                        .map(|&j| {
                            let (lt, kp) = row(cache, j).split_at(lkv);
                            let d = dot_var(lt, row(&qa, t), row(&vqa, t), kp, qp, path.sum);
                            score(d, p.scale, path.sum)
                        })
                        .collect();
                    let vals: Vec<&[f64]> = keys.iter().map(|&j| &row(cache, j)[..lkv]).collect();
                    let cs = |a: usize, b: usize| match &gram {
                        Some(g) => g[keys[a] * t_all + keys[b]] as f64,
                        None => 0.0,
                    };
                    let g: Option<&dyn Fn(usize, usize) -> f64> =
                        gram.as_ref().map(|_| &cs as &dyn Fn(usize, usize) -> f64);
                    let mut lat = attend(&sc, &vals, None, lkv, path, g);
                    // The latent is stored before W_UV.
                    for (v, &o) in lat.var.iter_mut().zip(&lat.out) {
                        *v += hidden_round(path.dt, o);
                    }
                    up_project(&lat, &uv)
                })
                .collect()
        })
        .collect();
    let mut out: Vec<Option<Attn>> = (0..pl * h).map(|_| None).collect();
    for (hh, rows) in per_head.into_iter().enumerate() {
        for (t, a) in rows.into_iter().enumerate() {
            out[t * h + hh] = Some(a);
        }
    }
    out.into_iter().map(|a| a.expect("every row")).collect()
}

/// `W_UV · latent` with the latent's variance carried and the product's own; its truncation bias
/// mapped linearly; the shared variance scaled as the variance is (W_UV moves every source alike).
fn up_project(lat: &Attn, uv: &Array2<f64>) -> Attn {
    let a = Array2::from_shape_vec((1, lat.out.len()), lat.out.clone()).expect("[1, Lkv]");
    let va = Array2::from_shape_vec((1, lat.var.len()), lat.var.clone()).expect("[1, Lkv]");
    let (y, vy) = linear_var(a.view(), uv, Some(&va));
    let (_, own) = linear(a.view(), uv);
    let bias = uv.dot(&ndarray::ArrayView1::from(&lat.bias_out));
    // The carried part of the variance (all of it but the product's own).
    let (in_var, out_var) = (lat.var.iter().sum::<f64>(), (&vy - &own).sum());
    let ratio = if in_var > 0.0 { out_var / in_var } else { 0.0 };
    Attn {
        out: y.into_raw_vec_and_offset().0,
        var: vy.into_raw_vec_and_offset().0,
        lse: lat.lse,
        var_lse: lat.var_lse,
        coh: lat.coh * ratio,
        n_eff: lat.n_eff,
        bias_out: bias.to_vec(),
        bias_lse: lat.bias_lse,
    }
}
