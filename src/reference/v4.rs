//! The fp64 reference of one DeepSeek-V4 attention layer (docs/deepseek-v4.md, "The math, in stages"),
//! run from the GGUF's weights over a whole sequence at positions `0..T`.
//!
//! Each query's output depends only on the tokens up to it, so the reference computes the sequence in
//! one pass: a serving engine's prefill, its chunks and its decode steps (which carry the compressors'
//! buffers and CSA's Ca half across forward passes) must all give its rows. The golden
//! (`fixtures/golden/deepseek-v4.*`, transformers over two forward passes on one cache) holds it to
//! transformers to 1e-6 rel-L2 on both passes.
//!
//! Eps convention: one `layer_norm_rms_epsilon` for every RMSNorm (attn_norm, q_a_norm, the per-head
//! unweighted q norm, kv_norm, the compressors' norms): transformers' V4 builds every one of them with
//! `config.rms_norm_eps` and llama.cpp reads the one key, so they agree (unlike V2/V3's inner norms).

use crate::linalg::mat_mul_t;
use crate::model::v4::{CompressorWeights, LayerKind, V4Config, V4Rope, V4Weights};
use crate::trace::V4Stage;
use ndarray::{s, Array2, Array3, ArrayView2};

/// One layer's stages, in dataflow order (`V4Stage`).
#[derive(Debug, Clone)]
pub struct V4Layer {
    /// `[T, E]` after attn_norm.
    pub attn_in: Array2<f64>,
    /// `[T, q_lora]` after q_a_norm (transformers' `q_residual`).
    pub q_a: Array2<f64>,
    /// `[T, H, D]`: per head, the unweighted RMSNorm, then rope on the trailing R.
    pub q: Array3<f64>,
    /// `[T, D]`: kv_norm, then rope: each token's cache row (K = V).
    pub cache_rows: Array2<f64>,
    /// `[entries, D]`: the compressed entries of the closed windows (CSA/HCA), roped at `w·ratio`.
    pub compressed: Option<Array2<f64>>,
    /// `[T, entries]` (CSA): the indexer's scores, −inf where the entry is not yet closed for the query.
    pub index_scores: Option<Array2<f64>>,
    /// `[T, top_k]` (CSA): the selected entries, best first; −1 where fewer are valid.
    pub topk_indices: Option<Array2<i64>>,
    /// `[T, H, D]`: softmax over window rows, entries and the sink, times V = K.
    pub attn_heads: Array3<f64>,
    /// `[T, H]`: natural-log sum of exp of the scaled scores, the sink included.
    pub lse: Array2<f64>,
    /// `[T, H, D]`: attn_heads with the trailing R rotated back by −p.
    pub attn_derot: Array3<f64>,
    /// `[T, E]`: the grouped output projection.
    pub attn_out: Array2<f64>,
}

impl V4Layer {
    /// Each stage as `(stage, shape, values)`; indices as f64.
    pub fn stages(&self) -> Vec<(V4Stage, Vec<usize>, Vec<f64>)> {
        let two =
            |s: V4Stage, a: &Array2<f64>| (s, a.shape().to_vec(), a.iter().copied().collect());
        let three =
            |s: V4Stage, a: &Array3<f64>| (s, a.shape().to_vec(), a.iter().copied().collect());
        let mut v = vec![
            two(V4Stage::AttnIn, &self.attn_in),
            two(V4Stage::QA, &self.q_a),
            three(V4Stage::Q, &self.q),
            two(V4Stage::CacheRows, &self.cache_rows),
        ];
        if let Some(c) = &self.compressed {
            v.push(two(V4Stage::Compressed, c));
        }
        if let Some(c) = &self.index_scores {
            v.push(two(V4Stage::IndexScores, c));
        }
        if let Some(k) = &self.topk_indices {
            v.push((
                V4Stage::TopkIndices,
                k.shape().to_vec(),
                k.iter().map(|&i| i as f64).collect(),
            ));
        }
        v.extend([
            three(V4Stage::AttnHeads, &self.attn_heads),
            two(V4Stage::Lse, &self.lse),
            three(V4Stage::AttnDerot, &self.attn_derot),
            two(V4Stage::AttnOut, &self.attn_out),
        ]);
        v
    }
}

