//! `mla-diff merge`: the reports of a run's shards (`run --shard i/n`, `crate::shard`) joined into the
//! report the whole run writes, byte for byte: the layers of every mode in order, and the verdicts
//! recomputed from them by the functions the run itself uses.
//!
//! Reports are merged only when they are shards of one run: the same problem (file, architecture,
//! backend, dtype, schedule, inputs, modes, tolerances, planted faults, environment — everything but the
//! layer results), the same shard count and layer list, every shard once and each with exactly its
//! slice of the layers. Anything else is refused with the difference named.

use crate::compare;
use crate::error::{Error, Result};
use crate::report::repeat::RepeatResult;
use crate::report::{ModeResult, Report, ShardInfo};
use crate::shard::Shard;
use crate::tolerance::Tolerance;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Merge the shard reports (each with the path it was read from, for the errors) into one run's report.
pub fn merge(reports: Vec<(PathBuf, Report)>) -> Result<Report> {
    if reports.is_empty() {
        return Err(Error::Usage("merge: no report given".into()));
    }
    let mut shards: Vec<(PathBuf, ShardInfo, Report)> = Vec::new();
    for (p, r) in reports {
        let Some(s) = r.run.shard.clone() else {
            return Err(Error::Usage(format!(
                "{}: not a shard's report (no run.shard): merge joins the reports of `run --shard i/n`",
                p.display()
            )));
        };
        if r.baseline.is_some() {
            return Err(Error::Usage(format!(
                "{}: a shard's report with a baseline gate cannot be merged (each shard was gated on its own layers); run the shards without --baseline",
                p.display()
            )));
        }
        shards.push((p, s, r));
    }
    let (p0, s0, r0) = &shards[0];
    let frame0 = frame(r0);
    let tol0 = tolerances(r0);
    for (p, s, r) in &shards[1..] {
        if (s.count, &s.of) != (s0.count, &s0.of) {
            return Err(Error::Usage(format!(
                "{} and {} are shards of different runs: {} shards of layers [{}] vs {} shards of layers [{}]",
                p0.display(),
                p.display(),
                s0.count,
                crate::report::layer_list(&s0.of),
                s.count,
                crate::report::layer_list(&s.of)
            )));
        }
        let diffs = differences(&frame0, &frame(r), "");
        if !diffs.is_empty() {
            return Err(Error::Usage(format!(
                "{} and {} are reports of different problems: they differ in {}",
                p0.display(),
                p.display(),
                diffs.join(", ")
            )));
        }
        for (check, t) in tolerances(r) {
            if let Some(t0) = tol0.get(&check).filter(|t0| **t0 != t) {
                return Err(Error::Usage(format!(
                    "{} and {} are reports of different problems: the tolerance of {check} is {t0:?} vs {t:?}",
                    p0.display(),
                    p.display()
                )));
            }
        }
    }
    // Every shard once, each with its own slice of the layers.
    let count = s0.count;
    let mut by_index: Vec<Option<(PathBuf, Report)>> = vec![None; count];
    for (p, s, r) in shards {
        if s.index >= count {
            return Err(Error::Usage(format!(
                "{}: shard index {} of {count} shards",
                p.display(),
                s.index
            )));
        }
        let want = &s.of[Shard {
            index: s.index,
            count,
        }
        .range(s.of.len(), "layers")?];
        if r.run.layers != want {
            return Err(Error::Usage(format!(
                "{}: shard {}/{count} ran layers [{}], but its slice of layers [{}] is [{}]",
                p.display(),
                s.index,
                crate::report::layer_list(&r.run.layers),
                crate::report::layer_list(&s.of),
                crate::report::layer_list(want)
            )));
        }
        if let Some((q, _)) = &by_index[s.index] {
            return Err(Error::Usage(format!(
                "overlapping shards: {} and {} are both shard {}/{count}",
                q.display(),
                p.display(),
                s.index
            )));
        }
        by_index[s.index] = Some((p, r));
    }
    let missing: Vec<String> = (0..count)
        .filter(|&i| by_index[i].is_none())
        .map(|i| format!("{i}/{count}"))
        .collect();
    if !missing.is_empty() {
        return Err(Error::Usage(format!(
            "missing shards: {} (every shard 0..{count} is needed)",
            missing.join(", ")
        )));
    }
    let parts: Vec<Report> = by_index.into_iter().flatten().map(|(_, r)| r).collect();
    Ok(join(parts))
}

