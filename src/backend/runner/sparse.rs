//! The sparse_prefill op (DSA past top_k, docs/dsa.md): each prefill chunk's absorbed queries over the
//! cache slots of their selected keys, as FlashMLA's `flash_mla_sparse_fwd` takes them: q =
//! `[W_UKᵀ·q_nope | q_pe]` `[n, H, Lkv + R]`, the latent cache flat `[slots, 1, Lkv + R]` (slot =
//! physical page · page_size + offset; every slot not yet holding a token is NaN) and the index rows
//! `[n, 1, topk]` (`reference::sparse::flashmla_indices`, −1 padded). The runner returns the latent
//! output and the LSE; W_UV and o_proj are the CPU mirror's, as for a decode runner.
//!
//! With `--kv-cache-dtype FMT` the cache travels in the format's bytes, `kv` u8 `[slots, 1,
//! bytes_per_token]` with `meta.cache` (as the decode op's, `cache.rs`); the `@runner` yardstick is fp64
//! over the rows decoded from them. Every key of a sparse prefill is read from that cache, the chunk's
//! own too (the inner path's prefill attends to its own chunk from the fresh rows): the end-to-end
//! prefill checks are widened by the cache's exact effect here, fp64 over the decoded rows minus over
//! the rows as the dtype stores them (`kv_latent | k_pe`).
//!
//! The selection is `LayerCtx::selection`: the DSA driver runs the layer once with the reference's
//! selection and once with the optimized side's own (`run::dsa`), so the runner sees both, as the
//! CUDA sparse path does, and a kernel error is told apart from a selection difference.

use super::cache::{cache_meta, latent_effects, u8_tensor};
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
        let (q_nope, q_pe) = (stage(tr, Stage::QNope)?, stage(tr, Stage::QPe)?);
        // A quantized cache: the rows as the dtype stores them, for the cache's effect.
        let plain = match self.kv.is_auto() {
            true => None,
            false => Some(plain_rows(tr, lkv, cfg.qk_rope)?),
        };
        let rows = self.encode_cache(lkv, cfg.qk_rope, stage(tr, Stage::CacheRows)?);
        let q = absorbed_queries(cfg, mw, dt, &q_nope, &q_pe, prompt);
        let n = self.cache_bytes.as_ref().map_or(0, |(c, _)| c.bytes());
        let mut pool = SlotPool::new(ctx.block_table, sched.page_size, row, n);
        let mut plain_pool = SlotPool::new(ctx.block_table, sched.page_size, row, 0);
        let mut lat = LatentRows::new(t_all, h, lkv);
        let scale = cfg.softmax_scale;
        for c in sched.prefill_chunks() {
            pool.write(&c, &rows, self.cache_bytes.as_ref().map(|b| &b.1[..]));
            let topk = self.send_sparse_prefill(ctx, sel, &c, &q, &pool, &mut lat)?;
            let (lr, sr) = lat.fp64(&c, sel, &q, &pool, scale);
            lat.put(&c, lr, sr);
            if let Some(p) = &plain {
                plain_pool.write(&c, p, None);
                let (lp, sp) = lat.fp64(&c, sel, &q, &plain_pool, scale);
                lat.effect(&c, lp, sp);
            }
            lat.max_keys = lat.max_keys.max(topk);
        }
        if let Some(codec) = self.cache_bytes.as_ref().map(|b| b.0) {
            let names = ["lse[prefill]", "attn_heads[prefill]", "attn_out[prefill]"];
            tr.cache_effect
                .retain(|e| !names.contains(&e.check.as_str()));
            let rows = (0..prompt, "prefill");
            let (e_lat, e_lse) = (
                lat.e_lat[..prompt * h * lkv].to_vec(),
                &lat.e_lse[..prompt * h],
            );
            let fx = latent_effects(ctx, mw, rows, e_lat, e_lse, codec.format.name());
            tr.cache_effect.extend(fx);
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
        let topk = sel.index_width(c.clone());
        let mut idx = Vec::with_capacity(n * topk);
        for t in c.clone() {
            idx.extend(flashmla_indices(&sel.keys[t], topk, pool.table, pool.page));
        }
        let mut extra =
            serde_json::json!({ "context_len": c.start, "top_k": sel.top_k, "d_v": lkv });
        let kv = match &self.cache_bytes {
            Some((codec, _)) => {
                extra["cache"] = cache_meta(codec);
                let shape = vec![pool.slots, 1, codec.bytes()];
                u8_tensor("kv", shape, pool.bytes.clone())
            }
            None => floats("kv", vec![pool.slots, 1, row], &pool.pool, dt),
        };
        let inputs = [
            floats(
                "q",
                vec![n, h, row],
                &q[c.start * h * row..c.end * h * row],
                dt,
            ),
            kv,
            ints("indices", vec![n, 1, topk], &idx),
        ];
        let meta = self.meta(ctx, extra);
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
/// the same values in f64, what the yardstick reads. With a quantized cache, `bytes` holds the slots
/// in the format's bytes (`n` per slot, 0xff where no token is yet).
struct SlotPool<'a> {
    table: &'a [usize],
    page: usize,
    row: usize,
    slots: usize,
    pool: Vec<f32>,
    pool64: Vec<f64>,
    n: usize,
    bytes: Vec<u8>,
}