/// `x / sqrt(mean(x²) + eps) · w` (no weight: `w` = None), in place on one row.
fn rms_row(row: &mut [f64], w: Option<&[f64]>, eps: f64) {
    let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    match w {
        Some(w) => row.iter_mut().zip(w).for_each(|(v, g)| *v *= r * g),
        None => row.iter_mut().for_each(|v| *v *= r),
    }
}

fn rms_rows(mut x: Array2<f64>, w: &[f64], eps: f64) -> Array2<f64> {
    for mut row in x.rows_mut() {
        rms_row(row.as_slice_mut().expect("standard layout"), Some(w), eps);
    }
    x
}

/// The rope's angles: `[pos][pair]`.
struct Angles {
    rope: crate::model::RopeConfig,
}

impl Angles {
    fn new(c: &V4Config, which: V4Rope) -> Angles {
        Angles {
            rope: c.rope_config(which),
        }
    }
    /// Rotate the trailing `rope.dim` of `x` by the angles at `pos` (`sign` −1: back), pairs (2i, 2i+1).
    fn rotate(&self, x: &mut [f64], pos: usize, sign: f64) {
        let r = self.rope.dim;
        let off = x.len() - r;
        for i in 0..r / 2 {
            let th = crate::rope::theta(&self.rope, None, pos as f64, i);
            let (c, s) = (th.cos(), sign * th.sin());
            let (a, b) = (x[off + 2 * i], x[off + 2 * i + 1]);
            x[off + 2 * i] = a * c - b * s;
            x[off + 2 * i + 1] = b * c + a * s;
        }
    }
}

/// The compressed entries of every closed window of `ratio` tokens over `attn_in` (`[T, E]`), at width
/// `d`: per window and dim, a softmax over its slots of gate + ape, the kv pooled with it, normed, roped
/// at the window's first position. CSA (ratio 4, `coff` 2) pools window w−1's Ca (first `d` of the
/// projection) with window w's Cb (last `d`) over 2·ratio slots; window 0 has no Ca (weight 0).
fn compress(
    attn_in: ArrayView2<f64>,
    w: &CompressorWeights,
    kind: LayerKind,
    d: usize,
    eps: f64,
    rope: &Angles,
) -> Array2<f64> {
    let m = kind.ratio();
    let n = attn_in.nrows() / m;
    let kv = mat_mul_t(attn_in, w.kv.view());
    let gate = mat_mul_t(attn_in, w.gate.view());
    let mut out = Array2::<f64>::zeros((n, d));
    for win in 0..n {
        let mut row = vec![0.0; d];
        for (dim, o) in row.iter_mut().enumerate() {
            // (score, value) per slot: Ca of the previous window (CSA), then this window's own.
            let mut slots: Vec<(f64, f64)> = Vec::with_capacity(2 * m);
            if kind == LayerKind::Csa && win > 0 {
                for j in 0..m {
                    let t = (win - 1) * m + j;
                    slots.push((gate[[t, dim]] + w.ape[[j, dim]], kv[[t, dim]]));
                }
            }
            let half = if kind == LayerKind::Csa { d } else { 0 };
            for j in 0..m {
                let t = win * m + j;
                slots.push((
                    gate[[t, half + dim]] + w.ape[[j, half + dim]],
                    kv[[t, half + dim]],
                ));
            }
            let mx = slots.iter().map(|s| s.0).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = slots.iter().map(|s| (s.0 - mx).exp()).sum();
            *o = slots.iter().map(|s| (s.0 - mx).exp() / z * s.1).sum();
        }
        rms_row(&mut row, Some(&w.norm), eps);
        rope.rotate(&mut row, win * m, 1.0);
        out.row_mut(win).assign(&ndarray::ArrayView1::from(&row));
    }
    out
}

