//! The CPU mirror of DeepSeek-V4 attention (docs/deepseek-v4.md): what an engine computes, at its
//! precision, one forward pass at a time; the specification a V4 kernel path is held to, beside the
//! MLA mirror (`backend::cpu`), in the stages of `trace::V4Stage`.
//!
//! Precision as the MLA mirror's (`ops`): weights and activations stored in the dtype, products
//! accumulated in f32, `round` wherever an engine writes a tensor to memory:
//! - row-wise (every token alike): `attn_in = round(RMSNorm(round(x))·w)`; `q_a = round(RMSNorm(
//!   round(attn_in·W_qaᵀ))·w)`; `q = round(q_a·W_qbᵀ)`, per head `round(RMSNorm(q_h))` (no weight) then
//!   `round(rope)` on the trailing R (interleaved pairs, f32 cos/sin of the f64 angles); the cache row
//!   `round(rope(round(RMSNorm(round(attn_in·W_kvᵀ))·w)))`: the window cache holds these (K = V);
//! - the compressors (`compress.rs`): `round(attn_in·W_kvᵀ)`, `round(attn_in·W_gateᵀ)` of each token
//!   (the carried state between passes), pooled per dim by an f32 softmax when a window closes, then
//!   `round(RMSNorm)`, `round(rope)` at the window's first position: the compressed cache (dtype);
//! - the CSA indexer: its own compressor at Di, `q_i = round(rope(round(q_a·W_iqbᵀ)))`, head weights
//!   `round(attn_in·W_projᵀ)`, score `round(Σ_h w_h/√Hi · ReLU(q_h·k)/√Di)` (f32 sum) of each entry closed
//!   at or before the query, the top_k by score (ties: the lower entry), −1 where fewer;
//! - attention per query and head over [window rows ∪ entries (CSA: selected; HCA: every closed one)]
//!   and the sink: `s = (q·k)·scale` in f32, `m = max(s, sink)`, `l = Σexp(s−m) + exp(sink−m)`,
//!   `acc = Σ round(exp(s−m))·v`, `attn_heads = round(acc/l)`, `lse = m + ln l`;
//! - `attn_derot = round(rope⁻¹(attn_heads))` on the trailing R; per group `round(heads_g·W_oa,gᵀ)`,
//!   `attn_out = round(mid·W_obᵀ)`.
//!
//! Forward passes (`passes`: consecutive token ranges, a prompt's chunks then decode steps) matter to
//! the compressors alone: each pass feeds its tokens, closes the windows they complete and carries the
//! rest; a query sees the entries closed at or before it. With the state carried, any split of the
//! sequence into passes gives the same bits (`tests`).
//!
//! Planted bugs (`crate::faults`, V4's): `window_off_by_one` (`window_start`), `sink_dropped`
//! (`attend_one`), `compress_group_off_by_one` and `compressor_state_dropped` (`compress.rs`).

mod compress;

use super::ops;
use crate::faults::{Active, Fault};
use crate::model::v4::{LayerKind, V4Config, V4Rope, V4Weights};
use crate::precision::Dtype;
use crate::reference::v4::V4Layer;
use compress::Compressor;
use ndarray::{s, Array1, Array2, Array3, ArrayView2};
use std::ops::Range;

/// f64 weights (read from f32 or narrower) as f32, exactly.
fn to32(a: &Array2<f64>) -> Array2<f32> {
    a.mapv(|v| v as f32)
}

fn to64<D: ndarray::Dimension>(a: &ndarray::Array<f32, D>) -> ndarray::Array<f64, D> {
    a.mapv(|v| v as f64)
}

/// A rope's f32 cos/sin of its f64 angles, per position and pair.
pub struct Rope32 {
    dim: usize,
    cos: Array2<f32>,
    sin: Array2<f32>,
}

impl Rope32 {
    /// `which` rope's tables for positions `0..positions`.
    pub fn new(c: &V4Config, which: V4Rope, positions: usize) -> Rope32 {
        let rope = c.rope_config(which);
        let half = rope.dim / 2;
        let th = Array2::from_shape_fn((positions, half), |(p, i)| {
            crate::rope::theta(&rope, None, p as f64, i)
        });
        Rope32 {
            dim: rope.dim,
            cos: th.mapv(|t| t.cos() as f32),
            sin: th.mapv(|t| t.sin() as f32),
        }
    }
    /// The f32 cos and sin `[position, dim / 2]` (what the CUDA path uploads).
    pub fn tables(&self) -> (&Array2<f32>, &Array2<f32>) {
        (&self.cos, &self.sin)
    }
}

