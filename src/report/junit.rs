//! JUnit XML: one test suite per mode, one test case per layer, and a `baseline` suite with one case for
//! the gate. Only what decides the verdict can fail: a layer of the deciding mode, or the gate. Drift in
//! free mode alongside shadow mode is informational (it grows with depth even for a correct kernel), so
//! its layers pass with the crossing noted in system-out: the failure count agrees with the exit code.
//! A check whose stage the backend does not provide is one skipped case per mode, naming its layers.
//! `--repeat` adds a `repeat` suite, one case per layer, failing where the runs differ.

use super::{Gate, Report};
use quick_junit::{NonSuccessKind, Report as JReport, TestCase, TestCaseStatus, TestSuite};

pub fn render(r: &Report) -> String {
    let file = r.file.base_name();
    let modes = r.modes.iter().map(|m| mode_suite(r, m, &file));
    let gates = r.gates().into_iter().map(|g| match g {
        Gate::Baseline(b) => baseline_suite(b, &file),
        Gate::Repeat(rep) => repeat_suite(rep, &file),
        Gate::RunnerChecks(rc) => runner_suite(rc, &file),
        Gate::Tp(t) => tp_suite(t, &file),
        Gate::Dsa(d) => dsa_suite(d, &file),
    });
    xml(modes.chain(gates))
}

/// The JUnit XML of a verdict document's suites (a run's, a sweep's).
pub fn xml(suites: impl IntoIterator<Item = TestSuite>) -> String {
    let mut report = JReport::new("mla-diff");
    for s in suites {
        report.add_test_suite(s);
    }
    report.to_string().expect("junit serialises")
}

/// The run's notices as a suite's properties (every suite of a run, a sweep).
pub fn add_notices(suite: &mut TestSuite, notices: &[String]) {
    for n in notices {
        suite.add_property(quick_junit::Property::new("mla-diff.notice", n.as_str()));
    }
}

/// A failing case's status with its message.
pub fn failure(message: String) -> TestCaseStatus {
    let mut s = TestCaseStatus::non_success(NonSuccessKind::Failure);
    s.set_message(message);
    s
}

/// One mode: a case per layer (failing only in the deciding mode), a skipped case per check the
/// backend does not provide; the run's notices and coverage as properties.
fn mode_suite(r: &Report, m: &super::ModeResult, file: &str) -> TestSuite {
    let decisive = r.decisive_mode();
    let mut suite = TestSuite::new(format!("{file} {} {}", m.mode, r.run.dtype));
    add_notices(&mut suite, &r.run.notices);
    if let Some(c) = &r.coverage {
        add_coverage(&mut suite, c);
    }
    let decides = decisive == Some(m.mode.as_str());
    for l in &m.layers {
        let failing = l.checks.iter().find(|c| !c.pass);
        let mut note = None;
        let status = match failing {
            None => TestCaseStatus::success(),
            Some(c) if !decides => {
                note = Some(format!(
                    "informational ({} mode decides): drift crosses the tolerance at {}: {}",
                    decisive.unwrap_or("?"),
                    c.check,
                    c.reasons.join("; ")
                ));
                TestCaseStatus::success()
            }
            Some(c) => {
                let mut s = failure(format!("layer {} diverges at {}", l.layer, c.check));
                s.set_description(c.reasons.join("\n"));
                s
            }
        };
        let mut tc = TestCase::new(format!("layer {}", l.layer), status);
        tc.set_classname(format!("mla-diff.{}", m.mode));
        if let Some(n) = note {
            tc.set_system_out(n);
        }
        suite.add_test_case(tc);
    }
    // A check the backend does not provide is skipped, not passed: visible in every CI view.
    for (check, layers) in m.not_provided() {
        let mut s = TestCaseStatus::skipped();
        s.set_message(format!(
            "not provided by the backend ({}): {check} not compared in layer(s) {}",
            r.environment.backend,
            super::layer_list(&layers)
        ));
        let mut tc = TestCase::new(format!("{check} (not provided)"), s);
        tc.set_classname(format!("mla-diff.{}", m.mode));
        suite.add_test_case(tc);
    }
    suite
}

fn baseline_suite(b: &super::baseline::BaselineResult, file: &str) -> TestSuite {
    let status = if b.pass {
        TestCaseStatus::success()
    } else {
        let mut s = failure(b.message.clone());
        s.set_description(b.regressions.join("\n"));
        s
    };
    let mut tc = TestCase::new("baseline gate", status);
    tc.set_classname("mla-diff.baseline");
    if !b.across.is_empty() {
        tc.set_system_out(format!(
            "compared across differences: {}",
            b.across.join("; ")
        ));
    }
    let mut suite = TestSuite::new(format!("{file} baseline"));
    suite.add_test_case(tc);
    suite
}

