//! The sparse_decode op (DSA past top_k, docs/dsa.md): the decode steps' absorbed queries over the cache
//! slots of their selected keys, as FlashMLA's `flash_mla_with_kvcache(..., indices=...)` takes them:
//! q = `[q_absorbed | q_pe]` `[B, s_q, H, Lkv + R]` (one batch entry per decode step, as the decode op),
//! the paged latent cache `[pages, page_size, Lkv + R]` (each entry its own shuffled pages, NaN where no
//! token is) and the index rows `[B, s_q, topk]` (`page·page_size + offset` through the entry's block
//! table, −1 padded). The runner returns the latent output and the LSE.
//!
//! With `--kv-cache-dtype FMT` (a runner listing FMT in `supports.cache_formats`) the cache travels in
//! the format's bytes, u8 `[pages, page_size, bytes_per_token]` with `meta.cache`, as the decode op's
//! (`cache.rs`): the `@runner` yardstick is fp64 over the rows decoded from those bytes, and the
//! end-to-end checks keep the inner path's effect of the format, as on the decode op.
//!
//! Without it, an op that declares `kv_cache: fp8_v32` reads FlashMLA's fp8 cache, which the runner
//! writes from the rows it is sent. mla-diff then computes fp64 attention twice: over the cache as the
//! kernel reads it (`fp8_cache::dequantize_row`: the `@runner` yardstick, so the kernel's own error is
//! judged at bf16's bound) and over the rows as sent; their difference, the fp8 rounding's exact
//! effect, widens the end-to-end checks it reaches (`trace::CacheEffect`).

use super::cache::{latent_effects, paged_bytes};
use super::decode::{decode_lse, put_decode_outputs, step_entries, Entry, Paged};
use super::local::{self, Yardstick};
use super::tensors::{floats, ints, Output};
use super::{fp8_cache, stage, RunnerBackend};
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::LayerCtx;
use crate::error::{Error, Result};
use crate::reference::sparse::{flashmla_indices, Selection};
use crate::trace::{AtRunner, LayerTrace, Stage};
use rayon::prelude::*;

impl RunnerBackend {
    /// The decode steps in one request over their selections; the runner's latent and LSE replace the
    /// inner path's decode stages, judged against fp64 over the rows the kernel reads.
    pub(super) fn sparse_decode(
        &mut self,
        ctx: &LayerCtx,
        sel: &Selection,
        mw: &MirrorWeights,
        tr: &mut LayerTrace,
        at: &mut Vec<AtRunner>,
    ) -> Result<()> {
        let (cfg, sched, dt) = (ctx.cfg, ctx.sched, self.dtype);
        let (h, lkv, r) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope);
        let (prompt, t_all) = (sched.prompt_len, sched.total_tokens());
        let d_n = sched.decode_steps * sched.q_len;
        if sel.n_queries() < t_all {
            return Err(Error::Usage(format!(
                "layer {}: the selection holds {} queries, the run {t_all}",
                ctx.layer,
                sel.n_queries()
            )));
        }
        let spec = self
            .desc
            .ops
            .sparse_decode
            .clone()
            .expect("sparse_decode op");
        // The runner writes its own fp8 cache from the rows only when it is sent rows.
        let fp8 = self.kv.is_auto() && spec.kv_cache.as_deref() == Some(fp8_cache::FP8_V32);
        let (q_abs, q_pe_all) = (stage(tr, Stage::QAbsorbed)?, stage(tr, Stage::QPe)?);
        let rows = self.encode_cache(lkv, r, stage(tr, Stage::CacheRows)?);
        let q_pe = &q_pe_all[prompt * h * r..];
        let (lat, lse_o, lse, topk) = self.send_sparse_decode(ctx, sel, &q_abs, q_pe, &rows)?;
        let f = SparseFp64::new(ctx, sel, [&q_abs, q_pe], &rows, fp8);
        let y = Yardstick {
            dtype: dt,
            terms: topk * (lkv + r),
        };
        at.push(y.check(
            "attn_latent",
            Stage::AttnLatent,
            &[d_n, h, lkv],
            [f.read_out.clone(), lat.data.clone()],
            lat.dtype,
        ));
        at.push(y.check(
            "lse[decode]",
            Stage::Lse,
            &[t_all, h],
            [
                decode_lse(&f.read_lse, prompt, h),
                decode_lse(&lse, prompt, h),
            ],
            lse_o.dtype,
        ));

