//! The runner side of `lint` (`--runner CMD`): the runner's `supports` against the model, then its
//! conventions probed through the real protocol (docs/runners.md) with tiny synthetic requests at the
//! model's own dims, each built so that one convention decides the answer exactly:
//!
//! 1. **softmax scale**: one key. The softmax of one score is 1, so `lse = scale·(q·k)` exactly and
//!    `scale_used = lse / (q·k)`. q and the key are all 1/8, so q·k does not depend on the row order.
//! 2. **LSE base**: two equal keys. `lse = s + ln 2` in base e, `s·log2(e) + 1` in base 2, so the two
//!    requests' LSEs differ by ln 2 or by 1 whatever the scale. Probe 1 is read in the base found here,
//!    so a base-2 LSE is not mistaken for a wrong scale.
//! 3. **cache row order** `[latent | k_pe]`: a key whose latent is zero and k_pe[0] = 1, and one whose
//!    latent[0] = 1 and k_pe zero, against a query weighting the two parts differently (2 and 4): the
//!    scores (read with the scale found in 1) and the values returned tell the order the runner read.
//! 4. **page addressing**: a sequence of 2·page + 1 tokens over three pages placed out of order among
//!    NaN-poisoned ones, every score zero: the output is the mean of the tokens' (distinct) latents only
//!    if every token was read through the block table. Probes 1–3 keep their keys on the first physical
//!    pages in order, so a page-size slip does not disturb them.
//!
//! 5. **MTP causality**: a step of two queries over two keys (latents A and 2A, scores 0): query 0
//!    sees key 0 only.
//! 6. **split partition** and 7. **empty split**: 5 keys in 4 splits, scores 0, so `e^split_lse`
//!    counts each split's keys (vLLM's partition: 2, 2, 1, 0) and the empty one must weigh 0.
//!
//! Probes 5–7 run once the paging probe has shown that several keys over pages are read right. A
//! non-finite answer to probes 1–2 is one finding (`judge_non_finite`), not a wrong scale, base and
//! value at once.
//!
//! The prefill op gets probes 1 and 2, and so do the DSA ops (`sparse_prefill`, `sparse_decode`): one
//! query whose index row names one key, then two equal keys (then −1 padding; every other cache slot
//! NaN). All entries 1/8 stay exact through FlashMLA's fp8 cache (tile scale 2⁻¹¹, 1/8 = 256·2⁻¹¹),
//! so the same answers hold for a runner that reads one. Each comparison allows `8u`, `u` the unit roundoff of the dtype
//! the runner returned: far inside the factors the mistakes make (576^-0.5 vs 192^-0.5·mscale²: 3.25×;
//! base 2 vs e: 1.44× on the LSE, 1 vs ln 2 on the difference).

use super::{num, Findings, Options};
use crate::backend::runner::keep_io;
use crate::backend::runner::protocol::{self, Describe, LseBase, Outcome, Process};
use crate::backend::runner::tensors::{floats, ints, Named, Outputs};
use crate::error::Result;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use std::f64::consts::{LN_2, LOG2_E};

/// Unit roundoff of a returned dtype.
fn unit(dtype: &str) -> f64 {
    match dtype {
        "bf16" => 2f64.powi(-8),
        "fp16" => 2f64.powi(-11),
        "f32" => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    }
}

/// `err ≤ tol`, false for NaN (a NaN never passes).
fn within(err: f64, tol: f64) -> bool {
    err <= tol
}

/// Every entry of probe 1 and 2's queries and keys (exact in every dtype; q·k = width/64).
const A: f32 = 0.125;

/// One probe request's answer: the value output and the LSE per head, as returned.
struct Answer {
    out: Vec<f64>,
    out_dtype: &'static str,
    lse: Vec<f64>,
    lse_dtype: &'static str,
    /// The other outputs (the split partials).
    rest: Outputs,
}

impl Answer {
    fn u_lse(&self) -> f64 {
        unit(self.lse_dtype)
    }
    fn u_out(&self) -> f64 {
        unit(self.out_dtype)
    }
    fn mean_lse(&self) -> f64 {
        self.lse.iter().sum::<f64>() / self.lse.len() as f64
    }
    /// The largest |out − want| relative to max(|want|), NaN if anything is not finite.
    fn out_err(&self, want: &[f64]) -> f64 {
        let scale = want
            .iter()
            .fold(0.0f64, |m, w| m.max(w.abs()))
            .max(f64::MIN_POSITIVE);
        let mut e = 0.0f64;
        for (o, w) in self.out.iter().zip(want) {
            if !o.is_finite() {
                return f64::NAN;
            }
            e = e.max((o - w).abs() / scale);
        }
        e
    }
}

/// The decode inputs of one probe: per-head query (the same for every head), token rows and where
/// each logical page lives.
struct DecodeCase {
    q_nope: Vec<f32>,
    q_pe: Vec<f32>,
    rows: Vec<Vec<f32>>,
    /// Logical page → physical page.
    table: Vec<usize>,
    /// Pages in the pool; those no table entry names are NaN.
    pool: usize,
}

struct Prober<'a> {
    proc: Process,
    desc: &'a Describe,
    cfg: &'a MlaConfig,
    dt: Dtype,
    page: usize,
    /// What the cache holds outside the probe's tokens: NaN, or 0 to tell a NaN the kernel read from
    /// one it made (`judge_non_finite`).
    fill: f32,
}

