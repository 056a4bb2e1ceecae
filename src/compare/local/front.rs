//! The stages before the attention and after it: attn_in, q_nope, q_pe, kv_latent, k_pe and attn_out,
//! each from the path's stored inputs through the layer's weights as the path stores them
//! ([`Prepared`], made first by [`prepare`]).

use super::linear::{f64s, hidden_round, linear_stored, rms_norm, rope_rows};
use super::{opt2, Local, View};
use crate::backend::cpu::front::RopeF32;
use crate::model::{LayerWeights, MlaConfig, QProj};
use crate::precision::Dtype;
use crate::trace::{LayerTrace, Stage};
use ndarray::{s, Array1, Array2, Zip};

/// What of the layer's weights the view uses, made first ([`prepare`]): its products against the
/// large matrices (q, kv_a, o) and the rest as the path stores them, widened. A run frees the layer's
/// weights between [`prepare`] and [`super::finish`], so that a judge in flight holds no copy of them.
pub struct Prepared {
    pub(super) attn_norm: Array1<f64>,
    pub(super) kv_a_norm: Array1<f64>,
    /// q and its variance `[T, H·(P+R)]`, from the stored attn_in (`None`: not in the trace).
    pub(super) q: Option<(Array2<f64>, Array2<f64>)>,
    /// kv_a's product and variance `[T, Lkv+R]` from the stored attn_in, before it is stored.
    pub(super) kv: Option<(Array2<f64>, Array2<f64>)>,
    /// `[H·P, Lkv]` and `[H·Dv, Lkv]`.
    pub(super) w_uk: Array2<f64>,
    pub(super) w_uv: Array2<f64>,
    /// attn_out and its variance from the stored heads.
    pub(super) o: Option<(Array2<f64>, Array2<f64>)>,
}

/// The view's uses of the layer's weights ([`Prepared`]), from the path's storage `dt` and the stored
/// attn_in and heads of its trace `opt`.
pub fn prepare(cfg: &MlaConfig, weights: &LayerWeights, dt: Dtype, opt: &LayerTrace) -> Prepared {
    // The weights as the path stores them: the layer's rounded copy where the CPU mirror made one
    // (`LayerWeights::stored`), else the file's values rounded as they are read (a GPU run then holds
    // no second copy of the layer).
    let (w, round) = match weights.stored_made(dt) {
        Some(s) => (s, None),
        None => (weights, Some(dt)),
    };
    let attn_in = opt2(opt, Stage::AttnIn);
    // q ← attn_in (q-LoRA's latent stored and normed on the way).
    let q = attn_in.as_ref().map(|attn_in| match &w.q {
        QProj::Lora { a, a_norm, b } => {
            let (qa, mut vqa) = linear_stored(attn_in.view(), a.view(), round, None);
            Zip::from(&mut vqa)
                .and(&qa)
                .for_each(|v, &y| *v += hidden_round(dt, y));
            let a_norm = f64s(a_norm, round);
            let (qn, mut vqn) = rms_norm(qa.view(), vqa.view(), &a_norm, cfg.lora_norm_eps);
            Zip::from(&mut vqn)
                .and(&qn)
                .for_each(|v, &y| *v += hidden_round(dt, y));
            linear_stored(qn.view(), b.view(), round, Some(&vqn))
        }
        QProj::Plain { q } => linear_stored(attn_in.view(), q.view(), round, None),
    });
    let kv = attn_in.map(|a| linear_stored(a.view(), w.kv_a.view(), round, None));
    let (h, lkv) = (cfg.n_head, cfg.kv_lora_rank);
    let flat = |m: &ndarray::Array3<f32>, d: usize| {
        f64s(m, round)
            .into_shape_with_order((h * d, lkv))
            .expect("[H, d, Lkv]")
    };
    // attn_out ← the stored heads.
    let o = opt2(opt, Stage::AttnHeads)
        .map(|o_heads| linear_stored(o_heads.view(), w.o.view(), round, None));
    Prepared {
        attn_norm: f64s(&w.attn_norm, round),
        kv_a_norm: f64s(&w.kv_a_norm, round),
        q,
        kv,
        w_uk: flat(&w.w_uk, cfg.qk_nope),
        w_uv: flat(&w.w_uv, cfg.v_head_dim),
        o,
    }
}

