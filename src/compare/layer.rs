//! A layer's checks, fed stage by stage while the stage-local view is made ([`Streamed`]), so that each
//! stage's view is let go once its checks are judged instead of the whole view (values and variances of
//! every stage, ~1 GB on a covering GLM-5 layer) being alive at once (#39); [`compare_layer`] feeds it a
//! whole view at once.

use super::{
    apply_local, apply_local_at_runner, cache_effect, checks_for, compare_check, local, Check,
    CheckResult, Ctx, LayerResult, ToleranceTable, AT_RUNNER,
};
use crate::error::{Error, Result};
use crate::precision::Dtype;
use crate::trace::LayerTrace;
use rayon::prelude::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What every check of a layer reads.
#[derive(Clone, Copy)]
struct Sides<'a> {
    ctx: &'a Ctx<'a>,
    reference: &'a LayerTrace,
    optimized: &'a LayerTrace,
    dtype: Dtype,
    tols: &'a ToleranceTable,
}

/// The checks the backend provides (in dataflow order) and the names of those it does not.
fn split_checks(ctx: &Ctx) -> (Vec<Check>, Vec<String>) {
    let (checks, not_provided): (Vec<Check>, Vec<Check>) = checks_for(ctx.sched)
        .into_iter()
        .partition(|c| ctx.provided.contains(c.stage));
    (checks, not_provided.iter().map(|c| c.name()).collect())
}

/// One check's end-to-end part (and its `@runner` twin's, where the runner has one): everything
/// that reads the reference trace. The stage-local view is applied after ([`apply_view`]), from the
/// optimized trace alone, so a judge may let the reference go before the view is made.
fn end_to_end(s: Sides, check: Check) -> Result<Vec<CheckResult>> {
    let Sides {
        ctx,
        reference,
        optimized,
        dtype,
        tols,
    } = s;
    let missing = |side: &str| {
        Error::Usage(format!(
            "layer {}: the {side} trace has no stage {} (check {})",
            ctx.layer,
            check.stage,
            check.name()
        ))
    };
    let r = reference
        .get(check.stage)
        .ok_or_else(|| missing("reference"))?;
    let o = optimized
        .get(check.stage)
        .ok_or_else(|| missing("optimized backend, which claims to provide it,"))?;
    // A stage stored in a type of its own (a capture's `stage_dtypes`) is bounded by it.
    let dtype = optimized.tolerance_dtype(check.stage, dtype);
    let mut tol = tols.get(dtype, &check)?;
    let effect = optimized
        .cache_effect
        .iter()
        .find(|e| e.check == check.name());
    let widened = effect.map(|e| cache_effect(ctx, check, r, e, &mut tol));
    let mut c = compare_check(ctx, check, r, o, tol)?;
    c.cache_effect = widened;
    let mut out = vec![c];
    // A runner's stage, against fp64 from the runner's own inputs: its kernel's error alone.
    if let Some(a) = optimized.at_runner.iter().find(|a| a.check == check.name()) {
        let mut c = compare_check(ctx, check, &a.reference, &a.optimized, a.tolerance)?;
        c.check = format!("{}{AT_RUNNER}", check.name());
        out.push(c);
    }
    Ok(out)
}

/// The stage-local view `l` applied to a check's end-to-end results `out` ([`end_to_end`]): it decides
/// the check where it covers the stage; the `@runner` twin is judged by the view's model of that stage
/// (same inputs) where the view models the runner's path, else it keeps the storage bound.
fn apply_view(
    ctx: &Ctx,
    optimized: &LayerTrace,
    e2e_decides: bool,
    check: Check,
    out: &mut [CheckResult],
    l: &local::LocalStage,
) {
    let Some(o) = optimized.get(check.stage) else {
        return;
    };
    if l.values.len() == o.data.len() {
        apply_local(ctx, check, &mut out[0], o, l, e2e_decides);
    }
    if let (Some(a), Some(c)) = (
        optimized.at_runner.iter().find(|a| a.check == check.name()),
        out.get_mut(1),
    ) {
        if l.values.len() == a.optimized.data.len() && a.reference.data.len() == l.values.len() {
            apply_local_at_runner(ctx, check, c, &a.optimized, &a.reference, l);
        }
    }
}

/// Whether a user-given end-to-end tolerance decides `check` too (`ToleranceTable::is_overridden`, in
/// the type the stage is stored in).
fn e2e_decides(s: Sides, check: Check) -> bool {
    let dtype = s.optimized.tolerance_dtype(check.stage, s.dtype);
    s.tols.is_overridden(dtype, &check)
}