impl Prober<'_> {
    fn meta(&self, extra: serde_json::Value) -> serde_json::Value {
        let c = self.cfg;
        let mut m = serde_json::json!({
            "dtype": self.dt.name(),
            "softmax_scale": c.softmax_scale,
            "heads": c.n_head,
            "kv_lora_rank": c.kv_lora_rank,
            "qk_nope": c.qk_nope,
            "qk_rope": c.qk_rope,
            "v_head_dim": c.v_head_dim,
            "page_size": self.page,
            "num_splits": 1,
            "q_len": 1,
            "causal": true,
        });
        if let (Some(m), serde_json::Value::Object(e)) = (m.as_object_mut(), extra) {
            m.extend(e);
        }
        m
    }

    /// Send one request and read `out_name` (`out_shape`) and `lse` (one query: `[.., H]` or `[.., H, 1]`
    /// per the layout, the same order); `None` when the runner declined (a warning is recorded).
    #[allow(clippy::too_many_arguments)]
    fn call(
        &mut self,
        op: &str,
        inputs: &[Named],
        extra: serde_json::Value,
        out_name: &str,
        out_shape: &[usize],
        lse_shape: Vec<usize>,
        findings: &mut Findings,
    ) -> Result<Option<Answer>> {
        let meta = self.meta(extra);
        let ex = self.proc.request(op, 0, inputs, &meta)?;
        let (input, output) = (ex.input, ex.output);
        if let Outcome::Unsupported(reason) = ex.outcome? {
            findings.warning(
                &format!("runner.{op}.probe"),
                format!("declined: {reason}"),
                "an answer",
                "the probe is a request at the model's own dims; a run would be refused the same way",
            );
            return Ok(None);
        }
        let mut o = Outputs::read(&output, &self.desc.name)?;
        if !keep_io() {
            let _ = std::fs::remove_file(&input);
            let _ = std::fs::remove_file(&output);
        }
        let v = o.take(out_name, out_shape, op)?;
        let shape = match self.desc.conventions.lse_layout {
            protocol::LseLayout::TokenHead => lse_shape,
            protocol::LseLayout::HeadToken => {
                let mut s = lse_shape;
                let n = s.len();
                s.swap(n - 2, n - 1);
                s
            }
        };
        let l = o.take("lse", &shape, op)?;
        Ok(Some(Answer {
            out: v.data,
            out_dtype: v.dtype,
            lse: l.data,
            lse_dtype: l.dtype,
            rest: o,
        }))
    }

    /// A decode request of one query over `case`'s tokens.
    fn decode(&mut self, case: &DecodeCase, out: &mut Findings) -> Result<Option<Answer>> {
        self.decode_step(case, 1, 1, out)
    }

    /// A decode request of `s_q` queries (each `case`'s query; causal within the step) over `case`'s
    /// tokens, with `splits` split partials asked for.
    fn decode_step(
        &mut self,
        case: &DecodeCase,
        s_q: usize,
        splits: usize,
        out: &mut Findings,
    ) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, lkv, r, page) = (c.n_head, c.kv_lora_rank, c.qk_rope, self.page);
        let row = lkv + r;
        let dt = self.dt;
        let round = |v: &[f32]| v.iter().map(|&x| dt.round(x)).collect::<Vec<f32>>();
        let q_nope: Vec<f32> = round(&case.q_nope).repeat(h * s_q);
        let q_pe: Vec<f32> = round(&case.q_pe).repeat(h * s_q);
        let mut pool = vec![self.fill; case.pool * page * row];
        for (t, vals) in case.rows.iter().enumerate() {
            let slot = case.table[t / page] * page + t % page;
            pool[slot * row..(slot + 1) * row].copy_from_slice(&round(vals));
        }
        // One more table slot than the sequence needs, pointing at a NaN page (as `run` sends them).
        let spare = (0..case.pool)
            .find(|p| !case.table.contains(p))
            .expect("the pool keeps a NaN page");
        let mut table: Vec<i32> = case.table.iter().map(|&p| p as i32).collect();
        table.push(spare as i32);
        let inputs = [
            floats("q_nope", vec![1, s_q, h, lkv], &q_nope, dt),
            floats("q_pe", vec![1, s_q, h, r], &q_pe, dt),
            floats("kv_cache", vec![case.pool, page, row], &pool, dt),
            ints("block_table", vec![1, table.len()], &table),
            ints("cache_seqlens", vec![1], &[case.rows.len() as i32]),
        ];
        self.call(
            "decode",
            &inputs,
            serde_json::json!({ "q_len": s_q, "num_splits": splits }),
            "attn_latent",
            &[1, s_q, h, lkv],
            vec![1, s_q, h],
            out,
        )
    }

    /// A prefill request of one query over `keys` equal keys (all entries `A`).
    fn prefill(&mut self, keys: usize, out: &mut Findings) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, dqk, dv) = (c.n_head, c.qk_head_dim(), c.v_head_dim);
        let dt = self.dt;
        let inputs = [
            floats("q", vec![1, h, dqk], &vec![A; h * dqk], dt),
            floats("k", vec![keys, h, dqk], &vec![A; keys * h * dqk], dt),
            floats("v", vec![keys, h, dv], &vec![A; keys * h * dv], dt),
        ];
        self.call(
            "prefill",
            &inputs,
            serde_json::json!({ "context_len": keys - 1 }),
            "attn_heads",
            &[1, h, dv],
            vec![1, h],
            out,
        )
    }

    /// Two queries of a fresh chunk (context 0) over two equal keys whose values are A and 2A: causal,
    /// query 0 sees key 0 only.
    fn prefill_causal(&mut self, out: &mut Findings) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, dqk, dv) = (c.n_head, c.qk_head_dim(), c.v_head_dim);
        let dt = self.dt;
        let mut v = vec![A; h * dv];
        v.extend(vec![2.0 * A; h * dv]);
        let inputs = [
            floats("q", vec![2, h, dqk], &vec![A; 2 * h * dqk], dt),
            floats("k", vec![2, h, dqk], &vec![A; 2 * h * dqk], dt),
            floats("v", vec![2, h, dv], &v, dt),
        ];
        self.call(
            "prefill",
            &inputs,
            serde_json::json!({ "context_len": 0 }),
            "attn_heads",
            &[2, h, dv],
            vec![2, h],
            out,
        )
    }

    /// A DSA request (`sparse_prefill` or `sparse_decode`) of one query whose index row names the
    /// first `keys` cache slots (all entries `A`), padded with −1 to 4 entries; every other slot NaN.
    fn sparse(&mut self, op: &str, keys: usize, out: &mut Findings) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, lkv, row, page) = (c.n_head, c.kv_lora_rank, c.cache_row(), self.page);
        let dt = self.dt;
        let slots = 2 * page.max(keys);
        let mut kv = vec![self.fill; slots * row];
        kv[..keys * row].fill(A);
        let topk = keys.max(4);
        let idx: Vec<i32> = (0..topk)
            .map(|k| if k < keys { k as i32 } else { -1 })
            .collect();
        let q = vec![A; h * row];
        let (inputs, lse_shape, out_shape) = match op {
            "sparse_prefill" => (
                [
                    floats("q", vec![1, h, row], &q, dt),
                    floats("kv", vec![slots, 1, row], &kv, dt),
                    ints("indices", vec![1, 1, topk], &idx),
                ],
                vec![1, h],
                vec![1, h, lkv],
            ),
            _ => (
                [
                    floats("q", vec![1, 1, h, row], &q, dt),
                    floats("kv_cache", vec![slots / page, page, row], &kv, dt),
                    ints("indices", vec![1, 1, topk], &idx),
                ],
                vec![1, 1, h],
                vec![1, 1, h, lkv],
            ),
        };
        let extra = serde_json::json!({ "context_len": keys - 1, "top_k": topk, "d_v": lkv });
        self.call(
            op,
            &inputs,
            extra,
            "attn_latent",
            &out_shape,
            lse_shape,
            out,
        )
    }

    /// `n` tokens of equal rows, all `A`, on the first physical pages in order (one NaN page after).
    fn uniform(&self, n: usize) -> DecodeCase {
        let c = self.cfg;
        let pages = n.div_ceil(self.page);
        DecodeCase {
            q_nope: vec![A; c.kv_lora_rank],
            q_pe: vec![A; c.qk_rope],
            rows: vec![vec![A; c.cache_row()]; n],
            table: (0..pages).collect(),
            pool: pages + 1,
        }
    }
}

