//! The DSA lightning indexer in f64, as transformers' `GlmMoeDsaIndexer` computes it (DeepSeek-V3.2's
//! differs only in its rope pairing):
//!
//! - `q = W_q_b · q_lora_latent` (the normed q-LoRA latent the MLA query starts from), per head
//!   `[rope(R) | nope(Di−R)]` — rope first, unlike the MLA heads — and the rope part rotated;
//! - `k = LayerNorm(W_k · attn_in) · k_norm + k_norm_bias` (eps 1e-6), one key per token, rope part
//!   rotated the same way;
//! - `w = W_proj · attn_in · Hi^-0.5`;
//! - `score[t, j] = Σ_h w[t, h] · ReLU(q[t, h] · k[j] · Di^-0.5)` for `j ≤ t`, −inf after (causal);
//! - the selection: the top `min(top_k, t+1)` keys of each row (ties to the lower key).
//!
//! Rope uses the run's tables (same angles and YaRN magnitude as the MLA rope; transformers and llama.cpp
//! share them) with the indexer's own pairing: interleaved for GLM-5, NeoX for DeepSeek-V3.2. The
//! Hadamard rotation and fp8 keys engines use are precision, not semantics: they belong to the optimized
//! path (`backend::cpu::indexer`), not here.

use super::front::{linear, rms_norm};
use super::sparse::Selection;
use crate::model::{IndexerConfig, IndexerWeights, LayerWeights, MlaConfig, QProj, RopePairing};
use crate::rope::RopeTables;
use ndarray::{s, Array1, Array2, Array3, ArrayView2, Axis};

/// Deliberate misreadings of the indexer (the golden test shows each moves the output; the CPU mirror's
/// indexer faults plant the same ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reading {
    /// Rope pairing other than the architecture's (GLM interleaved ↔ DeepSeek NeoX).
    pub swap_rope: bool,
    /// The per-head weights without `Hi^-0.5` (the index scores scale, the order does not — unless ReLU
    /// is also dropped; kept to show the selection is blind to it, see docs/dsa.md).
    pub no_weight_scale: bool,
    /// No ReLU on the per-head logits.
    pub no_relu: bool,
    /// top_k one too small.
    pub top_k_minus_one: bool,
    /// No causal mask before the top-k (future keys compete; the attention mask then drops them).
    pub non_causal: bool,
    /// Rope on the last R dims of each head (the MLA's `[nope | rope]` order) instead of the first R.
    pub rope_last: bool,
}

/// The indexer's intermediate tensors and result for one layer.
#[derive(Debug, Clone)]
pub struct IndexerOut {
    /// `[T, Hi, Di]`, roped.
    pub q: Array3<f64>,
    /// `[T, Di]`, normed and roped.
    pub k: Array2<f64>,
    /// `[T, Di]`: LayerNorm's input `W_k · attn_in`, and its gain `k_norm_i / sqrt(var + eps)` per
    /// element: an error of the input reaches k times that gain (the noise model of the selection
    /// check needs it: the centring cancels, so the input's rounding is not relative to k).
    pub k_lin: Array2<f64>,
    pub k_gain: Array2<f64>,
    /// `[T, Hi]`, scaled.
    pub weights: Array2<f64>,
    /// `[T, Hi]`: Σ_m (W_proj[h, m]·attn_in[t, m])², scaled alike: what an error of attn_in's
    /// elements moves each weight by (the selection check's noise model).
    pub weights_sq: Array2<f64>,
    /// The input widths of the linears before q and k: the hidden size E and the q-LoRA rank (the
    /// noise model's f32 sums over them).
    pub in_dims: (usize, usize),
    /// `[T, T]` over all keys; only `j ≤ t` is visible (`select` cuts the rest).
    pub scores: Array2<f64>,
    pub selection: Selection,
}

/// `y = (x − mean) / sqrt(var + eps) · w + b` per row (population variance, as torch's LayerNorm).
pub fn layer_norm(x: ArrayView2<f64>, w: &Array1<f32>, b: &Array1<f32>, eps: f64) -> Array2<f64> {
    let mut y = x.to_owned();
    for mut row in y.rows_mut() {
        let n = row.len() as f64;
        let mean = row.sum() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let r = 1.0 / (var + eps).sqrt();
        for ((v, &g), &bb) in row.iter_mut().zip(w.iter()).zip(b.iter()) {
            *v = (*v - mean) * r * g as f64 + bb as f64;
        }
    }
    y
}

