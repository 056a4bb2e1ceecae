//! The prefill op: decompressed attention of one chunk over its context and itself, one request per
//! chunk, keys and values decompressed by the inner path's rule (vLLM's `forward_mha`).

use super::local;
use super::tensors::floats;
use super::{missing, RunnerBackend};
use crate::backend::cpu::front::{decompress, MirrorWeights};
use crate::backend::LayerCtx;
use crate::error::Result;
use crate::trace::{AtRunner, LayerTrace, Stage, StageTensor};
use ndarray::{s, Array2};

impl RunnerBackend {
    /// The prefill op: one request per chunk, keys and values decompressed by the inner path's rule.
    pub(super) fn prefill(
        &mut self,
        ctx: &LayerCtx,
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
        let (dqk, prompt, t_all) = (p + r, sched.prompt_len, sched.total_tokens());
        let get = |st: Stage| {
            tr.get(st)
                .map(|t| t.data.clone())
                .ok_or_else(|| missing(st))
        };
        let (q_nope, q_pe) = (get(Stage::QNope)?, get(Stage::QPe)?);
        let (latent, k_pe, rows) = (
            get(Stage::KvLatent)?,
            get(Stage::KPe)?,
            get(Stage::CacheRows)?,
        );
        // New tokens' keys from their fresh latent, context from the cache (vLLM's forward_mha).
        let arr =
            |v: Vec<f32>, n: usize, w: usize| Array2::from_shape_vec((n, w), v).expect("rows");
        let fresh = arr(
            latent[..prompt * lkv].iter().map(|&v| v as f32).collect(),
            prompt,
            lkv,
        );
        let cached = arr(
            (0..prompt)
                .flat_map(|j| {
                    rows[j * (lkv + r)..j * (lkv + r) + lkv]
                        .iter()
                        .map(|&v| v as f32)
                })
                .collect(),
            prompt,
            lkv,
        );
        let (k_fresh, v_fresh) = decompress(cfg, mw, fresh.view(), dt);
        let (k_cached, v_cached) = decompress(cfg, mw, cached.view(), dt);
        let kpe_of = |j: usize, fresh: bool| -> Vec<f64> {
            match fresh {
                true => k_pe[j * r..(j + 1) * r].to_vec(),
                false => rows[j * (lkv + r) + lkv..(j + 1) * (lkv + r)].to_vec(),
            }
        };
        let (mut l_heads, mut l_lse) = (vec![0.0; t_all * h * dv], vec![0.0; t_all * h]);
        let (mut o_heads, mut o_lse) = (vec![0.0; t_all * h * dv], vec![0.0; t_all * h]);
        let (mut heads_dtype, mut lse_dtype, mut max_keys) = ("f32", "f32", 0);
        for c in sched.prefill_chunks() {
            let (n, ctx_len, s_n) = (c.len(), c.start, c.end);
            let mut q = vec![0.0f64; n * h * dqk];
            let mut k = vec![0.0f64; s_n * h * dqk];
            let mut v = vec![0.0f64; s_n * h * dv];
            for (i, t) in c.clone().enumerate() {
                for hh in 0..h {
                    let dst = (i * h + hh) * dqk;
                    q[dst..dst + p]
                        .copy_from_slice(&q_nope[(t * h + hh) * p..(t * h + hh + 1) * p]);
                    q[dst + p..dst + dqk]
                        .copy_from_slice(&q_pe[(t * h + hh) * r..(t * h + hh + 1) * r]);
                }
            }
            for j in 0..s_n {
                let fresh = j >= ctx_len;
                let (kn, vv) = match fresh {
                    true => (&k_fresh, &v_fresh),
                    false => (&k_cached, &v_cached),
                };
                let kpe = kpe_of(j, fresh);
                for hh in 0..h {
                    let dst = (j * h + hh) * dqk;
                    for (d, x) in k[dst..dst + p].iter_mut().zip(kn.slice(s![j, hh, ..])) {
                        *d = *x as f64;
                    }
                    k[dst + p..dst + dqk].copy_from_slice(&kpe);
                    for (d, x) in v[(j * h + hh) * dv..(j * h + hh + 1) * dv]
                        .iter_mut()
                        .zip(vv.slice(s![j, hh, ..]))
                    {
                        *d = *x as f64;
                    }
                }
            }
            let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
            let inputs = [
                floats("q", vec![n, h, dqk], &f32s(&q), dt),
                floats("k", vec![s_n, h, dqk], &f32s(&k), dt),
                floats("v", vec![s_n, h, dv], &f32s(&v), dt),
            ];
            let meta = self.meta(ctx, serde_json::json!({ "context_len": ctx_len }));
            let mut out = self.call("prefill", ctx.layer, &meta, &inputs)?;
            let heads = out.take("attn_heads", &[n, h, dv], "prefill")?;
            let lse_o = out.take("lse", &self.lse_shape(None, n, h), "prefill")?;
            let lse = self.lse_rows(&lse_o, 1, n, h);
            heads_dtype = heads.dtype;
            lse_dtype = lse_o.dtype;
            max_keys = max_keys.max(s_n);
            for i in 0..n {
                let t = c.start + i;
                for hh in 0..h {
                    let qi = &q[(i * h + hh) * dqk..(i * h + hh + 1) * dqk];
                    let score = |j: usize| {
                        local::dot(qi, &k[(j * h + hh) * dqk..(j * h + hh + 1) * dqk])
                            * cfg.softmax_scale
                    };
                    let value = |j: usize| &v[(j * h + hh) * dv..(j * h + hh + 1) * dv];
                    let (o, l) = local::attend(0..ctx_len + i + 1, dv, score, value);
                    l_heads[(t * h + hh) * dv..(t * h + hh + 1) * dv].copy_from_slice(&o);
                    l_lse[t * h + hh] = l;
                    o_heads[(t * h + hh) * dv..(t * h + hh + 1) * dv]
                        .copy_from_slice(&heads.data[(i * h + hh) * dv..(i * h + hh + 1) * dv]);
                    o_lse[t * h + hh] = lse[i * h + hh];
                }
            }
        }
        let terms = max_keys * dqk.max(dv);
        at.push(AtRunner {
            check: "lse[prefill]".into(),
            reference: StageTensor::new(Stage::Lse, vec![t_all, h], l_lse),
            optimized: StageTensor::new(Stage::Lse, vec![t_all, h], o_lse.clone()),
            tolerance: local::tolerance(dt.name(), lse_dtype, terms),
            out_dtype: lse_dtype,
        });
        at.push(AtRunner {
            check: "attn_heads[prefill]".into(),
            reference: StageTensor::new(Stage::AttnHeads, vec![t_all, h, dv], l_heads),
            optimized: StageTensor::new(Stage::AttnHeads, vec![t_all, h, dv], o_heads.clone()),
            tolerance: local::tolerance(dt.name(), heads_dtype, terms),
            out_dtype: heads_dtype,
        });
        // The engine stores the chunk output in the dtype before o_proj.
        let heads = tr
            .get_mut(Stage::AttnHeads)
            .ok_or_else(|| missing(Stage::AttnHeads))?;
        for (d, &v) in heads.data[..prompt * h * dv]
            .iter_mut()
            .zip(&o_heads[..prompt * h * dv])
        {
            *d = dt.round(v as f32) as f64;
        }
        let lse_stage = tr.get_mut(Stage::Lse).ok_or_else(|| missing(Stage::Lse))?;
        lse_stage.data[..prompt * h].copy_from_slice(&o_lse[..prompt * h]);
        Ok(())
    }
}