/// `round(rope)` of the trailing `dim` of `x` at `pos` (`sign` −1: rotate back).
fn rope_row(x: &mut [f32], r: &Rope32, pos: usize, sign: f32, dt: Dtype) {
    let off = x.len() - r.dim;
    let cos = r.cos.row(pos);
    let sin: Vec<f32> = r.sin.row(pos).iter().map(|&v| sign * v).collect();
    ops::rope(
        &mut x[off..],
        cos.as_slice().expect("row"),
        &sin,
        crate::model::RopePairing::Norm,
        dt,
    );
}

/// The V4 mirror of one dtype.
#[derive(Debug, Clone, Copy)]
pub struct V4Mirror {
    pub dtype: Dtype,
}

/// The row-wise stages of every token.
struct Front {
    attn_in: Array2<f32>,
    q_a: Array2<f32>,
    q: Array3<f32>,
    rows: Array2<f32>,
}

impl V4Mirror {
    pub fn new(dtype: Dtype) -> V4Mirror {
        V4Mirror { dtype }
    }

    /// Layer `layer` on `x` (`[T, E]`, positions `0..T`) over the forward passes `passes` (they tile
    /// `0..T` in order), with the faults `faults`: its stages in the reference's layout.
    pub fn run_layer(
        &self,
        c: &V4Config,
        w: &V4Weights,
        layer: usize,
        x: ArrayView2<f64>,
        passes: &[Range<usize>],
        faults: Active,
    ) -> V4Layer {
        let (dt, kind, t_len) = (self.dtype, c.kind(layer), x.nrows());
        let rope = Rope32::new(c, c.rope_of(kind), t_len);
        let crope = Rope32::new(c, V4Rope::Compress, t_len);
        let f = self.front(c, w, x, &rope);
        let mut comp = w.compressor.as_ref().map(|cw| {
            Compressor::new(
                cw,
                kind,
                c.head_dim,
                f.attn_in.view(),
                c.rms_eps,
                dt,
                faults,
            )
        });
        let mut ix = (kind == LayerKind::Csa).then(|| Indexer::new(c, w, &f, &crope, dt, faults));
        let n_ref = match kind {
            LayerKind::Window => 0,
            k => t_len / k.ratio(),
        };
        let k_ref = c.indexer.top_k.min(n_ref);
        let mut topk = Array2::<i64>::from_elem((t_len, k_ref), -1);
        let mut scores = Array2::<f64>::from_elem((t_len, n_ref), f64::NEG_INFINITY);
        let (h, d) = (c.n_head, c.head_dim);
        let mut heads = Array3::<f32>::zeros((t_len, h, d));
        let mut lse = Array2::<f32>::zeros((t_len, h));
        let sinks: Vec<f32> = w.sinks.iter().map(|&v| v as f32).collect();
        for pass in passes {
            for cm in comp.iter_mut() {
                cm.begin_pass();
                cm.feed(pass.clone(), &crope);
            }
            if let Some(ix) = ix.as_mut() {
                ix.comp.begin_pass();
                ix.comp.feed(pass.clone(), &crope);
            }
            for t in pass.clone() {
                let mut keys: Vec<&[f32]> = (window_start(c, t, faults)..=t)
                    .map(|s| f.rows.row(s).to_slice().expect("row"))
                    .collect();
                if let (Some(ix), Some(cm)) = (ix.as_ref(), comp.as_ref()) {
                    let (sc, sel) = ix.select(t, c.indexer.top_k);
                    for (e, v) in sc.iter().enumerate().take(n_ref) {
                        scores[[t, e]] = *v as f64;
                    }
                    for (slot, &e) in sel.iter().enumerate().take(k_ref) {
                        topk[[t, slot]] = e as i64;
                    }
                    keys.extend(sel.iter().map(|&e| &cm.entries[e].0[..]));
                } else if let Some(cm) = comp.as_ref() {
                    keys.extend(cm.entries[..cm.visible(t)].iter().map(|e| &e.0[..]));
                }
                for hh in 0..h {
                    let q = super::row3(&f.q, t, hh);
                    let sink = (!faults.on(Fault::SinkDropped)).then_some(sinks[hh]);
                    let (o, l) = attend_one(q, &keys, sink, c.softmax_scale as f32, dt);
                    heads.slice_mut(s![t, hh, ..]).assign(&Array1::from(o));
                    lse[[t, hh]] = l;
                }
            }
        }
        let mut derot = heads.clone();
        for t in 0..t_len {
            for hh in 0..h {
                let mut row = derot.slice_mut(s![t, hh, ..]);
                rope_row(row.as_slice_mut().expect("row"), &rope, t, -1.0, dt);
            }
        }
        let attn_out = grouped_output(c, w, &derot, dt);
        V4Layer {
            attn_in: to64(&f.attn_in),
            q_a: to64(&f.q_a),
            q: to64(&f.q),
            cache_rows: to64(&f.rows),
            compressed: comp.as_ref().map(Compressor::stored),
            index_scores: ix.is_some().then_some(scores),
            topk_indices: ix.is_some().then_some(topk),
            attn_heads: to64(&heads),
            lse: to64(&lse),
            attn_derot: to64(&derot),
            attn_out: to64(&attn_out),
        }
    }

