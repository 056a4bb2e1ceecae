//! An external kernel as a backend (docs/runners.md): an inner optimized path (the CPU mirror or the
//! CUDA kernels) computes the layer up to the runner's entry stage; the runner's process computes its
//! ops (decode: absorbed attention over the paged latent cache; prefill: decompressed attention of a
//! chunk) from those tensors, as an engine would hand them over; its outputs replace the inner path's
//! stages, and what lies downstream of them (`attn_heads` of decode tokens, `attn_out`) is recomputed
//! from them by the CPU mirror's code. Each replaced stage also carries fp64 attention computed from the
//! runner's own inputs (`LayerTrace::at_runner`), which the comparator checks as `STAGE@runner`.

pub mod local;
pub mod protocol;
pub mod tensors;

use super::cpu::front::{decompress, o_proj, MirrorWeights};
use super::cpu::ops::round_all;
use super::{Backend, Dtype, LayerCtx};
use crate::error::{Error, Result};
use crate::trace::{AtRunner, LayerTrace, Stage, StageSet, StageTensor};
use ndarray::{s, Array2, Array3};
use protocol::{Describe, LseBase, LseLayout, Outcome, Process, Request};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tensors::{floats, ints, Named, Output, Outputs};

/// A runner over an inner optimized path.
pub struct RunnerBackend {
    inner: Box<dyn Backend>,
    pub desc: Describe,
    proc: Process,
    dtype: Dtype,
    /// Output dtypes seen, per output: `lse[decode] -> bf16`.
    out_dtypes: std::collections::BTreeMap<String, &'static str>,
}

impl RunnerBackend {
    /// Ask `cmd --describe`, then start `cmd --serve`.
    pub fn open(cmd: &str, inner: Box<dyn Backend>, dtype: Dtype) -> Result<RunnerBackend> {
        let desc = protocol::describe(cmd)?;
        let proc = Process::start(cmd, &desc.name, keep_io())?;
        Ok(RunnerBackend {
            inner,
            desc,
            proc,
            dtype,
            out_dtypes: Default::default(),
        })
    }

    /// The scratch directory the tensors go through.
    pub fn scratch(&self) -> &std::path::Path {
        &self.proc.scratch
    }

    /// Refuse, before anything runs, a case the runner says it cannot take.
    fn check_supports(&self, ctx: &LayerCtx) -> Result<()> {
        let (cfg, sched, s) = (ctx.cfg, ctx.sched, &self.desc.supports);
        let name = &self.desc.name;
        let refuse = |key: &str, v: String, allowed: String| {
            Err(Error::Unsupported(format!(
                "runner {name} does not support {key} {v} (it takes {allowed})"
            )))
        };
        let list = |key: &str, v: usize, allowed: &Option<Vec<usize>>| match allowed {
            Some(a) if !a.contains(&v) => refuse(key, v.to_string(), format!("{a:?}")),
            _ => Ok(()),
        };
        if let Some(d) = &s.dtypes {
            if !d.iter().any(|x| x == self.dtype.name()) {
                return refuse("dtype", self.dtype.name().into(), format!("{d:?}"));
            }
        }
        list("heads", cfg.n_head, &s.heads)?;
        list("kv_lora_rank", cfg.kv_lora_rank, &s.kv_lora_rank)?;
        list("qk_rope", cfg.qk_rope, &s.qk_rope)?;
        if self.desc.ops.decode.is_some() && sched.decode_steps > 0 {
            list("page_size", sched.page_size, &s.page_sizes)?;
            if let Some(m) = s.max_q_len {
                if sched.q_len > m {
                    return refuse("q_len", sched.q_len.to_string(), format!("at most {m}"));
                }
            }
        }
        if self.desc.ops.prefill.is_some() && sched.prompt_len > 0 {
            list("qk_head_dim", cfg.qk_head_dim(), &s.qk_head_dim)?;
            list("v_head_dim", cfg.v_head_dim, &s.v_head_dim)?;
        }
        Ok(())
    }