/// The CSA indexer: scores `Σ_h w_{t,h}/√Hi · ReLU(q_{t,h}·C_w)/√Di` of each closed entry, −inf past
/// the causal threshold `(p+1)/4`, and the top_k (−1 where fewer are valid).
fn indexer(
    c: &V4Config,
    w: &V4Weights,
    attn_in: ArrayView2<f64>,
    q_a: ArrayView2<f64>,
    rope: &Angles,
) -> (Array2<f64>, Array2<i64>) {
    let (comp, q_b, proj) = w.indexer.as_ref().expect("a CSA layer has its indexer");
    let (hi, di) = (c.indexer.n_head, c.indexer.head_dim);
    let keys = compress(attn_in, comp, LayerKind::Csa, di, c.rms_eps, rope);
    let mut q = mat_mul_t(q_a, q_b.view());
    let wts = mat_mul_t(attn_in, proj.view());
    let t_len = attn_in.nrows();
    let n = keys.nrows();
    let mut scores = Array2::<f64>::from_elem((t_len, n), f64::NEG_INFINITY);
    let k = c.indexer.top_k.min(n);
    let mut top = Array2::<i64>::from_elem((t_len, k), -1);
    for t in 0..t_len {
        let mut qt = q.row_mut(t);
        let qt = qt.as_slice_mut().expect("standard layout");
        for h in 0..hi {
            rope.rotate(&mut qt[h * di..(h + 1) * di], t, 1.0);
        }
        let valid = ((t + 1) / 4).min(n);
        for e in 0..valid {
            let kr = keys.row(e);
            scores[[t, e]] = (0..hi)
                .map(|h| {
                    let dot: f64 = (0..di).map(|x| qt[h * di + x] * kr[x]).sum();
                    wts[[t, h]] / (hi as f64).sqrt() * dot.max(0.0) / (di as f64).sqrt()
                })
                .sum();
        }
        let mut order: Vec<usize> = (0..valid).collect();
        order.sort_by(|&a, &b| scores[[t, b]].total_cmp(&scores[[t, a]]).then(a.cmp(&b)));
        for (slot, &e) in order.iter().take(k).enumerate() {
            top[[t, slot]] = e as i64;
        }
    }
    (scores, top)
}

/// Run layer `layer` on `x` (`[T, E]`, positions `0..T`).
pub fn run_layer(c: &V4Config, w: &V4Weights, layer: usize, x: ArrayView2<f64>) -> V4Layer {
    run_layer_selecting(c, w, layer, x, None)
}

/// As `run_layer`; on a CSA layer, attend to `selection` (`[T, k]`, −1: none) instead of the
/// reference's own top-k. Entries whose indexer scores tie exactly (ReLU zeros) make the top-k set
/// implementation-defined (the reference takes the lower index; torch's `topk` and ggml's argsort
/// another): an engine's own selection is then judged through it.
pub fn run_layer_selecting(
    c: &V4Config,
    w: &V4Weights,
    layer: usize,
    x: ArrayView2<f64>,
    selection: Option<&Array2<i64>>,
) -> V4Layer {
    let kind = c.kind(layer);
    let (t_len, h, d) = (x.nrows(), c.n_head, c.head_dim);
    let eps = c.rms_eps;
    let rope = Angles::new(c, c.rope_of(kind));
    let compress_rope = Angles::new(c, V4Rope::Compress);
    let attn_in = rms_rows(x.to_owned(), &w.attn_norm, eps);
    let q_a = rms_rows(mat_mul_t(attn_in.view(), w.q_a.view()), &w.q_a_norm, eps);
    let mut q = mat_mul_t(q_a.view(), w.q_b.view())
        .into_shape_with_order((t_len, h, d))
        .expect("H·D");
    let mut cache_rows = rms_rows(mat_mul_t(attn_in.view(), w.kv.view()), &w.kv_norm, eps);
    for t in 0..t_len {
        for hh in 0..h {
            let mut row = q.slice_mut(s![t, hh, ..]);
            let row = row.as_slice_mut().expect("standard layout");
            rms_row(row, None, eps);
            rope.rotate(row, t, 1.0);
        }
        rope.rotate(cache_rows.row_mut(t).as_slice_mut().unwrap(), t, 1.0);
    }
    let compressed = w
        .compressor
        .as_ref()
        .map(|cw| compress(attn_in.view(), cw, kind, d, eps, &compress_rope));
    let (index_scores, topk_indices) = match kind {
        LayerKind::Csa => {
            let (s, k) = indexer(c, w, attn_in.view(), q_a.view(), &compress_rope);
            (Some(s), Some(k))
        }
        _ => (None, None),
    };
    let (attn_heads, lse) = attend(
        c,
        w,
        kind,
        &q,
        &cache_rows,
        compressed.as_ref(),
        selection.or(topk_indices.as_ref()),
    );
    let mut attn_derot = attn_heads.clone();
    for t in 0..t_len {
        for hh in 0..h {
            let mut row = attn_derot.slice_mut(s![t, hh, ..]);
            rope.rotate(row.as_slice_mut().unwrap(), t, -1.0);
        }
    }
    let attn_out = grouped_output(c, w, &attn_derot);
    V4Layer {
        attn_in,
        q_a,
        q,
        cache_rows,
        compressed,
        index_scores,
        topk_indices,
        attn_heads,
        lse,
        attn_derot,
        attn_out,
    }
}