        // The runner's outputs replace the inner path's decode stages; W_UV turns them into the decode
        // heads as the engine would (output stored in the dtype first). No split partials: FlashMLA
        // splits the index list its own way and returns only the merged result.
        tr.stages
            .retain(|t| !matches!(t.stage, Stage::SplitOut | Stage::SplitLse));
        put_decode_outputs(tr, ctx, mw, dt, &lat.data, &lse)?;
        if fp8 {
            let e_lat = diff(&f.read_out, &f.sent_out);
            let e_lse = diff(&f.read_lse, &f.sent_lse);
            let rows = (prompt..t_all, "decode");
            let fx = latent_effects(ctx, mw, rows, e_lat, &e_lse, fp8_cache::FP8_V32);
            tr.cache_effect.extend(fx);
        }
        Ok(())
    }

    /// The decode steps' request: q `[B, s_q, H, Lkv + R]`, the paged cache as the decode op builds
    /// it (each entry its own pages, shuffled like the run's block table, one spare page of NaN) and
    /// each query's selected slots through its entry's pages (the longest selection's count, at least
    /// top_k, −1 padded). Returns the latent, the LSE as returned and in natural log `[D, H]`, and the
    /// index rows' width.
    fn send_sparse_decode(
        &mut self,
        ctx: &LayerCtx,
        sel: &Selection,
        q_abs: &[f64],
        q_pe: &[f64],
        rows: &[f64],
    ) -> Result<(Output, Output, Vec<f64>, usize)> {
        let (cfg, sched, dt) = (ctx.cfg, ctx.sched, self.dtype);
        let (h, lkv, r, page) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope, sched.page_size);
        let (b_n, s_q, prompt, t_all) = (
            sched.decode_steps,
            sched.q_len,
            sched.prompt_len,
            sched.total_tokens(),
        );
        let row = lkv + r;
        let entries = step_entries(ctx, q_abs, q_pe);
        let seed = sched.shuffle_seed.map(|s| s ^ 0x53445043);
        let paged = Paged::new(&entries, page, row, rows, seed);
        let topk = sel.index_width(prompt..t_all);
        let mut idx = Vec::with_capacity(b_n * s_q * topk);
        for (b, table) in paged.tables.iter().enumerate() {
            for i in 0..s_q {
                let d = b * s_q + i;
                idx.extend(flashmla_indices(&sel.keys[prompt + d], topk, table, page));
            }
        }
        let mut extra = serde_json::json!({ "top_k": sel.top_k, "d_v": lkv });
        let cache = match &self.cache_bytes {
            Some((codec, bytes)) => {
                let keys = entries.iter().map(|e| e.keys.as_slice());
                let (t, m) = paged_bytes(codec, bytes, keys, &paged.tables, paged.total, page);
                extra["cache"] = m;
                t
            }
            None => floats("kv_cache", vec![paged.total, page, row], &paged.pool, dt),
        };
        let inputs = [
            floats(
                "q",
                vec![b_n, s_q, h, row],
                &joined_queries(&entries, lkv, r),
                dt,
            ),
            cache,
            ints("indices", vec![b_n, s_q, topk], &idx),
        ];
        let meta = self.meta(ctx, extra);
        let mut out = self.call("sparse_decode", ctx.layer, &meta, &inputs)?;
        let lat = out.take("attn_latent", &[b_n, s_q, h, lkv], "sparse_decode")?;
        let lse_o = out.take("lse", &self.lse_shape(Some(b_n), s_q, h), "sparse_decode")?;
        let lse = self.lse_rows(&lse_o, b_n, s_q, h);
        Ok((lat, lse_o, lse, topk))
    }
}

