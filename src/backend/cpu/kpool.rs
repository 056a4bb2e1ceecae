//! glm5-next's k-pool DSA indexer at the engine's precision (the CPU mirror's; the fp64 one is
//! `reference::kpool`), as llama.cpp's glm5-next graph computes it (`src/models/glm5-next.cpp`,
//! `build_kpool_select`):
//!
//! - q, the normed k and the head weights as GLM-5's mirror indexer (`indexer::operands`, no rope):
//!   q and k stored in the run's dtype, the weights in f32 pre-scaled by `(Hi·Di)^-0.5`;
//! - gate scores `g = attn_in · gateᵀ`, the gate kept in f32 (the converter forces it to F32, and
//!   llama.cpp reads it so), **stored in the run's dtype**: llama.cpp caches each token's `key | gate`
//!   row in the indexer cache, of the context's cache type;
//! - per complete pool, in f32 (the cache rows gathered back to f32): logits `g + ape` (the APE kept in
//!   f32), a softmax over the slots per channel (`ggml_soft_max` on `[kpool]` rows), the pooled key
//!   `Σ_s prob · k`, **stored in the run's dtype** (the cache's pooled column, `scatter_pooled`);
//! - with fp8 keys (`KeyPrecision::Fp8`): q and the pooled keys (what the scores read) Hadamard-rotated
//!   and stored as fp8 e4m3 with per-128 scales, as GLM-5's mirror does its token keys (vLLM's fp8
//!   indexer cache). llama.cpp has no such cache (its cache type is f16/bf16/f32 or q8_0): the option
//!   is for an engine that keeps the pooled keys where GLM-5's engines keep the token keys; pooling
//!   itself stays in the run's dtype, as the cache's `key | gate` rows are;
//! - scores `Σ_h w · ReLU(q_h · K_p)` in f32 over every pool; the top `min(top_k / kpool, visible)`
//!   pools expanded to their keys, and the visible tail (`reference::kpool::select`).
//!
//! Planted bugs come in as a `kpool::Reading` (`plan_for`): the APE dropped, the softmax over channels,
//! no tail, pools counted from position 0 instead of the first real token.

use super::indexer::{attn_in, fp8_rows, operands, scale_blocks, Plan};
use super::ops::{dot, round_all};
use crate::error::Result;
use crate::faults::{Active, Fault};
use crate::model::{KpoolIndexer, KpoolLayer, LayerWeights, MlaConfig};
use crate::precision::{Dtype, KeyPrecision};
use crate::reference::kpool::{pool_starts, select, Reading};
use crate::reference::sparse::Selection;
use crate::rope::RopeTables;
use ndarray::{s, Array2, Array3};

/// What the mirror's k-pool indexer computes: the model, or a planted misreading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KpoolPlan {
    pub keys: KeyPrecision,
    pub reading: Reading,
}

/// The plan for a layer's planted faults. `pos_offset`: the run's first position; counting pools from
/// position 0 instead of the first real token shifts the grid by it (no effect where it is a multiple of
/// kpool: there the two agree).
pub fn plan_for(fx: Active, keys: KeyPrecision, pos_offset: usize) -> KpoolPlan {
    KpoolPlan {
        keys,
        reading: Reading {
            no_ape: fx.on(Fault::KpoolNoApe),
            softmax_over_channels: fx.on(Fault::KpoolSoftmaxChannels),
            no_tail: fx.on(Fault::KpoolNoTail),
            pools_from_slot_zero: if fx.on(Fault::KpoolFromPositionZero) {
                pos_offset
            } else {
                0
            },
        },
    }
}

/// The mirror's k-pool indexer of one layer.
#[derive(Debug, Clone)]
pub struct MirrorKpool {
    /// `[T, n_pools]` f32, over every pool (only the complete visible ones compete).
    pub pool_scores: Array2<f32>,
    pub pool_start: Vec<usize>,
    /// Per query, the chosen pools (indices into `pool_start`).
    pub pools: Vec<Vec<u32>>,
    pub selection: Selection,
}

