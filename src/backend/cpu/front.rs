//! The mirror's row-wise stages: the layer input in the dtype, attn_norm, q, kv_a, rope, decompression,
//! o_proj. Each token's row is computed independently, so the schedule cannot change these values.

use super::ops::{linear, rms_norm, rope, round_all};
use crate::backend::common::kv_b_split_swapped;
use crate::faults::{Active, Fault};
use crate::model::{LayerWeights, MlaConfig, QProj, RopePairing};
use crate::precision::Dtype;
use crate::rope::RopeTables;
use ndarray::{s, Array1, Array2, Array3, ArrayView2, Axis, CowArray, Ix2, Ix3};

/// The layer's weights stored in the dtype.
#[derive(Debug, Clone)]
pub struct MirrorWeights<'a> {
    pub attn_norm: &'a Array1<f32>,
    pub q: &'a QProj,
    pub kv_a: &'a Array2<f32>,
    pub kv_a_norm: &'a Array1<f32>,
    /// `[H·P, Lkv]`
    pub w_uk: CowArray<'a, f32, Ix2>,
    /// `[H·Dv, Lkv]`
    pub w_uv: CowArray<'a, f32, Ix2>,
    pub o: &'a Array2<f32>,
}

impl<'a> MirrorWeights<'a> {
    /// The layer's weights as stored in `dt` (made once per layer: [`LayerWeights::stored`]).
    pub fn new(cfg: &MlaConfig, w: &'a LayerWeights, dt: Dtype, fx: Active) -> MirrorWeights<'a> {
        let (h, lkv) = (cfg.n_head, cfg.kv_lora_rank);
        let s = w.stored(dt);
        let flat = |m: CowArray<'a, f32, Ix3>, d: usize| {
            m.into_shape_with_order((h * d, lkv))
                .expect("[H, d, Lkv], standard layout")
        };
        // Fault: each head's kv_b block [k_nope(P) | v(Dv)] split as [v(Dv) | k_nope(P)] (a permutation:
        // the stored values swapped are the swapped values stored).
        let (w_uk, w_uv) = match fx.on(Fault::KvBSwap) {
            true => {
                let (uk, uv) = kv_b_split_swapped(cfg, s);
                (CowArray::from(uk), CowArray::from(uv))
            }
            false => (CowArray::from(s.w_uk.view()), CowArray::from(s.w_uv.view())),
        };
        MirrorWeights {
            attn_norm: &s.attn_norm,
            q: &s.q,
            kv_a: &s.kv_a,
            kv_a_norm: &s.kv_a_norm,
            w_uk: flat(w_uk, cfg.qk_nope),
            w_uv: flat(w_uv, cfg.v_head_dim),
            o: &s.o,
        }
    }
    /// `W_UK[h]` as `[P, Lkv]`.
    pub fn uk(&self, cfg: &MlaConfig, h: usize) -> ArrayView2<'_, f32> {
        self.w_uk
            .slice(s![h * cfg.qk_nope..(h + 1) * cfg.qk_nope, ..])
    }
    /// `W_UV[h]` as `[Dv, Lkv]`.
    pub fn uv(&self, cfg: &MlaConfig, h: usize) -> ArrayView2<'_, f32> {
        self.w_uv
            .slice(s![h * cfg.v_head_dim..(h + 1) * cfg.v_head_dim, ..])
    }
}

/// The rope tables as a kernel receives them: f32 `[n_pos, R/2]`.
#[derive(Debug, Clone)]
pub struct RopeF32 {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half: usize,
    pub pairing: RopePairing,
}

impl RopeF32 {
    pub fn new(t: &RopeTables, fx: Active) -> RopeF32 {
        let (cos, sin) = t.to_f32();
        // Faults: a rope kernel with its pairing hard-coded.
        let pairing = match (fx.on(Fault::RopeNeox), fx.on(Fault::RopeNorm)) {
            (true, _) => RopePairing::Neox,
            (_, true) => RopePairing::Norm,
            _ => t.pairing,
        };
        RopeF32 {
            cos,
            sin,
            half: t.dim / 2,
            pairing,
        }
    }
    pub fn rotate(&self, t: usize, x: &mut [f32], dt: Dtype) {
        let r = t * self.half..(t + 1) * self.half;
        rope(x, &self.cos[r.clone()], &self.sin[r], self.pairing, dt);
    }
}

/// The layer input in the dtype.
pub fn input(x: &Array2<f64>, dt: Dtype) -> Array2<f32> {
    // Rows are read as slices downstream: standard layout whatever the caller passed.
    round_all(x.as_standard_layout().mapv(|v| v as f32), dt)
}

pub fn attn_in(cfg: &MlaConfig, mw: &MirrorWeights, x: ArrayView2<f32>, dt: Dtype) -> Array2<f32> {
    rms_norm(x, mw.attn_norm, cfg.rms_eps, dt)
}

