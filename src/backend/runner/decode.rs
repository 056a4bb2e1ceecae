//! The decode op: the absorbed query over the paged latent cache, one request per layer with one batch
//! entry per decode step (each with its own pages, as an engine's batch of requests at different lengths).

use super::cache::paged_bytes;
use super::local::{self, Yardstick};
use super::protocol::{LseBase, SplitPartition};
use super::tensors::{floats, ints, Output};
use super::{missing, set, stage, RunnerBackend};
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::cpu::ops::round_all;
use crate::backend::LayerCtx;
use crate::error::Result;
use crate::precision::Dtype;
use crate::trace::{AtRunner, LayerTrace, Stage};
use ndarray::{s, Array3};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

/// One batch entry of a decode request: its `s_q × H` query rows (absorbed and rope parts, as stored)
/// and its keys as rows of the run's cache (`None`: a row of NaN, a padded entry's).
pub(crate) struct Entry {
    pub q_nope: Vec<f64>,
    pub q_pe: Vec<f64>,
    pub keys: Vec<Option<usize>>,
}

/// What the runner returned for a decode request: LSEs natural-log in `[B, s_q, H]` order.
pub(super) struct Returned {
    pub lat: Output,
    pub lse: Vec<f64>,
    pub lse_dtype: &'static str,
    /// `split_out` `[B, s_q, H, S, Lkv]`, `split_lse` (natural log) `[B, s_q, H, S]`, its dtype, and `S`
    /// (the run's `num_splits`, or the kernel's own count with `split_partition: own`).
    pub split: Option<(Output, Vec<f64>, &'static str, usize)>,
}

/// One (query, head) row of [`Local`]: out, lse, and each split's (out, lse).
type LocalRow = (Vec<f64>, f64, Vec<(Vec<f64>, f64)>);

/// fp64 attention of one entry from exactly its rows: out `[s_q, H, Lkv]`, lse `[s_q, H]` and, over
/// `splits` (vLLM's partition of its keys), the partials `[s_q, H, S, Lkv]` and `[s_q, H, S]`.
pub(crate) struct Local {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub sout: Vec<f64>,
    pub slse: Vec<f64>,
}

/// The dims of an absorbed decode: query heads, latent width, rope width, softmax scale.
pub(crate) struct Dims {
    pub heads: usize,
    pub lkv: usize,
    pub rope: usize,
    pub scale: f64,
}

/// fp64 attention of `e` (all keys real) from its rows (`[slot, lkv + rope]`, value = the latent part),
/// causal within the entry's `s_q` queries (query `i` sees the first `len − s_q + i + 1` keys), with
/// the partials over `splits(len)` (none for an empty list): the yardstick of every `@runner` decode
/// check, a run's (`RunnerBackend::local_entry`) or an engine's logged kernel call's
/// (`capture::flashinfer`).
pub(crate) fn local_attention(
    d: &Dims,
    e: &Entry,
    s_q: usize,
    rows: &[f64],
    splits: impl Fn(usize) -> Vec<std::ops::Range<usize>>,
) -> Local {
    let (h, lkv, r, scale) = (d.heads, d.lkv, d.rope, d.scale);
    let row = lkv + r;
    let seq_len = e.keys.len();
    let key = |j: usize| e.keys[j].expect("a real entry's keys are rows");
    let split_ranges = splits(seq_len);
    let n_splits = split_ranges.len();
    // Rows (query, head) in parallel: a GLM-5 layer's yardstick is ~10¹⁰ products.
    let rows_out: Vec<LocalRow> = (0..s_q * h)
        .into_par_iter()
        .map(|d| {
            let i = d / h;
            let visible = (seq_len + i + 1).saturating_sub(s_q);
            let qa = &e.q_nope[d * lkv..(d + 1) * lkv];
            let qp = &e.q_pe[d * r..(d + 1) * r];
            let score = |j: usize| {
                let k = &rows[key(j) * row..(key(j) + 1) * row];
                (local::dot(qa, &k[..lkv]) + local::dot(qp, &k[lkv..])) * scale
            };
            let value = |j: usize| &rows[key(j) * row..key(j) * row + lkv];
            let (o, ls) = local::attend(0..visible, lkv, score, value);
            let parts = split_ranges
                .iter()
                .map(|kr| {
                    let keys = kr.start..kr.end.min(visible);
                    let keys = keys.start..keys.end.max(keys.start);
                    local::attend(keys, lkv, score, value)
                })
                .collect();
            (o, ls, parts)
        })
        .collect();
    let mut l = Local {
        out: Vec::with_capacity(s_q * h * lkv),
        lse: Vec::with_capacity(s_q * h),
        sout: Vec::with_capacity(s_q * h * n_splits * lkv),
        slse: Vec::with_capacity(s_q * h * n_splits),
    };
    for (o, ls, parts) in rows_out {
        l.out.extend(o);
        l.lse.push(ls);
        for (so, sl) in parts {
            l.sout.extend(so);
            l.slse.push(sl);
        }
    }
    l
}

/// The decode steps as the entries of one request: entry `b` is step `b`, its queries `q_abs`
/// `[s_q, H, Lkv]` and `q_pe` (the decode rows) `[s_q, H, R]`, its keys the cache as it stood after the
/// step's rows were written.
pub(super) fn step_entries(ctx: &LayerCtx, q_abs: &[f64], q_pe: &[f64]) -> Vec<Entry> {
    let (cfg, sched) = (ctx.cfg, ctx.sched);
    let (h, lkv, r) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope);
    let (s_q, prompt) = (sched.q_len, sched.prompt_len);
    (0..sched.decode_steps)
        .map(|b| Entry {
            q_nope: q_abs[b * s_q * h * lkv..(b + 1) * s_q * h * lkv].to_vec(),
            q_pe: q_pe[b * s_q * h * r..(b + 1) * s_q * h * r].to_vec(),
            keys: (0..prompt + (b + 1) * s_q).map(Some).collect(),
        })
        .collect()
}