    fn meta(&self, ctx: &LayerCtx, extra: serde_json::Value) -> serde_json::Value {
        let (cfg, sched) = (ctx.cfg, ctx.sched);
        let mut m = serde_json::json!({
            "dtype": self.dtype.name(),
            "softmax_scale": cfg.softmax_scale,
            "heads": cfg.n_head,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope": cfg.qk_nope,
            "qk_rope": cfg.qk_rope,
            "v_head_dim": cfg.v_head_dim,
            "page_size": sched.page_size,
            "num_splits": sched.num_splits,
            "q_len": sched.q_len,
            "causal": true,
        });
        if let (Some(m), serde_json::Value::Object(e)) = (m.as_object_mut(), extra) {
            m.extend(e);
        }
        m
    }

    /// Write the inputs, send the request, read the outputs.
    fn call(
        &mut self,
        op: &str,
        layer: usize,
        meta: &serde_json::Value,
        inputs: &[Named],
    ) -> Result<Outputs> {
        let (id, input, output) = self.proc.next_paths();
        tensors::write(&input, inputs)?;
        let req = Request {
            id,
            op,
            layer,
            input: &input,
            output: &output,
            meta,
        };
        match self.proc.call(&req)? {
            Outcome::Ok => {}
            Outcome::Unsupported(reason) => {
                return Err(Error::Unsupported(format!(
                    "runner {} cannot take layer {layer} {op}: {reason}",
                    self.desc.name
                )))
            }
        }
        let out = Outputs::read(&output, &self.desc.name)?;
        if !keep_io() {
            let _ = std::fs::remove_file(&input);
            let _ = std::fs::remove_file(&output);
        }
        Ok(out)
    }

    /// A runner's LSE as natural log in `[rows, H]` order (from `[rows, H]` or `[H, rows]`; per entry
    /// `b` of `entries` when the rows are `entries × s_q`).
    fn lse_rows(&self, o: &Output, entries: usize, s_q: usize, h: usize) -> Vec<f64> {
        let c = &self.desc.conventions;
        let k = match c.lse_base {
            LseBase::E => 1.0,
            LseBase::Two => std::f64::consts::LN_2,
        };
        let mut v = vec![0.0; entries * s_q * h];
        for b in 0..entries {
            for i in 0..s_q {
                for hh in 0..h {
                    let src = match c.lse_layout {
                        LseLayout::TokenHead => (b * s_q + i) * h + hh,
                        LseLayout::HeadToken => (b * h + hh) * s_q + i,
                    };
                    v[(b * s_q + i) * h + hh] = o.data[src] * k;
                }
            }
        }
        v
    }

    fn lse_shape(&self, entries: Option<usize>, s_q: usize, h: usize) -> Vec<usize> {
        let mut sh = match self.desc.conventions.lse_layout {
            LseLayout::TokenHead => vec![s_q, h],
            LseLayout::HeadToken => vec![h, s_q],
        };
        if let Some(b) = entries {
            sh.insert(0, b);
        }
        sh
    }

    /// The decode op: one request per layer, one batch entry per decode step.
    fn decode(
        &mut self,
        ctx: &LayerCtx,
        mw: &MirrorWeights,
        tr: &mut LayerTrace,
        at: &mut Vec<AtRunner>,
    ) -> Result<()> {
        let (cfg, sched, dt) = (ctx.cfg, ctx.sched, self.dtype);
        let (h, lkv, r, page) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope, sched.page_size);
        let (b_n, s_q, prompt) = (sched.decode_steps, sched.q_len, sched.prompt_len);
        let row = lkv + r;
        let get = |st: Stage| {
            tr.get(st)
                .map(|t| t.data.clone())
                .ok_or_else(|| missing(st))
        };
        let q_abs = get(Stage::QAbsorbed)?;
        let q_pe_all = get(Stage::QPe)?;
        let rows = get(Stage::CacheRows)?;
        let q_pe = &q_pe_all[prompt * h * r..];
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();