/// The pooled keys `[n_pools, Di]` in the run's dtype from the stored keys and gate scores (`[T, Di]`).
fn pool(
    k: &Array2<f32>,
    g: &Array2<f32>,
    ape: &Array2<f32>,
    start: &[usize],
    r: Reading,
) -> Array2<f32> {
    let (kpool, di) = ape.dim();
    let mut out = Array2::<f32>::zeros((start.len(), di));
    let mut logit = Array2::<f32>::zeros((kpool, di));
    for (p, &s0) in start.iter().enumerate() {
        for s in 0..kpool {
            for c in 0..di {
                let a = if r.no_ape { 0.0 } else { ape[[s, c]] };
                logit[[s, c]] = g[[s0 + s, c]] + a;
            }
        }
        let prob = match r.softmax_over_channels {
            true => softmax_rows(logit.clone()),
            false => softmax_rows(logit.t().to_owned()).t().to_owned(),
        };
        for c in 0..di {
            out[[p, c]] = (0..kpool).map(|s| prob[[s, c]] * k[[s0 + s, c]]).sum();
        }
    }
    out
}

fn softmax_rows(mut x: Array2<f32>) -> Array2<f32> {
    for mut row in x.rows_mut() {
        let m = row.fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        row.mapv_inplace(|v| (v - m).exp());
        let z = row.sum();
        row.mapv_inplace(|v| v / z);
    }
    x
}

/// The mirror's k-pool indexer of a full layer on the layer input `x`.
#[allow(clippy::too_many_arguments)]
pub fn run(
    cfg: &MlaConfig,
    k: &KpoolIndexer,
    kw: &KpoolLayer,
    w: &LayerWeights,
    rope: &RopeTables,
    x: &Array2<f64>,
    dt: Dtype,
    plan: KpoolPlan,
) -> Result<MirrorKpool> {
    let tokens = Plan {
        keys: KeyPrecision::Storage,
        ..Plan::default()
    };
    if plan.keys == KeyPrecision::Fp8 && !k.ic.head_dim.is_power_of_two() {
        return Err(crate::error::Error::Usage(format!(
            "fp8 indexer keys need a power-of-two head dim for the Hadamard rotation, the file has {}",
            k.ic.head_dim
        )));
    }
    let ops = operands(cfg, &k.ic, &kw.index, w, rope, x, dt, tokens)?;
    let a = attn_in(cfg, w, x, dt);
    let g = round_all(a.dot(&kw.pool.gate.t()), dt);
    let t = x.nrows();
    let start = pool_starts(t, k.kp.kpool, plan.reading.pools_from_slot_zero);
    let mut keys = round_all(pool(&ops.k, &g, &kw.pool.ape, &start, plan.reading), dt);
    let mut q = ops.q;
    if plan.keys == KeyPrecision::Fp8 {
        let (qs, ks) = fp8_rows(&mut q, &mut keys);
        for (mut row, sc) in q.rows_mut().into_iter().zip(qs.rows()) {
            scale_blocks(row.as_slice_mut().expect("contiguous"), sc);
        }
        for (mut row, sc) in keys.rows_mut().into_iter().zip(ks.rows()) {
            scale_blocks(row.as_slice_mut().expect("contiguous"), sc);
        }
    }
    let pool_scores = scores(&q, &keys, &ops.weights);
    let (pools, selection) = select(&pool_scores.mapv(f64::from), &start, k, plan.reading);
    Ok(MirrorKpool {
        pool_scores,
        pool_start: start,
        pools,
        selection,
    })
}

/// `S[t, p] = Σ_h w[t, h] · ReLU(q[t, h] · K[p])` in f32 (the weights carry `(Hi·Di)^-0.5`).
fn scores(q: &Array3<f32>, keys: &Array2<f32>, w: &Array2<f32>) -> Array2<f32> {
    let (t, hi, _) = q.dim();
    Array2::from_shape_fn((t, keys.nrows()), |(tt, p)| {
        let kp = keys.row(p);
        let kp = kp.as_slice().expect("contiguous");
        (0..hi)
            .map(|h| {
                let qh = q.slice(s![tt, h, ..]);
                w[[tt, h]] * dot(qh.as_slice().expect("contiguous"), kp).max(0.0)
            })
            .sum()
    })
}
