//! Reference A: decompressed multi-head attention, as the model is written (and as the prefill path of a
//! serving engine computes it): per head `k = [W_UK[h]·latent | k_pe]`, `v = W_UV[h]·latent`, causal
//! softmax with the model's scale.

use super::front::{linear, o_proj, Front};
use super::softmax_in_place;
use super::sparse::{mask_row, Selection};
use crate::model::{LayerWeights, MlaConfig};
use ndarray::{concatenate, s, Array2, Array3, ArrayView2, Axis};
use rayon::prelude::*;

/// What attention produces for a set of query tokens.
#[derive(Debug, Clone)]
pub struct AttnOutput {
    /// `[n, H]`, natural log.
    pub lse: Array2<f64>,
    /// `[n, H, Dv]`
    pub heads: Array3<f64>,
    /// `[n, E]`
    pub out: Array2<f64>,
}

/// Per-head keys and values from the latent: `k_nope [T, H, P]`, `v [T, H, Dv]`.
pub fn decompress(
    cfg: &MlaConfig,
    w: &LayerWeights,
    latent: ArrayView2<f64>,
) -> (Array3<f64>, Array3<f64>) {
    let (t, h, lkv) = (latent.nrows(), cfg.n_head, cfg.kv_lora_rank);
    let per_head = |m: &Array3<f32>, d: usize| {
        let m = m
            .view()
            .into_shape_with_order((h * d, lkv))
            .expect("[H, d, Lkv]");
        linear(latent, m)
            .into_shape_with_order((t, h, d))
            .expect("[T, H·d]")
    };
    (
        per_head(&w.w_uk, cfg.qk_nope),
        per_head(&w.w_uv, cfg.v_head_dim),
    )
}

/// Causal attention of every token over the tokens up to itself.
pub fn attention(cfg: &MlaConfig, w: &LayerWeights, f: &Front) -> AttnOutput {
    attention_sel(cfg, w, f, None)
}

/// `attention` over the keys a DSA selection keeps (`None`: all of them).
pub fn attention_sel(
    cfg: &MlaConfig,
    w: &LayerWeights,
    f: &Front,
    sel: Option<&Selection>,
) -> AttnOutput {
    let (t, h, dv) = (f.latent.nrows(), cfg.n_head, cfg.v_head_dim);
    let (k_nope, v) = decompress(cfg, w, f.latent.view());
    // Heads are independent: each computed on its own (over the host's cores), then stored in place.
    let per_head: Vec<(Vec<f64>, Array2<f64>)> = (0..h)
        .into_par_iter()
        .map(|hh| {
            let q = concatenate(
                Axis(1),
                &[f.q_nope.slice(s![.., hh, ..]), f.q_pe.slice(s![.., hh, ..])],
            )
            .expect("same rows");
            let k = concatenate(Axis(1), &[k_nope.slice(s![.., hh, ..]), f.k_pe.view()])
                .expect("same rows");
            let mut p = q.dot(&k.t()) * cfg.softmax_scale;
            let mut lse = vec![0.0; t];
            for (i, mut row) in p.rows_mut().into_iter().enumerate() {
                let row = row.as_slice_mut().expect("contiguous");
                if let Some(sel) = sel {
                    mask_row(sel, i, &mut row[..=i]);
                }
                lse[i] = softmax_in_place(&mut row[..=i]);
                row[i + 1..].fill(0.0);
            }
            (lse, p.dot(&v.slice(s![.., hh, ..])))
        })
        .collect();
    let mut lse = Array2::zeros((t, h));
    let mut heads = Array3::zeros((t, h, dv));
    for (hh, (l, o)) in per_head.into_iter().enumerate() {
        lse.column_mut(hh).assign(&ndarray::ArrayView1::from(&l));
        heads.slice_mut(s![.., hh, ..]).assign(&o);
    }
    let out = o_proj(w, &heads);
    AttnOutput { lse, heads, out }
}
