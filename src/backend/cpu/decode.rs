//! Decode steps: the absorbed query `[W_UKᵀ·q_nope | q_pe]` attends over the latent cache rows through
//! the block table, split-KV (flash decoding): each split runs the tiled online softmax over its keys,
//! keeps its partial in f32, and the splits are combined by lse; then `W_UV` per head.

use super::cache::PagedCache;
use super::flash::{attend, attend_handover_stale, merge, merge_log2, Partial, TILE};
use super::front::MirrorWeights;
use super::ops::{dot, rope_dot, round_all};
use super::prefill::causal_end;
use super::{row3, MirrorFront};
use crate::faults::{Active, Fault};
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::reference::sparse::Selection;
use crate::schedule::Schedule;
use ndarray::{s, Array2, Array3, Array4, ArrayView1};
use std::ops::Range;

/// The decode-only stages for all decode tokens.
#[derive(Debug, Clone)]
pub struct DecodeStages {
    /// `[D, H, Lkv]`
    pub q_abs: Array3<f32>,
    /// `[D, H, S, Lkv]`, f32 partials.
    pub split_out: Array4<f32>,
    /// `[D, H, S]`
    pub split_lse: Array3<f32>,
    /// `[D, H, Lkv]`
    pub attn_latent: Array3<f32>,
}

impl DecodeStages {
    pub fn new(cfg: &MlaConfig, sched: &Schedule) -> DecodeStages {
        let (d, h, lkv, ns) = (
            sched.decode_tokens(),
            cfg.n_head,
            cfg.kv_lora_rank,
            sched.num_splits,
        );
        DecodeStages {
            q_abs: Array3::zeros((d, h, lkv)),
            split_out: Array4::zeros((d, h, ns, lkv)),
            split_lse: Array3::zeros((d, h, ns)),
            attn_latent: Array3::zeros((d, h, lkv)),
        }
    }
}

/// `q_abs = round(W_UK[h]ᵀ · q_nope[h])` for the tokens `r`, `[n, H, Lkv]` (f32 accumulation; in fp16
/// this can overflow to inf, as in real engines).
pub fn absorb_query(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    f: &MirrorFront,
    r: Range<usize>,
    dt: Dtype,
    fx: Active,
) -> Array3<f32> {
    let (p, lkv) = (cfg.qk_nope, cfg.kv_lora_rank);
    let mut q_abs = Array3::zeros((r.len(), cfg.n_head, lkv));
    for h in 0..cfg.n_head {
        let qn = f.q_nope.slice(s![r.clone(), h, ..]);
        let uk = mw.uk(cfg, h);
        // Fault: the stored k_b buffer (W_UKᵀ, [Lkv, P] row-major) read as [P, Lkv] without the transpose.
        let untransposed;
        let uk = match fx.on(Fault::KBUntransposed) {
            true => {
                untransposed = uk
                    .t()
                    .as_standard_layout()
                    .into_owned()
                    .into_shape_with_order((p, lkv))
                    .expect("P·Lkv elements");
                untransposed.view()
            }
            false => uk,
        };
        let out = match fx.on(Fault::QAbsFp16Accum) {
            // Fault: an fp16 GEMM (operands, accumulator and result in fp16; llama.cpp #13137).
            true => round_all(fp16_gemm(qn, uk), dt),
            false => round_all(qn.dot(&uk), dt),
        };
        q_abs.slice_mut(s![.., h, ..]).assign(&out);
    }
    q_abs
}

/// `a · b` as an fp16 GEMM computes it: operands converted to fp16, each multiply-add rounded to fp16
/// in order (an fp16 accumulator), an fp16 result; past ±65504 it is ±inf.
fn fp16_gemm(a: ndarray::ArrayView2<f32>, b: ndarray::ArrayView2<f32>) -> Array2<f32> {
    let h = |x: f32| half::f16::from_f32(x).to_f32();
    Array2::from_shape_fn((a.nrows(), b.ncols()), |(i, j)| {
        (0..a.ncols()).fold(0f32, |acc, k| h(acc + h(a[[i, k]]) * h(b[[k, j]])))
    })
}

/// One split's partial for query `(q_abs, q_pe)` over cache rows `keys`.
pub fn split_partial(
    cfg: &MlaConfig,
    cache: &PagedCache,
    qa: &[f32],
    qp: &[f32],
    keys: Range<usize>,
    dt: Dtype,
) -> Partial {
    split_partial_fx(cfg, cache, qa, qp, keys, dt, Active::NONE, None)
}