    fn front(&self, c: &V4Config, w: &V4Weights, x: ArrayView2<f64>, rope: &Rope32) -> Front {
        let dt = self.dtype;
        let st = |a: &Array2<f64>| ops::stored(&to32(a), dt);
        let vst = |v: &[f64]| ops::stored(&Array1::from_iter(v.iter().map(|&g| g as f32)), dt);
        let x = ops::round_all(x.mapv(|v| v as f32), dt);
        let attn_in = ops::rms_norm(x.view(), &vst(&w.attn_norm), c.rms_eps, dt);
        let qa = ops::linear(attn_in.view(), st(&w.q_a).view(), dt);
        let q_a = ops::rms_norm(qa.view(), &vst(&w.q_a_norm), c.rms_eps, dt);
        let (t_len, h, d) = (x.nrows(), c.n_head, c.head_dim);
        let qb = ops::linear(q_a.view(), st(&w.q_b).view(), dt);
        let ones = Array1::<f32>::ones(d);
        let mut q = Array3::<f32>::zeros((t_len, h, d));
        for t in 0..t_len {
            let qt = qb
                .row(t)
                .to_owned()
                .into_shape_with_order((h, d))
                .expect("H·D");
            let mut n = ops::rms_norm(qt.view(), &ones, c.rms_eps, dt);
            for mut row in n.rows_mut() {
                rope_row(row.as_slice_mut().expect("row"), rope, t, 1.0, dt);
            }
            q.slice_mut(s![t, .., ..]).assign(&n);
        }
        let kv = ops::linear(attn_in.view(), st(&w.kv).view(), dt);
        let mut rows = ops::rms_norm(kv.view(), &vst(&w.kv_norm), c.rms_eps, dt);
        for (t, mut row) in rows.rows_mut().into_iter().enumerate() {
            rope_row(row.as_slice_mut().expect("row"), rope, t, 1.0, dt);
        }
        Front {
            attn_in,
            q_a,
            q,
            rows,
        }
    }
}

/// The first window row query `t` sees: `sliding_window − 1` past rows and its own. Fault
/// `window_off_by_one`: one past row more.
fn window_start(c: &V4Config, t: usize, faults: Active) -> usize {
    let past = match faults.on(Fault::WindowOffByOne) {
        true => c.sliding_window,
        false => c.sliding_window - 1,
    };
    t.saturating_sub(past)
}

/// One query head over `keys` (V = K) and the sink (`None`: fault `sink_dropped`): `(round(out), lse)`.
fn attend_one(
    q: &[f32],
    keys: &[&[f32]],
    sink: Option<f32>,
    scale: f32,
    dt: Dtype,
) -> (Vec<f32>, f32) {
    let s: Vec<f32> = keys.iter().map(|k| ops::dot(q, k) * scale).collect();
    let m = s
        .iter()
        .copied()
        .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
    let mut l = sink.map_or(0.0, |v| (v - m).exp());
    let mut acc = vec![0f32; q.len()];
    for (k, &si) in keys.iter().zip(&s) {
        let p = (si - m).exp();
        l += p;
        let pr = dt.round(p);
        acc.iter_mut()
            .zip(k.iter())
            .for_each(|(a, &v)| *a += pr * v);
    }
    let out = acc.iter().map(|&a| dt.round(a / l)).collect();
    (out, m + l.ln())
}

