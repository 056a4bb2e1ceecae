//! The sweep's terminal table, JUnit XML and Markdown, rendered from the `SweepReport` (the JSON is the
//! source of truth; these add nothing to it), and written by `report::outputs::Outputs` as a run's
//! report is ([`Document`]). The frame is the run report's (`report::markdown::heading` and `notices`,
//! `report::junit::xml`, `add_notices` and `failure`, `report::table::verdict_text`); the sections,
//! a length sweep's and a split sweep's, are the sweep's own.

use super::splits::SplitSweep;
use super::{LengthSweep, Outcome, SweepReport};
use crate::report::outputs::Document;
use crate::report::table::Style;
use crate::report::{junit as rjunit, markdown as rmd};
use quick_junit::{TestCase, TestCaseStatus, TestSuite};
use std::fmt::Write;

impl Document for SweepReport {
    fn terminal(&self, style: &Style, quiet: bool) -> String {
        match quiet {
            true => verdict_line(self, style),
            false => table(self, style),
        }
    }
    fn json(&self) -> String {
        self.to_json()
    }
    fn junit(&self) -> String {
        junit(self)
    }
    fn markdown(&self) -> String {
        markdown(self)
    }
}

/// Metric ÷ tolerance in a sweep's cells. (The run table prints 10 ≤ r < 100 without decimals and its
/// Markdown "non-finite" and every ratio with two: kept apart so both stay as they were.)
fn ratio(r: f64) -> String {
    if r.is_infinite() {
        "NaN".into()
    } else if r >= 100.0 {
        format!("{r:.0e}")
    } else {
        format!("{r:.2}")
    }
}

fn worst(o: &Outcome) -> (String, String) {
    match &o.worst {
        Some(w) => (ratio(w.ratio), format!("{} (layer {})", w.check, w.layer)),
        None => ("-".into(), "-".into()),
    }
}

/// What a failing run failed at: "layer 0 cache_rows".
fn failure(o: &Outcome) -> String {
    match (&o.first_layer, &o.first_check) {
        (Some(l), Some(c)) => format!("layer {l} {c}"),
        _ => "-".into(),
    }
}

fn origins(v: &[String]) -> String {
    match v {
        [] => String::new(),
        [one] => one.clone(),
        [first, rest @ ..] => format!("{first} (+{})", rest.len()),
    }
}

fn header(r: &SweepReport) -> String {
    let sc = &r.run.schedule;
    let what = match r.run.kind.as_str() {
        "lengths" => format!(
            "prompt = length - {} ({} decode steps x {} tokens)",
            sc.decode_tokens(),
            sc.decode_steps,
            sc.q_len
        ),
        _ => format!(
            "prompt {}, {} decode steps x {} tokens",
            sc.prompt_len, sc.decode_steps, sc.q_len
        ),
    };
    let splits = match r.run.kind.as_str() {
        "splits" => String::new(),
        _ => format!(", {} splits", sc.num_splits),
    };
    format!(
        "{what}, chunks of {}, page {}{splits}; layers {}",
        sc.chunk,
        sc.page_size,
        crate::report::layer_list(&r.run.layers)
    )
}

pub fn table(r: &SweepReport, style: &Style) -> String {
    let mut s = String::new();
    writeln!(
        s,
        "mla-diff {} sweep {}  {} ({})  backend {}  dtype {}",
        r.tool.version,
        r.run.kind,
        r.file.path,
        r.file.architecture,
        r.environment.backend,
        r.run.dtype
    )
    .ok();
    writeln!(s, "schedule: {}", header(r)).ok();
    for n in &r.run.notices {
        writeln!(s, "NOTICE: {n}").ok();
    }
    if let Some(ls) = &r.lengths {
        lengths_table(&mut s, ls, style);
    }
    if let Some(sp) = &r.splits {
        splits_tables(&mut s, sp, style);
    }
    writeln!(s).ok();
    s.push_str(&verdict_line(r, style));
    s
}

fn mark(pass: bool, style: &Style) -> String {
    if pass {
        style.green("PASS")
    } else {
        style.red("FAIL")
    }
}