/// The entries' queries as one row per (query, head), `[q_absorbed | q_pe]`: FlashMLA's q.
fn joined_queries(entries: &[Entry], lkv: usize, r: usize) -> Vec<f32> {
    let mut q = Vec::new();
    for e in entries {
        for k in 0..e.q_nope.len() / lkv {
            q.extend(e.q_nope[k * lkv..(k + 1) * lkv].iter().map(|&v| v as f32));
            q.extend(e.q_pe[k * r..(k + 1) * r].iter().map(|&v| v as f32));
        }
    }
    q
}

/// fp64 attention of the decode queries `[D, H]` over their selected rows, from the runner's inputs:
/// over the rows as sent (`sent_*`) and, with an fp8 cache, as the kernel reads them (`read_*`, the
/// `@runner` yardstick; without one, the rows as sent).
struct SparseFp64 {
    sent_out: Vec<f64>,
    sent_lse: Vec<f64>,
    read_out: Vec<f64>,
    read_lse: Vec<f64>,
}

impl SparseFp64 {
    fn new(
        ctx: &LayerCtx,
        sel: &Selection,
        [q_abs, q_pe]: [&[f64]; 2],
        rows: &[f64],
        fp8: bool,
    ) -> SparseFp64 {
        let (cfg, sched) = (ctx.cfg, ctx.sched);
        let (h, lkv, r, prompt) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope, sched.prompt_len);
        let (row, d_n) = (lkv + r, sched.decode_steps * sched.q_len);
        let deq: Vec<f64> = match fp8 {
            true => rows
                .par_chunks(row)
                .flat_map_iter(|x| fp8_cache::dequantize_row(x, lkv))
                .collect(),
            false => Vec::new(),
        };
        let scale = cfg.softmax_scale;
        let attend = |cache: &[f64], d: usize, hh: usize| {
            let qa = &q_abs[(d * h + hh) * lkv..(d * h + hh + 1) * lkv];
            let qp = &q_pe[(d * h + hh) * r..(d * h + hh + 1) * r];
            let keys = &sel.keys[prompt + d];
            let k = |n: usize| &cache[keys[n] as usize * row..(keys[n] as usize + 1) * row];
            local::attend(
                0..keys.len(),
                lkv,
                |n| (local::dot(qa, &k(n)[..lkv]) + local::dot(qp, &k(n)[lkv..])) * scale,
                |n| &k(n)[..lkv],
            )
        };
        type Attn = (Vec<f64>, f64);
        let both: Vec<(Attn, Option<Attn>)> = (0..d_n * h)
            .into_par_iter()
            .map(|dh| {
                let (d, hh) = (dh / h, dh % h);
                (attend(rows, d, hh), fp8.then(|| attend(&deq, d, hh)))
            })
            .collect();
        let (mut sent_out, mut sent_lse) = (vec![0.0; d_n * h * lkv], vec![0.0; d_n * h]);
        let (mut read_out, mut read_lse) = (sent_out.clone(), sent_lse.clone());
        for (dh, ((o, l), rd)) in both.into_iter().enumerate() {
            let (ro, rl) = rd.unwrap_or_else(|| (o.clone(), l));
            sent_out[dh * lkv..(dh + 1) * lkv].copy_from_slice(&o);
            read_out[dh * lkv..(dh + 1) * lkv].copy_from_slice(&ro);
            sent_lse[dh] = l;
            read_lse[dh] = rl;
        }
        SparseFp64 {
            sent_out,
            sent_lse,
            read_out,
            read_lse,
        }
    }
}

fn diff(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}