/// What probes 1 and 2 established about an op.
struct ScaleBase {
    /// The factor that turns the runner's LSE into a natural log (found, or declared if unclear).
    to_e: f64,
    /// The scale the runner applied.
    scale: f64,
}

/// Probes 1 and 2 on one op's two answers (one key, two equal keys) with `dot` = q·k.
fn judge_scale_base(
    op: &str,
    desc: &Describe,
    c: &MlaConfig,
    dot: f64,
    one: &Answer,
    two: &Answer,
    out: &mut Findings,
) -> ScaleBase {
    let declared = desc.conventions.lse_base;
    let declared_to_e = match declared {
        LseBase::E => 1.0,
        LseBase::Two => LN_2,
    };
    // Probe 2: the step from one key to two equal keys, in the runner's own units.
    let d = two.mean_lse() - one.mean_lse();
    let tol =
        8.0 * one.u_lse().max(two.u_lse()) * (one.mean_lse().abs() + two.mean_lse().abs()) + 1e-6;
    let found = if (d - LN_2).abs() <= tol {
        Some(LseBase::E)
    } else if (d - 1.0).abs() <= tol {
        Some(LseBase::Two)
    } else {
        None
    };
    let name = |b: LseBase| match b {
        LseBase::E => "base e",
        LseBase::Two => "base 2",
    };
    let check = format!("runner.{op}.lse_base");
    let to_e = match found {
        Some(b) if b == declared => {
            out.note(
                &check,
                format!("{} (two equal keys raise the LSE by {})", name(b), num(d)),
                "as describe declares",
            );
            declared_to_e
        }
        Some(b) => {
            // Read in the declared base, the runner's LSE comes out this many times its natural log.
            let (to_e, factor) = match b {
                LseBase::E => (1.0, LN_2),
                LseBase::Two => (LN_2, LOG2_E),
            };
            out.error(
                &check,
                format!("{} (two equal keys raise its LSE by {}, not {})", name(b), num(d), if b == LseBase::Two { "ln 2 = 0.693147" } else { "1" }),
                format!("{}, as its describe declares (conventions.lse_base)", name(declared)),
                format!(
                    "mla-diff converts the runner's LSE by the declared base, so it reads every LSE as {}× its natural log; an engine merging split-KV or chunk LSEs in the wrong base weights the partials wrongly (fault lse_log2_merge: sglang's base-2 merge, flashinfer's sm_scale)",
                    num(factor)
                ),
            );
            to_e
        }
        None => {
            out.error(
                &check,
                format!("two equal keys raise its LSE by {}", num(d)),
                "ln 2 = 0.693147 (base e) or 1 (base 2)",
                "the LSE of two equal scores is the score plus log(2): anything else is no log-sum-exp over the keys given (keys lost or read twice?)",
            );
            declared_to_e
        }
    };
    // Probe 1: the scale, read in the base just found.
    let scale = one.mean_lse() * to_e / dot;
    let rel = |x: f64, y: f64| (x / y - 1.0).abs();
    let tol = 8.0 * one.u_lse() + 1e-6;
    let check = format!("runner.{op}.softmax_scale");
    let want = c.softmax_scale;
    let spread = one
        .lse
        .iter()
        .map(|l| l * to_e / dot)
        .fold(0.0f64, |m, s| m.max(rel(s, scale)));
    if !scale.is_finite() {
        out.error(
            &check,
            format!("an LSE of {} for one key", num(one.mean_lse())),
            format!("{} · q·k = {}", num(want), num(want * dot)),
            "the LSE of one key is its score: a non-finite one means the key was not read",
        );
    } else if rel(scale, want) <= tol && spread <= tol {
        out.note(
            &check,
            format!("{} (LSE of one key / q·k)", num(scale)),
            "the model's softmax scale, as given in meta softmax_scale",
        );
    } else {
        let qk = c.qk_head_dim() as f64;
        let row = c.cache_row() as f64;
        let m2 = c.mscale * c.mscale;
        let mut known: Vec<(f64, String)> = vec![
            (
                1.0 / row.sqrt(),
                format!("1/sqrt(kv_lora_rank + rope) = {}^-0.5: the width of the absorbed query, FlashMLA's default softmax_scale (q.shape[-1]^-0.5) — the 576^-0.5 trap (fault scale_576)", c.cache_row()),
            ),
            (m2 / row.sqrt(), format!("mscale² / sqrt({}): the right mscale² over the latent row's width", c.cache_row())),
            (want * LOG2_E, "the scale times log2(e): a base-2 softmax scale applied to natural exponentials".into()),
            (want / LOG2_E, "the scale divided by log2(e): a natural scale applied to base-2 exponentials (flashinfer's sm_scale)".into()),
            (1.0, "1: no softmax scale at all".into()),
        ];
        if c.mscale != 1.0 {
            known.insert(
                0,
                (
                    1.0 / qk.sqrt(),
                    format!(
                        "1/sqrt({}) without the YaRN mscale² = {} (fault yarn_mscale_missing)",
                        c.qk_head_dim(),
                        num(m2)
                    ),
                ),
            );
        }
        let what = known
            .iter()
            .find(|(s, _)| rel(scale, *s) <= tol)
            .map(|(_, w)| format!("it is {w}"))
            .unwrap_or_else(|| "it matches none of the known mistakes".into());
        let per_head = if spread > tol {
            format!(" (heads differ by up to {}×)", num(1.0 + spread))
        } else {
            String::new()
        };
        out.error(
            &check,
            format!("{} (LSE of one key / q·k){per_head}", num(scale)),
            format!(
                "{} = mscale {}² / sqrt({} + {}), the meta softmax_scale it was given",
                num(want),
                num(c.mscale),
                c.qk_nope,
                c.qk_rope
            ),
            format!(
                "{what}; every score is {}× the model's, which sharpens or flattens the softmax over any context of more than one key",
                num(scale / want)
            ),
        );
    }
    ScaleBase { to_e, scale }
}

