//! The serving-shaped decode batch through the mirror's decode (issue #32, item 6; the batch, its pool
//! and its judgement are `backend::serving`): per request its own block table, length and split
//! partition, the mirror's split partials and combine.

use super::cache::PagedCache;
use super::decode::split_partial;
use super::flash::{merge, Partial};
use super::row3;
use crate::backend::runner::checks::RunnerCheck;
use crate::backend::serving::{judge, Batch, Outputs, Query};
use crate::backend::LayerCtx;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use ndarray::Array3;

/// A bug planted in the batch's combine, only for tests (no catalogue entry: the catalogue's faults
/// are each caught at a stage check of the default run, which this one by construction is not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// An empty split's partial (out 0, lse −inf) merged with weight 1, as a combine that weighs
    /// `exp(lse − max)` without the −inf guard on a partial whose lse was written as the running max.
    EmptySplitWeightOne,
}

/// Run the serving batch of `ctx.sched` at this layer: `acfg` the kernels' view of the config,
/// `q_abs` `[D, H, Lkv]` and `q_pe` `[T, H, R]` the stored queries, `cache` the run's cache after all
/// writes. Empty when the schedule has no decode step.
#[allow(clippy::too_many_arguments)]
pub fn checks(
    ctx: &LayerCtx,
    acfg: &MlaConfig,
    q_abs: &Array3<f32>,
    q_pe: &Array3<f32>,
    cache: &PagedCache,
    dt: Dtype,
    plant: Option<Plant>,
) -> Vec<RunnerCheck> {
    let (cfg, sched) = (ctx.cfg, ctx.sched);
    let Some(batch) = Batch::of(ctx) else {
        return Vec::new();
    };
    let (h, lkv, t) = (cfg.n_head, cfg.kv_lora_rank, sched.total_tokens());
    let rows: Vec<f32> = cache.gather(0..t).iter().copied().collect();
    let mut bc = PagedCache::from_pool(
        batch.width,
        batch.page,
        Vec::new(),
        batch.pool(&rows, f32::NAN),
    );

    // Our decode over the batch: per request its own table, length and split partition.
    let s = sched.num_splits;
    let n = batch.reqs.len();
    let mut out = Outputs {
        lat: vec![0f64; n * h * lkv],
        lse: vec![0f64; n * h],
        sout: vec![0f64; n * h * s * lkv],
        slse: vec![0f64; n * h * s],
    };
    for (i, q) in batch.reqs.iter().enumerate() {
        bc.table = batch.tables[i].clone();
        let splits = sched.split_ranges(q.seq_len);
        for hh in 0..h {
            let (qa, qp) = (
                row3(q_abs, q.query, hh),
                row3(q_pe, sched.prompt_len + q.query, hh),
            );
            let parts: Vec<Partial> = splits
                .iter()
                .map(|sr| split_partial(acfg, &bc, qa, qp, sr.clone(), dt))
                .collect();
            let row = i * h + hh;
            for (k, p) in parts.iter().enumerate() {
                let at = (row * s + k) * lkv;
                for (o, &v) in out.sout[at..at + lkv].iter_mut().zip(&p.out) {
                    *o = v as f64;
                }
                out.slse[row * s + k] = p.lse as f64;
            }
            let m = match plant {
                Some(Plant::EmptySplitWeightOne) => {
                    let top = parts
                        .iter()
                        .map(|p| p.lse)
                        .fold(f32::NEG_INFINITY, f32::max);
                    let moved: Vec<Partial> = parts
                        .iter()
                        .map(|p| match p.lse == f32::NEG_INFINITY {
                            true => Partial {
                                out: p.out.clone(),
                                lse: top,
                            },
                            false => p.clone(),
                        })
                        .collect();
                    merge(&moved)
                }
                None => merge(&parts),
            }
            .rounded(dt);
            for (o, &v) in out.lat[row * lkv..(row + 1) * lkv].iter_mut().zip(&m.out) {
                *o = v as f64;
            }
            out.lse[row] = m.lse as f64;
        }
    }

    // fp64 from the batch's own inputs (the stored queries and cache rows), as for a runner's batch.
    let rows: Vec<f64> = rows.iter().map(|&v| v as f64).collect();
    let queries: Vec<Query> = batch
        .reqs
        .iter()
        .map(|q| Query {
            q_abs: (0..h)
                .flat_map(|hh| row3(q_abs, q.query, hh).iter().map(|&v| v as f64))
                .collect(),
            q_pe: (0..h)
                .flat_map(|hh| {
                    row3(q_pe, sched.prompt_len + q.query, hh)
                        .iter()
                        .map(|&v| v as f64)
                })
                .collect(),
        })
        .collect();
    judge(ctx, &batch, &queries, &rows, &out, dt, "our decode")
}
