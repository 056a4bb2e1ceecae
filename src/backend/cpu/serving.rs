//! The serving-shaped decode batch through the mirror's decode (issue #32, item 6; the batch, its pool
//! and its judgement are `backend::serving`): per request its own block table, length and split
//! partition, the mirror's split partials and combine.

use super::cache::PagedCache;
use super::decode::{decode_faults, query_row, split_partial_fx};
use super::flash::{merge, Partial};
use super::row3;
use crate::backend::runner::checks::RunnerCheck;
use crate::backend::serving::{
    aims, judge, judge_sparse, sparse_aim, Batch, Outputs, Query, Record,
};
use crate::backend::LayerCtx;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::reference::sparse::Selection;
use crate::tiles::variants::SPARSE_ID;
use ndarray::Array3;

/// A bug planted in the batch's combine, only for tests (no catalogue entry: the catalogue's faults
/// are each caught at a stage check of the default run, which this one by construction is not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// An empty split's partial (out 0, lse −inf) merged with weight 1, as a combine that weighs
    /// `exp(lse − max)` without the −inf guard on a partial whose lse was written as the running max.
    EmptySplitWeightOne,
}

/// The stored queries and cache a layer's decode left, which its batches read: `q_abs` `[D, H, Lkv]`
/// and `q_pe` `[T, H, R]`, `cache` the run's cache after all writes.
pub struct Stored<'a> {
    pub q_abs: &'a Array3<f32>,
    pub q_pe: &'a Array3<f32>,
    pub cache: &'a PagedCache,
}

/// Run the serving batch of `ctx.sched` at this layer and the batches aimed at the variants the
/// schedule does not reach (`serving::aims`), once per layer, each recorded in `record`: `acfg` the
/// kernels' view of the config.
pub fn run(
    ctx: &LayerCtx,
    acfg: &MlaConfig,
    st: &Stored,
    dt: Dtype,
    plant: Option<Plant>,
    record: &mut Record,
) {
    if !record.first_at(ctx.layer) {
        return;
    }
    // Every batch runs with the layer's faults (`ctx.faults`), as the CUDA batches run the layer's
    // kernels: each at its own launch (`decode::decode_faults`: a kernel-variant fault where the rules
    // pick its kernel for that launch).
    if let Some(batch) = Batch::of(ctx) {
        let q_len = ctx.sched.q_len;
        record.add(checks(
            "serving_batch",
            ctx,
            acfg,
            &batch,
            st,
            dt,
            (plant, q_len),
            "our decode",
        ));
    }
    for aim in aims(ctx.cfg, ctx.sched) {
        let (cfg, sched) = aim.frame(ctx.cfg, ctx.sched);
        let mut a = acfg.clone();
        a.n_head = cfg.n_head;
        let framed = LayerCtx {
            cfg: &cfg,
            sched: &sched,
            ..*ctx
        };
        let Some(batch) = Batch::aimed(&framed, &aim) else {
            continue;
        };
        let who = format!("our decode, {}", aim.label_of(ctx.cfg.n_head));
        let how = (plant, aim.launch.q_len);
        let c = checks("variant_batch", &framed, &a, &batch, st, dt, how, &who);
        record.add_aimed(&aim.id, c);
    }
    if let Some(sel) = sparse_aim(ctx) {
        record.add_aimed(SPARSE_ID, sparse(ctx, acfg, &sel, st, dt));
    }
}