/// The value a one-key request returns is that key's value (the softmax of one score is 1).
fn judge_value(op: &str, ans: &Answer, want: f64, what: &str, out: &mut Findings) {
    let w = vec![want; ans.out.len()];
    let err = ans.out_err(&w);
    if !within(err, 4.0 * ans.u_out()) {
        let first = ans
            .out
            .iter()
            .copied()
            .find(|o| !o.is_finite() || (o - want).abs() > 4.0 * ans.u_out() * want.abs());
        out.error(
            &format!("runner.{op}.value"),
            format!("an output of {}", first.map(num).unwrap_or("?".into())),
            format!("{} everywhere: {what}", num(want)),
            "with one key the softmax weight is exactly 1, so the output is that key's value; a NaN means rows outside the sequence were read",
        );
    }
}

/// Probe 3: the order of a cache row.
fn probe_row_order(p: &mut Prober, sb: &ScaleBase, out: &mut Findings) -> Result<Option<bool>> {
    let c = p.cfg;
    let (lkv, r) = (c.kv_lora_rank, c.qk_rope);
    let (w_nope, w_pe) = (2.0f32, 4.0f32);
    let mut q_nope = vec![0.0; lkv];
    q_nope[0] = w_nope;
    let mut q_pe = vec![0.0; r];
    q_pe[0] = w_pe;
    let key = |latent0: f32, pe0: f32| {
        let mut row = vec![0.0f32; lkv + r];
        row[0] = latent0;
        row[lkv] = pe0;
        DecodeCase {
            q_nope: q_nope.clone(),
            q_pe: q_pe.clone(),
            rows: vec![row],
            table: vec![0],
            pool: 2,
        }
    };
    // (key, its score q·k, its value's latent[0]) as [latent | k_pe] reads them.
    let cases = [
        (key(0.0, 1.0), w_pe as f64, 0.0),
        (key(1.0, 0.0), w_nope as f64, 1.0),
    ];
    let mut seen = Vec::new();
    for (case, dot, v0) in &cases {
        let Some(a) = p.decode(case, out)? else {
            return Ok(None);
        };
        let dot_found = a.mean_lse() * sb.to_e / sb.scale;
        let mut want = vec![0.0; a.out.len()];
        for hh in 0..c.n_head {
            want[hh * lkv] = *v0;
        }
        let out_ok = a.out_err(&want) <= 4.0 * a.u_out();
        let dot_ok = (dot_found - dot).abs() <= (8.0 * a.u_lse() + 1e-6) * dot.max(1.0);
        seen.push((dot_found, dot_ok && out_ok, a.out.get(lkv - r).copied()));
    }
    let check = "runner.decode.cache_row";
    if seen.iter().all(|s| s.1) {
        out.note(
            check,
            format!("[latent {lkv} | k_pe {r}]"),
            "a key with only k_pe[0] = 1 and one with only latent[0] = 1 scored and returned as that order says",
        );
        return Ok(Some(true));
    }
    // Read as [k_pe | latent]: the first key's 1 lands in the latent at lkv − r (q_nope 0 there), the
    // second's in k_pe[0] (weight w_pe).
    let swapped =
        (seen[0].0).abs() <= 1e-3 && (seen[1].0 - w_pe as f64).abs() <= 1e-2 * w_pe as f64;
    let found = format!(
        "a key with only k_pe[0] = 1 scored q·k = {} (expected {}), one with only latent[0] = 1 scored {} (expected {})",
        num(seen[0].0),
        num(w_pe as f64),
        num(seen[1].0),
        num(w_nope as f64)
    );
    if swapped {
        out.error(
            check,
            format!("[k_pe | latent]: {found}"),
            format!("[latent {lkv} | k_pe {r}]"),
            "the cache rows hold the normed latent first, then the roped k_pe (llama.cpp since it moved from [pe, kv] to [kv, pe], vLLM, FlashMLA); a kernel with the old order hard-coded scores every key with the wrong dims and returns k_pe as values (fault cache_pe_first)",
        );
    } else {
        out.error(
            check,
            found,
            format!("[latent {lkv} | k_pe {r}]: scores {} and {}, values latent[0] 0 and 1", num(w_pe as f64), num(w_nope as f64)),
            "the runner reads the rows [latent | k_pe] in some other layout: its scores or values come from the wrong columns",
        );
    }
    Ok(Some(false))
}

