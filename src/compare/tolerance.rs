//! Tolerances per optimized dtype and check, and how they are overridden.
//!
//! A check passes when (1) no non-finite value appears where the reference has a finite one (or vice
//! versa), (2) rel-L2 ≤ `rel_l2`, and (3) every element satisfies |o − r| ≤ `atol_rms`·rms(r) + `rtol`·|r|.
//! The absolute part is relative to the reference tensor's RMS so that one table serves models whose
//! activations differ in scale by orders of magnitude.
//!
//! The defaults are not guessed: `mla-diff calibrate` runs the CPU mirror on the shipped fixtures over a
//! set of schedules, measures the worst noise per dtype and check, multiplies it by a documented margin
//! and writes `tolerances.json`, which is compiled in.

use super::checks::Check;
use crate::backend::Dtype;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    pub rel_l2: f64,
    pub atol_rms: f64,
    pub rtol: f64,
}

/// The calibrated table: dtype name → check name → tolerance.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ToleranceTable {
    /// How the numbers were obtained (command, fixtures, margin).
    #[serde(default)]
    pub derived_from: String,
    #[serde(default)]
    pub margin: f64,
    pub dtypes: BTreeMap<String, BTreeMap<String, Tolerance>>,
}

const DEFAULTS_JSON: &str = include_str!("tolerances.json");

impl ToleranceTable {
    /// The compiled-in calibrated defaults.
    pub fn defaults() -> ToleranceTable {
        serde_json::from_str(DEFAULTS_JSON).expect("src/compare/tolerances.json is valid")
    }

    pub fn from_file(path: &std::path::Path) -> Result<ToleranceTable> {
        let s = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read tolerance file {}", path.display()), e))?;
        let t: ToleranceTable = serde_json::from_str(&s)
            .map_err(|e| Error::Usage(format!("tolerance file {}: {e}", path.display())))?;
        t.validate()?;
        Ok(t)
    }

    fn validate(&self) -> Result<()> {
        for (d, m) in &self.dtypes {
            for k in m.keys() {
                if Check::parse(k).is_none() {
                    return Err(Error::Usage(format!(
                        "tolerances for {d}: unknown check {k:?}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Overlay `other` on top of `self` (per dtype and check).
    pub fn merge(&mut self, other: &ToleranceTable) {
        for (d, m) in &other.dtypes {
            let e = self.dtypes.entry(d.clone()).or_default();
            for (k, t) in m {
                e.insert(k.clone(), *t);
            }
        }
    }

    /// Apply a command-line override `CHECK=rel_l2:X,atol_rms:Y,rtol:Z` (any subset) for `dtype`.
    /// `CHECK` may be a stage name (all its phases) or `stage[prefill]` / `stage[decode]`.
    pub fn apply_override(&mut self, dtype: Dtype, spec: &str) -> Result<()> {
        let bad = |m: String| {
            Error::Usage(format!(
                "--tol {spec:?}: {m} (form: STAGE=rel_l2:X,atol_rms:Y,rtol:Z)"
            ))
        };
        let (check, vals) = spec
            .split_once('=')
            .ok_or_else(|| bad("missing '='".into()))?;
        let stage_only = crate::trace::Stage::from_name(check);
        if stage_only.is_none() && Check::parse(check).is_none() {
            return Err(bad(format!("unknown stage {check:?}")));
        }
        let table = self.dtypes.entry(dtype.name().to_string()).or_default();
        let keys: Vec<String> = ["", "[prefill]", "[decode]"]
            .iter()
            .map(|s| format!("{check}{s}"))
            .filter(|k| Check::parse(k).is_some() && (k == check || stage_only.is_some()))
            .collect();
        for kv in vals.split(',') {
            let (k, v) = kv
                .split_once(':')
                .ok_or_else(|| bad(format!("{kv:?} is not KEY:VALUE")))?;
            let v: f64 = v
                .parse()
                .map_err(|_| bad(format!("{v:?} is not a number")))?;
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(format!("{v} must be a finite number ≥ 0")));
            }
            for key in &keys {
                let t = table.entry(key.clone()).or_insert(Tolerance {
                    rel_l2: 0.0,
                    atol_rms: 0.0,
                    rtol: 0.0,
                });
                match k {
                    "rel_l2" => t.rel_l2 = v,
                    "atol_rms" | "atol" => t.atol_rms = v,
                    "rtol" => t.rtol = v,
                    _ => return Err(bad(format!("unknown key {k:?}"))),
                }
            }
        }
        Ok(())
    }

    pub fn get(&self, dtype: Dtype, check: &Check) -> Result<Tolerance> {
        self.dtypes
            .get(dtype.name())
            .and_then(|m| m.get(&check.name()))
            .copied()
            .ok_or_else(|| {
                Error::Usage(format!(
                    "no tolerance for {} at {} (give one with --tol)",
                    check.name(),
                    dtype.name()
                ))
            })
    }
}
