//! The judges of probes 1 and 2 (softmax scale and LSE base), of a one-key value, and of a non-finite
//! answer (one finding for it, not a wrong scale, base and value at once).

use super::prober::Answer;
use super::within;
use crate::backend::runner::protocol::{Describe, LseBase};
use crate::lint::{num, Findings};
use crate::model::MlaConfig;
use std::f64::consts::{LN_2, LOG2_E};

/// What probes 1 and 2 established about an op.
pub(super) struct ScaleBase {
    /// The factor that turns the runner's LSE into a natural log (found, or declared if unclear).
    pub(super) to_e: f64,
    /// The scale the runner applied.
    pub(super) scale: f64,
}

/// Probes 1 and 2 on one op's two answers (one key, two equal keys) with `dot` = q·k: the LSE base
/// first, so the scale is read in the base the runner uses.
pub(super) fn judge_scale_base(
    op: &str,
    desc: &Describe,
    c: &MlaConfig,
    dot: f64,
    one: &Answer,
    two: &Answer,
    out: &mut Findings,
) -> ScaleBase {
    let to_e = judge_lse_base(op, desc, one, two, out);
    let scale = judge_scale(op, c, dot, one, to_e, out);
    ScaleBase { to_e, scale }
}

/// Probe 2: the LSE base, from the step one key → two equal keys; the factor that turns the
/// runner's LSE into a natural log (found, or declared if unclear).
fn judge_lse_base(
    op: &str,
    desc: &Describe,
    one: &Answer,
    two: &Answer,
    out: &mut Findings,
) -> f64 {
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
    to_e
}

/// Probe 1: the scale, the LSE of one key over q·k, read in the base found by probe 2; a wrong one is
/// named after the known mistake it matches.
fn judge_scale(
    op: &str,
    c: &MlaConfig,
    dot: f64,
    one: &Answer,
    to_e: f64,
    out: &mut Findings,
) -> f64 {
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
        let known = known_mistakes(c);
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
    scale
}

/// The scales the classic mistakes give, each with its explanation.
fn known_mistakes(c: &MlaConfig) -> Vec<(f64, String)> {
    let qk = c.qk_head_dim() as f64;
    let row = c.cache_row() as f64;
    let m2 = c.mscale * c.mscale;
    let want = c.softmax_scale;
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
    known
}

/// The value a one-key request returns is that key's value (the softmax of one score is 1).
pub(super) fn judge_value(op: &str, ans: &Answer, want: f64, what: &str, out: &mut Findings) {
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

/// The first non-finite value of an answer, named (`lse -inf`, `attn_latent NaN`).
pub(super) fn non_finite(a: &Answer, out_name: &str) -> Option<(String, f64)> {
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
pub(super) fn judge_non_finite(
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