/// Probe 4: a sequence over three shuffled pages among NaN ones.
fn probe_paging(p: &mut Prober, sb: &ScaleBase, out: &mut Findings) -> Result<bool> {
    let c = p.cfg;
    let (lkv, r, page) = (c.kv_lora_rank, c.qk_rope, p.page);
    let n = 2 * page + 1;
    // Logical pages 0, 1, 2 at physical 5, 1, 3 of 7: out of order, with NaN pages 0, 2, 4, 6 around.
    let table = vec![5, 1, 3];
    // Token t's latent: (1 + t / lkv) at t % lkv; distinct (index, weight) pairs tell tokens apart.
    let rows: Vec<Vec<f32>> = (0..n)
        .map(|t| {
            let mut row = vec![0.0f32; lkv + r];
            row[t % lkv] = p.dt.round((1 + t / lkv) as f32);
            row
        })
        .collect();
    let mut want1 = vec![0.0f64; lkv];
    for row in &rows {
        for (w, v) in want1.iter_mut().zip(row) {
            *w += *v as f64 / n as f64;
        }
    }
    let case = DecodeCase {
        q_nope: vec![0.0; lkv],
        q_pe: vec![0.0; r],
        rows,
        table: table.clone(),
        pool: 7,
    };
    let Some(a) = p.decode(&case, out)? else {
        return Ok(false);
    };
    let want: Vec<f64> = want1.repeat(c.n_head);
    let err = a.out_err(&want);
    let lse_e = a.mean_lse() * sb.to_e;
    let lse_want = (n as f64).ln();
    let lse_ok = (lse_e - lse_want).abs() <= (8.0 * a.u_lse() + 1e-6) * lse_want;
    let check = "runner.decode.paging";
    let layout = format!(
        "{n} tokens through pages [5, 1, 3] of {page} rows (physical pages 0, 2, 4, 6 NaN)"
    );
    if err <= 4.0 * a.u_out() && lse_ok {
        out.note(
            check,
            layout,
            "every token read through the block table, at the page size given",
        );
        return Ok(true);
    }
    let found = if err.is_nan() || !lse_e.is_finite() {
        "NaN: it read NaN-poisoned rows, slots no block-table entry holds a token in".to_string()
    } else {
        format!(
            "an output {} off the tokens' mean latent (relative to its largest entry), LSE {} (expected ln {n} = {})",
            num(err),
            num(lse_e),
            num(lse_want)
        )
    };
    out.error(
        check,
        found,
        format!("the mean of the tokens' latents: {layout}"),
        format!(
            "token t lives at slot table[t / {page}]·{page} + t % {page}; a kernel compiled for another page size, or that ignores the block table, reads other sequences' rows or unwritten ones (fault page_off_by_one; MLA decode kernels that ignore page_size > 1)"
        ),
    );
    Ok(false)
}

/// The first non-finite value of an answer, named (`lse -inf`, `attn_latent NaN`).
fn non_finite(a: &Answer, out_name: &str) -> Option<(String, f64)> {
    let lse = a.lse.iter().find(|v| !v.is_finite()).map(|&v| ("lse", v));
    let o = a
        .out
        .iter()
        .find(|v| !v.is_finite())
        .map(|&v| (out_name, v));
    lse.or(o).map(|(n, v)| (format!("{n} {}", num(v)), v))
}

/// A probe of `op` that came back non-finite: one finding, not one per convention its numbers would
/// seem to break. `again` sends the same request with every cache row outside its keys 0 instead of
/// NaN (`None`: the op's inputs hold no NaN): a finite answer then means the kernel read rows outside
/// the sequence; a non-finite one is the kernel's own (an LSE of −inf: no key was read).
fn judge_non_finite(
    op: &str,
    what: &str,
    found: (String, f64),
    again: Option<Option<Answer>>,
    out: &mut Findings,
) {
    let out_name = if op == "prefill" {
        "attn_heads"
    } else {
        "attn_latent"
    };
    let (why, own) = match again.as_ref().map(|a| a.as_ref().map(|a| non_finite(a, out_name))) {
        Some(Some(None)) => (
            "with the cache rows outside the request's keys set to 0 instead of NaN the same request comes back finite: the kernel reads rows outside the sequence (past cache_seqlens, or through block-table slots the sequence does not use), which in an engine hold other requests' tokens".to_string(),
            false,
        ),
        // The runner declined the second request (a warning says so): no diagnosis.
        Some(None) => (
            "the same request with the rest of the cache 0 was declined, so where the value came from is not known".to_string(),
            false,
        ),
        Some(Some(Some(_))) => ("even with every cache row finite".to_string(), true),
        None => ("its inputs hold no NaN".to_string(), true),
    };
    let why = match (own, found.1) {
        (false, _) => why,
        (true, v) if v == f64::NEG_INFINITY => format!(
            "{why}: an LSE of −inf is a softmax over no key — the kernel read none of the keys it was given (a sequence length one short, every score masked)"
        ),
        (true, _) => format!(
            "{why}: the NaN is the kernel's own (an output it never wrote, 0·inf, a division by a zero sum), not rows outside the sequence"
        ),
    };
    out.error(
        &format!("runner.{op}.non_finite"),
        format!("{} for {what}", found.0),
        "finite values: every key of the probe is finite (1/8 everywhere)",
        format!("{why}; the scale, LSE base and value probes of {op} are not judged on a non-finite answer"),
    );
}

