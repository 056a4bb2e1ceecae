//! The decode op: the absorbed query over the paged latent cache, one request per layer with one batch
//! entry per decode step (each with its own pages, as an engine's batch of requests at different lengths).

use super::local;
use super::protocol::LseBase;
use super::tensors::{floats, ints, Output};
use super::{missing, set, RunnerBackend};
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::cpu::ops::round_all;
use crate::backend::{Dtype, LayerCtx};
use crate::error::Result;
use crate::trace::{AtRunner, LayerTrace, Stage, StageTensor};
use ndarray::{s, Array3};
use rand::seq::SliceRandom;
use rand::SeedableRng;

impl RunnerBackend {
    /// The decode op: one request per layer, one batch entry per decode step.
    pub(super) fn decode(
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
        let mut split = match spec.has("split_out") {
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
        if let Some((so, sl)) = &mut split {
            let mut sl_nat = {
                let k = match self.desc.conventions.lse_base {
                    LseBase::E => 1.0,
                    LseBase::Two => std::f64::consts::LN_2,
                };
                sl.data.iter().map(|v| v * k).collect::<Vec<_>>()
            };
            self.unwritten_splits += empty_splits(&l_slse, &mut sl_nat, &mut so.data, splits, lkv);
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

        put_decode_outputs(tr, ctx, mw, dt, &lat.data, &lse)
    }
}

/// Empty splits (no key the query sees falls in them, `reference_lse` −inf) are judged by their LSE
/// alone: one the runner returned as −inf, or whose weight in an f32 merge is 0, is empty, and its
/// `split_out` is don't-care (a kernel may leave a `torch.empty` buffer unwritten): set to the
/// reference's 0 and its LSE to −inf. A finite weight on an empty split, or −inf on a split with keys,
/// stays as returned and fails `split_lse`; a merge poisoned by the garbage (0·NaN) still fails at
/// `attn_latent`. Returns how many such partials held something other than 0.
fn empty_splits(
    reference_lse: &[f64],
    lse: &mut [f64],
    out: &mut [f64],
    splits: usize,
    dim: usize,
) -> usize {
    let mut garbage = 0;
    for (row, (lr, lo)) in reference_lse
        .chunks(splits)
        .zip(lse.chunks_mut(splits))
        .enumerate()
    {
        let m = lo.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        for k in 0..splits {
            let weightless = lo[k] == f64::NEG_INFINITY || ((lo[k] - m) as f32).exp() == 0.0;
            if lr[k] == f64::NEG_INFINITY && weightless {
                lo[k] = f64::NEG_INFINITY;
                let o = &mut out[(row * splits + k) * dim..(row * splits + k + 1) * dim];
                garbage += o.iter().any(|&v| v != 0.0) as usize;
                o.fill(0.0);
            }
        }
    }
    garbage
}

/// The runner's decode outputs in place of the inner path's: `attn_latent` `[D, H, Lkv]`, the decode
/// rows of `lse`, and the decode heads W_UV makes of the latent as the engine would (the latent stored
/// in the dtype first).
pub(super) fn put_decode_outputs(
    tr: &mut LayerTrace,
    ctx: &LayerCtx,
    mw: &MirrorWeights,
    dt: Dtype,
    lat: &[f64],
    lse: &[f64],
) -> Result<()> {
    let (cfg, sched) = (ctx.cfg, ctx.sched);
    let (h, lkv, dv, prompt) = (
        cfg.n_head,
        cfg.kv_lora_rank,
        cfg.v_head_dim,
        sched.prompt_len,
    );
    let d_n = lat.len() / (h * lkv);
    set(tr, Stage::AttnLatent, lat.to_vec())?;
    let lse_stage = tr.get_mut(Stage::Lse).ok_or_else(|| missing(Stage::Lse))?;
    lse_stage.data[prompt * h..].copy_from_slice(lse);
    let lat32 = Array3::from_shape_vec(
        (d_n, h, lkv),
        lat.iter().map(|&v| dt.round(v as f32)).collect(),
    )
    .expect("shape checked");
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
