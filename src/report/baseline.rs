//! The baseline gate: fail when any layer × check metric got worse than a previous report by more than a
//! factor, even while still under the absolute tolerance ("layer 17 attn_out got 30× worse").
//!
//! Compared metrics: rel-L2 and max |diff|. Values below a noise floor (`FLOOR` × the tolerance's
//! rel-L2 for rel-L2; `FLOOR` × the reference RMS for max |diff|) are lifted to it first, so that a
//! baseline of exactly 0 does not turn any rounding into an infinite regression.

use super::Report;
use serde::{Deserialize, Serialize};

/// Default factor by which a metric may grow before the gate fails.
pub const DEFAULT_FACTOR: f64 = 2.0;
const FLOOR: f64 = 1e-3;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineResult {
    pub path: String,
    pub factor: f64,
    pub pass: bool,
    pub compared: usize,
    pub regressions: Vec<String>,
    pub message: String,
}

pub fn gate(current: &Report, base: &Report, path: &str, factor: f64) -> BaselineResult {
    let mut regressions = Vec::new();
    let mut compared = 0;
    for m in &current.modes {
        let Some(bm) = base.modes.iter().find(|b| b.mode == m.mode) else {
            continue;
        };
        for l in &m.layers {
            let Some(bl) = bm.layers.iter().find(|b| b.layer == l.layer) else {
                continue;
            };
            for c in &l.checks {
                let Some(bc) = bl.checks.iter().find(|b| b.check == c.check) else {
                    continue;
                };
                compared += 1;
                let floors = [FLOOR * c.tolerance.rel_l2, FLOOR * c.metrics.ref_rms];
                let pairs = [
                    ("rel-L2", c.metrics.rel_l2, bc.metrics.rel_l2),
                    ("max |diff|", c.metrics.max_abs, bc.metrics.max_abs),
                ];
                for ((name, now, before), floor) in pairs.into_iter().zip(floors) {
                    let (n, b) = (now.max(floor), before.max(floor));
                    // NaN never passes: a metric that became NaN is a regression.
                    if n.is_nan() || n > factor * b {
                        regressions.push(format!(
                            "[{}] layer {} {}: {name} {:.3e} vs baseline {:.3e} ({:.1}x worse, limit {factor}x)",
                            m.mode,
                            l.layer,
                            c.check,
                            now,
                            before,
                            n / b
                        ));
                    }
                }
            }
        }
    }
    let pass = regressions.is_empty() && compared > 0;
    let message = if compared == 0 {
        format!("BASELINE MISMATCH: {path} has no layer/check in common with this run")
    } else if pass {
        format!("baseline OK: {compared} layer x check metrics within {factor}x of {path}")
    } else {
        format!(
            "BASELINE REGRESSION: {} metrics more than {factor}x worse than {path}",
            regressions.len()
        )
    };
    BaselineResult {
        path: path.to_string(),
        factor,
        pass,
        compared,
        regressions,
        message,
    }
}