/// The paged latent cache a decode request carries, `[total pages, page_size, Lkv + R]`: each
/// entry's keys in its own pages, taken in an order shuffled by `seed` (the schedule's, salted per
/// op) as an engine's pages are, and one spare page; every slot no key is written to is NaN.
pub(super) struct Paged {
    pub pool: Vec<f32>,
    /// Per entry, its physical pages in order.
    pub tables: Vec<Vec<usize>>,
    pub total: usize,
    /// The spare page, all NaN: where an entry's unused table slots point.
    pub spare: usize,
}

impl Paged {
    pub(super) fn new(
        entries: &[Entry],
        page: usize,
        row: usize,
        rows: &[f64],
        seed: Option<u64>,
    ) -> Paged {
        let pages: Vec<usize> = entries
            .iter()
            .map(|e| e.keys.len().div_ceil(page))
            .collect();
        let total = pages.iter().sum::<usize>() + 1;
        let mut phys: Vec<usize> = (0..total).collect();
        if let Some(seed) = seed {
            phys.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        }
        let mut pool = vec![f32::NAN; total * page * row];
        let mut tables = Vec::with_capacity(entries.len());
        let mut next = 0;
        for (b, e) in entries.iter().enumerate() {
            let mut table = Vec::with_capacity(pages[b]);
            for p in 0..pages[b] {
                let ph = phys[next];
                next += 1;
                table.push(ph);
                for j in p * page..((p + 1) * page).min(e.keys.len()) {
                    let Some(k) = e.keys[j] else { continue };
                    let dst = (ph * page + j % page) * row;
                    for (d, &v) in pool[dst..dst + row]
                        .iter_mut()
                        .zip(&rows[k * row..(k + 1) * row])
                    {
                        *d = v as f32;
                    }
                }
            }
            tables.push(table);
        }
        Paged {
            pool,
            tables,
            total,
            spare: phys[total - 1],
        }
    }
}

/// The decode rows `v` `[D, H]` as the run's `lse` `[T, H]`, the prompt rows 0.
pub(super) fn decode_lse(v: &[f64], prompt: usize, h: usize) -> Vec<f64> {
    let mut f = vec![0.0; prompt * h + v.len()];
    f[prompt * h..].copy_from_slice(v);
    f
}