/// A length sweep: the boundaries, a row per length run, the smallest failing length.
fn lengths_table(s: &mut String, ls: &LengthSweep, style: &Style) {
    let b: Vec<String> = ls.boundaries.iter().map(|b| b.to_string()).collect();
    writeln!(
        s,
        "boundaries: {}",
        if b.is_empty() {
            "none".into()
        } else {
            b.join(", ")
        }
    )
    .ok();
    writeln!(s, "cells: worst metric / tolerance (>= 1 fails)\n").ok();
    writeln!(
        s,
        "{:>7} {:>7} {:4} {:>6}  {:<28} {:<28} origin",
        "length", "prompt", "", "worst", "worst check", "first failure"
    )
    .ok();
    for p in &ls.points {
        let (w, wc) = worst(&p.outcome);
        writeln!(
            s,
            "{:>7} {:>7} {} {:>6}  {:<28} {:<28} {}",
            p.length,
            p.prompt_len,
            mark(p.outcome.pass, style),
            w,
            wc,
            failure(&p.outcome),
            origins(&p.origins)
        )
        .ok();
    }
    writeln!(s, "\n{}", smallest_line(ls)).ok();
}

/// A split sweep: each split count's run against fp64, then its decode outputs against the first
/// count's, a row per (count, layer) and a column per invariant check.
fn splits_tables(s: &mut String, sp: &SplitSweep, style: &Style) {
    writeln!(s, "\nruns against fp64:").ok();
    writeln!(
        s,
        "{:>7} {:4} {:>6}  {:<28} first failure",
        "splits", "", "worst", "worst check"
    )
    .ok();
    for run in &sp.runs {
        let (w, wc) = worst(&run.outcome);
        writeln!(
            s,
            "{:>7} {} {:>6}  {:<28} {}",
            run.num_splits,
            mark(run.outcome.pass, style),
            w,
            wc,
            failure(&run.outcome)
        )
        .ok();
    }
    writeln!(
        s,
        "\ndecode outputs against {} splits' (cells: metric / the check's tolerance):",
        sp.base
    )
    .ok();
    let checks: Vec<String> = super::splits::invariant_checks()
        .iter()
        .map(|c| c.name())
        .filter(|n| sp.comparisons.iter().any(|c| &c.check == n))
        .collect();
    let mut head = format!("{:>7} {:>5} ", "splits", "layer");
    for c in &checks {
        write!(head, "{c:>19} ").ok();
    }
    writeln!(s, "{head}").ok();
    let mut keys: Vec<(usize, usize)> = sp
        .comparisons
        .iter()
        .map(|c| (c.num_splits, c.layer))
        .collect();
    keys.dedup();
    for (n, l) in keys {
        let mut row = format!("{n:>7} {l:>5} ");
        for name in &checks {
            match sp
                .comparisons
                .iter()
                .find(|c| c.num_splits == n && c.layer == l && &c.check == name)
            {
                Some(c) => {
                    let txt = format!("{:>18}{}", ratio(c.ratio), if c.pass { ' ' } else { '!' });
                    row.push_str(&if c.pass { txt } else { style.red(&txt) });
                    row.push(' ');
                }
                None => write!(row, "{:>19} ", "-").unwrap_or(()),
            }
        }
        writeln!(s, "{row}").ok();
    }
}

/// The smallest failing length and how it was found.
fn smallest_line(ls: &LengthSweep) -> String {
    match (ls.smallest_failing, &ls.bisection) {
        (None, _) => "no failing length".into(),
        (Some(l), Some(b)) => format!(
            "smallest failing length: {l} (bisected between {} passing and {} failing in {} runs)",
            b.pass,
            b.fail,
            b.probes.len()
        ),
        (Some(l), None) => {
            let below = ls
                .points
                .iter()
                .filter(|p| p.length < l)
                .map(|p| p.length)
                .max();
            match below {
                Some(p) if p + 1 == l => {
                    format!("smallest failing length: {l} ({p} passes)")
                }
                _ => format!(
                    "smallest failing length: {l} (the first length tried: lengths below it were not run)"
                ),
            }
        }
    }
}

/// The verdict, one line (all that `-q` prints).
pub fn verdict_line(r: &SweepReport, style: &Style) -> String {
    let m = format!("[sweep {}] {}", r.run.kind, r.verdict.message);
    crate::report::table::verdict_text(r.pass(), &m, style)
}

fn case(name: String, class: &str, o: &Outcome, what: &str, note: Option<String>) -> TestCase {
    let status = if o.pass {
        TestCaseStatus::success()
    } else {
        let mut s = rjunit::failure(format!("{what} diverges at {}", failure(o)));
        s.set_description(o.reasons.join("\n"));
        s
    };
    let mut tc = TestCase::new(name, status);
    tc.set_classname(class);
    let worst = o.worst.as_ref().map(|w| {
        format!(
            "worst: {} at layer {}, metric / tolerance {}",
            w.check,
            w.layer,
            ratio(w.ratio)
        )
    });
    let out: Vec<String> = worst.into_iter().chain(note).collect();
    if !out.is_empty() {
        tc.set_system_out(out.join("\n"));
    }
    tc
}