/// The rope tables with the indexer's pairing (the angles and magnitude are the model's).
pub fn indexer_rope(rope: &RopeTables, pairing: RopePairing) -> RopeTables {
    let mut r = rope.clone();
    r.pairing = pairing;
    r
}

fn other(p: RopePairing) -> RopePairing {
    match p {
        RopePairing::Norm => RopePairing::Neox,
        RopePairing::Neox => RopePairing::Norm,
    }
}

/// The top `n` keys of a score row over `0..end` (descending score, ties to the lower key); NaN scores
/// rank last, so a NaN row still selects `n` keys (its attention output then shows the NaN upstream).
pub fn top_keys(row: &[f64], end: usize, n: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..end as u32).collect();
    let key = |j: &u32| {
        let v = row[*j as usize];
        if v.is_nan() {
            f64::NEG_INFINITY
        } else {
            v
        }
    };
    idx.sort_by(|a, b| key(b).total_cmp(&key(a)).then(a.cmp(b)));
    idx.truncate(n);
    idx
}

/// The selection of every query from a `[T, T]` score matrix: `min(top_k, t+1)` of the keys `0..=t`
/// (a non-causal reading ranks all `T` keys and then keeps the visible ones).
pub fn select(scores: &Array2<f64>, top_k: usize, r: Reading) -> Selection {
    let t = scores.nrows();
    let k = if r.top_k_minus_one {
        top_k.saturating_sub(1)
    } else {
        top_k
    };
    let keys = (0..t)
        .map(|q| {
            let row = scores.row(q);
            let row = row.as_slice().expect("contiguous");
            if r.non_causal {
                let mut ks = top_keys(row, t, k.min(t));
                ks.retain(|&j| j as usize <= q);
                ks
            } else {
                top_keys(row, q + 1, k.min(q + 1))
            }
        })
        .collect();
    Selection::new(top_k, keys)
}

/// The indexer of one layer on `attn_in [T, E]` (the MLA's normed input).
pub fn run(
    cfg: &MlaConfig,
    ic: &IndexerConfig,
    iw: &IndexerWeights,
    w: &LayerWeights,
    rope: &RopeTables,
    attn_in: ArrayView2<f64>,
    r: Reading,
) -> IndexerOut {
    let (hi, di, rd) = (ic.heads, ic.head_dim, ic.rope_dim);
    let Heads {
        mut q,
        mut k,
        k_lin,
        k_gain,
        w_lin,
        w_sq,
        in_dims,
    } = heads(cfg, ic, iw, w, attn_in);
    let pairing = if r.swap_rope { other(ic.rope) } else { ic.rope };
    let tables = indexer_rope(rope, pairing);
    let rope_at = if r.rope_last { di - rd..di } else { 0..rd };
    for (tt, mut tok) in q.axis_iter_mut(Axis(0)).enumerate() {
        for mut head in tok.axis_iter_mut(Axis(0)) {
            let mut pe = head.slice_mut(s![rope_at.clone()]).to_owned();
            tables.rotate(tt, pe.as_slice_mut().expect("contiguous"));
            head.slice_mut(s![rope_at.clone()]).assign(&pe);
        }
    }
    for (tt, mut row) in k.axis_iter_mut(Axis(0)).enumerate() {
        let mut pe = row.slice(s![rope_at.clone()]).to_owned();
        tables.rotate(tt, pe.as_slice_mut().expect("contiguous"));
        row.slice_mut(s![rope_at.clone()]).assign(&pe);
    }
    let w_scale = if r.no_weight_scale {
        1.0
    } else {
        (hi as f64).powf(-0.5)
    };
    let weights = w_lin * w_scale;
    let weights_sq = w_sq * (w_scale * w_scale);
    let scores = index_scores(&q, &k, &weights, r.no_relu);
    let selection = select(&scores, ic.top_k, r);
    IndexerOut {
        q,
        k,
        k_lin,
        k_gain,
        weights_sq,
        in_dims,
        weights,
        scores,
        selection,
    }
}

