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

use super::checks::{short_name, Check, Phase};
use crate::error::{Error, Result};
use crate::precision::Dtype;
use crate::tolerance::Tolerance;
use crate::trace::Stage;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The calibrated table: dtype name → check name → tolerance.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ToleranceTable {
    /// How the numbers were obtained (command, fixtures, margin).
    #[serde(default)]
    pub derived_from: String,
    #[serde(default)]
    pub margin: f64,
    pub dtypes: BTreeMap<String, BTreeMap<String, Tolerance>>,
    /// `dtype/check` keys the user set (`--tol`, `--tol-file`): their end-to-end criteria stay binding
    /// next to the stage-local view.
    #[serde(skip)]
    pub overridden: std::collections::BTreeSet<String>,
}

/// Tolerance overrides laid over the calibrated defaults: a tolerance file (the format of `mla-diff
/// calibrate`) and `STAGE=FIELD:X,...` entries for the run's dtype (`--tol-file`, `--tol`).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub file: Option<std::path::PathBuf>,
    pub entries: Vec<String>,
}

impl Overrides {
    /// The tolerance table for `dtype` and where it came from (for the report).
    pub fn table(&self, dtype: Dtype) -> Result<(ToleranceTable, String)> {
        ToleranceTable::with_overrides(dtype, self.file.as_deref(), &self.entries)
    }
}

const DEFAULTS_JSON: &str = include_str!("tolerances.json");

impl ToleranceTable {
    /// The compiled-in calibrated defaults.
    /// The report's source line of the table [`ToleranceTable::defaults`] gives.
    pub const DEFAULTS_SOURCE: &'static str = "defaults (calibrated, src/compare/tolerances.json)";

    pub fn defaults() -> ToleranceTable {
        serde_json::from_str(DEFAULTS_JSON).expect("src/compare/tolerances.json is valid")
    }

    /// The defaults, then a tolerance file's entries, then `--tol` overrides for `dtype`, in that order;
    /// with the line the report shows as the table's source.
    pub fn with_overrides(
        dtype: Dtype,
        file: Option<&std::path::Path>,
        tol: &[String],
    ) -> Result<(ToleranceTable, String)> {
        let mut table = ToleranceTable::defaults();
        let mut source = ToleranceTable::DEFAULTS_SOURCE.to_string();
        if let Some(p) = file {
            for (d, o) in ToleranceTable::overrides_from_file(p)? {
                table.apply(d, &o)?;
            }
            source = format!("defaults + {}", p.display());
        }
        for t in tol {
            table.apply(dtype, &ToleranceTable::parse_override(t)?)?;
        }
        if !tol.is_empty() {
            source.push_str(&format!(" + --tol {}", tol.join(" --tol ")));
        }
        Ok((table, source))
    }

    /// Read a tolerance file (the format `mla-diff calibrate` writes; `dtypes` is the only key needed):
    /// every entry goes through the same grammar as `--tol` (see [`Override`]).
    pub fn overrides_from_file(path: &std::path::Path) -> Result<Vec<(Dtype, Override)>> {
        let s = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read tolerance file {}", path.display()), e))?;
        let bad = |m: String| Error::Usage(format!("tolerance file {}: {m}", path.display()));
        let v: serde_json::Value =
            serde_json::from_str(&s).map_err(|e| bad(format!("not JSON: {e}")))?;
        let top = v
            .as_object()
            .ok_or_else(|| bad("expected an object with \"dtypes\"".into()))?;
        if let Some(k) = top
            .keys()
            .find(|k| !["dtypes", "derived_from", "margin"].contains(&k.as_str()))
        {
            return Err(bad(format!(
                "unknown key {k:?} (valid: dtypes, derived_from, margin)"
            )));
        }
        let dtypes = top
            .get("dtypes")
            .and_then(|d| d.as_object())
            .ok_or_else(|| bad("expected \"dtypes\": {DTYPE: {STAGE: {FIELD: VALUE}}}".into()))?;
        let mut out = Vec::new();
        for (d, entries) in dtypes {
            let dtype = DTYPES.into_iter().find(|x| x.name() == d).ok_or_else(|| {
                bad(format!(
                    "unknown dtype {d:?} (valid: {})",
                    DTYPES.map(|d| d.name()).join(", ")
                ))
            })?;
            let entries = entries
                .as_object()
                .ok_or_else(|| bad(format!("dtypes.{d}: expected {{STAGE: {{FIELD: VALUE}}}}")))?;
            for (key, fields) in entries {
                let fields = fields.as_object().ok_or_else(|| {
                    bad(format!(
                        "dtypes.{d}.{key}: expected {{FIELD: VALUE}} with FIELD one of {}",
                        FIELDS.join(", ")
                    ))
                })?;
                let mut o = Override::for_key(key).map_err(|m| bad(format!("dtypes.{d}: {m}")))?;
                for (f, val) in fields {
                    let x = val.as_f64().ok_or_else(|| {
                        bad(format!("dtypes.{d}.{key}.{f}: {val} is not a number"))
                    })?;
                    o.set(f, x)
                        .map_err(|m| bad(format!("dtypes.{d}.{key}: {m}")))?;
                }
                out.push((dtype, o));
            }
        }
        Ok(out)
    }