        // The pool: each entry owns the pages of its own cache (as it stood after its step), shuffled
        // like the run's block table; one spare page of NaN is where unused table slots point.
        let seqlens: Vec<usize> = (0..b_n).map(|b| prompt + (b + 1) * s_q).collect();
        let pages: Vec<usize> = seqlens.iter().map(|l| l.div_ceil(page)).collect();
        let total = pages.iter().sum::<usize>() + 1;
        let mut phys: Vec<usize> = (0..total).collect();
        if let Some(seed) = sched.shuffle_seed {
            phys.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed ^ 0x52554e));
        }
        let poison = phys[total - 1];
        let max_pages = *pages.iter().max().expect("decode steps > 0");
        let mut table = vec![poison as i32; b_n * max_pages];
        let mut pool = vec![f32::NAN; total * page * row];
        let mut next = 0;
        for b in 0..b_n {
            for p in 0..pages[b] {
                let ph = phys[next];
                next += 1;
                table[b * max_pages + p] = ph as i32;
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
        }
        let inputs = [
            floats("q_nope", vec![b_n, s_q, h, lkv], &f32s(&q_abs), dt),
            floats("q_pe", vec![b_n, s_q, h, r], &f32s(q_pe), dt),
            floats("kv_cache", vec![total, page, row], &pool, dt),
            ints("block_table", vec![b_n, max_pages], &table),
            ints(
                "cache_seqlens",
                vec![b_n],
                &seqlens.iter().map(|&l| l as i32).collect::<Vec<_>>(),
            ),
        ];
        let meta = self.meta(ctx, serde_json::json!({}));
        let mut out = self.call("decode", ctx.layer, &meta, &inputs)?;
        let spec = self.desc.ops.decode.clone().expect("decode op");
        let lat = out.take("attn_latent", &[b_n, s_q, h, lkv], "decode")?;
        let lse_o = out.take("lse", &self.lse_shape(Some(b_n), s_q, h), "decode")?;
        let lse = self.lse_rows(&lse_o, b_n, s_q, h);
        let splits = sched.num_splits;
        let split = match spec.has("split_out") {
            true => Some((
                out.take("split_out", &[b_n, s_q, h, splits, lkv], "decode")?,
                out.take("split_lse", &[b_n, s_q, h, splits], "decode")?,
            )),
            false => None,
        };

        // fp64 from the runner's inputs: q as sent, keys the cache rows of the entry (as sent).
        let d_n = b_n * s_q;
        let scale = cfg.softmax_scale;
        let (mut l_out, mut l_lse) = (vec![0.0; d_n * h * lkv], vec![0.0; d_n * h]);
        let (mut l_sout, mut l_slse) = (
            vec![0.0; d_n * h * splits * lkv],
            vec![0.0; d_n * h * splits],
        );
        for (b, &seq_len) in seqlens.iter().enumerate() {
            for i in 0..s_q {
                let d = b * s_q + i;
                let visible = seq_len - s_q + i + 1;
                for hh in 0..h {
                    let qa = &q_abs[(d * h + hh) * lkv..(d * h + hh + 1) * lkv];
                    let qp = &q_pe[(d * h + hh) * r..(d * h + hh + 1) * r];
                    let score = |j: usize| {
                        let k = &rows[j * row..(j + 1) * row];
                        (local::dot(qa, &k[..lkv]) + local::dot(qp, &k[lkv..])) * scale
                    };
                    let value = |j: usize| &rows[j * row..j * row + lkv];
                    let (o, l) = local::attend(0..visible, lkv, score, value);
                    l_out[(d * h + hh) * lkv..(d * h + hh + 1) * lkv].copy_from_slice(&o);
                    l_lse[d * h + hh] = l;
                    for (k, kr) in sched.split_ranges(seq_len).into_iter().enumerate() {
                        let keys = kr.start..kr.end.min(visible);
                        let keys = keys.start..keys.end.max(keys.start);
                        let (o, l) = local::attend(keys, lkv, score, value);
                        let at = (d * h + hh) * splits + k;
                        l_sout[at * lkv..(at + 1) * lkv].copy_from_slice(&o);
                        l_slse[at] = l;
                    }
                }
            }
        }
        let terms = (seqlens[b_n - 1]) * row;
        let t_all = sched.total_tokens();
        let tol = |o: &Output| local::tolerance(dt.name(), o.dtype, terms);
        at.push(AtRunner {
            check: "attn_latent".into(),
            reference: StageTensor::new(Stage::AttnLatent, vec![d_n, h, lkv], l_out),
            optimized: StageTensor::new(Stage::AttnLatent, vec![d_n, h, lkv], lat.data.clone()),
            tolerance: tol(&lat),
            out_dtype: lat.dtype,
        });
        let full = |v: &[f64]| {
            let mut f = vec![0.0; t_all * h];
            f[prompt * h..].copy_from_slice(v);
            StageTensor::new(Stage::Lse, vec![t_all, h], f)
        };
        at.push(AtRunner {
            check: "lse[decode]".into(),
            reference: full(&l_lse),
            optimized: full(&lse),
            tolerance: tol(&lse_o),
            out_dtype: lse_o.dtype,
        });
        if let Some((so, sl)) = &split {
            let sl_nat = {
                let k = match self.desc.conventions.lse_base {
                    LseBase::E => 1.0,
                    LseBase::Two => std::f64::consts::LN_2,
                };
                sl.data.iter().map(|v| v * k).collect::<Vec<_>>()
            };
            at.push(AtRunner {
                check: "split_out".into(),
                reference: StageTensor::new(Stage::SplitOut, vec![d_n, h, splits, lkv], l_sout),
                optimized: StageTensor::new(
                    Stage::SplitOut,
                    vec![d_n, h, splits, lkv],
                    so.data.clone(),
                ),
                tolerance: tol(so),
                out_dtype: so.dtype,
            });
            at.push(AtRunner {
                check: "split_lse".into(),
                reference: StageTensor::new(Stage::SplitLse, vec![d_n, h, splits], l_slse),
                optimized: StageTensor::new(Stage::SplitLse, vec![d_n, h, splits], sl_nat.clone()),
                tolerance: tol(sl),
                out_dtype: sl.dtype,
            });
            set(tr, Stage::SplitOut, so.data.clone())?;
            set(tr, Stage::SplitLse, sl_nat)?;
        } else {
            tr.stages
                .retain(|t| !matches!(t.stage, Stage::SplitOut | Stage::SplitLse));
        }

        // The runner's outputs replace the inner path's; W_UV turns them into the decode heads as the
        // engine would (output stored in the dtype first).
        set(tr, Stage::AttnLatent, lat.data.clone())?;
        let lse_stage = tr.get_mut(Stage::Lse).ok_or_else(|| missing(Stage::Lse))?;
        lse_stage.data[prompt * h..].copy_from_slice(&lse);
        let lat32 = Array3::from_shape_vec(
            (d_n, h, lkv),
            lat.data.iter().map(|&v| dt.round(v as f32)).collect(),
        )
        .expect("shape checked");
        let dv = cfg.v_head_dim;
        let heads = tr
            .get_mut(Stage::AttnHeads)
            .ok_or_else(|| missing(Stage::AttnHeads))?;
        for hh in 0..h {
            let o = round_all(lat32.slice(s![.., hh, ..]).dot(&mw.uv(cfg, hh).t()), dt);
            for d in 0..d_n {
                let at = ((prompt + d) * h + hh) * dv;
                heads.data[at..at + dv]
                    .copy_from_slice(&o.row(d).iter().map(|&v| v as f64).collect::<Vec<_>>());
            }
        }
        Ok(())
    }

    /// The prefill op: one request per chunk, keys and values decompressed by the inner path's rule.
    fn prefill(
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

/// With `MLA_DIFF_KEEP_RUNNER_IO` set, the request files stay in the scratch directory (printed on
/// stderr): the exact tensors a runner was given, for its author.
fn keep_io() -> bool {
    std::env::var_os(KEEP_IO_ENV).is_some()
}
pub const KEEP_IO_ENV: &str = "MLA_DIFF_KEEP_RUNNER_IO";

fn missing(st: Stage) -> Error {
    Error::Usage(format!(
        "the optimized path under the runner gave no {st} stage, which the runner needs"
    ))
}

fn set(tr: &mut LayerTrace, st: Stage, data: Vec<f64>) -> Result<()> {
    let t = tr.get_mut(st).ok_or_else(|| missing(st))?;
    debug_assert_eq!(t.data.len(), data.len());
    t.data = data;
    Ok(())
}

impl Backend for RunnerBackend {
    fn describe(&self) -> String {
        let d = &self.desc;
        let ops: Vec<String> = [("decode", &d.ops.decode), ("prefill", &d.ops.prefill)]
            .iter()
            .filter_map(|(n, s)| s.as_ref().map(|s| format!("{n}: {}", s.outputs.join(", "))))
            .collect();
        format!(
            "runner {} {} ({}) over {}",
            d.name,
            d.version,
            ops.join("; "),
            self.inner.describe()
        )
    }

    fn device(&self) -> Option<String> {
        self.inner.device()
    }

    fn notices(&self) -> Vec<String> {
        let outs: Vec<String> = self
            .out_dtypes
            .iter()
            .map(|(c, d)| format!("{c} {d}"))
            .collect();
        let mut v = vec![format!(
            "runner {} produced {} (dtypes as returned: {}); upstream stages from {}; attn_heads of decode tokens and attn_out recomputed from its outputs by the CPU mirror's code",
            self.desc.name,
            self.out_dtypes.keys().cloned().collect::<Vec<_>>().join(", "),
            outs.join(", "),
            self.inner.describe()
        )];
        // An LSE stored in a 16-bit type loses ~3 decimal digits: fine for a single pass, not for
        // merging partial states (DCP, chunked context) downstream.
        for (c, d) in &self.out_dtypes {
            if c.starts_with("lse") && matches!(*d, "bf16" | "fp16") {
                v.push(format!(
                    "runner {} returns {c} in {d}, not f32: its @runner bound is {d}'s",
                    self.desc.name
                ));
            }
        }
        if self.out_dtypes.is_empty() {
            v.clear();
        }
        v
    }

    fn kernels(
        &self,
        cfg: &crate::model::MlaConfig,
        sched: &crate::schedule::Schedule,
    ) -> Vec<crate::coverage::KernelUse> {
        use crate::coverage::{Family, Phase};
        // The phases the runner computes are its kernels, whose tiles mla-diff cannot see.
        let mut k = self.inner.kernels(cfg, sched);
        for u in k.iter_mut() {
            let runs = match u.phase {
                Phase::Decode => self.desc.ops.decode.is_some(),
                Phase::Prefill => self.desc.ops.prefill.is_some(),
            };
            if runs {
                u.family = Family::External;
                u.label = format!("runner {} {}", self.desc.name, self.desc.version);
                u.geometry = None;
                u.production = None;
            }
        }
        k
    }

    fn provides(&self) -> StageSet {
        let mut s = self.inner.provides();
        if let Some(dec) = &self.desc.ops.decode {
            if !dec.has("split_out") {
                s = s.without(Stage::SplitOut).without(Stage::SplitLse);
            }
        }
        s
    }

    fn run_layer(&mut self, ctx: &LayerCtx, x: &Array2<f64>) -> Result<LayerTrace> {
        self.check_supports(ctx)?;
        let mut tr = self.inner.run_layer(ctx, x)?;
        let mut at = Vec::new();
        // The weights as the inner path stores them, for the decompression and projections around the
        // runner's ops (no planted bug: faults live in the inner path).
        let mw = MirrorWeights::new(
            ctx.cfg,
            ctx.weights,
            self.dtype,
            crate::faults::Active::NONE,
        );
        if self.desc.ops.prefill.is_some() && ctx.sched.prompt_len > 0 {
            self.prefill(ctx, &mw, &mut tr, &mut at)?;
        }
        if self.desc.ops.decode.is_some() && ctx.sched.decode_steps > 0 {
            self.decode(ctx, &mw, &mut tr, &mut at)?;
        }
        // attn_out from the heads as they now stand (the runner's rows included).
        let (t, h, dv) = (ctx.sched.total_tokens(), ctx.cfg.n_head, ctx.cfg.v_head_dim);
        let heads = tr
            .get(Stage::AttnHeads)
            .ok_or_else(|| missing(Stage::AttnHeads))?;
        let heads =
            Array3::from_shape_vec((t, h, dv), heads.data.iter().map(|&v| v as f32).collect())
                .map_err(|e| Error::Usage(format!("attn_heads: {e}")))?;
        let out = o_proj(&mw, &heads, self.dtype);
        set(
            &mut tr,
            Stage::AttnOut,
            out.iter().map(|&v| v as f64).collect(),
        )?;
        for a in &at {
            self.out_dtypes.insert(a.check.clone(), a.out_dtype);
        }
        tr.at_runner = at;
        Ok(tr)
    }
}
