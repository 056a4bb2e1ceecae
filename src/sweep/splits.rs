//! Split invariance: the same schedule with several split-KV counts. Each run is checked against fp64 as
//! usual, and the optimized decode outputs of every count are compared with the first count's.
//!
//! The rule: two optimized runs must agree within the **end-to-end tolerance of the check**, applied to
//! their difference exactly as to a run's difference from fp64 (`compare::compare_check`, with the first
//! count's output in the reference's place: rel-L2 ≤ `rel_l2`, every element within
//! `atol_rms·rms + rtol·|x|`, non-finite positions equal).
//!
//! Why this and not "within 2× the difference each has to the reference": by the triangle inequality
//! `|a − b| ≤ |a − r| + |b − r| ≤ 2·max(|a − r|, |b − r|)`, so that bound holds for any two outputs
//! whatever they are; it cannot fail. The tolerance can: it is 4× the worst noise calibrated on the
//! mirror (docs/tolerances.md), while two correct runs that differ only in where the split partition
//! rounds differ by about √2 × that noise (independent roundings), well inside it — measured on the
//! mirror at 3.3e-3 rel-L2 in bf16 against a bound of 1.2e-2 (tests/it/schedule_invariance.rs). A
//! split-dependent error of the size the tolerance exists to catch (a lost or doubled split, a merge in
//! the wrong base) shows here as it does against fp64, and one that each run keeps just under the
//! tolerance but in different directions shows here only.
//!
//! Compared: the outputs that depend on the partition, `attn_latent`, `lse[decode]`, `attn_heads[decode]`,
//! `attn_out[decode]` (prefill and the token-local stages do not see the split count; `split_out` and
//! `split_lse` have one entry per split and cannot be compared across counts).

use super::{Outcome, SweepOptions, SweepReport, SweepVerdict};
use crate::backend::{Backend, BackendInfo, Judging, LayerCtx};
use crate::compare::{self, Check, Phase, Position};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::schedule::Schedule;
use crate::tolerance::Tolerance;
use crate::trace::{LayerTrace, Stage, StageSet};
use serde::Serialize;

/// The checks compared across split counts.
pub fn invariant_checks() -> [Check; 4] {
    let dec = |stage| Check {
        stage,
        phase: Some(Phase::Decode),
    };
    [
        Check {
            stage: Stage::AttnLatent,
            phase: None,
        },
        dec(Stage::Lse),
        dec(Stage::AttnHeads),
        dec(Stage::AttnOut),
    ]
}

/// One split count's run against fp64.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitRun {
    pub num_splits: usize,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// One check of one layer, a split count's optimized output against the base count's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitComparison {
    pub num_splits: usize,
    pub layer: usize,
    pub check: String,
    pub pass: bool,
    /// Metric ÷ tolerance as for a check (≥ 1 fails; null: non-finite mismatch).
    pub ratio: f64,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub max_abs_at: Option<Position>,
    pub tolerance: Tolerance,
    pub reasons: Vec<String>,
}

/// A split sweep's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitSweep {
    pub counts: Vec<usize>,
    /// The count the others are compared with (the first given).
    pub base: usize,
    pub runs: Vec<SplitRun>,
    /// Every compared check of every layer, for every count but the base.
    pub comparisons: Vec<SplitComparison>,
}

/// The backend, keeping a copy of the stages the comparison needs from each layer it runs.
struct Recorder<'a> {
    inner: &'a mut dyn Backend,
    traces: Vec<LayerTrace>,
}

impl Backend for Recorder<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn device(&self) -> Option<String> {
        self.inner.device()
    }
    fn provides(&self) -> StageSet {
        self.inner.provides()
    }
    fn notices(&self) -> Vec<String> {
        self.inner.notices()
    }
    /// The inner path's, whole: the recorder computes nothing, so the judges read its traces as they
    /// would the inner path's (a sweep runs dense, within a DSA file's top_k: `run::dense_beyond_top_k`).
    fn judging(&self) -> Judging {
        self.inner.judging()
    }
    fn run_layer(&mut self, ctx: &LayerCtx, x: &ndarray::Array2<f64>) -> Result<LayerTrace> {
        let t = self.inner.run_layer(ctx, x)?;
        let mut keep = LayerTrace::new(t.layer);
        for c in invariant_checks() {
            if let Some(s) = t.get(c.stage) {
                keep.push(s.clone());
            }
        }
        self.traces.push(keep);
        Ok(t)
    }
}

/// Check the split counts: at least one, each at least 1, distinct; a schedule with decode steps.
pub fn check_counts(counts: &[usize], sched: &Schedule) -> Result<()> {
    let bad = |m: String| Err(Error::Usage(format!("--splits: {m}")));
    if counts.is_empty() {
        return bad("no split count".into());
    }
    if let Some(c) = counts
        .iter()
        .find(|&&c| c == 0 || c > crate::schedule::MAX_TOKENS)
    {
        return bad(format!(
            "{c} is not a split count (1..={})",
            crate::schedule::MAX_TOKENS
        ));
    }
    let mut s = counts.to_vec();
    s.sort_unstable();
    s.dedup();
    if s.len() != counts.len() {
        return bad("the counts must be distinct".into());
    }
    if sched.decode_steps == 0 {
        return bad("the split count only changes decode, and the schedule has no decode steps (--decode-steps 0)".into());
    }
    Ok(())
}