/// MTP causality: a step of two queries (q = 0: every score 0) over two keys whose latents are A and
/// 2A. Query 0 sees key 0 only (A, LSE 0); query 1 both (1.5A, LSE ln 2).
fn probe_mtp(p: &mut Prober, out: &mut Findings) -> Result<()> {
    let check = "runner.decode.mtp_causal";
    if let Some(m) = p.desc.supports.max_q_len.filter(|&m| m < 2) {
        out.note(
            check,
            "not probed",
            format!("the runner takes at most {m} query per decode step (supports.max_q_len)"),
        );
        return Ok(());
    }
    let c = p.cfg;
    let case = DecodeCase {
        q_nope: vec![0.0; c.kv_lora_rank],
        q_pe: vec![0.0; c.qk_rope],
        rows: vec![vec![A; c.cache_row()], vec![2.0 * A; c.cache_row()]],
        table: (0..2usize.div_ceil(p.page)).collect(),
        pool: 2usize.div_ceil(p.page) + 1,
    };
    let Some(a) = p.decode_step(&case, 2, 1, out)? else {
        return Ok(());
    };
    let n = a.out.len() / 2;
    let mut want = vec![A as f64; n];
    want.extend(vec![1.5 * A as f64; n]);
    if within(a.out_err(&want), 4.0 * a.u_out()) {
        out.note(
            check,
            "query 0 of a 2-query step sees key 0 only",
            "causal within the step, as the protocol asks (query i sees keys 0 .. L − s_q + i + 1)",
        );
        return Ok(());
    }
    let q0 = a.out[..n].iter().sum::<f64>() / n as f64;
    out.error(
        check,
        format!(
            "query 0 of a 2-query step over 2 keys returned {} (latents A = {} and 2A)",
            num(q0),
            num(A as f64)
        ),
        format!(
            "{} for query 0 (it sees key 0 only), {} for query 1",
            num(A as f64),
            num(1.5 * A as f64)
        ),
        "with MTP (q_len > 1) query i of a step sees keys 0 .. cache_seqlens − q_len + i + 1 (FlashMLA's causal=True); a kernel without the mask lets a draft token see the tokens after it",
    );
    Ok(())
}

