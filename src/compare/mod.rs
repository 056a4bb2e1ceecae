//! The comparator: reference trace vs optimized trace, check by check, with positions decoded into named
//! axes, and the verdict (first diverging layer, and inside it the first diverging check in dataflow order).

pub mod checks;
mod layer;
pub mod local;
pub mod metrics;
pub mod noise;
mod position;
pub mod selection;
pub mod tolerance;
pub mod v4;
mod verdict;

pub use checks::{checks_for, Check, Phase};
pub use layer::{compare_layer, Streamed};
pub use position::Position;
pub use tolerance::ToleranceTable;
pub use verdict::{verdict, Verdict};

use crate::error::{Error, Result};
use crate::schedule::Schedule;
use crate::tolerance::Tolerance;
use crate::trace::{Stage, StageSet, StageTensor};
use serde::{Deserialize, Serialize};

/// Every metric of one check. Positions are decoded; values are for finite pairs unless stated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub ref_l2: f64,
    pub opt_l2: f64,
    pub ref_rms: f64,
    pub max_abs: f64,
    pub max_abs_at: Option<Position>,
    pub max_abs_ref: Option<f64>,
    pub max_abs_opt: Option<f64>,
    /// |o − r| / max(|r|, floor) with floor = `metrics::REL_FLOOR_RMS`·rms(r).
    pub max_rel: f64,
    pub max_rel_at: Option<Position>,
    pub mean_abs: f64,
    pub rel_l2: f64,
    pub cos_diff: f64,
    /// `null` when the two tensors are identical.
    pub sqnr_db: Option<f64>,
    pub outside: usize,
    pub outside_share: f64,
    pub first_outside_at: Option<Position>,
    pub nonfinite: metrics::NonFinite,
    pub first_nonfinite_at: Vec<Position>,
    /// The factor by which the elementwise tolerance would have to grow for this check to pass it.
    pub tol_factor_needed: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    pub check: String,
    pub axes: Vec<String>,
    pub shape: Vec<usize>,
    pub pass: bool,
    /// Whether the elementwise criterion was applied (false in free-running mode).
    #[serde(default = "yes")]
    pub elementwise: bool,
    /// Why it failed, one line per violated criterion.
    pub reasons: Vec<String>,
    pub tolerance: Tolerance,
    pub metrics: Metrics,
    /// The stage-local view (fp64 from the optimized path's own inputs to this stage, judged against
    /// the noise model); where present it decides `pass`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<noise::LocalResult>,
    /// With a local view: what the end-to-end criteria above found (reported, not deciding unless
    /// `end_to_end_decides`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub end_to_end_reasons: Vec<String>,
    /// The end-to-end tolerance was given by the user (`--tol`, `--tol-file`): it decides too.
    #[serde(default, skip_serializing_if = "is_false")]
    pub end_to_end_decides: bool,
    /// `tolerance` includes the exact effect of the runner's cache precision (fp8) on this check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_effect: Option<CacheEffectResult>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn yes() -> bool {
    true
}

impl CheckResult {
    /// How close to failing: the largest of metric/tolerance over the criteria (≥ 1 fails; ∞ for non-finite).
    pub fn ratio(&self) -> f64 {
        match &self.local {
            Some(l) if self.end_to_end_decides => l.ratio.max(self.end_to_end_ratio()),
            Some(l) => l.ratio,
            None => self.end_to_end_ratio(),
        }
    }