/// The layer's result from each check's, in the checks' order (the first error in that order).
fn assemble(
    ctx: &Ctx,
    per_check: Vec<Result<Vec<CheckResult>>>,
    not_provided: Vec<String>,
) -> Result<LayerResult> {
    let mut out = Vec::new();
    for r in per_check {
        out.extend(r?);
    }
    let first_failure = out.iter().find(|c| !c.pass).map(|c| c.check.clone());
    Ok(LayerResult {
        layer: ctx.layer,
        pass: first_failure.is_none(),
        first_failure,
        drift: None,
        checks: out,
        not_provided,
    })
}

/// Compare every check of a layer. A check whose stage the backend does not provide is listed as not
/// provided; a stage it claims but left out of its trace (or one missing from the reference) is an error.
/// [`Streamed`] over the whole view at once: the view's stages fed in order (the first of a stage
/// counts, as `Local::get` says).
pub fn compare_layer(
    ctx: &Ctx,
    reference: &LayerTrace,
    optimized: &LayerTrace,
    dtype: Dtype,
    tols: &ToleranceTable,
    local: Option<&local::Local>,
) -> Result<LayerResult> {
    let cmp = Streamed::new(ctx, reference, optimized, dtype, tols);
    for l in local.iter().flat_map(|l| &l.stages) {
        cmp.stage(l);
    }
    cmp.finish().0
}

/// [`compare_layer`] in two steps: every check's end-to-end part at once ([`Streamed::new`], the only
/// step that reads the reference trace, which the caller may then let go), then the stage-local view
/// fed one stage at a time ([`Streamed::stage`], from any thread) and applied to its stage's checks as
/// it comes. [`Streamed::finish`] gives what `compare_layer` gives with the whole view (a check whose
/// stage never came keeps its end-to-end verdict). As `Local::get` does, the first view of a stage is
/// the one that counts.
pub struct Streamed<'a> {
    ctx: &'a Ctx<'a>,
    optimized: &'a LayerTrace,
    not_provided: Vec<String>,
    /// Per check: itself, whether a user-given tolerance decides it too, and its results so far; and
    /// every stage given so far.
    done: Mutex<Done>,
    /// Time spent judging, summed over the threads that did.
    busy: Mutex<Duration>,
}

type Done = (
    Vec<(Check, bool, Result<Vec<CheckResult>>)>,
    Vec<crate::trace::Stage>,
);

impl<'a> Streamed<'a> {
    /// Every check's end-to-end part, in parallel (each independent, as in [`compare_layer`]).
    pub fn new(
        ctx: &'a Ctx<'a>,
        reference: &LayerTrace,
        optimized: &'a LayerTrace,
        dtype: Dtype,
        tols: &ToleranceTable,
    ) -> Streamed<'a> {
        let t0 = Instant::now();
        let s = Sides {
            ctx,
            reference,
            optimized,
            dtype,
            tols,
        };
        let (checks, not_provided) = split_checks(ctx);
        let per_check = checks
            .par_iter()
            .map(|&check| (check, e2e_decides(s, check), end_to_end(s, check)))
            .collect();
        Streamed {
            ctx,
            optimized,
            not_provided,
            done: Mutex::new((per_check, Vec::new())),
            busy: Mutex::new(t0.elapsed()),
        }
    }

    /// Judge the checks of `l`'s stage by it (nothing if that stage came before).
    pub fn stage(&self, l: &local::LocalStage) {
        let t0 = Instant::now();
        // The stage's checks are taken out while they are judged, so other stages' go on meanwhile.
        let mut mine: Vec<(usize, Check, bool, Result<Vec<CheckResult>>)> = {
            let mut g = self.done.lock().expect("not poisoned");
            if g.1.contains(&l.stage) {
                return;
            }
            g.1.push(l.stage);
            (g.0.iter_mut().enumerate())
                .filter(|(_, (c, _, _))| c.stage == l.stage)
                .map(|(i, (c, d, r))| (i, *c, *d, std::mem::replace(r, Ok(Vec::new()))))
                .collect()
        };
        mine.par_iter_mut().for_each(|(_, check, decides, r)| {
            if let Ok(out) = r {
                apply_view(self.ctx, self.optimized, *decides, *check, out, l);
            }
        });
        let mut g = self.done.lock().expect("not poisoned");
        for (i, _, _, r) in mine {
            g.0[i].2 = r;
        }
        drop(g);
        *self.busy.lock().expect("not poisoned") += t0.elapsed();
    }

    /// The layer's result, every check in order; and the time spent judging, summed over threads.
    pub fn finish(self) -> (Result<LayerResult>, Duration) {
        let (done, _) = self.done.into_inner().expect("not poisoned");
        let per_check = done.into_iter().map(|(_, _, r)| r).collect();
        let r = assemble(self.ctx, per_check, self.not_provided);
        (r, self.busy.into_inner().expect("not poisoned"))
    }
}
