//! The stages before attention, and o_proj, in f64: shared by both reference forms.
//!
//! `attn_in = RMSNorm(x, attn_norm)`; q through q-LoRA (`W_qb · RMSNorm(W_qa · attn_in)`) or plain
//! `W_q · attn_in`; each head split `[nope(P) | pe(R)]` with rope on the pe part; `kv_a · attn_in` split
//! into the latent `[0:Lkv]` (then kv_a_norm) and `k_pe [Lkv:]` (then rope, shared by all heads).

use crate::model::{LayerWeights, MlaConfig, QProj};
use crate::rope::RopeTables;
use ndarray::{s, Array1, Array2, Array3, ArrayView2, Axis};

/// The per-token tensors both attention forms start from.
#[derive(Debug, Clone)]
pub struct Front {
    /// `[T, E]`
    pub attn_in: Array2<f64>,
    /// `[T, H, P]`
    pub q_nope: Array3<f64>,
    /// `[T, H, R]`, roped.
    pub q_pe: Array3<f64>,
    /// `[T, Lkv]`, after kv_a_norm.
    pub latent: Array2<f64>,
    /// `[T, R]`, roped.
    pub k_pe: Array2<f64>,
}

/// `y = x / sqrt(mean(x²) + eps) · w`, per row.
pub fn rms_norm(x: ArrayView2<f64>, w: &Array1<f32>, eps: f64) -> Array2<f64> {
    let mut y = x.to_owned();
    for mut row in y.rows_mut() {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        row.iter_mut()
            .zip(w.iter())
            .for_each(|(v, &g)| *v = *v * r * g as f64);
    }
    y
}

/// `x · Wᵀ` for a torch-orientation `W [out, in]`, in f64 (`linalg::linear_f32`: on the host, or on the
/// GPU a run installed).
pub fn linear(x: ArrayView2<f64>, w: ArrayView2<f32>) -> Array2<f64> {
    crate::linalg::linear_f32(x, None, w, None).y
}

pub fn attn_in(cfg: &MlaConfig, w: &LayerWeights, x: ArrayView2<f64>) -> Array2<f64> {
    rms_norm(x, &w.attn_norm, cfg.rms_eps)
}

/// The full query `[T, H·(P+R)]`, heads `[nope | pe]`.
pub fn query(cfg: &MlaConfig, w: &LayerWeights, attn_in: ArrayView2<f64>) -> Array2<f64> {
    match &w.q {
        QProj::Lora { a, a_norm, b } => {
            let qa = linear(attn_in, a.view());
            let qa = rms_norm(qa.view(), a_norm, cfg.lora_norm_eps);
            linear(qa.view(), b.view())
        }
        QProj::Plain { q } => linear(attn_in, q.view()),
    }
}

/// Split the query per head into `q_nope` and the roped `q_pe`.
pub fn split_query(
    cfg: &MlaConfig,
    q: &Array2<f64>,
    rope: &RopeTables,
) -> (Array3<f64>, Array3<f64>) {
    let (t, h, p) = (q.nrows(), cfg.n_head, cfg.qk_nope);
    let q = q
        .view()
        .into_shape_with_order((t, h, cfg.qk_head_dim()))
        .expect("q has H·Dk columns");
    let q_nope = q.slice(s![.., .., ..p]).to_owned();
    let mut q_pe = q.slice(s![.., .., p..]).to_owned();
    apply_rope(&mut q_pe, rope);
    (q_nope, q_pe)
}

/// Rotate every `[.., .., R]` row of a `[T, H, R]` tensor by its token's angles.
pub fn apply_rope(x: &mut Array3<f64>, rope: &RopeTables) {
    for (t, mut tok) in x.axis_iter_mut(Axis(0)).enumerate() {
        for mut head in tok.axis_iter_mut(Axis(0)) {
            rope.rotate(t, head.as_slice_mut().expect("contiguous"));
        }
    }
}

/// `kv_a · attn_in` → (normed latent `[T, Lkv]`, roped `k_pe [T, R]`).
pub fn kv(
    cfg: &MlaConfig,
    w: &LayerWeights,
    attn_in: ArrayView2<f64>,
    rope: &RopeTables,
) -> (Array2<f64>, Array2<f64>) {
    let kv = linear(attn_in, w.kv_a.view());
    let lkv = cfg.kv_lora_rank;
    let latent = rms_norm(kv.slice(s![.., ..lkv]), &w.kv_a_norm, cfg.lora_norm_eps);
    let mut k_pe = kv.slice(s![.., lkv..]).to_owned().insert_axis(Axis(1));
    apply_rope(&mut k_pe, rope);
    (latent, k_pe.remove_axis(Axis(1)))
}

pub fn front(cfg: &MlaConfig, w: &LayerWeights, rope: &RopeTables, x: ArrayView2<f64>) -> Front {
    let attn_in = attn_in(cfg, w, x);
    let q = query(cfg, w, attn_in.view());
    let (q_nope, q_pe) = split_query(cfg, &q, rope);
    let (latent, k_pe) = kv(cfg, w, attn_in.view(), rope);
    Front {
        attn_in,
        q_nope,
        q_pe,
        latent,
        k_pe,
    }
}

/// Cache rows `[latent | k_pe]`, `[T, Lkv+R]`.
pub fn cache_rows(f: &Front) -> Array2<f64> {
    ndarray::concatenate(Axis(1), &[f.latent.view(), f.k_pe.view()]).expect("same rows")
}

/// `attn_out = heads · W_oᵀ` with heads flattened `[T, H·Dv]`.
pub fn o_proj(w: &LayerWeights, heads: &Array3<f64>) -> Array2<f64> {
    let (t, h, dv) = heads.dim();
    let flat = heads
        .as_standard_layout()
        .into_owned()
        .into_shape_with_order((t, h * dv))
        .expect("contiguous");
    linear(flat.view(), w.o.view())
}