impl RunnerBackend {
    /// Send one decode request of `entries` (each `s_q` queries; keys in their own shuffled pages, one
    /// spare page of NaN where unused table slots point) and read the reply.
    pub(super) fn send_decode(
        &mut self,
        ctx: &LayerCtx,
        entries: &[Entry],
        s_q: usize,
        rows: &[f64],
    ) -> Result<Returned> {
        let (cfg, sched, dt) = (ctx.cfg, ctx.sched, self.dtype);
        let (h, lkv, r, page) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope, sched.page_size);
        let row = lkv + r;
        let b_n = entries.len();
        let seed = sched.shuffle_seed.map(|s| s ^ 0x52554e);
        let Paged {
            pool,
            tables,
            total,
            spare,
        } = Paged::new(entries, page, row, rows, seed);
        let max_pages = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut table = vec![spare as i32; b_n * max_pages];
        for (b, t) in tables.iter().enumerate() {
            for (p, &ph) in t.iter().enumerate() {
                table[b * max_pages + p] = ph as i32;
            }
        }
        let cat = |f: fn(&Entry) -> &Vec<f64>| -> Vec<f32> {
            entries
                .iter()
                .flat_map(|e| f(e).iter().map(|&x| x as f32))
                .collect()
        };
        let seqlens: Vec<i32> = entries.iter().map(|e| e.keys.len() as i32).collect();
        let (cache, cache_meta) = match &self.cache_bytes {
            Some((codec, bytes)) => {
                let keys = entries.iter().map(|e| e.keys.as_slice());
                paged_bytes(codec, bytes, keys, &tables, total, page)
            }
            None => (
                floats("kv_cache", vec![total, page, row], &pool, dt),
                serde_json::Value::Null,
            ),
        };
        let inputs = [
            floats("q_nope", vec![b_n, s_q, h, lkv], &cat(|e| &e.q_nope), dt),
            floats("q_pe", vec![b_n, s_q, h, r], &cat(|e| &e.q_pe), dt),
            cache,
            ints("block_table", vec![b_n, max_pages], &table),
            ints("cache_seqlens", vec![b_n], &seqlens),
        ];
        let mut extra = serde_json::json!({ "q_len": s_q });
        if !cache_meta.is_null() {
            extra["cache"] = cache_meta;
        }
        if let Some(s) = self.q_scale {
            extra["q_scale"] = serde_json::json!(s);
        }
        let meta = self.meta(ctx, extra);
        let mut out = self.call("decode", ctx.layer, &meta, &inputs)?;
        let spec = self.desc.ops.decode.clone().expect("decode op");
        let lat = out.take("attn_latent", &[b_n, s_q, h, lkv], "decode")?;
        let lse_o = out.take("lse", &self.lse_shape(Some(b_n), s_q, h), "decode")?;
        let lse = self.lse_rows(&lse_o, b_n, s_q, h);
        let splits = match self.desc.decode_partition() {
            SplitPartition::Vllm => sched.num_splits,
            // The kernel's own count: whatever its split_lse holds (checked against split_out below).
            SplitPartition::Own => out
                .tensors
                .get("split_lse")
                .and_then(|t| t.shape.get(3).copied())
                .unwrap_or(0)
                .max(1),
        };
        let split = match spec.has("split_out") {
            true => {
                let so = out.take("split_out", &[b_n, s_q, h, splits, lkv], "decode")?;
                let sl = out.take("split_lse", &[b_n, s_q, h, splits], "decode")?;
                let k = match self.desc.conventions.lse_base {
                    LseBase::E => 1.0,
                    LseBase::Two => std::f64::consts::LN_2,
                };
                let nat = sl.data.iter().map(|v| v * k).collect();
                Some((so, nat, sl.dtype, splits))
            }
            false => None,
        };
        Ok(Returned {
            lat,
            lse,
            lse_dtype: lse_o.dtype,
            split,
        })
    }

    /// fp64 attention of `e` (all keys real) from its rows, split partials over vLLM's partition of
    /// the run's `num_splits`.
    pub(crate) fn local_entry(ctx: &LayerCtx, e: &Entry, s_q: usize, rows: &[f64]) -> Local {
        let (cfg, sched) = (ctx.cfg, ctx.sched);
        let dims = Dims {
            heads: cfg.n_head,
            lkv: cfg.kv_lora_rank,
            rope: cfg.qk_rope,
            scale: cfg.softmax_scale,
        };
        local_attention(&dims, e, s_q, rows, |n| sched.split_ranges(n))
    }

    /// The decode op: one request per layer, one batch entry per decode step; the first time a layer
    /// is seen, also its serving batch, padded and alone (`batch_checks`).
    pub(super) fn decode(
        &mut self,
        ctx: &LayerCtx,
        mw: &MirrorWeights,
        tr: &mut LayerTrace,
        at: &mut Vec<AtRunner>,
    ) -> Result<()> {
        let (cfg, sched, dt) = (ctx.cfg, ctx.sched, self.dtype);
        let (h, lkv, r) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope);
        let (b_n, s_q, prompt) = (sched.decode_steps, sched.q_len, sched.prompt_len);
        let row = lkv + r;
        let q_abs = stage(tr, Stage::QAbsorbed)?;
        let q_pe_all = stage(tr, Stage::QPe)?;
        // The rows the kernel attends over: as it decodes the bytes sent, rounded to the dtype
        // where it declares so (`conventions.cache_dequant`); every yardstick of the layer reads them.
        let rows = self.encode_cache(lkv, r, stage(tr, Stage::CacheRows)?);
        let rows = self.rows_as_read(rows, dt);
        let q_pe = &q_pe_all[prompt * h * r..];
        // With `conventions.q_fp8`: q on its e4m3 grid in every request of the layer (`q_fp8`), and
        // the entries of q as computed kept for its effect.
        let q8 = self.q_fp8().then(|| super::q_fp8::quantize(&q_abs, q_pe));
        self.q_scale = q8.as_ref().map(|q| q.scale);
        tr.q_scale = self.q_scale;
        let plain = q8.as_ref().map(|_| step_entries(ctx, &q_abs, q_pe));
        let (q_abs, q_pe): (&[f64], &[f64]) = match &q8 {
            Some(q) => (&q.q_abs, &q.q_pe),
            None => (&q_abs, q_pe),
        };
        let entries = step_entries(ctx, q_abs, q_pe);
        let ret = self.send_decode(ctx, &entries, s_q, &rows)?;
        let (lat, lse) = (&ret.lat, &ret.lse);
        let own = self.desc.decode_partition() == SplitPartition::Own;

        // fp64 from the runner's inputs: q as sent, keys the cache rows of the entry (as sent).
        let d_n = b_n * s_q;
        let splits = sched.num_splits;
        let (mut l_out, mut l_lse) = (Vec::with_capacity(d_n * h * lkv), Vec::new());
        let (mut l_sout, mut l_slse) = (Vec::new(), Vec::new());
        for e in &entries {
            let l = Self::local_entry(ctx, e, s_q, &rows);
            l_out.extend(l.out);
            l_lse.extend(l.lse);
            l_sout.extend(l.sout);
            l_slse.extend(l.slse);
        }
        if let Some(plain) = &plain {
            Self::q_effect(
                ctx,
                mw,
                tr,
                plain,
                [&l_out, &l_lse, &l_sout, &l_slse],
                &rows,
            );
        }
        let terms = entries[b_n - 1].keys.len() * row;
        let t_all = sched.total_tokens();
        let y = Yardstick { dtype: dt, terms };
        at.push(y.check(
            "attn_latent",
            Stage::AttnLatent,
            &[d_n, h, lkv],
            [l_out, lat.data.clone()],
            lat.dtype,
        ));
        at.push(y.check(
            "lse[decode]",
            Stage::Lse,
            &[t_all, h],
            [decode_lse(&l_lse, prompt, h), decode_lse(lse, prompt, h)],
            ret.lse_dtype,
        ));
        match &ret.split {
            Some((so, sl_nat, sl_dtype, _)) if !own => {
                let (mut so_data, mut sl_nat, sl_dtype) =
                    (so.data.clone(), sl_nat.clone(), *sl_dtype);
                self.unwritten_splits +=
                    empty_splits(&l_slse, &mut sl_nat, &mut so_data, splits, lkv);
                at.push(y.check(
                    "split_out",
                    Stage::SplitOut,
                    &[d_n, h, splits, lkv],
                    [l_sout, so_data.clone()],
                    so.dtype,
                ));
                at.push(y.check(
                    "split_lse",
                    Stage::SplitLse,
                    &[d_n, h, splits],
                    [l_slse, sl_nat.clone()],
                    sl_dtype,
                ));
                set(tr, Stage::SplitOut, so_data)?;
                set(tr, Stage::SplitLse, sl_nat)?;
            }
            _ => {
                tr.stages
                    .retain(|t| !matches!(t.stage, Stage::SplitOut | Stage::SplitLse));
            }
        }
        if own {
            let checks = self.merge_consistency(ctx.layer, &ret, terms);
            self.checks.extend(checks);
        }
        if self.batch_layers.insert(ctx.layer) {
            self.batch_checks(ctx, q_abs, q_pe, &rows)?;
            self.aimed_checks(ctx, q_abs, q_pe, &rows)?;
        }
        let (lat, lse) = (ret.lat.data, ret.lse);
        put_decode_outputs(tr, ctx, mw, dt, &lat, &lse)
    }
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