/// Softmax over [window rows ∪ entries ∪ the sink] of q·k/√D, times V = K (the sink has no value).
fn attend(
    c: &V4Config,
    w: &V4Weights,
    kind: LayerKind,
    q: &Array3<f64>,
    rows: &Array2<f64>,
    entries: Option<&Array2<f64>>,
    topk: Option<&Array2<i64>>,
) -> (Array3<f64>, Array2<f64>) {
    let (t_len, h, d) = q.dim();
    let scale = c.softmax_scale;
    let mut out = Array3::<f64>::zeros((t_len, h, d));
    let mut lse = Array2::<f64>::zeros((t_len, h));
    for t in 0..t_len {
        let first = (t + 1).saturating_sub(c.sliding_window);
        let mut keys: Vec<ndarray::ArrayView1<f64>> = (first..=t).map(|s| rows.row(s)).collect();
        if let Some(e) = entries {
            match kind {
                LayerKind::Hca => {
                    keys.extend((0..((t + 1) / 128).min(e.nrows())).map(|i| e.row(i)))
                }
                LayerKind::Csa => {
                    let sel = topk.expect("CSA selects").row(t);
                    keys.extend(sel.iter().filter(|&&i| i >= 0).map(|&i| e.row(i as usize)));
                }
                LayerKind::Window => {}
            }
        }
        for hh in 0..h {
            let qh = q.slice(s![t, hh, ..]);
            let logits: Vec<f64> = keys.iter().map(|k| qh.dot(k) * scale).collect();
            let sink = w.sinks[hh];
            let mx = logits.iter().copied().fold(sink, f64::max);
            let z = logits.iter().map(|l| (l - mx).exp()).sum::<f64>() + (sink - mx).exp();
            let mut o = out.slice_mut(s![t, hh, ..]);
            for (k, l) in keys.iter().zip(&logits) {
                o.scaled_add((l - mx).exp() / z, k);
            }
            lse[[t, hh]] = mx + z.ln();
        }
    }
    (out, lse)
}

/// `W_ob · concat_g(W_oa,g · heads of group g)`.
fn grouped_output(c: &V4Config, w: &V4Weights, heads: &Array3<f64>) -> Array2<f64> {
    let (t_len, h, d) = heads.dim();
    let g = c.o_groups;
    let per = h / g * d;
    let flat = heads
        .to_owned()
        .into_shape_with_order((t_len, h * d))
        .expect("contiguous");
    let mut mid = Array2::<f64>::zeros((t_len, g * c.o_lora_rank));
    for gi in 0..g {
        let wg = w
            .o_a
            .slice(s![gi * c.o_lora_rank..(gi + 1) * c.o_lora_rank, ..]);
        let xg = flat.slice(s![.., gi * per..(gi + 1) * per]);
        mid.slice_mut(s![.., gi * c.o_lora_rank..(gi + 1) * c.o_lora_rank])
            .assign(&mat_mul_t(xg, wg));
    }
    mat_mul_t(mid.view(), w.o_b.view())
}