/// `split_partial` with the faults of the split's tile loop (`keys` are the split's keys this query sees).
#[allow(clippy::too_many_arguments)]
pub fn split_partial_fx(
    cfg: &MlaConfig,
    cache: &PagedCache,
    qa: &[f32],
    qp: &[f32],
    mut keys: Range<usize>,
    dt: Dtype,
    fx: Active,
    sel: Option<(&Selection, usize)>,
) -> Partial {
    let lkv = cfg.kv_lora_rank;
    let scale = cfg.softmax_scale as f32;
    // Fault: the tile loop stops at the last full tile when the split holds more than one tile.
    if fx.on(Fault::SplitTailDropped) && keys.len() > TILE {
        keys.end = keys.start + keys.len() / TILE * TILE;
    }
    // Fault: keys 32..63 of each tile (the Hopper kernel's second warpgroup) scored −inf, i.e. dropped:
    // exp(−inf) = 0 exactly, and a tile with any key seen always has one in its first half.
    let (start, drop_upper) = (keys.start, fx.on(Fault::Wg2KeysDropped));
    // Fault: a sparse reader's key index is the key's position, the block table skipped.
    let raw = sel.is_some() && fx.on(Fault::SparseIndexPageBase);
    // Kernel-variant faults (`fx` has them only where the launch's kernel does: `decode_faults`): the
    // row key j is read from.
    let from = variant_row(fx, keys.start, cache.page_size);
    let row = |j: usize| match raw {
        true => cache.raw_row(j),
        false => cache.row(from(j)),
    };
    let score = |j: usize| {
        if drop_upper && (j - start) % TILE >= TILE / 2 {
            return f32::NEG_INFINITY;
        }
        // DSA: a key the query's selection drops (`sel`: the selection and the query token).
        if let Some((sel, t)) = sel {
            if !sel.allows(t, j) {
                return f32::NEG_INFINITY;
            }
        }
        let row = row(j);
        (dot(qa, &row[..lkv]) + rope_dot(qp, &row[lkv..])) * scale
    };
    let value = |j: usize| &row(j)[..lkv];
    match fx.on(Fault::PairsHandoverStale) {
        // Fault: attn_wgmma_pairs's hand-over without the rescale.
        true => attend_handover_stale(keys, lkv, dt, score, value),
        false => attend(keys, lkv, dt, score, value),
    }
}

/// Stages of `attn_small`'s key ring (`SM_NS` in kernels/sm90/decode/attn_small.cuh).
const SMALL_STAGES: usize = 2;

/// The key whose cache row key `j` of a split starting at `lo` is read from, under the kernel-variant
/// faults of `fx` (pages of `page` keys): attn_small's ring fetching 32-key tile `it` (from `lo` rounded
/// down to 32) as tile `it % SM_NS` (`small_ring_wrap`); attn_wgmma's TMA box of a 64-key tile starting
/// at its page's first row (`tma_page_tile`). Else `j` itself.
fn variant_row(fx: Active, lo: usize, page: usize) -> impl Fn(usize) -> usize {
    let (wrap, page_tile) = (fx.on(Fault::SmallRingWrap), fx.on(Fault::TmaPageTile));
    move |j| {
        if wrap {
            let jb = lo / 32 * 32;
            jb + (j - jb) / 32 % SMALL_STAGES * 32 + (j - jb) % 32
        } else if page_tile {
            j / page * page + j % TILE
        } else {
            j
        }
    }
}

/// The layer's faults `fx` as a decode launch of `q_len` queries (the module's rows per query) over
/// `n_keys` keys runs them (the rules' kernel for it on sm_90a, `tiles::variants::faults_at`): `cfg`
/// the kernels' view (its heads), `sched` the page and split count.
pub fn decode_faults(
    fx: Active,
    cfg: &MlaConfig,
    sched: &Schedule,
    dt: Dtype,
    q_len: usize,
    n_keys: usize,
) -> Active {
    let l = crate::tiles::variants::Launch {
        heads: cfg.n_head,
        q_len,
        page: sched.page_size,
        splits: sched.num_splits,
        n_keys,
    };
    crate::tiles::variants::faults_at(fx, &crate::tiles::Dims::of_model(cfg, dt), &l)
}

