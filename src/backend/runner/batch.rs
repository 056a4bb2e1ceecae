//! A decode runner's batch checks (issue #32, items 6–8, 10), once per layer: the serving-shaped batch
//! (`crate::batch::serving`: mixed lengths, one key to thousands, shorter than a page, empty splits)
//! against fp64 from its inputs; the same batch with padded entries appended (a CUDA graph's), whose
//! real rows must not change by a bit; each of two requests alone, against its row inside the batch
//! (a verdict only for a runner that declares `batch_invariant`); and, for a kernel that chooses its
//! own split partition, its partials by merge consistency.

use super::checks::{against_fp64, against_fp64_with, e, record, same_bits, RunnerCheck, Status};
use super::decode::{Entry, Returned};
use super::RunnerBackend;
use crate::backend::LayerCtx;
use crate::error::{Error, Result};

/// One layer's serving batch (or a batch aimed at a variant, `aimed`) as sent: the requests, their
/// entries and the runner's reply.
pub(super) struct Batch<'a> {
    pub ctx: &'a LayerCtx<'a>,
    pub rows: &'a [f64],
    pub reqs: Vec<crate::batch::Request>,
    pub entries: Vec<Entry>,
    pub ret: Returned,
    /// The kernel chooses its own split partition (`geometry.split_partition own`).
    pub own: bool,
    pub scope: String,
    /// Queries per entry.
    pub s_q: usize,
}

impl Batch<'_> {
    /// Products per output: the longest request's keys (or the sequence) times the cache row.
    fn terms(&self) -> usize {
        let cfg = self.ctx.cfg;
        crate::batch::LONG.max(self.ctx.sched.total_tokens()) * (cfg.kv_lora_rank + cfg.qk_rope)
    }
}

impl RunnerBackend {
    /// Judge `o` against fp64 `r` at the `@runner` bound of `dtype` over `terms` products.
    #[allow(clippy::too_many_arguments)]
    fn against_fp64(
        &self,
        layer: usize,
        check: &str,
        what: &str,
        r: &[f64],
        o: &[f64],
        dtype: &str,
        terms: usize,
        skip: impl Fn(usize) -> bool,
        scope: &str,
    ) -> RunnerCheck {
        against_fp64(
            self.dtype.name(),
            layer,
            check,
            what,
            (r, o),
            dtype,
            terms,
            skip,
            scope,
        )
    }

    /// The serving batch, padded and alone, for this layer (see the module doc).
    pub(super) fn batch_checks(
        &mut self,
        ctx: &LayerCtx,
        q_abs: &[f64],
        q_pe: &[f64],
        rows: &[f64],
    ) -> Result<()> {
        let (cfg, sched) = (ctx.cfg, ctx.sched);
        let (h, lkv, r) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope);
        let t = sched.total_tokens();
        let reqs = crate::batch::serving(sched);
        if reqs.is_empty() {
            return Ok(());
        }
        let entry = |q: usize, keys: Vec<Option<usize>>| Entry {
            q_nope: q_abs[q * h * lkv..(q + 1) * h * lkv].to_vec(),
            q_pe: q_pe[q * h * r..(q + 1) * h * r].to_vec(),
            keys,
        };
        let entries: Vec<Entry> = reqs
            .iter()
            .map(|q| entry(q.query, (0..q.seq_len).map(|j| Some(j % t)).collect()))
            .collect();
        let lens: Vec<String> = reqs.iter().map(|q| q.seq_len.to_string()).collect();
        let scope = format!("{} requests of {} keys", reqs.len(), lens.join(", "));
        let ret = self.send_decode(ctx, &entries, 1, rows)?;
        let own = self.desc.decode_partition() == super::protocol::SplitPartition::Own;

