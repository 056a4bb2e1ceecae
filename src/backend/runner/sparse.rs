//! The sparse_prefill op (DSA past top_k, docs/dsa.md): each prefill chunk's absorbed queries over the
//! cache slots of their selected keys, as FlashMLA's `flash_mla_sparse_fwd` takes them: q =
//! `[W_UKᵀ·q_nope | q_pe]` `[n, H, Lkv + R]`, the latent cache flat `[slots, 1, Lkv + R]` (slot =
//! physical page · page_size + offset; every slot not yet holding a token is NaN) and the index rows
//! `[n, 1, topk]` (`reference::sparse::flashmla_indices`, −1 padded). The runner returns the latent
//! output and the LSE; W_UV and o_proj are the CPU mirror's, as for a decode runner.
//!
//! The selection is `LayerCtx::selection`: the DSA driver runs the layer once with the reference's
//! selection and once with the optimized side's own (`run::dsa`), so the runner sees both, as the
//! CUDA sparse path does, and a kernel error is told apart from a selection difference.

use super::local::{self, Yardstick};
use super::prefill::put_prefill_outputs;
use super::tensors::{floats, ints};
use super::{stage, RunnerBackend};
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::cpu::ops::round_all;
use crate::backend::LayerCtx;
use crate::error::{Error, Result};
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::reference::sparse::{flashmla_indices, Selection};
use crate::trace::{AtRunner, LayerTrace, Stage};
use ndarray::Array2;
use rayon::prelude::*;
use std::ops::Range;

impl RunnerBackend {
    /// One request per prefill chunk; the chunk's rows are in the cache before its request (the
    /// engine writes them first), later tokens' slots are NaN.
    pub(super) fn sparse_prefill(
        &mut self,
        ctx: &LayerCtx,
        sel: &Selection,
        mw: &MirrorWeights,
        tr: &mut LayerTrace,
        at: &mut Vec<AtRunner>,
    ) -> Result<()> {
        let (cfg, sched, dt) = (ctx.cfg, ctx.sched, self.dtype);
        let (h, lkv, dv) = (cfg.n_head, cfg.kv_lora_rank, cfg.v_head_dim);
        let (row, prompt, t_all) = (lkv + cfg.qk_rope, sched.prompt_len, sched.total_tokens());
        if sel.n_queries() < prompt {
            return Err(Error::Usage(format!(
                "layer {}: the selection holds {} queries, the prompt {prompt}",
                ctx.layer,
                sel.n_queries()
            )));
        }
        let (q_nope, q_pe, rows) = (
            stage(tr, Stage::QNope)?,
            stage(tr, Stage::QPe)?,
            stage(tr, Stage::CacheRows)?,
        );
        let q = absorbed_queries(cfg, mw, dt, &q_nope, &q_pe, prompt);
        let mut pool = SlotPool::new(ctx.block_table, sched.page_size, row);
        let mut lat = LatentRows::new(t_all, h, lkv);
        for c in sched.prefill_chunks() {
            pool.write(&c, &rows);
            let topk = self.send_sparse_prefill(ctx, sel, &c, &q, &pool, &mut lat)?;
            lat.add_fp64(&c, sel, &q, &pool, cfg.softmax_scale);
            lat.max_keys = lat.max_keys.max(topk);
        }
        let [heads_ref, heads_opt] = project_heads(cfg, mw, dt, &lat, prompt);
        put_prefill_outputs(
            tr,
            &heads_opt[..prompt * h * dv],
            &lat.lse_opt[..prompt * h],
        )?;

        // The latent's own rounding (its dtype) plus W_UV's output rounding: within the coarser
        // type's bound (local::tolerance), as for the decode runner's heads.
        let y = Yardstick {
            dtype: dt,
            terms: lat.max_keys * row,
        };
        at.push(y.check(
            "lse[prefill]",
            Stage::Lse,
            &[t_all, h],
            [lat.lse_ref, lat.lse_opt],
            lat.lse_dtype,
        ));
        at.push(y.check(
            "attn_heads[prefill]",
            Stage::AttnHeads,
            &[t_all, h, dv],
            [heads_ref, heads_opt],
            lat.lat_dtype,
        ));
        Ok(())
    }