    /// `ratio` of the end-to-end criteria alone.
    pub fn end_to_end_ratio(&self) -> f64 {
        if self.metrics.nonfinite.mismatches > 0 {
            return f64::INFINITY;
        }
        let t = &self.tolerance;
        let r1 = if t.rel_l2 > 0.0 {
            self.metrics.rel_l2 / t.rel_l2
        } else if self.metrics.rel_l2 > 0.0 {
            f64::INFINITY
        } else {
            0.0
        };
        if self.elementwise {
            r1.max(self.metrics.tol_factor_needed)
        } else {
            r1
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerResult {
    pub layer: usize,
    pub pass: bool,
    /// The first failing check in dataflow order.
    pub first_failure: Option<String>,
    /// Free-running mode: rel-L2 of the optimized residual stream against the reference after this layer.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub drift: Option<f64>,
    pub checks: Vec<CheckResult>,
    /// Checks not compared because the backend does not provide their stage (`Backend::provides`);
    /// not a divergence, but shown in every format.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub not_provided: Vec<String>,
}

/// Context for decoding positions.
pub struct Ctx<'a> {
    pub layer: usize,
    /// Apply the elementwise criterion. Off in free-running mode, where the two sides see different
    /// inputs by design and only the size of the drift (rel-L2) is meaningful.
    pub elementwise: bool,
    pub sched: &'a Schedule,
    pub block_table: &'a [usize],
    /// The stages the optimized backend provides (`Backend::provides`); the others are "not provided".
    pub provided: StageSet,
}

fn position(ctx: &Ctx, stage: Stage, t: &StageTensor, row0: usize, flat: usize) -> Position {
    let idx = t.unravel(flat);
    let mut coords = vec![("layer".to_string(), ctx.layer)];
    for (axis, &i) in stage.axes().iter().zip(&idx) {
        match *axis {
            "token" => {
                let tok = row0 + i;
                coords.push(("token".into(), tok));
                coords.push(("pos".into(), tok + ctx.sched.pos_offset));
                if stage == Stage::CacheRows {
                    let page = ctx
                        .block_table
                        .get(tok / ctx.sched.page_size)
                        .copied()
                        .unwrap_or(usize::MAX);
                    coords.push(("page".into(), page));
                    coords.push(("page_row".into(), tok % ctx.sched.page_size));
                }
            }
            "decode_token" => {
                let tok = ctx.sched.prompt_len + row0 + i;
                coords.push(("token".into(), tok));
                coords.push(("decode_step".into(), (row0 + i) / ctx.sched.q_len));
            }
            "split" => {
                let seq_len = {
                    let dt = row0 + idx[0];
                    ctx.sched.prompt_len + (dt / ctx.sched.q_len + 1) * ctx.sched.q_len
                };
                let r = ctx.sched.split_ranges(seq_len)[i].clone();
                coords.push(("split".into(), i));
                coords.push(("split_key_start".into(), r.start));
                coords.push(("split_key_end".into(), r.end));
            }
            other => coords.push((other.to_string(), i)),
        }
    }
    Position { coords }
}

/// Where a flat index of a whole stage tensor lies: the check whose rows hold it (a phased stage's
/// `[prefill]` or `[decode]` check) and its position decoded into named axes.
pub fn locate(ctx: &Ctx, t: &StageTensor, flat: usize) -> (String, Position) {
    let per: usize = t.shape[1..].iter().product();
    let row = flat / per.max(1);
    let check = checks_for(ctx.sched)
        .into_iter()
        .find(|c| c.stage == t.stage && c.rows(ctx.sched).contains(&row))
        .map(|c| c.name())
        .unwrap_or_else(|| t.stage.name().to_string());
    (check, position(ctx, t.stage, t, 0, flat))
}

/// Rows `rows` of a stage tensor (first axis), as a view.
pub fn rows_of<'a>(t: &'a StageTensor, rows: &std::ops::Range<usize>) -> (&'a [f64], Vec<usize>) {
    let per: usize = t.shape[1..].iter().product();
    let mut shape = t.shape.clone();
    shape[0] = rows.len();
    (&t.data[rows.start * per..rows.end * per], shape)
}

/// Compare one check.
pub fn compare_check(
    ctx: &Ctx,
    check: Check,
    r: &StageTensor,
    o: &StageTensor,
    tol: Tolerance,
) -> Result<CheckResult> {
    if r.shape != o.shape {
        return Err(Error::Usage(format!(
            "layer {}: stage {} has shape {:?} in the reference but {:?} in the optimized trace",
            ctx.layer, check.stage, r.shape, o.shape
        )));
    }
    let rows = check.rows(ctx.sched);
    let (rv, shape) = rows_of(r, &rows);
    let (ov, _) = rows_of(o, &rows);
    let view = StageTensor {
        stage: check.stage,
        shape: shape.clone(),
        data: Vec::new(),
    };
    let pos = |flat: usize| position(ctx, check.stage, &view, rows.start, flat);
    let axes = check.stage.axes().iter().map(|s| s.to_string()).collect();
    Ok(check_result(
        check.name(),
        axes,
        shape,
        (rv, ov),
        tol,
        ctx.elementwise,
        &pos,
    ))
}

/// One check of the pair `(reference, optimized)` of shape `shape` (positions decoded by `pos`): every
/// metric and the end-to-end criteria of `tol` (elementwise only where `elementwise`). The judge of
/// every stage check, MLA's (`compare_check`) and DeepSeek-V4's (`v4`).
pub fn check_result(
    name: String,
    axes: Vec<String>,
    shape: Vec<usize>,
    (rv, ov): (&[f64], &[f64]),
    tol: Tolerance,
    elementwise: bool,
    pos: &dyn Fn(usize) -> Position,
) -> CheckResult {
    // Every metric in two passes over the pair, each the same bits as its own function's.
    let all = metrics::all(rv, ov, tol.atol_rms, tol.rtol);
    let ref_rms = all.ref_rms;
    let (max_abs, max_abs_i) = all.max_abs;
    let (max_rel, max_rel_i) = all.max_rel;
    let (outside, first_out) = all.outside;
    let nf = all.nonfinite;
    let m = Metrics {
        ref_l2: all.ref_l2,
        opt_l2: all.opt_l2,
        ref_rms,
        max_abs,
        max_abs_at: max_abs_i.map(pos),
        max_abs_ref: max_abs_i.map(|i| rv[i]),
        max_abs_opt: max_abs_i.map(|i| ov[i]),
        max_rel,
        max_rel_at: max_rel_i.map(pos),
        mean_abs: all.mean_abs,
        rel_l2: all.rel_l2,
        cos_diff: all.cos_diff,
        sqnr_db: all.sqnr_db,
        outside,
        outside_share: if rv.is_empty() {
            0.0
        } else {
            outside as f64 / rv.len() as f64
        },
        first_outside_at: first_out.map(pos),
        first_nonfinite_at: nf.first_mismatches.iter().map(|&i| pos(i)).collect(),
        nonfinite: nf,
        tol_factor_needed: all.tol_factor_needed,
    };
    let mut reasons = Vec::new();
    if m.nonfinite.mismatches > 0 {
        let at = m
            .first_nonfinite_at
            .first()
            .map(|p| format!(", first at {p}"))
            .unwrap_or_default();
        let ref_nf = m.nonfinite.ref_nan + m.nonfinite.ref_inf;
        reasons.push(format!(
            "{} non-finite mismatches (optimized: {} NaN, {} inf; reference: {} non-finite){at}",
            m.nonfinite.mismatches, m.nonfinite.opt_nan, m.nonfinite.opt_inf, ref_nf
        ));
    }
    if m.rel_l2 > tol.rel_l2 {
        reasons.push(format!("rel-L2 {:.3e} > {:.1e}", m.rel_l2, tol.rel_l2));
    }
    if elementwise && m.outside > 0 {
        reasons.push(format!(
            "{} elements ({:.3}%) outside {:.1e}·rms + {:.1e}·|ref|; worst |diff| {:.4e} at {} (ref {:.6e}, opt {:.6e})",
            m.outside,
            100.0 * m.outside_share,
            tol.atol_rms,
            tol.rtol,
            m.max_abs,
            m.max_abs_at.as_ref().map(|p| p.to_string()).unwrap_or_default(),
            m.max_abs_ref.unwrap_or(f64::NAN),
            m.max_abs_opt.unwrap_or(f64::NAN)
        ));
    }
    CheckResult {
        check: name,
        axes,
        shape,
        pass: reasons.is_empty(),
        elementwise,
        reasons,
        tolerance: tol,
        metrics: m,
        local: None,
        end_to_end_reasons: Vec::new(),
        end_to_end_decides: false,
        cache_effect: None,
    }
}

/// Judge a check on the local view: its verdict replaces the end-to-end one, whose reasons move to
/// `end_to_end_reasons` (unless `e2e_decides`: a user-given end-to-end tolerance stays binding).
pub fn apply_local(
    ctx: &Ctx,
    check: Check,
    c: &mut CheckResult,
    opt: &StageTensor,
    loc: &local::LocalStage,
    e2e_decides: bool,
) {
    let l = judge_local(ctx, check, c, opt, loc, &loc.values);
    let e2e = std::mem::take(&mut c.reasons);
    c.reasons = l.reasons.iter().map(|r| format!("local: {r}")).collect();
    if e2e_decides {
        c.reasons.extend(e2e.iter().cloned());
    }
    c.pass = c.reasons.is_empty();
    c.end_to_end_reasons = e2e;
    c.end_to_end_decides = e2e_decides;
    c.local = Some(l);
}

/// A runner's `@runner` check judged by the stage-local model: its yardstick (fp64 from the tensors the
/// runner was given) with the noise the local view predicts for that stage, which is computed from the
/// same inputs (docs/runners.md). One error model decides both views, so a kernel error that fails the
/// stage locally fails `@runner` too, and an `@runner` pass means the runner computed within the noise.
/// The storage-precision bound stays in the report (`tolerance`, and its reasons in
/// `end_to_end_reasons`), not deciding.
pub fn apply_local_at_runner(
    ctx: &Ctx,
    check: Check,
    c: &mut CheckResult,
    opt: &StageTensor,
    reference: &StageTensor,
    loc: &local::LocalStage,
) {
    let l = judge_local(ctx, check, c, opt, loc, &reference.data);
    c.end_to_end_reasons = std::mem::take(&mut c.reasons);
    c.reasons = l.reasons.clone();
    c.pass = c.reasons.is_empty();
    c.local = Some(l);
}

/// The local judge over `check`'s rows, `values` in the reference's place.
fn judge_local(
    ctx: &Ctx,
    check: Check,
    c: &CheckResult,
    opt: &StageTensor,
    loc: &local::LocalStage,
    values: &[f64],
) -> noise::LocalResult {
    let rows = check.rows(ctx.sched);
    let per: usize = opt.shape[1..].iter().product();
    let span = rows.start * per..rows.end * per;
    let view = StageTensor {
        stage: check.stage,
        shape: c.shape.clone(),
        data: Vec::new(),
    };
    let pos = |flat: usize| position(ctx, check.stage, &view, rows.start, flat);
    let row = *opt.shape.last().unwrap_or(&1).max(&1);
    let coherent = loc
        .coherent
        .as_ref()
        .map(|c| &c[span.start / row..span.end / row]);
    let pred = noise::Prediction {
        hidden: &loc.hidden_var[span.clone()],
        exact: loc.exact,
        row,
        coherent,
        truncation: loc.truncation.as_ref().map(|b| &b[span.clone()]),
        store: loc.store,
    };
    let mut l = noise::judge(&opt.data[span.clone()], &values[span.clone()], &pred, &pos);
    if let Some(b) = &loc.bound {
        beyond_bound(
            &mut l,
            &opt.data[span.clone()],
            &values[span.clone()],
            &b[span],
            &pos,
        );
    }
    l
}

/// A quantized cache's rows against the format's rounding bound per element (`LocalStage::bound`): the
/// worst |error| ÷ bound joins the check's ratio, and any element beyond it fails the check.
fn beyond_bound(
    l: &mut noise::LocalResult,
    opt: &[f64],
    local: &[f64],
    bound: &[f64],
    pos: &dyn Fn(usize) -> Position,
) {
    let (mut worst, mut at) = (0f64, None);
    for (i, ((&o, &v), &b)) in opt.iter().zip(local).zip(bound).enumerate() {
        if !(o.is_finite() && v.is_finite()) {
            continue;
        }
        let e = (o - v).abs();
        let q = match b > 0.0 {
            true => e / b,
            false if e > 0.0 => f64::INFINITY,
            false => 0.0,
        };
        if q > worst {
            (worst, at) = (q, Some(i));
        }
    }
    l.ratio = l.ratio.max(worst);
    if let (true, Some(i)) = (worst > 1.0, at) {
        l.reasons.push(format!(
            "an element beyond the cache format's rounding bound: |error| {:.4e} > {:.4e} at {} (stored {:.6e}, read back {:.6e})",
            (opt[i] - local[i]).abs(),
            bound[i],
            pos(i),
            local[i],
            opt[i]
        ));
        l.pass = false;
    }
}

/// Widen `tol` by the exact effect of a runner's cache precision on this check (`trace::CacheEffect`):
/// rel-L2 by ‖effect‖/‖ref‖, the elementwise bound by max|effect|/rms(ref) — the triangle inequality
/// over the calibrated tolerance (upstream rounding) and the cache's rounding; the kernel's own error is
/// its `@runner` check's, against fp64 over the cache it reads.
fn cache_effect(
    ctx: &Ctx,
    check: Check,
    r: &StageTensor,
    e: &crate::trace::CacheEffect,
    tol: &mut Tolerance,
) -> CacheEffectResult {
    let rows = check.rows(ctx.sched);
    let (rv, _) = rows_of(r, &rows);
    let ev = match e.effect.shape == r.shape {
        true => rows_of(&e.effect, &rows).0,
        false => &[][..],
    };
    let (l2, rms) = (metrics::l2_norm(rv), metrics::rms(rv));
    let rel_l2 = match l2 > 0.0 {
        true => metrics::l2_norm(ev) / l2,
        false => 0.0,
    };
    let max_abs = ev.iter().fold(0f64, |m, v| m.max(v.abs()));
    let atol_rms = match rms > 0.0 {
        true => max_abs / rms,
        false => 0.0,
    };
    tol.rel_l2 += rel_l2;
    tol.atol_rms += atol_rms;
    CacheEffectResult {
        cache: e.cache.to_string(),
        rel_l2,
        atol_rms,
    }
}

/// A check's tolerance widened by a runner's cache precision (`CheckResult::cache_effect`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEffectResult {
    /// The cache the runner's kernel reads (`fp8_v32`: FlashMLA's fp8 cache).
    pub cache: String,
    /// What was added to the tolerance's rel_l2 (‖effect‖/‖ref‖) and atol_rms (max|effect|/rms).
    pub rel_l2: f64,
    pub atol_rms: f64,
}

/// The suffix of a runner's own-error check (`attn_latent@runner`).
pub const AT_RUNNER: &str = "@runner";
