//! `mla-diff selftest --sensitivity`: the smallest planted error each check catches, in units of that
//! check's own noise — the clean optimized path's rms error against fp64 from its own inputs (the
//! stage-local view, which decides the verdict), each element's share shaped by the noise model.
//!
//! Each perturbation is added to one stage of a clean trace, stored in that stage's type as a kernel
//! would store it, and only that check is re-run, so the figure is the check's detection threshold,
//! not how far an error travels:
//! - `noise`: independent Gaussian error of k × each element's noise on every element of the check;
//! - `bias`: a constant k × the rms noise (an LSE offset, a mis-scaled mean);
//! - `one row`: Gaussian error of k × the noise on the last row (last axis) only, the draw scaled to
//!   a mean square of 1 over the row: one query's and head's output, one token's projection.
//!
//! A check whose threshold is k catches an error k times its noise; the goal of #14 is k ≤ 2 everywhere.

use crate::backend::{Backend, RunTables};
use crate::compare::{self, checks_for, ToleranceTable};
use crate::error::Result;
use crate::faults::Active;
use crate::gguf::GgufFile;
use crate::model::{LayerWeights, MlaConfig, RopeFactors};
use crate::precision::Dtype;
use crate::schedule::Schedule;
use crate::trace::StageTensor;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Noise,
    Bias,
    OneRow,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Noise, Kind::Bias, Kind::OneRow];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Noise => "noise",
            Kind::Bias => "bias",
            Kind::OneRow => "one row",
        }
    }
}

/// One check's thresholds.
#[derive(Debug, Clone)]
pub struct Row {
    pub check: String,
    /// The clean run's local rel-L2 at this check (the noise) and the noise model's prediction of it.
    pub clean_rel_l2: f64,
    pub predicted_rel_l2: f64,
    /// Per `Kind::ALL`: the smallest k caught (`None`: not caught at 10⁶; `Some(0)`: the clean run
    /// already fails).
    pub thresholds: [Option<f64>; 3],
}

/// Measure every check of layer `layer` of `file` on `sched`.
pub fn measure(
    file: &GgufFile,
    layer: usize,
    backend: &mut dyn Backend,
    dtype: Dtype,
    sched: &Schedule,
    tols: &ToleranceTable,
    seed: u64,
) -> Result<Vec<Row>> {
    let cfg = MlaConfig::from_gguf(file)?;
    let w = LayerWeights::load(file, &cfg, layer)?;
    let factors = RopeFactors::load(file, &cfg)?;
    let tables = RunTables::new(&cfg, factors.as_ref(), sched)?;
    let x = crate::input::random_hidden(cfg.hidden, sched.total_tokens(), seed);
    let reference = crate::reference::run_layer(&cfg, &w, &tables.rope, &x, sched)?;
    let opt = backend.run_layer(&tables.ctx(&cfg, &w, sched, Active::NONE), &x)?;
    let ctx = compare::Ctx {
        layer,
        elementwise: true,
        sched,
        block_table: &tables.block_table,
        provided: backend.provides(),
    };
    let local = compare::local::compute(
        &compare::local::Inputs {
            weights: &w,
            frame: compare::local::Frame {
                cfg: &cfg,
                rope: &tables.rope,
                sched,
                x: &x,
                dtype,
                provided: ctx.provided,
                judging: &backend.judging(),
            },
        },
        &opt,
    );
    let mut rows = Vec::new();
    for check in checks_for(sched) {
        if !ctx.provided.contains(check.stage) {
            continue;
        }
        let (Some(r), Some(o), Some(l)) = (
            reference.get(check.stage),
            opt.get(check.stage),
            local.get(check.stage),
        ) else {
            continue;
        };
        let tol = tols.get(dtype, &check)?;
        let judged = |t: &StageTensor| -> Result<compare::CheckResult> {
            let mut c = compare::compare_check(&ctx, check, r, t, tol)?;
            compare::apply_local(&ctx, check, &mut c, t, l, false);
            Ok(c)
        };
        let span = check.rows(sched);
        let per: usize = o.shape[1..].iter().product();
        let (a, b) = (span.start * per, span.end * per);
        let clean = judged(o)?;
        let lr = clean.local.clone().expect("a local view");
        let store = lr.store;
        // Each element's noise: the model's σ, scaled to the measured clean error (a stage computed
        // exactly, the cache, gets one unit of its type's rounding instead).
        let sig: Vec<f64> = (a..b)
            .map(|i| (l.hidden_var[i] + store.round_var(o.data[i])).sqrt())
            .collect();
        let fit = if lr.predicted_rel_l2 > 0.0 && lr.rel_l2 > 0.0 {
            lr.rel_l2 / lr.predicted_rel_l2
        } else {
            1.0
        };
        let unit: Vec<f64> = sig
            .iter()
            .zip(&o.data[a..b])
            .map(|(&s, &y)| match s > 0.0 {
                true => s * fit,
                false => store.ulp(y) / 12f64.sqrt(),
            })
            .collect();
        let rms_unit = (unit.iter().map(|u| u * u).sum::<f64>() / unit.len().max(1) as f64).sqrt();
        let mut g = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5e5);
        let gauss: Vec<f64> = (a..b).map(|_| StandardNormal.sample(&mut g)).collect();
        let row = *o.shape.last().unwrap_or(&1);
        let last_row = (b - row.min(b - a))..b;
        let mut one_row = gauss[last_row.start - a..].to_vec();
        normalize_row(&mut one_row);
        let caught = |kind: Kind, k: f64| -> Result<bool> {
            let mut p: StageTensor = o.clone();
            for (n, i) in (a..b).enumerate() {
                let d = match kind {
                    Kind::Noise => k * unit[n] * gauss[n],
                    Kind::Bias => k * rms_unit,
                    Kind::OneRow if last_row.contains(&i) => {
                        k * unit[n] * one_row[i - last_row.start]
                    }
                    Kind::OneRow => 0.0,
                };
                p.data[i] = store.round(p.data[i] + d);
            }
            Ok(!judged(&p)?.pass)
        };
        let mut thresholds = [None; 3];
        for (t, kind) in thresholds.iter_mut().zip(Kind::ALL) {
            *t = match clean.pass {
                false => Some(0.0),
                true => threshold(|k| caught(kind, k))?,
            };
        }
        rows.push(Row {
            check: check.name(),
            clean_rel_l2: lr.rel_l2,
            predicted_rel_l2: lr.predicted_rel_l2,
            thresholds,
        });
    }
    Ok(rows)
}

