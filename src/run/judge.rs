//! Each layer's judge: its stage-local view and its comparison in each mode, and its dump, on a thread
//! of its own next to the next layer's paths (`layers::run_layers`).

use super::{DumpLayers, RunOptions};
use crate::compare::{self, LayerResult};
use crate::error::Result;
use crate::model::MlaConfig;
use crate::trace::LayerTrace;
use ndarray::Array2;
use std::path::PathBuf;

/// A layer's traces, computed, for [`judge`]: the reference, shadow mode's optimized trace with what
/// its stage-local view needs (none where it is not modelled), free mode's with its drift (or already
/// compared: a layer run alone, `footprint.rs`).
pub(super) struct Computed {
    pub(super) reference: LayerTrace,
    pub(super) shadow: Option<(LayerTrace, Option<View>)>,
    pub(super) free: Option<Free>,
}

/// Free mode's part of a layer for its judge: its trace and drift, or its comparison made already.
pub(super) enum Free {
    Trace(LayerTrace, f64),
    Judged(Box<FreeJudged>),
}

/// Free mode's comparison of a layer ([`judge_free`]): its result, its trace where `--dump-dir` may
/// want it, and how long it took.
pub(super) struct FreeJudged {
    result: LayerResult,
    kept: Option<LayerTrace>,
    took: std::time::Duration,
}

/// Free mode's comparison of a layer's trace `opt` (its drift `drift`) with the reference; the trace
/// is let go unless `--dump-dir` may want it.
pub(super) fn judge_free(
    reference: &LayerTrace,
    opt: LayerTrace,
    drift: f64,
    free_ctx: &compare::Ctx,
    opts: &RunOptions,
) -> Result<FreeJudged> {
    let t0 = std::time::Instant::now();
    let mut result = compare::compare_layer(
        free_ctx,
        reference,
        &opt,
        opts.dtype,
        &opts.tolerances,
        None,
    )?;
    result.drift = Some(drift);
    Ok(FreeJudged {
        result,
        kept: opts.dump.is_some().then_some(opt),
        took: t0.elapsed(),
    })
}

/// What a layer's stage-local view needs besides the run's tables: the layer's weights and input, the
/// backend's answers about its path, and (DSA) the selection the path attended over.
pub(super) struct View {
    /// The view's products against the layer's weights, made next to the reference
    /// ([`compare::local::prepare`]): a judge holds no copy of the layer.
    pub(super) pre: compare::local::Prepared,
    pub(super) x: Array2<f64>,
    /// The backend's `judging` after the layer ran.
    pub(super) judging: crate::judging::Judging,
    pub(super) selection: Option<crate::reference::sparse::Selection>,
}

/// What every layer's [`judge`] shares.
pub(super) struct JudgeEnv<'a> {
    pub(super) cfg: &'a MlaConfig,
    pub(super) rope: &'a crate::rope::RopeTables,
    pub(super) opts: &'a RunOptions,
    pub(super) provided: crate::trace::StageSet,
}

/// A layer's comparisons: its results per mode, its dump, and how long its local view and the rest took.
pub(super) struct Judged {
    pub(super) shadow: Option<LayerResult>,
    pub(super) free: Option<LayerResult>,
    pub(super) dump: Option<PathBuf>,
    pub(super) local: std::time::Duration,
    pub(super) took: std::time::Duration,
}

/// Shadow mode's comparison `cmp` (its end-to-end part made: the reference may be gone), fed the
/// stage-local view of its trace `opt` (from its products against the weights made already) one stage
/// at a time: each stage is judged beside the next ones being made and then let go, so the whole view
/// is never alive at once (#39). The result, the view's time (wall, its stages' judging beside it) and
/// the judging's (summed over threads, the end-to-end part included).
fn shadow_judged(
    env: &JudgeEnv,
    cmp: compare::Streamed,
    opt: &LayerTrace,
    v: Option<View>,
) -> (
    Result<LayerResult>,
    std::time::Duration,
    std::time::Duration,
) {
    let opts = env.opts;
    let t0 = std::time::Instant::now();
    if let Some(v) = v {
        let frame = compare::local::Frame {
            cfg: env.cfg,
            rope: env.rope,
            sched: &opts.sched,
            x: &v.x,
            dtype: opts.dtype,
            provided: env.provided,
            judging: &v.judging,
        };
        let sp = v
            .selection
            .as_ref()
            .map(|selection| compare::local::Sparse { selection });
        let outside = v.judging.outside_local_view;
        let cmp = &cmp;
        rayon::scope(|s| {
            compare::local::finish_into(frame, opt, v.pre, sp, &mut |l| {
                if !outside.contains(l.stage) {
                    s.spawn(move |_| cmp.stage(&l));
                }
            })
        });
    }
    let local = t0.elapsed();
    let (r, took) = cmp.finish();
    (r, local, took)
}

/// A computed layer's stage-local view and comparison in each mode, and its dump as `--dump-dir` asks
/// (`dumped_before`: an earlier layer was dumped).
pub(super) fn judge(
    c: Computed,
    env: &JudgeEnv,
    ctx: &compare::Ctx,
    free_ctx: &compare::Ctx,
    dumped_before: bool,
) -> Result<Judged> {
    let opts = env.opts;
    let Computed {
        reference,
        shadow,
        free,
    } = c;
    // Free mode first, so that its trace is let go before the stage-local view, the largest part of
    // a judge, is made (`footprint.rs`).
    let free = free
        .map(|f| match f {
            Free::Trace(opt, drift) => judge_free(&reference, opt, drift, free_ctx, opts),
            Free::Judged(j) => Ok(*j),
        })
        .transpose()?;
    // The traces are kept for `--dump-dir` only: each is dropped once compared, with its local view.
    let keep = opts.dump.is_some();
    let mut traces: Vec<(LayerTrace, bool)> = Vec::new();
    let mut shadow_result = None;
    let (mut local, mut took) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
    let mut reference = Some(reference);
    if let (Some((opt, v)), Some(r)) = (shadow, &reference) {
        let cmp = compare::Streamed::new(ctx, r, &opt, opts.dtype, &opts.tolerances);
        // The reference is read by the end-to-end part only: let go before the view is made, unless
        // `--dump-dir` may write it.
        if !keep {
            reference = None;
        }
        let (r, l, t) = shadow_judged(env, cmp, &opt, v);
        let r = r?;
        (local, took) = (l, t);
        if keep {
            traces.push((opt, r.pass));
        }
        shadow_result = Some(r);
    }
    let free = free.map(|j| {
        took += j.took;
        if let Some(t) = j.kept {
            traces.push((t, j.result.pass));
        }
        j.result
    });
    let mut dump = None;
    if let Some((dir, which)) = &opts.dump {
        let failing = traces.iter().find(|(_, pass)| !pass).map(|(t, _)| t);
        let chosen = match which {
            DumpLayers::All => traces.first().map(|(t, _)| t),
            DumpLayers::List(ls) if ls.contains(&ctx.layer) => traces.first().map(|(t, _)| t),
            DumpLayers::First if !dumped_before => failing,
            _ => None,
        };
        if let Some(opt) = chosen {
            if let Some(reference) = &reference {
                dump = Some(crate::report::npy::dump_layer(dir, reference, opt)?);
            }
        }
    }
    Ok(Judged {
        shadow: shadow_result,
        free,
        dump,
        local,
        took,
    })
}