/// JUnit: one case per length (lengths), or one per split count against fp64 and one per count against
/// the base count (splits).
pub fn junit(r: &SweepReport) -> String {
    let mut suites = Vec::new();
    let file = r.file.base_name();
    if let Some(ls) = &r.lengths {
        let mut suite = TestSuite::new(format!("{file} sweep lengths {}", r.run.dtype));
        rjunit::add_notices(&mut suite, &r.run.notices);
        for p in &ls.points {
            suite.add_test_case(case(
                format!("length {}", p.length),
                "mla-diff.sweep.lengths",
                &p.outcome,
                &format!("length {}", p.length),
                Some(format!("origins: {}", p.origins.join(", "))),
            ));
        }
        suites.push(suite);
    }
    if let Some(sp) = &r.splits {
        let mut suite = TestSuite::new(format!("{file} sweep splits {}", r.run.dtype));
        rjunit::add_notices(&mut suite, &r.run.notices);
        for run in &sp.runs {
            suite.add_test_case(case(
                format!("splits {}", run.num_splits),
                "mla-diff.sweep.splits",
                &run.outcome,
                &format!("{} splits", run.num_splits),
                None,
            ));
        }
        for &n in sp.counts.iter().skip(1) {
            let mine: Vec<_> = sp
                .comparisons
                .iter()
                .filter(|c| c.num_splits == n)
                .collect();
            let status = match mine.iter().find(|c| !c.pass) {
                None => TestCaseStatus::success(),
                Some(c) => {
                    let mut s = rjunit::failure(format!(
                        "{n} splits differ from {} splits at layer {} {}",
                        sp.base, c.layer, c.check
                    ));
                    s.set_description(c.reasons.join("\n"));
                    s
                }
            };
            let mut tc = TestCase::new(format!("splits {n} vs {}", sp.base), status);
            tc.set_classname("mla-diff.sweep.split_invariance");
            suite.add_test_case(tc);
        }
        suites.push(suite);
    }
    rjunit::xml(suites)
}

/// Markdown for a pull-request comment: the verdict and a summary table.
pub fn markdown(r: &SweepReport) -> String {
    let mut s = String::new();
    let what = format!("mla-diff sweep {}", r.run.kind);
    let run = [r.run.backend.as_str(), r.run.dtype.as_str()];
    rmd::heading(&mut s, &what, r.pass(), &r.file, run, &r.verdict.message);
    rmd::notices(&mut s, &r.run.notices);
    writeln!(
        s,
        "Schedule: {}. Worst: largest metric ÷ tolerance (≥ 1 fails).\n",
        header(r)
    )
    .ok();
    let cell = |o: &Outcome| {
        let w = worst(o);
        if o.pass {
            w.0
        } else {
            format!("❌ {}", w.0)
        }
    };
    if let Some(ls) = &r.lengths {
        writeln!(s, "{}\n", smallest_line(ls)).ok();
        writeln!(
            s,
            "| length | prompt | worst | worst check | first failure | origin |"
        )
        .ok();
        writeln!(s, "|---|---|---|---|---|---|").ok();
        for p in &ls.points {
            writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                p.length,
                p.prompt_len,
                cell(&p.outcome),
                worst(&p.outcome).1,
                failure(&p.outcome),
                p.origins.join(", ")
            )
            .ok();
        }
    }
    if let Some(sp) = &r.splits {
        writeln!(s, "| splits | against fp64: worst | worst check | first failure | against {} splits: worst | first failure |", sp.base).ok();
        writeln!(s, "|---|---|---|---|---|---|").ok();
        for run in &sp.runs {
            let mine: Vec<_> = sp
                .comparisons
                .iter()
                .filter(|c| c.num_splits == run.num_splits)
                .collect();
            let (inv, inv_fail) = if run.num_splits == sp.base {
                ("base".to_string(), "-".to_string())
            } else {
                let w = mine.iter().map(|c| c.ratio).fold(0.0, f64::max);
                let bad = mine.iter().find(|c| !c.pass);
                (
                    if bad.is_some() {
                        format!("❌ {}", ratio(w))
                    } else {
                        ratio(w)
                    },
                    bad.map(|c| format!("layer {} {}", c.layer, c.check))
                        .unwrap_or_else(|| "-".into()),
                )
            };
            writeln!(
                s,
                "| {} | {} | {} | {} | {inv} | {inv_fail} |",
                run.num_splits,
                cell(&run.outcome),
                worst(&run.outcome).1,
                failure(&run.outcome)
            )
            .ok();
        }
    }
    s
}
