//! The baseline gate: fail when any layer × check metric got worse than a previous report by more than a
//! factor, even while still under the absolute tolerance ("layer 17 attn_out got 30× worse").
//!
//! Compared metrics: rel-L2 and max |diff|. Values below a noise floor (`FLOOR` × the tolerance's
//! rel-L2 for rel-L2; `FLOOR` × the reference RMS for max |diff|) are lifted to it first, so that a
//! baseline of exactly 0 does not turn any rounding into an infinite regression.
//!
//! A baseline only means something for the same problem: the same file (base name and size, so that a
//! checkout elsewhere still matches), architecture, storage dtype, schedule, inputs and tolerances, and
//! some layer in common. [`Identity`] is that; a mismatch is refused unless the user asks to compare
//! across it. The backend, its kernels and planted faults are not part of it: they are what the gate
//! measures (a CUDA run held against a CPU-mirror baseline asks "is the kernel as accurate as the
//! mirror?", and both are measured against the same fp64 reference).

use super::Report;
use crate::tolerance::Tolerance;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
    /// Identity differences the user accepted with `--allow-baseline-mismatch` (empty: same problem).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub across: Vec<String>,
}

/// What a run compared: a baseline must match it (see the module's documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    pub file: String,
    pub size: u64,
    pub architecture: String,
    pub dtype: String,
    pub schedule: serde_json::Value,
    pub input: serde_json::Value,
    pub layers: Vec<usize>,
    /// Check name → tolerance, for the checks the run compares.
    pub tolerances: BTreeMap<String, Tolerance>,
}

/// An `--hidden` capture is identified by its base name, like the GGUF file.
fn input_identity(input: &serde_json::Value) -> serde_json::Value {
    let mut v = input.clone();
    if let Some(p) = v.get("path").and_then(|p| p.as_str()) {
        let base = std::path::Path::new(p)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.to_string());
        v["path"] = serde_json::Value::String(base);
    }
    v
}

/// A run's schedule as its identity: the schedule, or with a split (`crate::schedule::Split`) the
/// covering schedule and the split (which layers ran which), so that a baseline of another split is
/// another problem.
pub fn schedule_identity(
    s: &crate::schedule::Schedule,
    split: Option<&crate::schedule::Split>,
) -> serde_json::Value {
    let s = serde_json::to_value(s).expect("schedule serialises");
    match split {
        None => s,
        Some(sp) => serde_json::json!({ "covering": s, "split": sp }),
    }
}

impl Identity {
    pub fn of(r: &Report) -> Identity {
        let mut tolerances = BTreeMap::new();
        for m in &r.modes {
            for l in &m.layers {
                for c in &l.checks {
                    tolerances.entry(c.check.clone()).or_insert(c.tolerance);
                }
            }
        }
        Identity {
            file: r.file.base_name(),
            size: r.file.size,
            architecture: r.file.architecture.clone(),
            dtype: r.run.dtype.clone(),
            schedule: schedule_identity(&r.run.schedule, r.run.split.as_ref()),
            input: r.run.input.clone(),
            layers: r.run.layers.clone(),
            tolerances,
        }
    }

    /// Every way `base` differs from `self`, one line each (empty: the same problem).
    pub fn differences(&self, base: &Identity) -> Vec<String> {
        let mut d = Vec::new();
        if (&self.file, self.size) != (&base.file, base.size) {
            d.push(format!(
                "file {} ({} bytes) vs baseline {} ({} bytes)",
                self.file, self.size, base.file, base.size
            ));
        }
        for (what, now, then) in [
            ("architecture", &self.architecture, &base.architecture),
            ("dtype", &self.dtype, &base.dtype),
        ] {
            if now != then {
                d.push(format!("{what} {now} vs baseline {then}"));
            }
        }
        // Inputs are compared by file base name, whichever side built the identity (a planned run or a
        // report), so a capture in another checkout is the same input.
        let (input, base_input) = (input_identity(&self.input), input_identity(&base.input));
        for (what, now, then) in [
            ("schedule", &self.schedule, &base.schedule),
            ("input", &input, &base_input),
        ] {
            if now != then {
                d.push(format!("{what}{}", value_diff(now, then)));
            }
        }
        if !self.layers.iter().any(|l| base.layers.contains(l)) {
            d.push(format!(
                "layers {:?} vs baseline {:?}: none in common",
                self.layers, base.layers
            ));
        }
        let changed: Vec<String> = self
            .tolerances
            .iter()
            .filter_map(|(k, t)| {
                let b = base.tolerances.get(k)?;
                (t != b).then(|| {
                    format!(
                        "{k} (rel_l2 {:e}/{:e}, atol_rms {:e}/{:e}, rtol {:e}/{:e})",
                        t.rel_l2, b.rel_l2, t.atol_rms, b.atol_rms, t.rtol, b.rtol
                    )
                })
            })
            .collect();
        if !changed.is_empty() {
            d.push(format!(
                "tolerances of {} (this run/baseline)",
                changed.join(", ")
            ));
        }
        d
    }
}

/// ` key a vs baseline b, ...` for the top-level keys of two JSON objects that differ.
fn value_diff(now: &serde_json::Value, then: &serde_json::Value) -> String {
    let (Some(a), Some(b)) = (now.as_object(), then.as_object()) else {
        return format!(" {now} vs baseline {then}");
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let null = serde_json::Value::Null;
    let parts: Vec<String> = keys
        .into_iter()
        .filter_map(|k| {
            let (x, y) = (a.get(k).unwrap_or(&null), b.get(k).unwrap_or(&null));
            (x != y).then(|| format!("{k} {x} vs baseline {y}"))
        })
        .collect();
    format!(" {}", parts.join(", "))
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
        across: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(input: serde_json::Value) -> Identity {
        Identity {
            file: "m.gguf".into(),
            size: 1,
            architecture: "deepseek2".into(),
            dtype: "bf16".into(),
            schedule: serde_json::json!({}),
            input,
            layers: vec![0],
            tolerances: BTreeMap::new(),
        }
    }

    /// A planned run holds the capture's path as given; a report of the same run made in another
    /// checkout holds another directory: the same input. Another file name is not.
    #[test]
    fn captures_compare_by_base_name() {
        let npy = |p: &str| serde_json::json!({ "kind": "npy", "path": p });
        let planned = ident(npy("/work/ci/caps/x.npy"));
        assert!(planned
            .differences(&ident(npy("/home/me/caps/x.npy")))
            .is_empty());
        assert!(planned.differences(&ident(npy("x.npy"))).is_empty());
        let d = planned.differences(&ident(npy("/work/ci/caps/y.npy")));
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].starts_with("input"), "{d:?}");
    }
}