/// An indexer's projections of one layer before rope and scoring (DSA's token indexer and glm5-next's
/// k-pool one share them): per head `q = W_q_b · q_lora_latent` `[T, Hi, Di]`, the keys
/// `k = LayerNorm(W_k · attn_in)` with LayerNorm's input `k_lin` and gain, the head weights
/// `w_lin = attn_in · W_projᵀ` unscaled and their squares `w_sq` (`squares`), and the input widths of
/// the linears before q and k (E, q-LoRA rank).
pub struct Heads {
    pub q: Array3<f64>,
    pub k: Array2<f64>,
    pub k_lin: Array2<f64>,
    pub k_gain: Array2<f64>,
    pub w_lin: Array2<f64>,
    pub w_sq: Array2<f64>,
    pub in_dims: (usize, usize),
}

/// [`Heads`] of one layer on `attn_in [T, E]`.
pub fn heads(
    cfg: &MlaConfig,
    ic: &IndexerConfig,
    iw: &IndexerWeights,
    w: &LayerWeights,
    attn_in: ArrayView2<f64>,
) -> Heads {
    let (t, hi, di) = (attn_in.nrows(), ic.heads, ic.head_dim);
    let qr = match &w.q {
        QProj::Lora { a, a_norm, .. } => {
            rms_norm(linear(attn_in, a.view()).view(), a_norm, cfg.lora_norm_eps)
        }
        // IndexerConfig refuses a DSA file without q-LoRA.
        QProj::Plain { .. } => unreachable!("a DSA indexer needs q-LoRA"),
    };
    let q = linear(qr.view(), iw.q_b.view())
        .into_shape_with_order((t, hi, di))
        .expect("[T, Hi·Di]");
    let k_lin = linear(attn_in, iw.k.view());
    let k = layer_norm(
        k_lin.view(),
        &iw.k_norm,
        &iw.k_norm_bias,
        crate::model::indexer::K_NORM_EPS,
    );
    Heads {
        q,
        k,
        k_gain: k_gain(&k_lin, &iw.k_norm),
        k_lin,
        w_lin: linear(attn_in, iw.proj.view()),
        w_sq: squares(attn_in, &iw.proj),
        in_dims: (attn_in.ncols(), qr.ncols()),
    }
}

/// LayerNorm's gain per element, `k_norm_i / sqrt(var + eps)` of each row of its input `k_lin`: what
/// an error of the input is multiplied by (the selection check's noise model).
pub fn k_gain(k_lin: &Array2<f64>, k_norm: &Array1<f32>) -> Array2<f64> {
    Array2::from_shape_fn(k_lin.dim(), |(tt, i)| {
        let row = k_lin.row(tt);
        let n = row.len() as f64;
        let mean = row.sum() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        k_norm[i] as f64 / (var + crate::model::indexer::K_NORM_EPS).sqrt()
    })
}

/// `Σ_m (W[o, m]·x[t, m])²` per output `[T, O]`: what relative errors of `x`'s elements move each
/// output of `x · Wᵀ` by, in variance (the selection check's noise model).
pub fn squares(x: ArrayView2<f64>, w: &Array2<f32>) -> Array2<f64> {
    linear(x.mapv(|a| a * a).view(), w.mapv(|p| p * p).view())
}

/// `score[t, j] = Σ_h w[t, h] · ReLU(q[t, h] · k[j] · Di^-0.5)` over all keys: `select` applies the
/// causal cut (a non-causal reading ranks the full row).
pub fn index_scores(
    q: &Array3<f64>,
    k: &Array2<f64>,
    w: &Array2<f64>,
    no_relu: bool,
) -> Array2<f64> {
    let (t, hi, di) = q.dim();
    let sc = (di as f64).powf(-0.5);
    let mut out = Array2::zeros((t, t));
    for tt in 0..t {
        // [Hi, Di] · [Di, T]: every head's logits over all keys at once.
        let per_head = q.slice(s![tt, .., ..]).dot(&k.t());
        for j in 0..t {
            let mut acc = 0.0;
            for h in 0..hi {
                let l = per_head[[h, j]] * sc;
                acc += w[[tt, h]] * if no_relu { l } else { l.max(0.0) };
            }
            out[[tt, j]] = acc;
        }
    }
    out
}