/// The split partition and empty splits: 5 keys in 4 splits (q = 0: every score 0), key t's latent 1
/// at column t. vLLM's partition `[k·⌈L/S⌉, (k+1)·⌈L/S⌉)` gives splits of 2, 2, 1 and 0 keys, so
/// split k's `split_lse` is ln(its keys) and its `split_out` their mean latent; the last is empty, and
/// must weigh 0 in a merge (−inf, or ≥ 103 below the largest).
fn probe_splits(p: &mut Prober, out: &mut Findings) -> Result<()> {
    let (check, empty_check) = ("runner.decode.split_partition", "runner.decode.empty_split");
    let d = p.desc;
    // `split_lse` read in the declared base, as a run reads it (the LSE base probe judges `lse`).
    let to_e = match d.conventions.lse_base {
        LseBase::E => 1.0,
        LseBase::Two => LN_2,
    };
    let partials = d
        .ops
        .decode
        .as_ref()
        .is_some_and(|o| o.has("split_out") && o.has("split_lse"));
    if !partials || d.decode_partition() == protocol::SplitPartition::Own {
        let why = match partials {
            false => "the decode op returns no split partials",
            true => "the kernel chooses its own split partition (geometry.split_partition own)",
        };
        out.note(check, "not probed", why);
        out.note(empty_check, "not probed", why);
        return Ok(());
    }
    let c = p.cfg;
    let (h, lkv, r) = (c.n_head, c.kv_lora_rank, c.qk_rope);
    const L: usize = 5;
    const S: usize = 4;
    let want_keys = [2usize, 2, 1, 0];
    let rows: Vec<Vec<f32>> = (0..L)
        .map(|t| {
            let mut row = vec![0.0f32; lkv + r];
            row[t] = 1.0;
            row
        })
        .collect();
    let pages = L.div_ceil(p.page);
    let case = DecodeCase {
        q_nope: vec![0.0; lkv],
        q_pe: vec![0.0; r],
        rows,
        table: (0..pages).collect(),
        pool: pages + 1,
    };
    let Some(mut a) = p.decode_step(&case, 1, S, out)? else {
        return Ok(());
    };
    let so = a.rest.take("split_out", &[1, 1, h, S, lkv], "decode")?;
    let sl = a.rest.take("split_lse", &[1, 1, h, S], "decode")?;
    let (u_out, u_lse) = (unit(so.dtype), unit(sl.dtype));
    // Per split: the keys its LSE says it holds (e^lse: every score is 0), worst over the heads, and
    // whether its partial is their mean latent.
    let mut keys_found = vec![0.0f64; S];
    let mut ok = true;
    for hh in 0..h {
        for (k, &n) in want_keys.iter().enumerate() {
            let lse = sl.data[hh * S + k] * to_e;
            let found = lse.exp();
            if hh == 0
                || (found - n as f64).abs() > (keys_found[k] - n as f64).abs()
                || found.is_nan()
            {
                keys_found[k] = found;
            }
            if n == 0 {
                continue;
            }
            let lo: usize = want_keys[..k].iter().sum();
            let part = &so.data[(hh * S + k) * lkv..(hh * S + k + 1) * lkv];
            let mean_ok = part.iter().enumerate().all(|(j, &v)| {
                let w = if (lo..lo + n).contains(&j) {
                    1.0 / n as f64
                } else {
                    0.0
                };
                (v - w).abs() <= 4.0 * u_out
            });
            let lse_ok =
                (lse - (n as f64).ln()).abs() <= 8.0 * u_lse * (n as f64).ln().max(1.0) + 1e-6;
            ok &= mean_ok && lse_ok;
        }
    }
    let list = |v: &[f64]| {
        v.iter()
            .map(|&x| num((x * 1e3).round() / 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let layout = format!("{L} keys in {S} splits");
    if !ok {
        out.error(
            check,
            format!("keys per split [{}] (e^split_lse, every score 0), or partials not their mean latent: {layout}", list(&keys_found)),
            "[2, 2, 1, 0]: split k over keys [k·⌈L/S⌉, (k+1)·⌈L/S⌉) = [0, 2), [2, 4), [4, 5), [5, 5), each partial normalised within its split",
            "the protocol's split partials follow vLLM's partition of L = cache_seqlens[b] (a kernel with another one declares geometry.split_partition own); partials on other boundaries cannot be merged with vLLM's or checked against its reference",
        );
        out.note(
            empty_check,
            "not probed",
            "the split partition is already wrong",
        );
        return Ok(());
    }
    out.note(
        check,
        format!("keys per split [2, 2, 1, 0]: {layout}"),
        "vLLM's partition [k·⌈L/S⌉, (k+1)·⌈L/S⌉), each partial normalised within its split",
    );
    // The empty split: −inf, or a weight of 0 in an f32 merge (more than ~103 below the largest).
    let bad = (0..h)
        .map(|hh| {
            let row = &sl.data[hh * S..(hh + 1) * S];
            let max = row[..S - 1]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(v * to_e));
            (row[S - 1] * to_e, max)
        })
        .find(|&(e, max)| !(e == f64::NEG_INFINITY || e < max - 103.0));
    match bad {
        None => out.note(
            empty_check,
            "split 3 of 4 (no key) weighs 0",
            "its split_lse is −inf or 103 below the largest: its split_out is then don't-care",
        ),
        Some((e, max)) => out.error(
            empty_check,
            format!("split 3 of 4 holds no key, and its split_lse is {} (the largest is {})", num(e), num(max)),
            "−inf (or a value whose weight in an f32 merge is 0: more than ~103 below the largest)",
            "an empty split's LSE decides its weight in the merge: a finite one gives its partial (0, or an unwritten buffer's garbage) a share of the output",
        ),
    }
    Ok(())
}

/// The runner side: `describe`, `supports` against the model, then the probes. A runner that cannot be
/// started, describes itself badly or fails a request is an `Err` (exit 2, as in `run`).
pub fn lint(cmd: &str, cfg: Option<&MlaConfig>, opts: &Options, out: &mut Findings) -> Result<()> {
    let desc = protocol::describe(cmd)?;
    let ops: Vec<&str> = [
        desc.ops.decode.as_ref().map(|_| "decode"),
        desc.ops.prefill.as_ref().map(|_| "prefill"),
        desc.ops.sparse_prefill.as_ref().map(|_| "sparse_prefill"),
        desc.ops.sparse_decode.as_ref().map(|_| "sparse_decode"),
    ]
    .into_iter()
    .flatten()
    .collect();
    out.note(
        "runner",
        format!("{} ({})", desc.name, desc.version),
        format!(
            "ops {}; declares lse_base {}, lse_layout {}",
            ops.join(", "),
            match desc.conventions.lse_base {
                LseBase::E => "e",
                LseBase::Two => "2",
            },
            match desc.conventions.lse_layout {
                protocol::LseLayout::TokenHead => "token_head",
                protocol::LseLayout::HeadToken => "head_token",
            }
        ),
    );
    let Some(c) = cfg else {
        out.note(
            "runner.probes",
            "not run",
            "the loader refuses the file, so the model's dims and scale are unknown",
        );
        return Ok(());
    };
    let s = &desc.supports;
    let name = &desc.name;
    // (op it matters to, key, the model's value, the runner's list)
    let mut dims_ok = true;
    let mut prefill_ok = desc.ops.prefill.is_some();
    for (op, key, v, list) in [
        (None, "heads", c.n_head, &s.heads),
        (None, "kv_lora_rank", c.kv_lora_rank, &s.kv_lora_rank),
        (None, "qk_rope", c.qk_rope, &s.qk_rope),
        (
            Some("prefill"),
            "qk_head_dim",
            c.qk_head_dim(),
            &s.qk_head_dim,
        ),
        (Some("prefill"), "v_head_dim", c.v_head_dim, &s.v_head_dim),
    ] {
        if op == Some("prefill") && desc.ops.prefill.is_none() {
            continue;
        }
        if let Some(l) = list.as_ref().filter(|l| !l.contains(&v)) {
            out.error(
                &format!("runner.supports.{key}"),
                format!("{key} {v} (the model's)"),
                format!("one of {l:?} (what {name} takes)"),
                format!("{name} cannot run this model: a run is refused (exit 2), and a kernel given dims it is not specialised for would misread the rows"),
            );
            match op {
                None => dims_ok = false,
                Some(_) => prefill_ok = false,
            }
        }
    }
    let mut page = opts.page_size;
    if desc.ops.decode.is_some() {
        if let Some(l) = s
            .page_sizes
            .as_ref()
            .filter(|l| !l.contains(&opts.page_size) && !l.is_empty() && !opts.page_size_given)
        {
            page = protocol::pick_page(opts.page_size, l);
            out.note(
                "runner.supports.page_size",
                format!("page size {page}"),
                format!("{name} does not take page {} (it takes {l:?}): the probes use {page}, the largest it takes below, else its smallest; a run without --page-size picks the same way from its own schedule's page (the default run starts from its covering page, and its notice names the page it took)", opts.page_size),
            );
        } else if let Some(l) = s
            .page_sizes
            .as_ref()
            .filter(|l| !l.contains(&opts.page_size))
        {
            out.error(
                "runner.supports.page_size",
                format!("page size {} (--page-size, else the default schedule's)", opts.page_size),
                format!("one of {l:?} (what {name} takes)"),
                format!("a run at this page size is refused (exit 2); a kernel compiled for one page size and handed another reads the wrong rows (fault page_off_by_one). The probes below use page {}", l.first().copied().unwrap_or(opts.page_size)),
            );
            page = l.first().copied().unwrap_or(opts.page_size);
        }
        if let Some(m) = s.max_q_len.filter(|&m| opts.q_len > m) {
            out.error(
                "runner.supports.max_q_len",
                format!("q_len {}", opts.q_len),
                format!("at most {m}"),
                format!("{name} takes at most {m} query tokens per decode step (MTP); a run with --q-len {} is refused", opts.q_len),
            );
        }
    }
    let mut dt = opts.dtype;
    if let Some(l) = s
        .dtypes
        .as_ref()
        .filter(|l| !l.iter().any(|d| d == opts.dtype.name()))
    {
        out.error(
            "runner.supports.dtype",
            opts.dtype.name(),
            format!("one of {l:?}"),
            format!(
                "{name} does not take {} storage: a run with --dtype {} is refused",
                opts.dtype.name(),
                opts.dtype.name()
            ),
        );
        let pick = [Dtype::Bf16, Dtype::F16, Dtype::F32]
            .into_iter()
            .find(|d| l.iter().any(|x| x == d.name()));
        dt = pick.unwrap_or(dt);
    }
    if !dims_ok {
        out.note(
            "runner.probes",
            "not run",
            "the runner does not take the model's dims, so no request at them can be answered",
        );
        return Ok(());
    }
    let proc = Process::start(cmd, &desc.name, keep_io())?;
    let mut p = Prober {
        proc,
        desc: &desc,
        cfg: c,
        dt,
        page,
        fill: f32::NAN,
    };
    if desc.ops.decode.is_some() {
        let dot = c.cache_row() as f64 * (A as f64) * (A as f64);
        let one = p.uniform(1);
        let two = p.uniform(2);
        if let (Some(a1), Some(a2)) = (p.decode(&one, out)?, p.decode(&two, out)?) {
            let nf = [(&a1, &one, "one key"), (&a2, &two, "two equal keys")]
                .into_iter()
                .find_map(|(a, case, what)| Some((non_finite(a, "attn_latent")?, case, what)));
            if let Some((found, case, what)) = nf {
                p.fill = 0.0;
                let again = p.decode(case, out)?;
                p.fill = f32::NAN;
                judge_non_finite("decode", what, found, Some(again), out);
            } else {
                let sb = judge_scale_base("decode", &desc, c, dot, &a1, &a2, out);
                judge_value("decode", &a1, A as f64, "the one key's latent", out);
                if sb.scale.is_finite() && sb.scale > 0.0 {
                    let read = match probe_row_order(&mut p, &sb, out)? {
                        Some(true) => probe_paging(&mut p, &sb, out)?,
                        Some(false) => {
                            out.note(
                                "runner.decode.paging",
                                "not probed",
                                "the rows are already misread, so a paging probe could not tell its errors apart",
                            );
                            false
                        }
                        None => false,
                    };
                    // Several keys over pages must be read right before causality and the split
                    // partition can be told apart.
                    if read {
                        probe_mtp(&mut p, out)?;
                        probe_splits(&mut p, out)?;
                    }
                }
            }
        }
    }
    for (op, on) in [
        ("sparse_prefill", desc.ops.sparse_prefill.is_some()),
        ("sparse_decode", desc.ops.sparse_decode.is_some()),
    ] {
        if !on {
            continue;
        }
        let dot = c.cache_row() as f64 * (A as f64) * (A as f64);
        if let (Some(a1), Some(a2)) = (p.sparse(op, 1, out)?, p.sparse(op, 2, out)?) {
            let nf = [(&a1, 1, "one key"), (&a2, 2, "two equal keys")]
                .into_iter()
                .find_map(|(a, keys, what)| Some((non_finite(a, "attn_latent")?, keys, what)));
            if let Some((found, keys, what)) = nf {
                p.fill = 0.0;
                let again = p.sparse(op, keys, out)?;
                p.fill = f32::NAN;
                judge_non_finite(op, what, found, Some(again), out);
            } else {
                judge_scale_base(op, &desc, c, dot, &a1, &a2, out);
                judge_value(op, &a1, A as f64, "the one key's latent", out);
            }
        }
    }
    if prefill_ok {
        let dot = c.qk_head_dim() as f64 * (A as f64) * (A as f64);
        if let (Some(a1), Some(a2)) = (p.prefill(1, out)?, p.prefill(2, out)?) {
            let nf = [(&a1, "one key"), (&a2, "two equal keys")]
                .into_iter()
                .find_map(|(a, what)| Some((non_finite(a, "attn_heads")?, what)));
            if let Some((found, what)) = nf {
                judge_non_finite("prefill", what, found, None, out);
            } else {
                judge_scale_base("prefill", &desc, c, dot, &a1, &a2, out);
                judge_value("prefill", &a1, A as f64, "the one key's value", out);
            }
        }
        if let Some(ans) = p.prefill_causal(out)? {
            let n = ans.out.len() / 2;
            let mut want = vec![A as f64; n];
            want.extend(vec![1.5 * A as f64; n]);
            if !within(ans.out_err(&want), 4.0 * ans.u_out()) {
                let q0 = ans.out[..n].iter().sum::<f64>() / n as f64;
                out.error(
                    "runner.prefill.causal",
                    format!("query 0 of a chunk returned {} (values A = {} and 2A of keys 0 and 1)", num(q0), num(A as f64)),
                    format!("{} for query 0 (it sees key 0 only), {} for query 1", num(A as f64), num(1.5 * A as f64)),
                    "prefill attention is causal within the chunk (query i sees keys 0 .. context_len + i); a kernel called non-causal lets every token see the chunk's later tokens (vLLM's forward_mha runs the chunk causal and the cached context non-causal)",
                );
            } else {
                out.note(
                    "runner.prefill.causal",
                    "query 0 sees key 0 only",
                    "causal within the chunk, as the protocol asks",
                );
            }
        }
    }
    Ok(())
}