/// `round(round(heads_g·W_oa,gᵀ) concatenated · W_obᵀ)`.
fn grouped_output(c: &V4Config, w: &V4Weights, heads: &Array3<f32>, dt: Dtype) -> Array2<f32> {
    let (t_len, h, d) = heads.dim();
    let (g, r) = (c.o_groups, c.o_lora_rank);
    let per = h / g * d;
    let flat = heads
        .to_owned()
        .into_shape_with_order((t_len, h * d))
        .expect("contiguous");
    let o_a = ops::stored(&to32(&w.o_a), dt);
    let mut mid = Array2::<f32>::zeros((t_len, g * r));
    for gi in 0..g {
        let wg = o_a.slice(s![gi * r..(gi + 1) * r, ..]);
        let xg = flat.slice(s![.., gi * per..(gi + 1) * per]);
        mid.slice_mut(s![.., gi * r..(gi + 1) * r])
            .assign(&ops::linear(xg, wg, dt));
    }
    ops::linear(mid.view(), ops::stored(&to32(&w.o_b), dt).view(), dt)
}

/// The CSA indexer: its compressor, its roped queries and head weights.
struct Indexer {
    comp: Compressor,
    q: Array2<f32>,
    wts: Array2<f32>,
    hi: usize,
    di: usize,
    dt: Dtype,
}

impl Indexer {
    fn new(
        c: &V4Config,
        w: &V4Weights,
        f: &Front,
        rope: &Rope32,
        dt: Dtype,
        faults: Active,
    ) -> Indexer {
        let (cw, q_b, proj) = w.indexer.as_ref().expect("a CSA layer has its indexer");
        let (hi, di) = (c.indexer.n_head, c.indexer.head_dim);
        let comp = Compressor::new(
            cw,
            LayerKind::Csa,
            di,
            f.attn_in.view(),
            c.rms_eps,
            dt,
            faults,
        );
        let mut q = ops::linear(f.q_a.view(), ops::stored(&to32(q_b), dt).view(), dt);
        for (t, mut row) in q.rows_mut().into_iter().enumerate() {
            let row = row.as_slice_mut().expect("row");
            for h in 0..hi {
                rope_row(&mut row[h * di..(h + 1) * di], rope, t, 1.0, dt);
            }
        }
        let wts = ops::linear(f.attn_in.view(), ops::stored(&to32(proj), dt).view(), dt);
        Indexer {
            comp,
            q,
            wts,
            hi,
            di,
            dt,
        }
    }

    /// Query `t`'s scores of the entries it sees, and its top `k` of them (best first; ties: lower).
    fn select(&self, t: usize, k: usize) -> (Vec<f32>, Vec<usize>) {
        let n = self.comp.visible(t);
        let q = self.q.row(t);
        let q = q.as_slice().expect("row");
        let (shi, sdi) = ((self.hi as f32).sqrt(), (self.di as f32).sqrt());
        let scores: Vec<f32> = (0..n)
            .map(|e| {
                let key = &self.comp.entries[e].0;
                let s: f32 = (0..self.hi)
                    .map(|h| {
                        let dot = ops::dot(&q[h * self.di..(h + 1) * self.di], key);
                        self.wts[[t, h]] / shi * dot.max(0.0) / sdi
                    })
                    .sum();
                self.dt.round(s)
            })
            .collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        order.truncate(k);
        (scores, order)
    }
}

/// The tokens at which the mirror's compressor of ratio `m` (4: CSA, 128: HCA) closes its entries over
/// `t_len` tokens fed in `passes`, with `faults` (the CUDA path's restated arithmetic is held to it).
#[cfg(test)]
pub(crate) fn compress_closes(
    m: usize,
    t_len: usize,
    passes: &[Range<usize>],
    faults: Active,
) -> Vec<usize> {
    let kind = match m {
        4 => LayerKind::Csa,
        _ => LayerKind::Hca,
    };
    let (d, coff) = (2, kind.coff());
    let w = crate::model::v4::CompressorWeights {
        kv: ndarray::Array2::ones((coff * d, 1)),
        gate: ndarray::Array2::zeros((coff * d, 1)),
        ape: ndarray::Array2::zeros((m, coff * d)),
        norm: vec![1.0; d],
    };
    let attn_in = Array2::<f32>::ones((t_len, 1));
    let mut c = Compressor::new(&w, kind, d, attn_in.view(), 1e-6, Dtype::F32, faults);
    let rope = Rope32 {
        dim: d,
        cos: Array2::ones((t_len, 1)),
        sin: Array2::zeros((t_len, 1)),
    };
    for p in passes {
        c.begin_pass();
        c.feed(p.clone(), &rope);
    }
    c.entries.iter().map(|e| e.1).collect()
}

#[cfg(test)]
mod tests;