    /// Chunk `c`'s request: its queries, the pool as it stands, each query's selected slots (the
    /// longest selection's count, at least top_k, −1 padded). Stores the returned latent and LSE in
    /// `lat`; returns the index rows' width.
    fn send_sparse_prefill(
        &mut self,
        ctx: &LayerCtx,
        sel: &Selection,
        c: &Range<usize>,
        q: &[f32],
        pool: &SlotPool,
        lat: &mut LatentRows,
    ) -> Result<usize> {
        let (h, lkv, dt) = (ctx.cfg.n_head, ctx.cfg.kv_lora_rank, self.dtype);
        let (n, row) = (c.len(), pool.row);
        let topk = c
            .clone()
            .map(|t| sel.keys[t].len())
            .max()
            .unwrap_or(0)
            .max(sel.top_k)
            .max(1);
        let mut idx = Vec::with_capacity(n * topk);
        for t in c.clone() {
            idx.extend(flashmla_indices(&sel.keys[t], topk, pool.table, pool.page));
        }
        let inputs = [
            floats(
                "q",
                vec![n, h, row],
                &q[c.start * h * row..c.end * h * row],
                dt,
            ),
            floats("kv", vec![pool.slots, 1, row], &pool.pool, dt),
            ints("indices", vec![n, 1, topk], &idx),
        ];
        let meta = self.meta(
            ctx,
            serde_json::json!({ "context_len": c.start, "top_k": sel.top_k, "d_v": lkv }),
        );
        let mut out = self.call("sparse_prefill", ctx.layer, &meta, &inputs)?;
        let latent = out.take("attn_latent", &[n, h, lkv], "sparse_prefill")?;
        let lse_o = out.take("lse", &self.lse_shape(None, n, h), "sparse_prefill")?;
        let lse = self.lse_rows(&lse_o, 1, n, h);
        lat.lat_dtype = latent.dtype;
        lat.lse_dtype = lse_o.dtype;
        lat.lat_opt[c.start * h * lkv..c.end * h * lkv].copy_from_slice(&latent.data);
        lat.lse_opt[c.start * h..c.end * h].copy_from_slice(&lse);
        Ok(topk)
    }
}

/// The absorbed query `[T, H, Lkv + R]` of the prompt, `[W_UKᵀ·q_nope | q_pe]`, stored in the run's
/// dtype (the mirror's rule, as the CUDA sparse path).
fn absorbed_queries(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    dt: Dtype,
    q_nope: &[f64],
    q_pe: &[f64],
    prompt: usize,
) -> Vec<f32> {
    let (h, lkv, p, r) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_rope);
    let row = lkv + r;
    let mut q = vec![0f32; prompt * h * row];
    for hh in 0..h {
        let qn = Array2::from_shape_fn((prompt, p), |(t, i)| q_nope[(t * h + hh) * p + i] as f32);
        let qa = round_all(qn.dot(&mw.uk(cfg, hh)), dt);
        for t in 0..prompt {
            let dst = (t * h + hh) * row;
            for (d, &v) in q[dst..dst + lkv].iter_mut().zip(qa.row(t)) {
                *d = v;
            }
            for (d, &v) in q[dst + lkv..dst + row]
                .iter_mut()
                .zip(&q_pe[(t * h + hh) * r..(t * h + hh + 1) * r])
            {
                *d = v as f32;
            }
        }
    }
    q
}

/// The latent cache flat as FlashMLA's sparse prefill takes it, `[slots, Lkv + R]` (slot = physical
/// page · page_size + offset through the run's block table), NaN where no token is yet; `pool64` is
/// the same values in f64, what the yardstick reads.
struct SlotPool<'a> {
    table: &'a [usize],
    page: usize,
    row: usize,
    slots: usize,
    pool: Vec<f32>,
    pool64: Vec<f64>,
}

impl<'a> SlotPool<'a> {
    fn new(table: &'a [usize], page: usize, row: usize) -> Self {
        let slots = (table.iter().copied().max().unwrap_or(0) + 1) * page;
        SlotPool {
            table,
            page,
            row,
            slots,
            pool: vec![f32::NAN; slots * row],
            pool64: vec![f64::NAN; slots * row],
        }
    }

    /// Token `j`'s slot.
    fn slot(&self, j: usize) -> usize {
        self.table[j / self.page] * self.page + j % self.page
    }