    /// Parse a command-line override `KEY=FIELD:X,FIELD:Y` (see [`Override`]).
    pub fn parse_override(spec: &str) -> Result<Override> {
        let bad = |m: String| {
            Error::Usage(format!(
                "--tol {spec:?}: {m} (form: STAGE=FIELD:VALUE,..., e.g. attn_out[decode]=rel_l2:0.02; fields: {})",
                FIELDS.join(", ")
            ))
        };
        let (key, vals) = spec
            .split_once('=')
            .ok_or_else(|| bad("missing '='".into()))?;
        let mut o = Override::for_key(key).map_err(bad)?;
        for kv in vals.split(',') {
            let (f, v) = kv
                .split_once(':')
                .ok_or_else(|| bad(format!("{kv:?} is not FIELD:VALUE")))?;
            let x: f64 = v
                .trim()
                .parse()
                .map_err(|_| bad(format!("{v:?} is not a number")))?;
            o.set(f.trim(), x).map_err(bad)?;
        }
        Ok(o)
    }

    /// Lay an override over the table for `dtype`: the fields it gives replace those of every check its
    /// key names; the other fields keep their values.
    pub fn apply(&mut self, dtype: Dtype, o: &Override) -> Result<()> {
        let table = self.dtypes.entry(dtype.name().to_string()).or_default();
        for c in &o.checks {
            let name = c.name();
            self.overridden.insert(format!("{}/{name}", dtype.name()));
            let t = match table.get(&name) {
                Some(t) => *t,
                None if o.rel_l2.is_some() && o.atol_rms.is_some() && o.rtol.is_some() => {
                    Tolerance {
                        rel_l2: 0.0,
                        atol_rms: 0.0,
                        rtol: 0.0,
                    }
                }
                None => {
                    return Err(Error::Usage(format!(
                    "tolerance {name} at {}: no value to lay a partial entry over; give all of {}",
                    dtype.name(),
                    FIELDS.join(", ")
                )))
                }
            };
            table.insert(
                name,
                Tolerance {
                    rel_l2: o.rel_l2.unwrap_or(t.rel_l2),
                    atol_rms: o.atol_rms.unwrap_or(t.atol_rms),
                    rtol: o.rtol.unwrap_or(t.rtol),
                },
            );
        }
        Ok(())
    }

    /// Whether the user set this check's tolerance (`--tol`, `--tol-file`).
    pub fn is_overridden(&self, dtype: Dtype, check: &Check) -> bool {
        self.overridden
            .contains(&format!("{}/{}", dtype.name(), check.name()))
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

const DTYPES: [Dtype; 3] = [Dtype::Bf16, Dtype::F16, Dtype::F32];

/// The fields of a tolerance entry, as `--tol` and `--tol-file` spell them.
pub const FIELDS: [&str; 3] = ["rel_l2", "atol_rms", "rtol"];

/// One tolerance entry of `--tol` or `--tol-file`: the checks its key names and the fields it sets.
///
/// The key is `STAGE` (every phase of it) or `STAGE[prefill]` / `STAGE[decode]`, with the stage's long
/// name (`attn_out`) or the table's short one (`out`, and `out.p` / `out.d` for the phases). Any subset
/// of the fields may be given; each value must be finite and ≥ 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub checks: Vec<Check>,
    pub rel_l2: Option<f64>,
    pub atol_rms: Option<f64>,
    pub rtol: Option<f64>,
}

/// What a key may be, for error messages.
fn valid_keys() -> String {
    let stages: Vec<String> = Stage::ALL
        .iter()
        .map(|&s| format!("{} ({})", s.name(), short_name(s)))
        .collect();
    let phased: Vec<&str> = Stage::ALL
        .iter()
        .filter(|s| s.info().phased)
        .map(|s| s.name())
        .collect();
    format!(
        "stages: {}; phases [prefill] / [decode] (or .p / .d) for {} only",
        stages.join(", "),
        phased.join(", ")
    )
}

impl Override {
    /// The checks a key names (fields still unset).
    pub fn for_key(key: &str) -> std::result::Result<Override, String> {
        let key = key.trim();
        let (stage, phase) = if let Some((s, rest)) = key.split_once('[') {
            let p = match rest {
                "prefill]" => Phase::Prefill,
                "decode]" => Phase::Decode,
                _ => return Err(format!("unknown phase in {key:?}; valid: {}", valid_keys())),
            };
            (s, Some(p))
        } else if let Some(s) = key.strip_suffix(".p") {
            (s, Some(Phase::Prefill))
        } else if let Some(s) = key.strip_suffix(".d") {
            (s, Some(Phase::Decode))
        } else {
            (key, None)
        };
        let stage = Stage::ALL
            .iter()
            .copied()
            .find(|&st| st.name() == stage || short_name(st) == stage)
            .ok_or_else(|| format!("unknown stage {stage:?}; valid: {}", valid_keys()))?;
        let phased = stage.info().phased;
        let checks = match (phased, phase) {
            (false, None) => vec![Check { stage, phase: None }],
            (false, Some(_)) => {
                return Err(format!(
                    "{key:?}: {} has no phases; valid: {}",
                    stage.name(),
                    valid_keys()
                ))
            }
            (true, Some(p)) => vec![Check {
                stage,
                phase: Some(p),
            }],
            (true, None) => [Phase::Prefill, Phase::Decode]
                .map(|p| Check {
                    stage,
                    phase: Some(p),
                })
                .to_vec(),
        };
        Ok(Override {
            checks,
            rel_l2: None,
            atol_rms: None,
            rtol: None,
        })
    }