impl<'a> SlotPool<'a> {
    fn new(table: &'a [usize], page: usize, row: usize, n: usize) -> Self {
        let slots = (table.iter().copied().max().unwrap_or(0) + 1) * page;
        SlotPool {
            table,
            page,
            row,
            slots,
            pool: vec![f32::NAN; slots * row],
            pool64: vec![f64::NAN; slots * row],
            n,
            bytes: vec![0xff; slots * n],
        }
    }

    /// Token `j`'s slot.
    fn slot(&self, j: usize) -> usize {
        self.table[j / self.page] * self.page + j % self.page
    }

    /// Chunk `c`'s cache rows into their slots (the engine writes them before the chunk's attention),
    /// and their bytes (`n` per token) with a quantized cache.
    fn write(&mut self, c: &Range<usize>, rows: &[f64], bytes: Option<&[u8]>) {
        let (row, n) = (self.row, self.n);
        for j in c.clone() {
            let slot = self.slot(j);
            let s0 = slot * row;
            for k in 0..row {
                self.pool[s0 + k] = rows[j * row + k] as f32;
                self.pool64[s0 + k] = self.pool[s0 + k] as f64;
            }
            if let Some(b) = bytes {
                self.bytes[slot * n..(slot + 1) * n].copy_from_slice(&b[j * n..(j + 1) * n]);
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
    /// A quantized cache's exact effect: fp64 over the decoded rows minus over the dtype's rows.
    e_lat: Vec<f64>,
    e_lse: Vec<f64>,
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
            e_lat: vec![0.0; t_all * h * lkv],
            e_lse: vec![0.0; t_all * h],
        }
    }

    /// fp64 attention of chunk `c`'s queries over the rows `pool` holds: from exactly what the runner
    /// was given, its q and the cache slots its rows name. Latent `[n, H, Lkv]` and LSE `[n, H]`.
    fn fp64(
        &self,
        c: &Range<usize>,
        sel: &Selection,
        q: &[f32],
        pool: &SlotPool,
        scale: f64,
    ) -> (Vec<f64>, Vec<f64>) {
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
        let mut lat = Vec::with_capacity(c.len() * h * lkv);
        let mut lse = Vec::with_capacity(c.len() * h);
        for (o, l) in fp64 {
            lat.extend(o);
            lse.push(l);
        }
        (lat, lse)
    }

    /// Chunk `c`'s fp64 latent and LSE (`fp64`) as the yardstick.
    fn put(&mut self, c: &Range<usize>, lat: Vec<f64>, lse: Vec<f64>) {
        let (h, lkv) = (self.h, self.lkv);
        self.lat_ref[c.start * h * lkv..c.end * h * lkv].copy_from_slice(&lat);
        self.lse_ref[c.start * h..c.end * h].copy_from_slice(&lse);
    }

    /// Chunk `c`'s cache effect: the yardstick (`put` first) minus fp64 over the dtype's rows.
    fn effect(&mut self, c: &Range<usize>, lat: Vec<f64>, lse: Vec<f64>) {
        let (h, lkv) = (self.h, self.lkv);
        let (a, b) = (c.start * h * lkv, c.end * h * lkv);
        for ((e, r), p) in self.e_lat[a..b]
            .iter_mut()
            .zip(&self.lat_ref[a..b])
            .zip(lat)
        {
            *e = r - p;
        }
        for ((e, r), p) in self.e_lse[c.start * h..c.end * h]
            .iter_mut()
            .zip(&self.lse_ref[c.start * h..c.end * h])
            .zip(lse)
        {
            *e = r - p;
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

/// The rows `[kv_latent | k_pe]` `[T, Lkv + R]` as the inner path stored them: what the cache's writer
/// was given, which a cache of the run's dtype holds.
fn plain_rows(tr: &LayerTrace, lkv: usize, r: usize) -> Result<Vec<f64>> {
    let (lat, kpe) = (stage(tr, Stage::KvLatent)?, stage(tr, Stage::KPe)?);
    let t = lat.len() / lkv.max(1);
    let mut rows = Vec::with_capacity(t * (lkv + r));
    for j in 0..t {
        rows.extend_from_slice(&lat[j * lkv..(j + 1) * lkv]);
        rows.extend_from_slice(&kpe[j * r..(j + 1) * r]);
    }
    Ok(rows)
}