    /// Chunk `c`'s cache rows into their slots (the engine writes them before the chunk's attention).
    fn write(&mut self, c: &Range<usize>, rows: &[f64]) {
        let row = self.row;
        for j in c.clone() {
            let s0 = self.slot(j) * row;
            for k in 0..row {
                self.pool[s0 + k] = rows[j * row + k] as f32;
                self.pool64[s0 + k] = self.pool[s0 + k] as f64;
            }
        }
    }
}

/// The sparse prefill's latent output `[T, H, Lkv]` and LSE `[T, H]` over the run's tokens (prompt
/// rows filled chunk by chunk): fp64 from the runner's inputs (`*_ref`) and what it returned
/// (`*_opt`), with the dtypes it returned and the widest index rows sent.
struct LatentRows {
    h: usize,
    lkv: usize,
    lat_ref: Vec<f64>,
    lse_ref: Vec<f64>,
    lat_opt: Vec<f64>,
    lse_opt: Vec<f64>,
    lat_dtype: &'static str,
    lse_dtype: &'static str,
    max_keys: usize,
}

impl LatentRows {
    fn new(t_all: usize, h: usize, lkv: usize) -> Self {
        LatentRows {
            h,
            lkv,
            lat_ref: vec![0.0; t_all * h * lkv],
            lse_ref: vec![0.0; t_all * h],
            lat_opt: vec![0.0; t_all * h * lkv],
            lse_opt: vec![0.0; t_all * h],
            lat_dtype: "bf16",
            lse_dtype: "f32",
            max_keys: 0,
        }
    }

    /// fp64 attention of chunk `c`'s queries from exactly what the runner was given: its q, the cache
    /// slots its rows name.
    fn add_fp64(
        &mut self,
        c: &Range<usize>,
        sel: &Selection,
        q: &[f32],
        pool: &SlotPool,
        scale: f64,
    ) {
        let (h, lkv, row) = (self.h, self.lkv, pool.row);
        let pool64 = &pool.pool64;
        let fp64: Vec<(Vec<f64>, f64)> = (0..c.len() * h)
            .into_par_iter()
            .map(|ih| {
                let (t, hh) = (c.start + ih / h, ih % h);
                let qi: Vec<f64> = q[(t * h + hh) * row..(t * h + hh + 1) * row]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let keys = &sel.keys[t];
                let at_slot = |k: usize| pool.slot(keys[k] as usize) * row;
                local::attend(
                    0..keys.len(),
                    lkv,
                    |k| local::dot(&qi, &pool64[at_slot(k)..at_slot(k) + row]) * scale,
                    |k| &pool64[at_slot(k)..at_slot(k) + lkv],
                )
            })
            .collect();
        for (ih, (o, l)) in fp64.into_iter().enumerate() {
            let at = c.start * h + ih;
            self.lat_ref[at * lkv..(at + 1) * lkv].copy_from_slice(&o);
            self.lse_ref[at] = l;
        }
    }
}

/// W_UV over the prompt's latent, `[reference, optimized]` heads `[T, H, Dv]`: the runner's latent
/// stored in the dtype, then the mirror's projection (what the engine does after the kernel); the
/// yardstick is fp64 through the same stored weights.
fn project_heads(
    cfg: &MlaConfig,
    mw: &MirrorWeights,
    dt: Dtype,
    lat: &LatentRows,
    prompt: usize,
) -> [Vec<f64>; 2] {
    let (h, lkv, dv) = (cfg.n_head, cfg.kv_lora_rank, cfg.v_head_dim);
    let t_all = lat.lse_ref.len() / h;
    let mut heads_ref = vec![0.0; t_all * h * dv];
    let mut heads_opt = vec![0.0; t_all * h * dv];
    for hh in 0..h {
        let uv = mw.uv(cfg, hh);
        let lat32 = Array2::from_shape_fn((prompt, lkv), |(t, k)| {
            dt.round(lat.lat_opt[(t * h + hh) * lkv + k] as f32)
        });
        let o = round_all(lat32.dot(&uv.t()), dt);
        let lat64 =
            Array2::from_shape_fn((prompt, lkv), |(t, k)| lat.lat_ref[(t * h + hh) * lkv + k]);
        let o64 = lat64.dot(&uv.mapv(|v| v as f64).t());
        for t in 0..prompt {
            let at = (t * h + hh) * dv;
            for d in 0..dv {
                heads_opt[at + d] = o[[t, d]] as f64;
                heads_ref[at + d] = o64[[t, d]];
            }
        }
    }
    [heads_ref, heads_opt]
}