/// Scale the one-row draw `g` to a mean square of 1, so that `one row` at k puts k × the noise on
/// that row whatever the draw: on a row of a few elements (an lse row is one token's heads, a
/// split_lse row its splits) the draw's own mean square spreads over 0.2–3 and the threshold with it
/// (the 4-head fixtures' last lse[decode] row drew ~0.15: 13.5–16× where the check catches ~5×).
fn normalize_row(g: &mut [f64]) {
    let ms = g.iter().map(|x| x * x).sum::<f64>() / g.len().max(1) as f64;
    if ms > 0.0 {
        g.iter_mut().for_each(|x| *x /= ms.sqrt());
    }
}

/// The smallest k ≥ 0 with `caught(k)`, to 2 %, for a `caught` monotone in k; `None` past 10⁶.
fn threshold(mut caught: impl FnMut(f64) -> Result<bool>) -> Result<Option<f64>> {
    let mut hi = 0.25;
    while !caught(hi)? {
        hi *= 2.0;
        if hi > 1e6 {
            return Ok(None);
        }
    }
    let mut lo = hi / 2.0;
    if hi == 0.25 {
        lo = 0.0;
    }
    while hi - lo > 0.02 * hi {
        let mid = (lo + hi) / 2.0;
        match caught(mid)? {
            true => hi = mid,
            false => lo = mid,
        }
    }
    Ok(Some(hi))
}

/// The table of one fixture: check, clean rel-L2, tolerance, thresholds.
pub fn table(name: &str, rows: &[Row]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    writeln!(
        s,
        "{name}\n  {:<22} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "check", "local", "predicted", "noise", "bias", "one row"
    )
    .unwrap();
    let cell = |t: Option<f64>| match t {
        None => "never".to_string(),
        Some(0.0) => "FAILS".to_string(),
        // Caught at any size: e.g. a purely relative elementwise bound on elements near zero.
        Some(v) if v < 0.01 => "<0.01".to_string(),
        Some(v) => format!("{v:.2}"),
    };
    for r in rows {
        writeln!(
            s,
            "  {:<22} {:>10.2e} {:>10.2e} {:>8} {:>8} {:>8}",
            r.check,
            r.clean_rel_l2,
            r.predicted_rel_l2,
            cell(r.thresholds[0]),
            cell(r.thresholds[1]),
            cell(r.thresholds[2])
        )
        .unwrap();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_row_draw_has_unit_mean_square() {
        let mut g = vec![0.3, -0.2, 0.1, 0.4];
        normalize_row(&mut g);
        let ms = g.iter().map(|x| x * x).sum::<f64>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-12, "{ms}");
        assert!(g[3] > g[0] && g[1] < 0.0);
    }

    #[test]
    fn threshold_finds_the_step_of_a_monotone_predicate() {
        for step in [0.003, 0.3, 1.7, 7.0, 123.0] {
            let t = threshold(|k| Ok(k >= step)).unwrap().unwrap();
            assert!(t >= step && t <= step * 1.03 + 1e-3, "{step}: {t}");
        }
        assert_eq!(threshold(|_| Ok(false)).unwrap(), None);
    }
}
