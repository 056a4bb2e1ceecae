//! The sparse_decode op (DSA past top_k, docs/dsa.md): the decode steps' absorbed queries over the cache
//! slots of their selected keys, as FlashMLA's `flash_mla_with_kvcache(..., indices=...)` takes them:
//! q = `[q_absorbed | q_pe]` `[B, s_q, H, Lkv + R]` (one batch entry per decode step, as the decode op),
//! the paged latent cache `[pages, page_size, Lkv + R]` (each entry its own shuffled pages, NaN where no
//! token is) and the index rows `[B, s_q, topk]` (`page·page_size + offset` through the entry's block
//! table, −1 padded). The runner returns the latent output and the LSE.
//!
//! An op that declares `kv_cache: fp8_v32` reads FlashMLA's fp8 cache, which the runner writes from the
//! rows it is sent. mla-diff then computes fp64 attention twice: over the cache as the kernel reads it
//! (`fp8_cache::dequantize_row`: the `@runner` yardstick, so the kernel's own error is judged at bf16's
//! bound) and over the rows as sent; their difference, the fp8 rounding's exact effect, widens the
//! end-to-end checks it reaches (`trace::CacheEffect`).

use super::tensors::{floats, ints};
use super::{fp8_cache, local, missing, RunnerBackend};
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::LayerCtx;
use crate::error::{Error, Result};
use crate::reference::sparse::{flashmla_indices, Selection};
use crate::trace::{AtRunner, CacheEffect, LayerTrace, Stage, StageTensor};
use ndarray::Array2;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

impl RunnerBackend {
    pub(super) fn sparse_decode(
        &mut self,
        ctx: &LayerCtx,
        sel: &Selection,
        mw: &MirrorWeights,
        tr: &mut LayerTrace,
        at: &mut Vec<AtRunner>,
    ) -> Result<()> {
        let (cfg, sched, dt) = (ctx.cfg, ctx.sched, self.dtype);
        let (h, lkv, r, page) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope, sched.page_size);
        let (b_n, s_q, prompt) = (sched.decode_steps, sched.q_len, sched.prompt_len);
        let (row, t_all, d_n) = (lkv + r, sched.total_tokens(), b_n * s_q);
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
        let fp8 = spec.kv_cache.as_deref() == Some(fp8_cache::FP8_V32);
        let get = |st: Stage| {
            tr.get(st)
                .map(|t| t.data.clone())
                .ok_or_else(|| missing(st))
        };
        let (q_abs, q_pe_all, rows) = (
            get(Stage::QAbsorbed)?,
            get(Stage::QPe)?,
            get(Stage::CacheRows)?,
        );
        let q_pe = &q_pe_all[prompt * h * r..];