        let b = Batch {
            ctx,
            rows,
            reqs,
            entries,
            ret,
            own,
            scope,
            s_q: 1,
        };
        let mut out = self.vs_fp64(&b, "serving_batch");
        self.padding(&b, &mut out)?;
        self.alone(&b, &mut out)?;
        self.checks.extend(out);
        Ok(())
    }

    /// The batch against fp64 from its own inputs as check `check` (a kernel with its own split
    /// partition: its partials by merge consistency).
    pub(super) fn vs_fp64(&self, b: &Batch, check: &str) -> Vec<RunnerCheck> {
        let (ctx, rows, entries, ret, own, scope) =
            (b.ctx, b.rows, &b.entries, &b.ret, b.own, &b.scope);
        let (lkv, layer) = (ctx.cfg.kv_lora_rank, ctx.layer);
        let terms = b.terms();
        let (mut l_out, mut l_lse, mut l_sout, mut l_slse) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for en in entries.iter() {
            let l = Self::local_entry(ctx, en, b.s_q, rows);
            l_out.extend(l.out);
            l_lse.extend(l.lse);
            l_sout.extend(l.sout);
            l_slse.extend(l.slse);
        }
        // With P rounded to e4m3 (`conventions.p_fp8`): what that rounding may move each output.
        let pb = self
            .p_e4m3()
            .then(|| super::reads::p_e4m3_bounds(ctx, entries, b.s_q, rows));
        let mut out = vec![
            against_fp64_with(
                self.dtype.name(),
                (layer, check, "attn_latent"),
                (&l_out, &ret.lat.data),
                ret.lat.dtype,
                terms,
                |_| false,
                scope,
                pb.as_ref().map(|p| p.0.as_slice()),
            ),
            self.against_fp64(
                layer,
                check,
                "lse",
                &l_lse,
                &ret.lse,
                ret.lse_dtype,
                terms,
                |_| false,
                scope,
            ),
        ];
        if let Some((so, sl, sl_dtype, s)) = &ret.split {
            if !own {
                // An empty split's out is don't-care: its lse (−inf) weighs it 0 in the merge.
                let empty = |i: usize| l_slse[i / lkv] == f64::NEG_INFINITY;
                out.push(against_fp64_with(
                    self.dtype.name(),
                    (layer, check, "split_out"),
                    (&l_sout, &so.data),
                    so.dtype,
                    terms,
                    empty,
                    scope,
                    pb.as_ref().map(|p| p.1.as_slice()),
                ));
                out.push(self.against_fp64(
                    layer,
                    check,
                    "split_lse",
                    &l_slse,
                    sl,
                    sl_dtype,
                    terms,
                    |_| false,
                    scope,
                ));
            } else {
                out.extend(self.merge_consistency_of(
                    layer,
                    ret,
                    *s,
                    terms,
                    match check {
                        "serving_batch" => "serving batch",
                        _ => scope,
                    },
                ));
            }
        }
        out
    }

    /// Padded entries appended, as a CUDA graph's batch: the real rows bit for bit.
    fn padding(&mut self, b: &Batch, out: &mut Vec<RunnerCheck>) -> Result<()> {
        let (ctx, rows, reqs, entries, ret, own, scope) =
            (b.ctx, b.rows, &b.reqs, &b.entries, &b.ret, b.own, &b.scope);
        let (h, lkv, r, layer) = (
            ctx.cfg.n_head,
            ctx.cfg.kv_lora_rank,
            ctx.cfg.qk_rope,
            ctx.layer,
        );
        let terms = b.terms();
        let mut padded: Vec<Entry> = entries
            .iter()
            .map(|e| Entry {
                q_nope: e.q_nope.clone(),
                q_pe: e.q_pe.clone(),
                keys: e.keys.clone(),
            })
            .collect();
        for (len, _) in crate::batch::PADDING {
            let nan = |n: usize| vec![f64::NAN; n];
            padded.push(Entry {
                q_nope: nan(h * lkv),
                q_pe: nan(h * r),
                keys: vec![None; len],
            });
        }
        let pads: Vec<&str> = crate::batch::PADDING.iter().map(|p| p.1).collect();
        match self.send_decode(ctx, &padded, 1, rows) {
            // A kernel that picks its own splits may pick others for a larger batch (FlashMLA's
            // metadata): its real rows are held to the @runner bound, not to the bit.
            Ok(p) if own => {
                let (n, m) = (reqs.len() * h * lkv, reqs.len() * h);
                // With P rounded to e4m3, each reply carries its own rounding (against its own
                // running max): twice what one may move each output.
                let pb = self.p_e4m3().then(|| {
                    let (o, _) = super::reads::p_e4m3_bounds(ctx, entries, 1, rows);
                    o.into_iter().map(|x| 2.0 * x).collect::<Vec<f64>>()
                });
                let scope = format!(
                    "{scope}, then {} padded entries ({}); own split partition: real rows within the @runner bound of the unpadded reply",
                    pads.len(),
                    pads.join(", ")
                );
                out.push(against_fp64_with(
                    self.dtype.name(),
                    (layer, "padding", "attn_latent"),
                    (&ret.lat.data, &p.lat.data[..n]),
                    ret.lat.dtype,
                    terms,
                    |_| false,
                    &scope,
                    pb.as_deref(),
                ));
                out.push(self.against_fp64(
                    layer,
                    "padding",
                    "lse",
                    &ret.lse,
                    &p.lse[..m],
                    ret.lse_dtype,
                    terms,
                    |_| false,
                    &scope,
                ));
            }
            Ok(p) => {
                let diffs = differing(ret, &p, reqs.len());
                let status = if diffs.is_empty() {
                    Status::Pass
                } else {
                    Status::Fail
                };
                let detail = match diffs.first() {
                    None => format!(
                        "{scope}, then {} padded entries ({}): every real row bit-identical",
                        pads.len(),
                        pads.join(", ")
                    ),
                    Some((what, n, first)) => format!(
                        "{} padded entries ({}) changed {n} real value(s) of {what}, first in request {first} ({} keys){}",
                        pads.len(),
                        pads.join(", "),
                        reqs[*first].seq_len,
                        if diffs.len() > 1 {
                            format!(
                                "; also {}",
                                diffs[1..].iter().map(|d| d.0).collect::<Vec<_>>().join(", ")
                            )
                        } else {
                            String::new()
                        }
                    ),
                };
                let what = diffs.first().map(|d| d.0).unwrap_or("real rows");
                out.push(record(layer, "padding", status, what, (None, None), detail));
            }
            // A runner that cannot take a padded entry says why; its real rows are then not checked.
            Err(Error::Environment(m)) | Err(Error::Unsupported(m)) => out.push(record(
                layer,
                "padding",
                Status::Report,
                "real rows",
                (None, None),
                format!("not checked: the runner did not take padded entries: {m}"),
            )),
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Two requests alone (the longest, the whole sequence) against their rows in the batch.
    fn alone(&mut self, b: &Batch, out: &mut Vec<RunnerCheck>) -> Result<()> {
        let (ctx, rows, reqs, entries, ret) = (b.ctx, b.rows, &b.reqs, &b.entries, &b.ret);
        let (h, lkv, layer) = (ctx.cfg.n_head, ctx.cfg.kv_lora_rank, ctx.layer);
        for i in [0, 3.min(reqs.len() - 1)] {
            let alone = [Entry {
                q_nope: entries[i].q_nope.clone(),
                q_pe: entries[i].q_pe.clone(),
                keys: entries[i].keys.clone(),
            }];
            let a = self.send_decode(ctx, &alone, 1, rows)?;
            let n = h * lkv;
            let inside = &ret.lat.data[i * n..(i + 1) * n];
            let rms = (inside.iter().map(|v| v * v).sum::<f64>() / n as f64).sqrt();
            let diff = inside
                .iter()
                .zip(&a.lat.data)
                .map(|(x, y)| {
                    if same_bits(*x, *y) {
                        0.0
                    } else {
                        (x - y).abs()
                    }
                })
                .fold(0.0f64, |m, d| if d.is_nan() { f64::NAN } else { m.max(d) });
            let lse_same = ret.lse[i * h..(i + 1) * h]
                .iter()
                .zip(&a.lse)
                .all(|(x, y)| same_bits(*x, *y));
            let bitwise = diff == 0.0 && lse_same;
            let rel = if rms > 0.0 { diff / rms } else { diff };
            let status = match (self.desc.batch_invariant, bitwise) {
                (false, _) => Status::Report,
                (true, true) => Status::Pass,
                (true, false) => Status::Fail,
            };
            let detail = format!(
                "request {i} ({} keys) alone vs in the batch of {}: {}{}",
                reqs[i].seq_len,
                reqs.len(),
                if bitwise {
                    "bit-identical".to_string()
                } else {
                    format!(
                        "attn_latent differs by up to {} of its rms{}",
                        e(rel),
                        if lse_same { "" } else { ", lse differs" }
                    )
                },
                if self.desc.batch_invariant {
                    " (the runner declares batch_invariant)"
                } else {
                    " (no verdict: the runner does not declare batch_invariant)"
                }
            );
            out.push(record(
                layer,
                "batch_invariance",
                status,
                &format!("request {i}"),
                (Some(rel), None),
                detail,
            ));
        }
        Ok(())
    }

    /// The merge of a kernel's own split partials against its merged output (`split_partition: own`).
    pub(super) fn merge_consistency(
        &self,
        layer: usize,
        ret: &Returned,
        terms: usize,
    ) -> Vec<RunnerCheck> {
        match &ret.split {
            Some((_, _, _, s)) => self.merge_consistency_of(layer, ret, *s, terms, "decode steps"),
            None => Vec::new(),
        }
    }

    fn merge_consistency_of(
        &self,
        layer: usize,
        ret: &Returned,
        s: usize,
        terms: usize,
        scope: &str,
    ) -> Vec<RunnerCheck> {
        let Some((so, sl, sl_dtype, _)) = &ret.split else {
            return Vec::new();
        };
        let lkv = so.data.len() / sl.len().max(1);
        let rows = sl.len() / s.max(1);
        let (mut out, mut lse) = (vec![0.0; rows * lkv], vec![f64::NEG_INFINITY; rows]);
        for i in 0..rows {
            let ls = &sl[i * s..(i + 1) * s];
            let m = ls.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                continue;
            }
            let z: f64 = ls.iter().map(|&l| (l - m).exp()).sum();
            lse[i] = m + z.ln();
            for (k, &l) in ls.iter().enumerate() {
                // An empty split (lse −inf) weighs 0: its out is don't-care.
                if l == f64::NEG_INFINITY {
                    continue;
                }
                let w = (l - lse[i]).exp();
                let src = &so.data[(i * s + k) * lkv..(i * s + k + 1) * lkv];
                for (o, v) in out[i * lkv..(i + 1) * lkv].iter_mut().zip(src) {
                    *o += w * v;
                }
            }
        }
        // The merge of rounded partials is within the coarser of the two outputs' bounds.
        let coarse = |a: &'static str, b: &'static str| {
            let rank = |d: &str| match d {
                "bf16" => 3,
                "fp16" => 2,
                "f32" => 1,
                _ => 0,
            };
            if rank(a) >= rank(b) {
                a
            } else {
                b
            }
        };
        let scope = format!("{scope}: the merge of its {s} own splits against its merged output");
        vec![
            self.against_fp64(
                layer,
                "merge_consistency",
                "attn_latent",
                &out,
                &ret.lat.data,
                coarse(so.dtype, ret.lat.dtype),
                terms,
                |_| false,
                &scope,
            ),
            self.against_fp64(
                layer,
                "merge_consistency",
                "lse",
                &lse,
                &ret.lse,
                coarse(sl_dtype, ret.lse_dtype),
                terms,
                |_| false,
                &scope,
            ),
        ]
    }
}