/// --repeat: one case per layer, failing where the optimized path's runs differ.
fn repeat_suite(rep: &super::repeat::RepeatResult, file: &str) -> TestSuite {
    let mut suite = TestSuite::new(format!("{file} repeat {}", rep.runs));
    for l in &rep.layers {
        let status = if l.identical {
            TestCaseStatus::success()
        } else {
            failure(format!(
                "layer {} nondeterministic over {} runs: {}",
                l.layer,
                rep.runs,
                l.differing
                    .iter()
                    .map(|d| d.stage.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        };
        let mut tc = TestCase::new(format!("layer {} repeat", l.layer), status);
        tc.set_classname("mla-diff.repeat");
        if !l.identical {
            let lines: Vec<String> = l
                .differing
                .iter()
                .map(|d| super::table::repeat_line(l.layer, d))
                .collect();
            tc.set_system_out(lines.join("\n"));
        }
        suite.add_test_case(tc);
    }
    suite
}

/// A runner's batch and input checks: one case each, failing where the check failed; a reported
/// figure (no verdict) passes with its line as output.
fn runner_suite(rc: &crate::backend::runner::checks::RunnerChecks, file: &str) -> TestSuite {
    use crate::backend::runner::checks::Status;
    let mut suite = TestSuite::new(format!("{file} runner checks"));
    for c in &rc.checks {
        let status = match c.status {
            Status::Fail => failure(c.line()),
            _ => TestCaseStatus::success(),
        };
        let at = c.layer.map(|l| format!("layer {l} ")).unwrap_or_default();
        let mut tc = TestCase::new(format!("{at}{} {}", c.check, c.what), status);
        tc.set_classname(format!("mla-diff.runner.{}", c.check));
        tc.set_system_out(c.line());
        suite.add_test_case(tc);
    }
    suite
}

/// --tp: one case per rank, failing where the rank diverges from the fp64 reference of its heads.
fn tp_suite(t: &super::tp::TpResult, file: &str) -> TestSuite {
    let mut suite = TestSuite::new(format!("{file} tp {}", t.size));
    for rk in &t.ranks {
        let status = if rk.verdict.pass {
            TestCaseStatus::success()
        } else {
            failure(rk.line(t.size))
        };
        let mut tc = TestCase::new(format!("tp rank {}", rk.rank), status);
        tc.set_classname("mla-diff.tp");
        suite.add_test_case(tc);
    }
    suite
}

/// DSA: one case per layer, failing where a selection (or the path over its own) fails.
fn dsa_suite(d: &super::dsa::DsaResult, file: &str) -> TestSuite {
    let mut suite = TestSuite::new(format!("{file} dsa top_k {}", d.top_k));
    suite.add_property(quick_junit::Property::new(
        "mla-diff.dsa.indexer",
        d.indexer.as_str(),
    ));
    for l in &d.layers {
        let status = if l.pass {
            TestCaseStatus::success()
        } else {
            failure(format!("layer {} DSA selection: {}", l.layer, l.failure()))
        };
        let mut tc = TestCase::new(format!("layer {} selection", l.layer), status);
        tc.set_classname("mla-diff.dsa");
        tc.set_system_out(l.line());
        suite.add_test_case(tc);
    }
    suite
}

/// The coverage section as suite properties: `mla-diff.coverage.kernel.PHASE` (the kernel),
/// `mla-diff.coverage.PHASE.CLASS` (its count, `unknown` without a geometry), `mla-diff.coverage.warning`.
fn add_coverage(suite: &mut TestSuite, c: &crate::coverage::Coverage) {
    use quick_junit::Property;
    for k in &c.kernels {
        suite.add_property(Property::new(
            format!("mla-diff.coverage.kernel.{}", k.phase.name()),
            k.describe(),
        ));
    }
    for cl in &c.classes {
        suite.add_property(Property::new(
            format!("mla-diff.coverage.{}.{}", cl.phase.name(), cl.class),
            cl.count.map_or("unknown".to_string(), |n| n.to_string()),
        ));
    }
    if let Some(d) = &c.dsa {
        suite.add_property(Property::new("mla-diff.coverage.dsa", d.line()));
    }
    for w in &c.warnings {
        suite.add_property(Property::new("mla-diff.coverage.warning", w.as_str()));
    }
}
