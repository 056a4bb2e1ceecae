//! Chunked prefill: each chunk attends causally to itself in decompressed (MHA) form; a chunk with
//! cached context also attends to the decompressed context rows read back from the paged cache, and the
//! two results are merged by their lse (vLLM's `_forward_prefill` with `merge_attn_states`).

use super::cache::PagedCache;
use super::flash::{attend, merge, Partial};
use super::front::{decompress, MirrorWeights};
use super::ops::{dot, rope_dot};
use super::{row3, MirrorFront};
use crate::faults::{Active, Fault};
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::reference::sparse::Selection;
use ndarray::{s, Array2, Array3};
use std::ops::Range;

/// Decompressed keys and values of a run of tokens, with their shared `k_pe`.
pub struct Kv {
    /// `[n, H, P]`
    pub k_nope: Array3<f32>,
    /// `[n, R]`
    pub k_pe: Array2<f32>,
    /// `[n, H, Dv]`
    pub v: Array3<f32>,
}

/// The chunk's own keys and values, from its fresh latent.
pub fn chunk_kv(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    f: &MirrorFront,
    c: Range<usize>,
    dt: Dtype,
) -> Kv {
    let (k_nope, v) = decompress(cfg, mw, f.latent.slice(s![c.clone(), ..]), dt);
    Kv {
        k_nope,
        k_pe: f.k_pe.slice(s![c, ..]).to_owned(),
        v,
    }
}

/// The context rows `0..end` gathered from the paged cache and decompressed.
pub fn context_kv(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    cache: &PagedCache,
    end: usize,
    dt: Dtype,
) -> Kv {
    rows_kv(cfg, mw, cache.gather(0..end), dt)
}

/// Cache rows `[latent | k_pe]` decompressed.
fn rows_kv(cfg: &MlaConfig, mw: &MirrorWeights, rows: Array2<f32>, dt: Dtype) -> Kv {
    let lkv = cfg.kv_lora_rank;
    let (k_nope, v) = decompress(cfg, mw, rows.slice(s![.., ..lkv]), dt);
    Kv {
        k_nope,
        k_pe: rows.slice(s![.., lkv..]).to_owned(),
        v,
    }
}

/// Attention of query `(t, h)` over `keys` (indices into `kv`); the output is stored in the dtype.
pub fn attend_kv(
    cfg: &MlaConfig,
    f: &MirrorFront,
    kv: &Kv,
    t: usize,
    h: usize,
    keys: Range<usize>,
    dt: Dtype,
) -> Partial {
    attend_kv_sel(cfg, f, kv, t, h, keys, dt, None)
}

/// `attend_kv` over the keys a DSA selection keeps: `sel` and the token of `kv`'s row 0.
#[allow(clippy::too_many_arguments)]
pub fn attend_kv_sel(
    cfg: &MlaConfig,
    f: &MirrorFront,
    kv: &Kv,
    t: usize,
    h: usize,
    keys: Range<usize>,
    dt: Dtype,
    sel: Option<(&Selection, usize)>,
) -> Partial {
    let (qn, qp) = (row3(&f.q_nope, t, h), row3(&f.q_pe, t, h));
    let scale = cfg.softmax_scale as f32;
    let k_pe = kv.k_pe.as_slice().expect("contiguous");
    // The rows' rope width: qk_rope, or a padded row's (fault `nope_pad_as_rope`).
    let r = kv.k_pe.ncols();
    attend(
        keys,
        cfg.v_head_dim,
        dt,
        |j| match sel {
            Some((sel, base)) if !sel.allows(t, base + j) => f32::NEG_INFINITY,
            _ => {
                (dot(qn, row3(&kv.k_nope, j, h)) + rope_dot(qp, &k_pe[j * r..(j + 1) * r])) * scale
            }
        },
        |j| row3(&kv.v, j, h),
    )
    .rounded(dt)
}

/// The end of the keys query `i` may see under the causal mask (fault: one key too many).
pub fn causal_end(i: usize, fx: Active) -> usize {
    i + 1 + fx.on(Fault::CausalOffByOne) as usize
}

/// Prefill chunk `c`: its rows must already be in the cache. Writes `heads [T, H, Dv]` and `lse [T, H]`
/// for the chunk's tokens.
#[allow(clippy::too_many_arguments)]
pub fn chunk(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    f: &MirrorFront,
    cache: &PagedCache,
    c: Range<usize>,
    dt: Dtype,
    fx: Active,
    sel: Option<&Selection>,
    heads: &mut Array3<f32>,
    lse: &mut Array2<f32>,
) {
    // Fault (sparse only): every key read at its position as the cache slot, the block table skipped;
    // the chunk's own keys too, which a sparse kernel reads from the cache like the context.
    let raw = sel.is_some() && fx.on(Fault::SparseIndexPageBase);
    let own = match raw {
        true => rows_kv(cfg, mw, cache.gather_raw(c.clone()), dt),
        false => chunk_kv(cfg, mw, f, c.clone(), dt),
    };
    // Fault: an engine that runs the context pass even for a chunk without context (FA2 then returns
    // lse +inf for it, vLLM #15492).
    let empty_ctx_inf = fx.on(Fault::EmptyCtxLseInf);
    let ctx = (c.start > 0 || empty_ctx_inf).then(|| match raw {
        true => rows_kv(cfg, mw, cache.gather_raw(0..c.start), dt),
        false => context_kv(cfg, mw, cache, c.start, dt),
    });
    for (i, t) in c.clone().enumerate() {
        for h in 0..cfg.n_head {
            let own_keys = 0..causal_end(i, fx).min(c.len());
            let mine = attend_kv_sel(cfg, f, &own, t, h, own_keys, dt, sel.map(|s| (s, c.start)));
            let res = match &ctx {
                None => mine,
                Some(kv) => {
                    let ks = 0..c.start;
                    let mut prefix = attend_kv_sel(cfg, f, kv, t, h, ks, dt, sel.map(|s| (s, 0)));
                    if c.start == 0 && empty_ctx_inf {
                        prefix.lse = f32::INFINITY;
                    }
                    merge(&[prefix, mine]).rounded(dt)
                }
            };
            heads
                .slice_mut(s![t, h, ..])
                .assign(&ndarray::ArrayView1::from(&res.out));
            lse[[t, h]] = res.lse;
        }
    }
}