/// The shards, in order, as one report: what `run::run` builds from the same layer results (also the
/// two passes of a split run, `run/split.rs`, joined).
pub fn join(parts: Vec<Report>) -> Report {
    let mut out = parts[0].clone();
    out.run.layers = parts.iter().flat_map(|r| r.run.layers.clone()).collect();
    out.run.shard = None;
    out.modes = out
        .modes
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let layers: Vec<_> = parts
                .iter()
                .flat_map(|r| r.modes[i].layers.clone())
                .collect();
            ModeResult {
                mode: m.mode.clone(),
                verdict: compare::verdict(&layers),
                layers,
            }
        })
        .collect();
    out.verdict = Report::overall_verdict(&out.modes);
    let repeat = out.repeat.take();
    if let Some(rp) = repeat {
        let layers = parts
            .iter()
            .flat_map(|r| {
                r.repeat
                    .as_ref()
                    .map(|x| x.layers.clone())
                    .unwrap_or_default()
            })
            .collect();
        out.set_repeat(RepeatResult::new(rp.runs, &rp.mode, layers));
    }
    // The runner's (or our own path's serving-batch) checks are per layer: each shard has its layers'.
    if let Some(rc) = out.runner_checks.take() {
        let rest = parts[1..].iter().filter_map(|r| r.runner_checks.clone());
        out.set_runner_checks(rc.joined(rest));
    }
    if let Some(tp) = out.tp.take() {
        let ranks = tp
            .ranks
            .iter()
            .enumerate()
            .map(|(i, rk)| {
                let layers = parts
                    .iter()
                    .flat_map(|r| {
                        r.tp.as_ref()
                            .map(|t| t.ranks[i].layers.clone())
                            .unwrap_or_default()
                    })
                    .collect();
                (rk.rank, rk.heads, layers)
            })
            .collect();
        out.set_tp(crate::report::tp::TpResult::new(
            tp.size,
            tp.fault_rank,
            ranks,
        ));
    }
    out
}

/// A report without what differs between the shards of one run (their layers, the results and verdicts
/// made of them): two shards of one run have equal frames.
fn frame(r: &Report) -> serde_json::Value {
    let mut f = r.clone();
    f.run.layers.clear();
    f.run.shard = None;
    for m in &mut f.modes {
        m.layers.clear();
        m.verdict = compare::verdict(&[]);
    }
    f.verdict = compare::verdict(&[]);
    if let Some(rp) = &mut f.repeat {
        *rp = RepeatResult::new(rp.runs, &rp.mode, vec![]);
    }
    if let Some(rc) = &mut f.runner_checks {
        rc.pass = true;
        rc.checks.clear();
        rc.message.clear();
    }
    if let Some(tp) = &mut f.tp {
        tp.pass = true;
        tp.message.clear();
        for r in &mut tp.ranks {
            r.layers.clear();
            r.verdict = compare::verdict(&[]);
        }
    }
    serde_json::to_value(&f).expect("report serialises")
}

/// Check name → tolerance, over every layer of the report.
fn tolerances(r: &Report) -> BTreeMap<String, Tolerance> {
    let mut out = BTreeMap::new();
    for l in r.modes.iter().flat_map(|m| &m.layers) {
        for c in &l.checks {
            out.entry(c.check.clone()).or_insert(c.tolerance);
        }
    }
    out
}

/// The paths (`run.schedule.chunk`) where two JSON values differ, at most six.
fn differences(a: &serde_json::Value, b: &serde_json::Value, at: &str) -> Vec<String> {
    use serde_json::Value;
    let mut out = Vec::new();
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => out.extend(differences(u, v, &p)),
                    _ => out.push(p),
                }
            }
        }
        _ if a != b => out.push(at.to_string()),
        _ => {}
    }
    out.truncate(6);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn differences_name_the_paths() {
        let a = json!({"run": {"dtype": "bf16", "schedule": {"chunk": 32, "page": 16}}, "x": 1});
        let b = json!({"run": {"dtype": "f32", "schedule": {"chunk": 64, "page": 16}}, "x": 1});
        assert_eq!(
            differences(&a, &b, ""),
            vec!["run.dtype", "run.schedule.chunk"]
        );
        assert!(differences(&a, &a, "").is_empty());
    }
}
