//! Reference B: the absorbed form a decode kernel computes: `q_abs[h] = W_UK[h]ᵀ·q_nope[h]`, one shared
//! key/value row per token `[latent | k_pe]` (MQA), scores `q_abs·latent + q_pe·k_pe`, output in latent
//! space, then `W_UV[h]` and o_proj. Also the exact split-KV partials of the serving schedule.

use super::front::{cache_rows, linear, o_proj, Front};
use super::mha::AttnOutput;
use super::softmax_in_place;
use super::sparse::{mask_row, Selection};
use crate::model::{LayerWeights, MlaConfig};
use crate::schedule::Schedule;
use ndarray::{concatenate, s, Array2, Array3, Array4, Axis};
use rayon::prelude::*;
use std::ops::Range;

/// `q_abs [n, H, Lkv]` for the query tokens `rows`.
pub fn absorb_query(
    cfg: &MlaConfig,
    w: &LayerWeights,
    q_nope: &Array3<f64>,
    rows: Range<usize>,
) -> Array3<f64> {
    let (n, h, lkv) = (rows.len(), cfg.n_head, cfg.kv_lora_rank);
    let mut q_abs = Array3::zeros((n, h, lkv));
    for hh in 0..h {
        let q = q_nope.slice(s![rows.clone(), hh, ..]);
        let uk = w.w_uk.slice(s![hh, .., ..]).mapv(f64::from);
        q_abs.slice_mut(s![.., hh, ..]).assign(&q.dot(&uk));
    }
    q_abs
}

/// Scaled scores `[H, n, rows.end]` of the queries `rows` over the keys `0..rows.end`; −inf where a key
/// lies after its query (causal).
pub fn scores(cfg: &MlaConfig, f: &Front, q_abs: &Array3<f64>, rows: Range<usize>) -> Array3<f64> {
    scores_sel(cfg, f, q_abs, rows, None)
}

/// `scores` with −inf also at the keys a DSA selection drops.
pub fn scores_sel(
    cfg: &MlaConfig,
    f: &Front,
    q_abs: &Array3<f64>,
    rows: Range<usize>,
    sel: Option<&Selection>,
) -> Array3<f64> {
    let keys = cache_rows(f);
    let keys = keys.slice(s![..rows.end, ..]);
    let (n, h) = (rows.len(), cfg.n_head);
    // Heads are independent: each computed on its own (over the host's cores), then stored in place.
    let per_head: Vec<Array2<f64>> = (0..h)
        .into_par_iter()
        .map(|hh| {
            let q = concatenate(
                Axis(1),
                &[
                    q_abs.slice(s![.., hh, ..]),
                    f.q_pe.slice(s![rows.clone(), hh, ..]),
                ],
            )
            .expect("same rows");
            let mut sc = q.dot(&keys.t()) * cfg.softmax_scale;
            for (i, mut row) in sc.rows_mut().into_iter().enumerate() {
                row.slice_mut(s![rows.start + i + 1..])
                    .fill(f64::NEG_INFINITY);
                if let Some(sel) = sel {
                    let t = rows.start + i;
                    mask_row(sel, t, &mut row.as_slice_mut().expect("contiguous")[..=t]);
                }
            }
            sc
        })
        .collect();
    let mut out = Array3::zeros((h, n, rows.end));
    for (hh, sc) in per_head.into_iter().enumerate() {
        out.slice_mut(s![hh, .., ..]).assign(&sc);
    }
    out
}

/// Absorbed attention of the query tokens `rows`, in latent space.
#[derive(Debug, Clone)]
pub struct LatentAttention {
    /// `[n, H, Lkv]`
    pub q_abs: Array3<f64>,
    /// `[H, n, rows.end]`
    pub scores: Array3<f64>,
    /// `[n, H]`
    pub lse: Array2<f64>,
    /// `[n, H, Lkv]`
    pub latent_out: Array3<f64>,
}

/// Attention over the latent rows: probabilities times latent (MQA, one shared value row per token).
pub fn latent_attention(
    cfg: &MlaConfig,
    w: &LayerWeights,
    f: &Front,
    rows: Range<usize>,
) -> LatentAttention {
    latent_attention_sel(cfg, w, f, rows, None)
}