        // The pool as the decode op builds it: each entry its own pages (shuffled like the run's
        // block table), one spare page of NaN where unused table slots point.
        let seqlens: Vec<usize> = (0..b_n).map(|b| prompt + (b + 1) * s_q).collect();
        let pages: Vec<usize> = seqlens.iter().map(|l| l.div_ceil(page)).collect();
        let total = pages.iter().sum::<usize>() + 1;
        let mut phys: Vec<usize> = (0..total).collect();
        if let Some(seed) = sched.shuffle_seed {
            phys.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed ^ 0x53445043));
        }
        let mut tables: Vec<Vec<usize>> = Vec::with_capacity(b_n);
        let mut pool = vec![f32::NAN; total * page * row];
        let mut next = 0;
        for b in 0..b_n {
            let mut table = Vec::with_capacity(pages[b]);
            for p in 0..pages[b] {
                let ph = phys[next];
                next += 1;
                table.push(ph);
                for j in p * page..((p + 1) * page).min(seqlens[b]) {
                    let dst = (ph * page + j % page) * row;
                    for (d, &v) in pool[dst..dst + row]
                        .iter_mut()
                        .zip(&rows[j * row..(j + 1) * row])
                    {
                        *d = v as f32;
                    }
                }
            }
            tables.push(table);
        }
        let topk = (prompt..t_all)
            .map(|t| sel.keys[t].len())
            .max()
            .unwrap_or(0)
            .max(sel.top_k)
            .max(1);
        let mut idx = Vec::with_capacity(d_n * topk);
        let mut q = vec![0f32; d_n * h * row];
        for (b, table) in tables.iter().enumerate() {
            for i in 0..s_q {
                let d = b * s_q + i;
                idx.extend(flashmla_indices(&sel.keys[prompt + d], topk, table, page));
                for hh in 0..h {
                    let dst = (d * h + hh) * row;
                    for (o, &v) in q[dst..dst + lkv]
                        .iter_mut()
                        .zip(&q_abs[(d * h + hh) * lkv..(d * h + hh + 1) * lkv])
                    {
                        *o = v as f32;
                    }
                    for (o, &v) in q[dst + lkv..dst + row]
                        .iter_mut()
                        .zip(&q_pe[(d * h + hh) * r..(d * h + hh + 1) * r])
                    {
                        *o = v as f32;
                    }
                }
            }
        }
        let inputs = [
            floats("q", vec![b_n, s_q, h, row], &q, dt),
            floats("kv_cache", vec![total, page, row], &pool, dt),
            ints("indices", vec![b_n, s_q, topk], &idx),
        ];
        let meta = self.meta(ctx, serde_json::json!({ "top_k": sel.top_k, "d_v": lkv }));
        let mut out = self.call("sparse_decode", ctx.layer, &meta, &inputs)?;
        let lat = out.take("attn_latent", &[b_n, s_q, h, lkv], "sparse_decode")?;
        let lse_o = out.take("lse", &self.lse_shape(Some(b_n), s_q, h), "sparse_decode")?;
        let lse = self.lse_rows(&lse_o, b_n, s_q, h);

        // fp64 from the runner's inputs, over each query's selected rows: as sent (`sent`) and, with
        // an fp8 cache, as the kernel reads them (`read`, the @runner yardstick).
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
                (attend(&rows, d, hh), fp8.then(|| attend(&deq, d, hh)))
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
        let full = |v: &[f64]| {
            let mut f = vec![0.0; t_all * h];
            f[prompt * h..].copy_from_slice(v);
            StageTensor::new(Stage::Lse, vec![t_all, h], f)
        };
        let terms = topk * row;
        at.push(AtRunner {
            check: "attn_latent".into(),
            reference: StageTensor::new(Stage::AttnLatent, vec![d_n, h, lkv], read_out.clone()),
            optimized: StageTensor::new(Stage::AttnLatent, vec![d_n, h, lkv], lat.data.clone()),
            tolerance: local::tolerance(dt.name(), lat.dtype, terms),
            out_dtype: lat.dtype,
        });
        at.push(AtRunner {
            check: "lse[decode]".into(),
            reference: full(&read_lse),
            optimized: full(&lse),
            tolerance: local::tolerance(dt.name(), lse_o.dtype, terms),
            out_dtype: lse_o.dtype,
        });

        // The runner's outputs replace the inner path's decode stages; W_UV turns them into the decode
        // heads as the engine would (output stored in the dtype first). No split partials: FlashMLA
        // splits the index list its own way and returns only the merged result.
        tr.stages
            .retain(|t| !matches!(t.stage, Stage::SplitOut | Stage::SplitLse));
        super::decode::put_decode_outputs(tr, ctx, mw, dt, &lat.data, &lse)?;

        // The fp8 cache's exact effect (read − sent), carried through W_UV and o_proj in fp64 (both
        // linear): what the end-to-end decode checks are widened by.
        if fp8 {
            let dv = cfg.v_head_dim;
            let e_lat: Vec<f64> = read_out.iter().zip(&sent_out).map(|(a, b)| a - b).collect();
            let e_lse: Vec<f64> = read_lse.iter().zip(&sent_lse).map(|(a, b)| a - b).collect();
            let mut e_heads = vec![0.0; t_all * h * dv];
            for hh in 0..h {
                let uv = mw.uv(cfg, hh).mapv(|v| v as f64);
                let e = Array2::from_shape_fn((d_n, lkv), |(d, k)| e_lat[(d * h + hh) * lkv + k]);
                let o = e.dot(&uv.t());
                for d in 0..d_n {
                    let at = ((prompt + d) * h + hh) * dv;
                    for (x, &v) in e_heads[at..at + dv].iter_mut().zip(o.row(d)) {
                        *x = v;
                    }
                }
            }
            let wo = mw.o.mapv(|v| v as f64);
            let eh = Array2::from_shape_vec((t_all, h * dv), e_heads.clone()).expect("shape");
            let e_out = eh.dot(&wo.t());
            let out_shape = vec![t_all, wo.nrows()];
            let cache = fp8_cache::FP8_V32;
            let effects = [
                ("attn_latent", Stage::AttnLatent, vec![d_n, h, lkv], e_lat),
                ("lse[decode]", Stage::Lse, vec![t_all, h], full(&e_lse).data),
                (
                    "attn_heads[decode]",
                    Stage::AttnHeads,
                    vec![t_all, h, dv],
                    e_heads,
                ),
                (
                    "attn_out[decode]",
                    Stage::AttnOut,
                    out_shape,
                    e_out.into_raw_vec_and_offset().0,
                ),
            ];
            for (check, stage, shape, data) in effects {
                tr.cache_effect.push(CacheEffect {
                    check: check.into(),
                    cache,
                    effect: StageTensor::new(stage, shape, data),
                });
            }
        }
        Ok(())
    }
}