/// attn_in ← the layer input, as the path stores it.
pub(super) fn attn_in(vw: &View, attn_norm: &Array1<f64>, out: &mut Local) {
    let dt = vw.f.dtype;
    let x = vw.f.x.mapv(|v| dt.round(v as f32) as f64);
    let zero = Array2::<f64>::zeros(x.dim());
    let (ai, vai) = rms_norm(x.view(), zero.view(), attn_norm, vw.f.cfg.rms_eps);
    out.push(
        Stage::AttnIn,
        ai.into_raw_vec_and_offset().0,
        vai.into_raw_vec_and_offset().0,
    );
}

/// q_nope, then q_pe (q is stored before rope) ← the product of the stored attn_in with q ([`prepare`]).
pub(super) fn query(
    vw: &View,
    (q, vq): (Array2<f64>, Array2<f64>),
    rope: &RopeF32,
    out: &mut Local,
) {
    let (h, p, t_all) = (vw.h, vw.p, vw.t_all);
    // Per head rows `[T·H, P+R]`.
    let dk = p + vw.r;
    let mut q = q.into_shape_with_order((t_all * h, dk)).expect("[T, H·Dk]");
    let mut vq = vq
        .into_shape_with_order((t_all * h, dk))
        .expect("[T, H·Dk]");
    let q_nope = q.slice(s![.., ..p]).to_owned();
    out.push(
        Stage::QNope,
        q_nope.iter().copied().collect(),
        vq.slice(s![.., ..p]).iter().copied().collect(),
    );
    // q is stored before rope.
    Zip::from(vq.slice_mut(s![.., p..]))
        .and(q.slice(s![.., p..]))
        .for_each(|v, &y| *v += hidden_round(vw.dt_of(Stage::QPe), y));
    rope_rows(&mut q, &mut vq, rope, p..dk, |row| row / h);
    out.push(
        Stage::QPe,
        q.slice(s![.., p..]).iter().copied().collect(),
        vq.slice(s![.., p..]).iter().copied().collect(),
    );
}

/// kv_latent and k_pe ← attn_in through kv_a ([`prepare`]): stored, then the latent normed and k_pe
/// roped.
pub(super) fn keys(
    vw: &View,
    (mut kv, mut vkv): (Array2<f64>, Array2<f64>),
    kv_a_norm: &Array1<f64>,
    rope: &RopeF32,
    out: &mut Local,
) {
    let (lkv, r) = (vw.lkv, vw.r);
    for (cols, st) in [
        (s![.., ..lkv], Stage::KvLatent),
        (s![.., lkv..], Stage::KPe),
    ] {
        Zip::from(vkv.slice_mut(cols))
            .and(kv.slice(cols))
            .for_each(|v, &y| *v += hidden_round(vw.dt_of(st), y));
    }
    let (lat, vlat) = rms_norm(
        kv.slice(s![.., ..lkv]),
        vkv.slice(s![.., ..lkv]),
        kv_a_norm,
        vw.f.cfg.lora_norm_eps,
    );
    out.push(
        Stage::KvLatent,
        lat.iter().copied().collect(),
        vlat.iter().copied().collect(),
    );
    rope_rows(&mut kv, &mut vkv, rope, lkv..lkv + r, |row| row);
    out.push(
        Stage::KPe,
        kv.slice(s![.., lkv..]).iter().copied().collect(),
        vkv.slice(s![.., lkv..]).iter().copied().collect(),
    );
}

/// attn_out ← the stored heads through o ([`prepare`]).
pub(super) fn out(o: Option<(Array2<f64>, Array2<f64>)>, out: &mut Local) {
    if let Some((y, v)) = o {
        out.push(
            Stage::AttnOut,
            y.into_raw_vec_and_offset().0,
            v.into_raw_vec_and_offset().0,
        );
    }
}