/// The batch aimed at the sparse kernel (`serving::sparse_aim`): each decode query over its selected
/// keys of the run's cache, one split, with the layer's faults (a sparse reader's index faults show
/// here), judged by `serving::judge_sparse`.
fn sparse(
    ctx: &LayerCtx,
    acfg: &MlaConfig,
    sel: &Selection,
    st: &Stored,
    dt: Dtype,
) -> Vec<RunnerCheck> {
    let (sched, h, lkv) = (ctx.sched, ctx.cfg.n_head, ctx.cfg.kv_lora_rank);
    let (p0, d) = (sched.prompt_len, sched.decode_tokens());
    let mut out = Outputs {
        lat: vec![0f64; d * h * lkv],
        lse: vec![0f64; d * h],
        sout: Vec::new(),
        slse: Vec::new(),
    };
    let mut queries = Vec::with_capacity(d);
    for i in 0..d {
        let t = p0 + i;
        let mut q = Query {
            q_abs: Vec::with_capacity(h * lkv),
            q_pe: Vec::new(),
        };
        for hh in 0..h {
            let (qa, qp) = (row3(st.q_abs, i, hh), row3(st.q_pe, t, hh));
            q.q_abs.extend(qa.iter().map(|&v| v as f64));
            q.q_pe.extend(qp.iter().map(|&v| v as f64));
            let keys = 0..t + 1;
            let fx = crate::tiles::variants::sparse_faults(ctx.faults);
            let p = split_partial_fx(acfg, st.cache, qa, qp, keys, dt, fx, Some((sel, t)));
            let m = merge(&[p]).rounded(dt);
            let row = i * h + hh;
            for (o, &v) in out.lat[row * lkv..(row + 1) * lkv].iter_mut().zip(&m.out) {
                *o = v as f64;
            }
            out.lse[row] = m.lse as f64;
        }
        queries.push(q);
    }
    let t = sched.total_tokens();
    let rows: Vec<f64> = st
        .cache
        .rows(0..t, ctx.cfg.cache_row())
        .iter()
        .map(|&v| v as f64)
        .collect();
    judge_sparse(
        ctx,
        sel,
        &queries,
        &rows,
        &out,
        dt,
        "our decode (sparse_attn, one split)",
    )
}

/// One batch through the mirror's decode with the layer's faults, judged (`serving::judge`) as check
/// `check_name`: `how` the test plant and the launch's queries per step (the module's rows per query).
#[allow(clippy::too_many_arguments)]
fn checks(
    check_name: &str,
    ctx: &LayerCtx,
    acfg: &MlaConfig,
    batch: &Batch,
    st: &Stored,
    dt: Dtype,
    how: (Option<Plant>, usize),
    who: &str,
) -> Vec<RunnerCheck> {
    let (plant, q_len) = how;
    let (cfg, sched) = (ctx.cfg, ctx.sched);
    let (q_abs, q_pe, cache) = (st.q_abs, st.q_pe, st.cache);
    let (h, lkv, t) = (cfg.n_head, cfg.kv_lora_rank, sched.total_tokens());
    let rows: Vec<f32> = cache.rows(0..t, cfg.cache_row()).iter().copied().collect();
    // The batch's cache, through the layer's format where it has one (its writer's faults included);
    // the judge's fp64 reads the run's rows, what a writer without a batch's faults stores.
    let mut bc = cache.for_batch(batch, t);

    // Our decode over the batch: per request its own table, length and split partition.
    let s = sched.num_splits;
    let n = batch.reqs.len();
    let mut out = Outputs {
        lat: vec![0f64; n * h * lkv],
        lse: vec![0f64; n * h],
        sout: vec![0f64; n * h * s * lkv],
        slse: vec![0f64; n * h * s],
    };
    // One launch over the batch: its key count is the longest request's.
    let n_keys = batch.lens().into_iter().max().unwrap_or(1);
    let fx = decode_faults(ctx.faults, acfg, sched, dt, q_len, n_keys);
    for (i, q) in batch.reqs.iter().enumerate() {
        bc.table = batch.tables[i].clone();
        let splits = sched.split_ranges(q.seq_len);
        for hh in 0..h {
            let (qa, qp) = (
                row3(q_abs, q.query, hh),
                row3(q_pe, sched.prompt_len + q.query, hh),
            );
            let (parts, merged) = query_row(acfg, &bc, qa, qp, &splits, q.seq_len, dt, fx, None);
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
                    merge(&moved).rounded(dt)
                }
                None => merged,
            };
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
    judge(check_name, ctx, batch, &queries, &rows, &out, dt, who)
}
