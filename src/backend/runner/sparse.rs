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

use super::local;
use super::tensors::{floats, ints};
use super::{missing, RunnerBackend};
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::cpu::ops::round_all;
use crate::backend::LayerCtx;
use crate::error::{Error, Result};
use crate::reference::sparse::{flashmla_indices, Selection};
use crate::trace::{AtRunner, LayerTrace, Stage, StageTensor};
use ndarray::Array2;
use rayon::prelude::*;

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
        let (h, lkv, p, r, dv) = (
            cfg.n_head,
            cfg.kv_lora_rank,
            cfg.qk_nope,
            cfg.qk_rope,
            cfg.v_head_dim,
        );
        let (row, page, prompt, t_all) = (
            lkv + r,
            sched.page_size,
            sched.prompt_len,
            sched.total_tokens(),
        );
        if sel.n_queries() < prompt {
            return Err(Error::Usage(format!(
                "layer {}: the selection holds {} queries, the prompt {prompt}",
                ctx.layer,
                sel.n_queries()
            )));
        }
        let get = |st: Stage| {
            tr.get(st)
                .map(|t| t.data.clone())
                .ok_or_else(|| missing(st))
        };
        let (q_nope, q_pe, rows) = (get(Stage::QNope)?, get(Stage::QPe)?, get(Stage::CacheRows)?);

        // The absorbed query, stored in the run's dtype (the mirror's rule, as the CUDA sparse path).
        let mut q = vec![0f32; prompt * h * row];
        for hh in 0..h {
            let qn =
                Array2::from_shape_fn((prompt, p), |(t, i)| q_nope[(t * h + hh) * p + i] as f32);
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

        let table = ctx.block_table;
        let slots = (table.iter().copied().max().unwrap_or(0) + 1) * page;
        let slot = |j: usize| table[j / page] * page + j % page;
        let mut pool = vec![f32::NAN; slots * row];
        let mut pool64 = vec![f64::NAN; slots * row];
        let scale = cfg.softmax_scale;
        let (mut lat_ref, mut lse_ref) = (vec![0.0; t_all * h * lkv], vec![0.0; t_all * h]);
        let (mut lat_opt, mut lse_opt) = (vec![0.0; t_all * h * lkv], vec![0.0; t_all * h]);
        let (mut lat_dtype, mut lse_dtype, mut max_keys) = ("bf16", "f32", 0);
        for c in sched.prefill_chunks() {
            let n = c.len();
            for j in c.clone() {
                let s0 = slot(j) * row;
                for k in 0..row {
                    pool[s0 + k] = rows[j * row + k] as f32;
                    pool64[s0 + k] = pool[s0 + k] as f64;
                }
            }
            let topk = c
                .clone()
                .map(|t| sel.keys[t].len())
                .max()
                .unwrap_or(0)
                .max(sel.top_k)
                .max(1);
            let mut idx = Vec::with_capacity(n * topk);
            for t in c.clone() {
                idx.extend(flashmla_indices(&sel.keys[t], topk, table, page));
            }
            let inputs = [
                floats(
                    "q",
                    vec![n, h, row],
                    &q[c.start * h * row..c.end * h * row],
                    dt,
                ),
                floats("kv", vec![slots, 1, row], &pool, dt),
                ints("indices", vec![n, 1, topk], &idx),
            ];
            let meta = self.meta(
                ctx,
                serde_json::json!({ "context_len": c.start, "top_k": sel.top_k, "d_v": lkv }),
            );
            let mut out = self.call("sparse_prefill", ctx.layer, &meta, &inputs)?;
            let lat = out.take("attn_latent", &[n, h, lkv], "sparse_prefill")?;
            let lse_o = out.take("lse", &self.lse_shape(None, n, h), "sparse_prefill")?;
            let lse = self.lse_rows(&lse_o, 1, n, h);
            lat_dtype = lat.dtype;
            lse_dtype = lse_o.dtype;
            lat_opt[c.start * h * lkv..c.end * h * lkv].copy_from_slice(&lat.data);
            lse_opt[c.start * h..c.end * h].copy_from_slice(&lse);

            // fp64 from exactly what the runner was given: its q, the cache slots its rows name.
            let (qs, pool64) = (&q, &pool64);
            let fp64: Vec<(Vec<f64>, f64)> = (0..n * h)
                .into_par_iter()
                .map(|ih| {
                    let (t, hh) = (c.start + ih / h, ih % h);
                    let qi: Vec<f64> = qs[(t * h + hh) * row..(t * h + hh + 1) * row]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    let keys = &sel.keys[t];
                    let at_slot = |k: usize| slot(keys[k] as usize) * row;
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
                lat_ref[at * lkv..(at + 1) * lkv].copy_from_slice(&o);
                lse_ref[at] = l;
            }
            max_keys = max_keys.max(topk);
        }

        // W_UV: the runner's latent stored in the dtype, then the mirror's projection (what the
        // engine does after the kernel); the yardstick is fp64 through the same stored weights.
        let mut heads_ref = vec![0.0; t_all * h * dv];
        let mut heads_opt = vec![0.0; t_all * h * dv];
        for hh in 0..h {
            let uv = mw.uv(cfg, hh);
            let lat32 = Array2::from_shape_fn((prompt, lkv), |(t, k)| {
                dt.round(lat_opt[(t * h + hh) * lkv + k] as f32)
            });
            let o = round_all(lat32.dot(&uv.t()), dt);
            let lat64 =
                Array2::from_shape_fn((prompt, lkv), |(t, k)| lat_ref[(t * h + hh) * lkv + k]);
            let o64 = lat64.dot(&uv.mapv(|v| v as f64).t());
            for t in 0..prompt {
                let at = (t * h + hh) * dv;
                for d in 0..dv {
                    heads_opt[at + d] = o[[t, d]] as f64;
                    heads_ref[at + d] = o64[[t, d]];
                }
            }
        }
        let heads = tr
            .get_mut(Stage::AttnHeads)
            .ok_or_else(|| missing(Stage::AttnHeads))?;
        heads.data[..prompt * h * dv].copy_from_slice(&heads_opt[..prompt * h * dv]);
        let lse_stage = tr.get_mut(Stage::Lse).ok_or_else(|| missing(Stage::Lse))?;
        lse_stage.data[..prompt * h].copy_from_slice(&lse_opt[..prompt * h]);

        // The latent's own rounding (its dtype) plus W_UV's output rounding: within the coarser
        // type's bound (local::tolerance), as for the decode runner's heads.
        let terms = max_keys * row;
        at.push(AtRunner {
            check: "lse[prefill]".into(),
            reference: StageTensor::new(Stage::Lse, vec![t_all, h], lse_ref),
            optimized: StageTensor::new(Stage::Lse, vec![t_all, h], lse_opt),
            tolerance: local::tolerance(dt.name(), lse_dtype, terms),
            out_dtype: lse_dtype,
        });
        at.push(AtRunner {
            check: "attn_heads[prefill]".into(),
            reference: StageTensor::new(Stage::AttnHeads, vec![t_all, h, dv], heads_ref),
            optimized: StageTensor::new(Stage::AttnHeads, vec![t_all, h, dv], heads_opt),
            tolerance: local::tolerance(dt.name(), lat_dtype, terms),
            out_dtype: lat_dtype,
        });
        Ok(())
    }
}