/// The full query `[T, H·(P+R)]`; with q-LoRA the low-rank activation is stored and normed in between.
pub fn query(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    attn_in: ArrayView2<f32>,
    dt: Dtype,
) -> Array2<f32> {
    match mw.q {
        QProj::Lora { a, a_norm, b } => {
            let qa = linear(attn_in, a.view(), dt);
            let qa = rms_norm(qa.view(), a_norm, cfg.lora_norm_eps, dt);
            linear(qa.view(), b.view(), dt)
        }
        QProj::Plain { q } => linear(attn_in, q.view(), dt),
    }
}

/// Split per head into `q_nope [T, H, P]` and the roped `q_pe [T, H, R]`.
pub fn split_query(
    cfg: &MlaConfig,
    q: Array2<f32>,
    rope: &RopeF32,
    dt: Dtype,
) -> (Array3<f32>, Array3<f32>) {
    let (t, h, p) = (q.nrows(), cfg.n_head, cfg.qk_nope);
    let q = q
        .into_shape_with_order((t, h, cfg.qk_head_dim()))
        .expect("H·Dk columns");
    let q_nope = q.slice(s![.., .., ..p]).to_owned();
    let mut q_pe = q.slice(s![.., .., p..]).to_owned();
    for (tt, mut tok) in q_pe.axis_iter_mut(Axis(0)).enumerate() {
        for mut head in tok.axis_iter_mut(Axis(0)) {
            rope.rotate(tt, head.as_slice_mut().expect("contiguous"), dt);
        }
    }
    (q_nope, q_pe)
}

pub use crate::backend::common::DEEPSEEK_ROPE;

/// Fault `rope_on_nope`'s rope on a NoPE model (`common::nope_rope_tables`), rounded as the mirror's;
/// `None` without the fault or with rope.
pub fn nope_rope(cfg: &MlaConfig, t: &RopeTables, fx: Active) -> Option<RopeF32> {
    crate::backend::common::nope_rope_tables(cfg, t, fx).map(|t| RopeF32::new(&t, Active::NONE))
}

/// `kv_a · attn_in` (stored), then the normed latent `[T, Lkv]` and the roped `k_pe [T, R]`; also the
/// stored `kv_a · attn_in` itself `[T, Lkv+R]`. `nope`: fault `rope_on_nope`'s rope, applied to the
/// latent's last 64 columns (where DeepSeek's row has k_pe).
pub fn kv(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    attn_in: ArrayView2<f32>,
    rope: &RopeF32,
    nope: Option<&RopeF32>,
    dt: Dtype,
) -> (Array2<f32>, Array2<f32>, Array2<f32>) {
    let kv = linear(attn_in, mw.kv_a.view(), dt);
    let lkv = cfg.kv_lora_rank;
    let mut latent = rms_norm(kv.slice(s![.., ..lkv]), mw.kv_a_norm, cfg.lora_norm_eps, dt);
    let mut k_pe = kv.slice(s![.., lkv..]).to_owned();
    for (t, mut row) in k_pe.rows_mut().into_iter().enumerate() {
        rope.rotate(t, row.as_slice_mut().expect("contiguous"), dt);
    }
    if let Some(r) = nope.filter(|_| lkv >= DEEPSEEK_ROPE) {
        for (t, mut row) in latent.rows_mut().into_iter().enumerate() {
            let row = row.as_slice_mut().expect("contiguous");
            r.rotate(t, &mut row[lkv - DEEPSEEK_ROPE..], dt);
        }
    }
    (latent, k_pe, kv)
}

/// Per-head `k_nope = round(W_UK·latent) [n, H, P]` and `v = round(W_UV·latent) [n, H, Dv]`.
pub fn decompress(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    latent: ArrayView2<f32>,
    dt: Dtype,
) -> (Array3<f32>, Array3<f32>) {
    let (n, h) = (latent.nrows(), cfg.n_head);
    let k = linear(latent, mw.w_uk.view(), dt)
        .into_shape_with_order((n, h, cfg.qk_nope))
        .expect("[n, H·P]");
    let v = linear(latent, mw.w_uv.view(), dt)
        .into_shape_with_order((n, h, cfg.v_head_dim))
        .expect("[n, H·Dv]");
    (k, v)
}

/// `attn_out = round(heads · W_oᵀ)`, heads flattened `[T, H·Dv]`.
pub fn o_proj(mw: &MirrorWeights, heads: &Array3<f32>, dt: Dtype) -> Array2<f32> {
    let (t, h, dv) = heads.dim();
    let flat = heads
        .view()
        .into_shape_with_order((t, h * dv))
        .expect("contiguous");
    linear(flat, mw.o.view(), dt)
}

/// The heads `[T, H, Dv]` as a reader sees them through a view with head stride `stride` (instead of Dv)
/// over the same row-major buffer; elements past the buffer's end read as NaN (memory it does not own).
pub fn restride_heads(heads: &Array3<f32>, stride: usize) -> Array3<f32> {
    let (t, h, dv) = heads.dim();
    let buf = heads.as_slice().expect("standard layout");
    Array3::from_shape_fn((t, h, dv), |(tt, hh, d)| {
        buf.get(tt * h * dv + hh * stride + d)
            .copied()
            .unwrap_or(f32::NAN)
    })
}