/// `latent_attention` over the keys a DSA selection keeps (`None`: all of them).
pub fn latent_attention_sel(
    cfg: &MlaConfig,
    w: &LayerWeights,
    f: &Front,
    rows: Range<usize>,
    sel: Option<&Selection>,
) -> LatentAttention {
    let (n, h, lkv) = (rows.len(), cfg.n_head, cfg.kv_lora_rank);
    let q_abs = absorb_query(cfg, w, &f.q_nope, rows.clone());
    let scores = scores_sel(cfg, f, &q_abs, rows.clone(), sel);
    let latent = f.latent.slice(s![..rows.end, ..]);
    let per_head: Vec<(Vec<f64>, Array2<f64>)> = (0..h)
        .into_par_iter()
        .map(|hh| {
            let mut p = scores.slice(s![hh, .., ..]).to_owned();
            let mut lse = vec![0.0; n];
            for (i, mut row) in p.rows_mut().into_iter().enumerate() {
                let row = row.as_slice_mut().expect("contiguous");
                let t = rows.start + i;
                lse[i] = softmax_in_place(&mut row[..=t]);
                row[t + 1..].fill(0.0);
            }
            (lse, p.dot(&latent))
        })
        .collect();
    let mut lse = Array2::zeros((n, h));
    let mut latent_out = Array3::zeros((n, h, lkv));
    for (hh, (l, o)) in per_head.into_iter().enumerate() {
        lse.column_mut(hh).assign(&ndarray::ArrayView1::from(&l));
        latent_out.slice_mut(s![.., hh, ..]).assign(&o);
    }
    LatentAttention {
        q_abs,
        scores,
        lse,
        latent_out,
    }
}

/// Reference B for the query tokens `rows`: latent attention, then `W_UV[h]` and o_proj.
pub fn attention(
    cfg: &MlaConfig,
    w: &LayerWeights,
    f: &Front,
    rows: Range<usize>,
) -> (LatentAttention, AttnOutput) {
    let la = latent_attention(cfg, w, f, rows);
    let (n, h, _) = la.latent_out.dim();
    let mut heads = Array3::zeros((n, h, cfg.v_head_dim));
    for hh in 0..h {
        heads.slice_mut(s![.., hh, ..]).assign(&linear(
            la.latent_out.slice(s![.., hh, ..]),
            w.w_uv.slice(s![hh, .., ..]),
        ));
    }
    let out = o_proj(w, &heads);
    let lse = la.lse.clone();
    (la, AttnOutput { lse, heads, out })
}

/// The key count a decode token attends over: the end of its decode step.
pub fn step_seq_len(sched: &Schedule, t: usize) -> usize {
    let step = (t - sched.prompt_len) / sched.q_len;
    sched.prompt_len + (step + 1) * sched.q_len
}

/// Exact split-KV partials for the decode tokens `rows`: each split of `Schedule::split_ranges(seq_len)`
/// restricted to the keys its query sees, softmax over those keys alone. Returns
/// (`out [n, H, S, Lkv]`, `lse [n, H, S]`); a split without a visible key has out 0 and lse −inf.
pub fn split_partials(
    scores: &Array3<f64>,
    latent: &Array2<f64>,
    rows: Range<usize>,
    sched: &Schedule,
) -> (Array4<f64>, Array3<f64>) {
    let (h, n, _) = scores.dim();
    let (ns, lkv) = (sched.num_splits, latent.ncols());
    let mut out = Array4::zeros((n, h, ns, lkv));
    let mut lse = Array3::from_elem((n, h, ns), f64::NEG_INFINITY);
    for i in 0..n {
        let t = rows.start + i;
        let splits = sched.split_ranges(step_seq_len(sched, t));
        for (k, r) in splits.into_iter().enumerate() {
            let r = r.start..r.end.min(t + 1);
            if r.is_empty() {
                continue;
            }
            // All heads at once: [H, keys] probabilities times [keys, Lkv] latent rows.
            let mut p = scores.slice(s![.., i, r.clone()]).to_owned();
            for (hh, mut row) in p.rows_mut().into_iter().enumerate() {
                lse[[i, hh, k]] = softmax_in_place(row.as_slice_mut().expect("contiguous"));
            }
            out.slice_mut(s![i, .., k, ..])
                .assign(&p.dot(&latent.slice(s![r, ..])));
        }
    }
    (out, lse)
}