/// One query row's decode (`qa`, `qp`) over `splits` with keys visible up to `end` (exclusive): each
/// split's partial as stored (with the faults of the split loop: `fx` as the launch runs them), and
/// their combine (with the combine's faults), rounded to the dtype.
#[allow(clippy::too_many_arguments)]
pub fn query_row(
    cfg: &MlaConfig,
    cache: &PagedCache,
    qa: &[f32],
    qp: &[f32],
    splits: &[Range<usize>],
    end: usize,
    dt: Dtype,
    fx: Active,
    sel: Option<(&Selection, usize)>,
) -> (Vec<Partial>, Partial) {
    let last = splits.len() - 1;
    let parts: Vec<Partial> = splits
        .iter()
        .enumerate()
        .map(|(k, sr)| {
            let mut keys = sr.start..sr.end.min(end);
            // Fault: the last split's key loop runs one row past the sequence end.
            if k == last && fx.on(Fault::ReadPastEnd) {
                keys.end += 1;
            }
            let p = split_partial_fx(cfg, cache, qa, qp, keys, dt, fx, sel);
            // Fault: the split's LSE stored in bf16 before the combine reads it.
            match fx.on(Fault::SplitLseBf16) {
                true => Partial {
                    lse: half::bf16::from_f32(p.lse).to_f32(),
                    ..p
                },
                false => p,
            }
        })
        .collect();
    // Faults in the split combine: the last split dropped; the lse merged in base 2.
    let used = match fx.on(Fault::SplitDropLast) {
        true => &parts[..last],
        false => &parts[..],
    };
    let m = match fx.on(Fault::LseLog2Merge) {
        // With one split the fault drops it: nothing merged is out 0, lse −inf, at the
        // partials' width (as decode.cu's combine writes it).
        _ if used.is_empty() => Partial::empty(parts[0].out.len()),
        true => merge_log2(used),
        false => merge(used),
    }
    .rounded(dt);
    (parts, m)
}

/// Decode step `r` (its rows already cached; keys `0..r.end`, causal within the step). Fills the
/// decode stages and `heads`/`lse` of the step's tokens.
#[allow(clippy::too_many_arguments)]
pub fn step(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    f: &MirrorFront,
    cache: &PagedCache,
    r: Range<usize>,
    sched: &Schedule,
    dt: Dtype,
    fx: Active,
    sel: Option<&Selection>,
    out: &mut DecodeStages,
    heads: &mut Array3<f32>,
    lse: &mut Array2<f32>,
) {
    let d0 = r.start - sched.prompt_len;
    let q_abs = absorb_query(cfg, mw, f, r.clone(), dt, fx);
    let splits = sched.split_ranges(r.end);
    // The kernel-variant faults where the step's launch runs their kernel (the module's q_len); none
    // in the sparse kernel (DSA past top_k).
    let fx = match sel {
        Some(_) => crate::tiles::variants::sparse_faults(fx),
        None => decode_faults(fx, cfg, sched, dt, sched.q_len, r.end),
    };
    for (i, t) in r.clone().enumerate() {
        for h in 0..cfg.n_head {
            let qa = row3(&q_abs, i, h);
            let qp = row3(&f.q_pe, t, h);
            let end = causal_end(t, fx);
            let (parts, m) = query_row(
                cfg,
                cache,
                qa,
                qp,
                &splits,
                end,
                dt,
                fx,
                sel.map(|s| (s, t)),
            );
            for (k, p) in parts.iter().enumerate() {
                out.split_out
                    .slice_mut(s![d0 + i, h, k, ..])
                    .assign(&ArrayView1::from(&p.out));
                out.split_lse[[d0 + i, h, k]] = p.lse;
            }
            out.attn_latent
                .slice_mut(s![d0 + i, h, ..])
                .assign(&ArrayView1::from(&m.out));
            lse[[t, h]] = m.lse;
        }
    }
    out.q_abs
        .slice_mut(s![d0..d0 + r.len(), .., ..])
        .assign(&q_abs);
    for h in 0..cfg.n_head {
        let lat = out.attn_latent.slice(s![d0..d0 + r.len(), h, ..]);
        heads
            .slice_mut(s![r.clone(), h, ..])
            .assign(&round_all(lat.dot(&mw.uv(cfg, h).t()), dt));
    }
}
