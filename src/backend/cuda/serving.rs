//! The serving-shaped decode batch on our decode kernel (issue #32, item 6; the batch, its pool and its
//! judgement are `backend::serving`): one launch over every request, as a serving engine launches its
//! batch — per entry its own `seq_lens`, its own block table row into one pool (unused slots point at a
//! NaN page) and the split partition of its own length, then the combine. The kernel is the one the
//! layer loaded (with any planted kernel fault), chosen among its variants by the batch's longest
//! request, as `Attn::run` chooses for any launch.

use super::args::AttnArgs;
use super::attn::Attn;
use super::device::{encode, DevBuf};
use super::kernels::Kernels;
use super::launch::Sparse;
use super::layer::Layer;
use super::trace::down;
use crate::backend::runner::checks::RunnerCheck;
use crate::backend::serving::{aims, judge, sparse_aim, Aim, Batch, Outputs, Query, Record};
use crate::backend::LayerCtx;
use crate::error::Result;
use crate::tiles::Dims;

/// The layer's cache rows `[T, Lkv + R]` (token order) and decode queries `[D, H, Lkv + R]`, as stored,
/// read back once for all the batches of a layer (`Layer::stored`).
pub struct Stored {
    pub rows: Vec<f64>,
    pub qf: Vec<f64>,
}

impl Layer<'_> {
    /// The layer's stored cache rows and decode queries (after `finish`: the cache rows are gathered).
    pub fn stored(&self) -> Result<Stored> {
        let (z, a) = (&self.z, self.a);
        Ok(Stored {
            rows: down(&a.ctx_rows, z.dt, 0, z.t_all * z.row)?,
            qf: down(&a.qfull, z.dt, 0, z.td * z.h * z.row)?,
        })
    }

    /// Every batch of the layer (once per run, at the first layer `Record` asks for): the serving
    /// batch, one aimed batch per production variant the schedule misses, the sparse aim. The cache
    /// rows and queries are read back once for all of them.
    pub fn batches(
        &self,
        ctx: &LayerCtx,
        dims: &Dims,
        kernels: &mut Kernels,
        record: &mut Record,
        force_scalar: bool,
    ) -> Result<()> {
        let stored = self.stored()?;
        record.add(self.serving_batch(ctx, &stored)?);
        // Each aim's decode module, compiled for its page and head slice once for all layers
        // (`tiles::variants` says which kernel that selects on sm_90a; another device takes its own).
        for aim in aims(ctx.cfg, ctx.sched) {
            let (fcfg, fsched) = aim.frame(ctx.cfg, ctx.sched);
            let framed = LayerCtx {
                cfg: &fcfg,
                sched: &fsched,
                ..*ctx
            };
            let fdims = Dims {
                h: fcfg.n_head,
                page: fsched.page_size,
                ..*dims
            };
            let tiles = crate::tiles::decode_tiles(aim.launch.q_len * fcfg.n_head);
            let dec = Attn::load(kernels, self.gpu, "decode.cu", &fdims, &tiles, force_scalar)?;
            record.add_aimed(&aim.id, self.aimed_batch(&framed, &aim, &dec, &stored)?);
        }
        if let Some(sel) = sparse_aim(ctx) {
            let sp = Sparse::load(kernels, dims, &sel, ctx.block_table)?;
            let checks = self.sparse_aimed(ctx, &sp, &stored)?;
            record.add_aimed(crate::tiles::variants::SPARSE_ID, checks);
        }
        Ok(())
    }

    /// Run and judge the serving batch of `ctx.sched` over `st` (`stored`). Empty when the schedule
    /// has no decode step.
    pub fn serving_batch(&self, ctx: &LayerCtx, st: &Stored) -> Result<Vec<RunnerCheck>> {
        let Some(batch) = Batch::of(ctx) else {
            return Ok(Vec::new());
        };
        self.batch_on(
            "serving_batch",
            ctx,
            &batch,
            &self.k.decode,
            "our decode",
            st,
        )
    }

    /// Run and judge the batch aimed at `aim` (`serving::aims`) on `dec`, the decode module compiled
    /// for the aim's page and head slice (`framed`: the layer's context framed by `Aim::frame`).
    pub fn aimed_batch(
        &self,
        framed: &LayerCtx,
        aim: &Aim,
        dec: &Attn,
        st: &Stored,
    ) -> Result<Vec<RunnerCheck>> {
        let Some(batch) = Batch::aimed(framed, aim) else {
            return Ok(Vec::new());
        };
        let who = format!("our decode, {}", aim.label_of(self.z.h));
        self.batch_on("variant_batch", framed, &batch, dec, &who, st)
    }

    /// One batch on `dec` in one launch, judged as `check_name`: the queries of the first
    /// `ctx.cfg.n_head` heads of the layer's decode queries (all of them but for a head slice).
    fn batch_on(
        &self,
        check_name: &str,
        ctx: &LayerCtx,
        batch: &Batch,
        dec: &Attn,
        who: &str,
        st: &Stored,
    ) -> Result<Vec<RunnerCheck>> {
        let z = &self.z;
        let (dt, es, lkv, row) = (z.dt, z.es, z.lkv, z.row);
        // The layer's heads (the stride of its stored queries) and the batch's (a slice: the first).
        let (hz, h, ns) = (z.h, ctx.cfg.n_head, ctx.sched.num_splits);
        let (n, page) = (batch.reqs.len(), batch.page);

        let (rows, qf) = (&st.rows, &st.qf);
        let head = |t: usize, hh: usize| &qf[(t * hz + hh) * row..(t * hz + hh + 1) * row];
        let queries: Vec<Query> = batch
            .reqs
            .iter()
            .map(|q| Query {
                q_abs: (0..h)
                    .flat_map(|hh| head(q.query, hh)[..lkv].to_vec())
                    .collect(),
                q_pe: (0..h)
                    .flat_map(|hh| head(q.query, hh)[lkv..].to_vec())
                    .collect(),
            })
            .collect();

        // The pool, then one NaN page that every unused table slot points at.
        let mut pool = batch.pool(rows, f64::NAN);
        pool.extend(std::iter::repeat_n(f64::NAN, page * row));
        let (table, max_pages) = batch.flat_table();
        let lens: Vec<i32> = batch.lens().iter().map(|&l| l as i32).collect();
        // Each request's query rows as stored: decode token `q.query`'s `[h, Lkv + R]` block of qfull.
        let q: Vec<f64> = batch
            .reqs
            .iter()
            .flat_map(|q| (0..h).flat_map(move |hh| head(q.query, hh).iter().copied()))
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
        dec.run(&args, n as u32)?;
        let partials = self.debug || ns > 1;
        if partials {
            dec.combine(&args, n * h)?;
        }
        self.gpu.sync("a decode batch")?;
        let f32s = |b: &DevBuf, len: usize| -> Result<Vec<f64>> {
            Ok(b.read::<f32>(0, len)?.into_iter().map(f64::from).collect())
        };
        let out = Outputs {
            lat: down(&lat_d, dt, 0, n * h * lkv)?,
            lse: f32s(&lse_d, n * h)?,
            sout: match partials {
                true => f32s(&po_d, n * h * ns * lkv)?,
                false => Vec::new(),
            },
            slse: match partials {
                true => f32s(&pl_d, n * h * ns)?,
                false => Vec::new(),
            },
        };
        let who = format!(
            "{who} ({}, one launch)",
            dec.launches(args.n_keys, args.num_splits)
        );
        Ok(judge(
            check_name, ctx, batch, &queries, rows, &out, dt, &who,
        ))
    }
}