    /// Set one field; negative, non-finite values and unknown fields are errors.
    pub fn set(&mut self, field: &str, value: f64) -> std::result::Result<(), String> {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!(
                "{field}: {value} is not valid: values must be finite and >= 0"
            ));
        }
        let slot = match field {
            "rel_l2" => &mut self.rel_l2,
            "atol_rms" => &mut self.atol_rms,
            "rtol" => &mut self.rtol,
            _ => {
                return Err(format!(
                    "unknown field {field:?}; valid: {}",
                    FIELDS.join(", ")
                ))
            }
        };
        *slot = Some(value);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(t: &ToleranceTable, d: Dtype, c: &str) -> Tolerance {
        t.get(d, &Check::parse(c).unwrap()).unwrap()
    }

    #[test]
    fn key_without_phase_covers_both_phases() {
        let mut t = ToleranceTable::defaults();
        let before = get(&t, Dtype::Bf16, "attn_out[decode]");
        t.apply(
            Dtype::Bf16,
            &ToleranceTable::parse_override("attn_out=rel_l2:0.5").unwrap(),
        )
        .unwrap();
        for c in ["attn_out[prefill]", "attn_out[decode]"] {
            assert_eq!(get(&t, Dtype::Bf16, c).rel_l2, 0.5, "{c}");
        }
        // A partial entry keeps the other fields.
        let after = get(&t, Dtype::Bf16, "attn_out[decode]");
        assert_eq!((after.atol_rms, after.rtol), (before.atol_rms, before.rtol));
    }

    #[test]
    fn short_names_as_the_table_prints_them() {
        for (short, long) in [
            ("out.d", "attn_out[decode]"),
            ("heads.p", "attn_heads[prefill]"),
            ("latnt", "kv_latent"),
            ("splO", "split_out"),
        ] {
            let o = ToleranceTable::parse_override(&format!("{short}=rtol:1")).unwrap();
            assert_eq!(o.checks, vec![Check::parse(long).unwrap()], "{short}");
        }
    }

    #[test]
    fn bad_entries_list_what_is_valid() {
        for (spec, needle) in [
            ("bogus=rel_l2:1", "attn_out (out)"),
            ("q_nope[decode]=rel_l2:1", "has no phases"),
            ("attn_out[later]=rel_l2:1", "unknown phase"),
            ("attn_out=rel_l2:-1", "finite and >= 0"),
            ("attn_out=rel_l2:NaN", "finite and >= 0"),
            ("attn_out=rel_l2:inf", "finite and >= 0"),
            ("attn_out=atol:1", "valid: rel_l2, atol_rms, rtol"),
        ] {
            let e = ToleranceTable::parse_override(spec)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }

    /// The file's entries are laid first, `--tol` last (it wins), and the source line names both.
    #[test]
    fn overrides_in_order_with_their_source() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.json");
        std::fs::write(
            &p,
            r#"{"dtypes": {"bf16": {"attn_out": {"rel_l2": 0.25}, "q_nope": {"rtol": 3}}}}"#,
        )
        .unwrap();
        let tol = ["out=rel_l2:0.5".to_string()];
        let (t, source) = ToleranceTable::with_overrides(Dtype::Bf16, Some(&p), &tol).unwrap();
        assert_eq!(get(&t, Dtype::Bf16, "attn_out[decode]").rel_l2, 0.5);
        assert_eq!(get(&t, Dtype::Bf16, "q_nope").rtol, 3.0);
        assert_eq!(
            source,
            format!("defaults + {} + --tol out=rel_l2:0.5", p.display())
        );
        let (t, source) = ToleranceTable::with_overrides(Dtype::Bf16, None, &[]).unwrap();
        assert_eq!(
            get(&t, Dtype::Bf16, "q_nope"),
            get(&ToleranceTable::defaults(), Dtype::Bf16, "q_nope")
        );
        assert_eq!(source, "defaults (calibrated, src/compare/tolerances.json)");
    }
}
