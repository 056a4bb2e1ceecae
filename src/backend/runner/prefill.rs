//! The prefill op: decompressed attention of one chunk over its context and itself, one request per
//! chunk, keys and values decompressed by the inner path's rule (vLLM's `forward_mha`).

use super::local::{self, Yardstick};
use super::tensors::floats;
use super::{missing, stage, RunnerBackend};
use crate::backend::cpu::front::{decompress, MirrorWeights};
use crate::backend::LayerCtx;
use crate::error::Result;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::trace::{AtRunner, LayerTrace, Stage};
use ndarray::{s, Array2, Array3};
use std::ops::Range;

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
        let (h, dv, prompt) = (cfg.n_head, cfg.v_head_dim, sched.prompt_len);
        let (q_nope, q_pe) = (stage(tr, Stage::QNope)?, stage(tr, Stage::QPe)?);
        let kv = PromptKv::new(ctx, mw, dt, tr)?;
        let mut rows = PrefillRows::new(sched.total_tokens(), h, dv);
        for c in sched.prefill_chunks() {
            let qkv = ChunkQkv::new(cfg, dt, &c, &q_nope, &q_pe, &kv);
            let (n, ctx_len, s_n) = (c.len(), c.start, c.end);
            let inputs = [
                floats("q", vec![n, h, qkv.dqk], &f32s(&qkv.q), dt),
                floats("k", vec![s_n, h, qkv.dqk], &f32s(&qkv.k), dt),
                floats("v", vec![s_n, h, dv], &f32s(&qkv.v), dt),
            ];
            let meta = self.meta(ctx, serde_json::json!({ "context_len": ctx_len }));
            let mut out = self.call("prefill", ctx.layer, &meta, &inputs)?;
            let heads = out.take("attn_heads", &[n, h, dv], "prefill")?;
            let lse_o = out.take("lse", &self.lse_shape(None, n, h), "prefill")?;
            let lse = self.lse_rows(&lse_o, 1, n, h);
            rows.heads_dtype = heads.dtype;
            rows.lse_dtype = lse_o.dtype;
            rows.max_keys = rows.max_keys.max(s_n);
            rows.add_chunk(cfg, &c, &qkv, &heads.data, &lse);
        }
        let y = Yardstick {
            dtype: dt,
            terms: rows.max_keys * (cfg.qk_nope + cfg.qk_rope).max(dv),
        };
        let t_all = sched.total_tokens();
        at.push(y.check(
            "lse[prefill]",
            Stage::Lse,
            &[t_all, h],
            [rows.ref_lse, rows.lse.clone()],
            rows.lse_dtype,
        ));
        at.push(y.check(
            "attn_heads[prefill]",
            Stage::AttnHeads,
            &[t_all, h, dv],
            [rows.ref_heads, rows.heads.clone()],
            rows.heads_dtype,
        ));
        // The engine stores the chunk output in the dtype before o_proj.
        let stored: Vec<f64> = rows.heads[..prompt * h * dv]
            .iter()
            .map(|&v| dt.round(v as f32) as f64)
            .collect();
        put_prefill_outputs(tr, &stored, &rows.lse[..prompt * h])
    }
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// The prompt's keys and values as the engine decompresses them (vLLM's `forward_mha`): a chunk's
/// own tokens from their fresh latent and `k_pe`, its context from the cache rows.
struct PromptKv {
    /// `(k_nope [T, H, P], v [T, H, Dv])` from the fresh latent, and from the cache rows' latent.
    fresh: (Array3<f32>, Array3<f32>),
    cached: (Array3<f32>, Array3<f32>),
    k_pe: Vec<f64>,
    /// `cache_rows` `[T, Lkv + R]`.
    rows: Vec<f64>,
    lkv: usize,
    r: usize,
}

impl PromptKv {
    fn new(ctx: &LayerCtx, mw: &MirrorWeights, dt: Dtype, tr: &LayerTrace) -> Result<PromptKv> {
        let (cfg, prompt) = (ctx.cfg, ctx.sched.prompt_len);
        let (lkv, r) = (cfg.kv_lora_rank, cfg.qk_rope);
        let (latent, k_pe, rows) = (
            stage(tr, Stage::KvLatent)?,
            stage(tr, Stage::KPe)?,
            stage(tr, Stage::CacheRows)?,
        );
        let arr = |v: Vec<f32>| Array2::from_shape_vec((prompt, lkv), v).expect("rows");
        let fresh = arr(latent[..prompt * lkv].iter().map(|&v| v as f32).collect());
        let cached = arr((0..prompt)
            .flat_map(|j| {
                rows[j * (lkv + r)..j * (lkv + r) + lkv]
                    .iter()
                    .map(|&v| v as f32)
            })
            .collect());
        Ok(PromptKv {
            fresh: decompress(cfg, mw, fresh.view(), dt),
            cached: decompress(cfg, mw, cached.view(), dt),
            k_pe,
            rows,
            lkv,
            r,
        })
    }

    /// Token `j`'s `(k_nope, v)` of every head and its roped key part: the fresh ones for a token of
    /// the chunk itself, the cached ones for its context.
    fn key(&self, j: usize, fresh: bool) -> (&(Array3<f32>, Array3<f32>), Vec<f64>) {
        let (lkv, r) = (self.lkv, self.r);
        match fresh {
            true => (&self.fresh, self.k_pe[j * r..(j + 1) * r].to_vec()),
            false => (
                &self.cached,
                self.rows[j * (lkv + r) + lkv..(j + 1) * (lkv + r)].to_vec(),
            ),
        }
    }
}

