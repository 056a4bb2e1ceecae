//! The serving-shaped decode batch on our decode kernel (issue #32, item 6; the batch, its pool and its
//! judgement are `backend::serving`): one launch over every request, as a serving engine launches its
//! batch — per entry its own `seq_lens`, its own block table row into one pool (unused slots point at a
//! NaN page) and the split partition of its own length, then the combine. The kernel is the one the
//! layer loaded (with any planted kernel fault), chosen among its variants by the batch's longest
//! request, as `Attn::run` chooses for any launch.

use super::args::AttnArgs;
use super::device::{encode, DevBuf};
use super::layer::Layer;
use super::trace::down;
use crate::backend::runner::checks::RunnerCheck;
use crate::backend::serving::{judge, Batch, Outputs, Query};
use crate::backend::LayerCtx;
use crate::error::Result;

impl Layer<'_> {
    /// Run and judge the serving batch of `ctx.sched` (after `finish`: the cache rows are gathered).
    /// Empty when the schedule has no decode step.
    pub fn serving_batch(&self, ctx: &LayerCtx) -> Result<Vec<RunnerCheck>> {
        let Some(batch) = Batch::of(ctx) else {
            return Ok(Vec::new());
        };
        let (z, a) = (&self.z, self.a);
        let (dt, es, h, lkv, row, ns) = (z.dt, z.es, z.h, z.lkv, z.row, z.ns);
        let (n, page) = (batch.reqs.len(), batch.page);

        // The run's cache rows and decode queries `[q_abs | q_pe]`, as stored.
        let rows = down(&a.ctx_rows, dt, 0, z.t_all * row)?;
        let qf = down(&a.qfull, dt, 0, z.td * h * row)?;
        let queries: Vec<Query> = batch
            .reqs
            .iter()
            .map(|q| {
                let head = |hh: usize| &qf[(q.query * h + hh) * row..(q.query * h + hh + 1) * row];
                Query {
                    q_abs: (0..h).flat_map(|hh| head(hh)[..lkv].to_vec()).collect(),
                    q_pe: (0..h).flat_map(|hh| head(hh)[lkv..].to_vec()).collect(),
                }
            })
            .collect();

        // The pool, then one NaN page that every unused table slot points at.
        let mut pool = batch.pool(&rows, f64::NAN);
        pool.extend(std::iter::repeat_n(f64::NAN, page * row));
        let (table, max_pages) = batch.flat_table();
        let lens: Vec<i32> = batch.lens().iter().map(|&l| l as i32).collect();
        // Each request's query rows as stored: decode token `q.query`'s `[H, Lkv + R]` block of qfull.
        let q: Vec<f64> = batch
            .reqs
            .iter()
            .flat_map(|q| {
                qf[q.query * h * row..(q.query + 1) * h * row]
                    .iter()
                    .copied()
            })
            .collect();
        let (pool_d, table_d, lens_d) = (
            DevBuf::upload(&encode(dt, pool.into_iter()))?,
            DevBuf::upload(&table)?,
            DevBuf::upload(&lens)?,
        );
        let q_d = DevBuf::upload(&encode(dt, q.into_iter()))?;
        let lat_d = DevBuf::alloc(n * h * lkv * es)?;
        let lse_d = DevBuf::alloc(n * h * 4)?;
        let po_d = DevBuf::alloc(n * h * ns * lkv * 4)?;
        let pl_d = DevBuf::alloc(n * h * ns * 4)?;
        let args = AttnArgs {
            q: q_d.ptr,
            ka: pool_d.ptr,
            kb: pool_d.ptr,
            v: pool_d.ptr,
            table: table_d.ptr,
            seq_lens: lens_d.ptr,
            out: lat_d.ptr,
            lse: lse_d.ptr,
            part_out: po_d.ptr,
            part_lse: pl_d.ptr,
            // The launch's key count picks the kernel variant (`Attn::run`); each entry reads its own.
            n_keys: *lens.iter().max().unwrap_or(&1),
            num_splits: ns as i32,
            scale_log2: z.scale_log2,
            ..AttnArgs::decode_batch(h, lkv, row - lkv, max_pages)
        };
        let dec = &self.k.decode;
        dec.run(&args, n as u32)?;
        let partials = self.debug || ns > 1;
        if partials {
            dec.combine(&args, n * h)?;
        }
        self.gpu.sync("the serving batch's decode")?;
        let out = Outputs {
            lat: down(&lat_d, dt, 0, n * h * lkv)?,
            lse: lse_d
                .read::<f32>(0, n * h)?
                .into_iter()
                .map(f64::from)
                .collect(),
            sout: match partials {
                true => po_d
                    .read::<f32>(0, n * h * ns * lkv)?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
                false => Vec::new(),
            },
            slse: match partials {
                true => pl_d
                    .read::<f32>(0, n * h * ns)?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
                false => Vec::new(),
            },
        };
        let who = format!(
            "our decode ({}, one launch)",
            dec.launches(args.n_keys, args.num_splits)
        );
        Ok(judge(ctx, &batch, &queries, &rows, &out, dt, &who))
    }
}