/// The split sweep over `counts` (the first is the base).
pub fn sweep_splits(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &SweepOptions,
    counts: &[usize],
) -> Result<SweepReport> {
    check_counts(counts, &opts.sched)?;
    let bar = super::progress(opts.progress, "splits");
    bar.set_length(counts.len() as u64);
    let mut runs = Vec::new();
    let mut comparisons = Vec::new();
    let mut base: Option<Vec<LayerTrace>> = None;
    let mut rep: Option<SweepReport> = None;
    for &s in counts {
        bar.set_message(format!("{s} splits"));
        let sched = Schedule {
            num_splits: s,
            ..opts.sched.clone()
        };
        let mut rec = Recorder {
            inner: &mut *backend,
            traces: Vec::new(),
        };
        let r = crate::run::run(file, &mut rec, info, &opts.run_options(sched.clone()))?;
        let provided = rec.provides();
        let traces = rec.traces;
        let sr = rep.get_or_insert_with(|| SweepReport::frame("splits", opts, &r));
        sr.add_notices(&r);
        runs.push(SplitRun {
            num_splits: s,
            outcome: Outcome::of(&r),
        });
        match &base {
            None => base = Some(traces),
            Some(b) => comparisons.extend(compare_counts(opts, &sched, provided, s, b, &traces)?),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut rep = rep.expect("one count at least");
    rep.verdict = split_verdict(counts, &runs, &comparisons);
    rep.splits = Some(SplitSweep {
        counts: counts.to_vec(),
        base: counts[0],
        runs,
        comparisons,
    });
    Ok(rep)
}

/// Count `s`'s layers against the base count's, check by check.
fn compare_counts(
    opts: &SweepOptions,
    sched: &Schedule,
    provided: StageSet,
    s: usize,
    base: &[LayerTrace],
    traces: &[LayerTrace],
) -> Result<Vec<SplitComparison>> {
    let table = sched.block_table();
    let present = compare::checks_for(sched);
    let mut out = Vec::new();
    for (b, t) in base.iter().zip(traces) {
        let ctx = compare::Ctx {
            layer: t.layer,
            elementwise: true,
            sched,
            block_table: &table,
            provided,
        };
        for c in invariant_checks() {
            if !present.contains(&c) || !provided.contains(c.stage) {
                continue;
            }
            let (Some(x), Some(y)) = (b.get(c.stage), t.get(c.stage)) else {
                return Err(Error::Usage(format!(
                    "layer {}: the optimized trace has no stage {}",
                    t.layer, c.stage
                )));
            };
            let r = compare::compare_check(&ctx, c, x, y, opts.tolerances.get(opts.dtype, &c)?)?;
            out.push(SplitComparison {
                num_splits: s,
                layer: t.layer,
                check: r.check.clone(),
                pass: r.pass,
                ratio: r.ratio(),
                rel_l2: r.metrics.rel_l2,
                max_abs: r.metrics.max_abs,
                max_abs_at: r.metrics.max_abs_at.clone(),
                tolerance: r.tolerance,
                reasons: r.reasons,
            });
        }
    }
    Ok(out)
}

fn split_verdict(counts: &[usize], runs: &[SplitRun], cmp: &[SplitComparison]) -> SweepVerdict {
    let list: Vec<String> = counts.iter().map(|c| c.to_string()).collect();
    if let Some(r) = runs.iter().find(|r| !r.outcome.pass) {
        return SweepVerdict {
            pass: false,
            message: format!(
                "DIVERGENCE: {} splits against fp64: layer {}, {}: {}",
                r.num_splits,
                r.outcome
                    .first_layer
                    .map(|l| l.to_string())
                    .unwrap_or_else(|| "?".into()),
                r.outcome.first_check.as_deref().unwrap_or("?"),
                r.outcome.reasons.join("; ")
            ),
            reasons: r.outcome.reasons.clone(),
        };
    }
    if let Some(c) = cmp.iter().find(|c| !c.pass) {
        return SweepVerdict {
            pass: false,
            message: format!(
                "DIVERGENCE: {} splits against {} splits: layer {}, {}: {}",
                c.num_splits,
                counts[0],
                c.layer,
                c.check,
                c.reasons.join("; ")
            ),
            reasons: c.reasons.clone(),
        };
    }
    let message = match counts {
        [one] => format!("PASS: {one} splits within tolerance of fp64 (one count: nothing to compare)"),
        _ => format!(
            "PASS: splits {} each within tolerance of fp64, and their decode outputs within tolerance of {} splits'",
            list.join(", "),
            counts[0]
        ),
    };
    SweepVerdict {
        pass: true,
        message,
        reasons: Vec::new(),
    }
}