/// One chunk's request in f64, as sent (stored in the dtype) and as the yardstick reads it: q
/// `[n, H, P + R]` of the chunk's tokens, k `[s, H, P + R]` and v `[s, H, Dv]` of the keys it sees (its
/// context, then itself).
struct ChunkQkv {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    dqk: usize,
    dv: usize,
    h: usize,
}

impl ChunkQkv {
    fn new(
        cfg: &MlaConfig,
        dt: Dtype,
        c: &Range<usize>,
        q_nope: &[f64],
        q_pe: &[f64],
        kv: &PromptKv,
    ) -> Self {
        let (h, p, r, dv) = (cfg.n_head, cfg.qk_nope, cfg.qk_rope, cfg.v_head_dim);
        let (dqk, n, ctx_len, s_n) = (p + r, c.len(), c.start, c.end);
        let mut q = vec![0.0f64; n * h * dqk];
        let mut k = vec![0.0f64; s_n * h * dqk];
        let mut v = vec![0.0f64; s_n * h * dv];
        for (i, t) in c.clone().enumerate() {
            for hh in 0..h {
                let dst = (i * h + hh) * dqk;
                q[dst..dst + p].copy_from_slice(&q_nope[(t * h + hh) * p..(t * h + hh + 1) * p]);
                q[dst + p..dst + dqk]
                    .copy_from_slice(&q_pe[(t * h + hh) * r..(t * h + hh + 1) * r]);
            }
        }
        for j in 0..s_n {
            let ((kn, vv), kpe) = kv.key(j, j >= ctx_len);
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
        // As sent: each value in the dtype. The context's k_pe from a quantized cache's rows
        // (e4m3·scale for `fp8`) is generally off its grid, and the runner reads it rounded.
        let sent = |x: Vec<f64>| -> Vec<f64> {
            x.into_iter().map(|v| dt.round(v as f32) as f64).collect()
        };
        ChunkQkv {
            q: sent(q),
            k: sent(k),
            v: sent(v),
            dqk,
            dv,
            h,
        }
    }
}

/// The two prefill checks' rows over the run's tokens (prompt rows filled chunk by chunk): fp64 from
/// the runner's inputs (`ref_*`) and what it returned, heads `[T, H, Dv]` and LSE `[T, H]`, with the
/// dtypes they came in and the most keys a chunk saw.
struct PrefillRows {
    ref_heads: Vec<f64>,
    ref_lse: Vec<f64>,
    heads: Vec<f64>,
    lse: Vec<f64>,
    heads_dtype: &'static str,
    lse_dtype: &'static str,
    max_keys: usize,
}

impl PrefillRows {
    fn new(t_all: usize, h: usize, dv: usize) -> Self {
        PrefillRows {
            ref_heads: vec![0.0; t_all * h * dv],
            ref_lse: vec![0.0; t_all * h],
            heads: vec![0.0; t_all * h * dv],
            lse: vec![0.0; t_all * h],
            heads_dtype: "f32",
            lse_dtype: "f32",
            max_keys: 0,
        }
    }

    /// Chunk `c`'s rows: fp64 causal attention of its queries from `qkv`, and the runner's `heads`
    /// `[n, H, Dv]` and `lse` `[n, H]`.
    fn add_chunk(
        &mut self,
        cfg: &MlaConfig,
        c: &Range<usize>,
        qkv: &ChunkQkv,
        heads: &[f64],
        lse: &[f64],
    ) {
        let (h, dqk, dv) = (qkv.h, qkv.dqk, qkv.dv);
        let (q, k, v) = (&qkv.q, &qkv.k, &qkv.v);
        for i in 0..c.len() {
            let t = c.start + i;
            for hh in 0..h {
                let qi = &q[(i * h + hh) * dqk..(i * h + hh + 1) * dqk];
                let score = |j: usize| {
                    local::dot(qi, &k[(j * h + hh) * dqk..(j * h + hh + 1) * dqk])
                        * cfg.softmax_scale
                };
                let value = |j: usize| &v[(j * h + hh) * dv..(j * h + hh + 1) * dv];
                let (o, l) = local::attend(0..c.start + i + 1, dv, score, value);
                self.ref_heads[(t * h + hh) * dv..(t * h + hh + 1) * dv].copy_from_slice(&o);
                self.ref_lse[t * h + hh] = l;
                self.heads[(t * h + hh) * dv..(t * h + hh + 1) * dv]
                    .copy_from_slice(&heads[(i * h + hh) * dv..(i * h + hh + 1) * dv]);
                self.lse[t * h + hh] = lse[i * h + hh];
            }
        }
    }
}

/// The runner's prefill rows in place of the inner path's: the prompt tokens' `attn_heads` (as the
/// engine stores them before o_proj) and `lse`.
pub(super) fn put_prefill_outputs(tr: &mut LayerTrace, heads: &[f64], lse: &[f64]) -> Result<()> {
    let st = tr
        .get_mut(Stage::AttnHeads)
        .ok_or_else(|| missing(Stage::AttnHeads))?;
    st.data[..heads.len()].copy_from_slice(heads);
    let st = tr.get_mut(Stage::Lse).ok_or_else(|| missing(Stage::Lse))?;
    st.data[..lse.len()].copy_from_slice(lse);
    Ok(())
}