/// The outputs whose first `real` entries differ between two replies, bit for bit: (output, values
/// that differ, first differing entry).
fn differing(a: &Returned, b: &Returned, real: usize) -> Vec<(&'static str, usize, usize)> {
    let mut out = Vec::new();
    let mut cmp = |what: &'static str, x: &[f64], y: &[f64], per: usize| {
        let n = real * per;
        let mut first = None;
        let mut count = 0;
        for (i, (p, q)) in x[..n.min(x.len())].iter().zip(y).enumerate() {
            if !same_bits(*p, *q) {
                count += 1;
                first.get_or_insert(i / per.max(1));
            }
        }
        if let Some(f) = first {
            out.push((what, count, f));
        }
    };
    // Values per entry, from the unpadded reply's sizes (the padded one has more entries after them).
    let per = |total: usize| total / real.max(1);
    cmp(
        "attn_latent",
        &a.lat.data,
        &b.lat.data,
        per(a.lat.data.len()),
    );
    cmp("lse", &a.lse, &b.lse, per(a.lse.len()));
    if let (Some(x), Some(y)) = (&a.split, &b.split) {
        cmp("split_out", &x.0.data, &y.0.data, per(x.0.data.len()));
        cmp("split_lse", &x.1, &y.1, per(x.1.len()));
    }
    out
}
