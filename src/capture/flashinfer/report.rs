//! The report of a dump (`mla-diff flashinfer DIR`): one line per call and the summary, as text,
//! JSON (`flashinfer_report_version`), JUnit and Markdown.

use super::dump::Order;
use crate::backend::runner::checks::{RunnerCheck, Status};
use serde::Serialize;
use std::collections::BTreeMap;

/// Status of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
    /// A feature the check does not model (fp8 cache, sparse, sinks…), or a call that did not return.
    NotChecked,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::NotChecked => "not checked",
        }
    }
}

/// One MLA call, judged.
#[derive(Debug, Clone, Serialize)]
pub struct CallReport {
    /// The call's folder in the dump.
    pub folder: String,
    pub function: String,
    /// `call_sequence` (the `callNNNN` of the folder).
    pub call: u64,
    pub pid: u64,
    /// A call captured in a CUDA graph: the replay snapshot (`graph_flushes/flush_<n>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<u64>,
    /// The plan a wrapper run was paired with (its folder).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// The shapes, lengths and scale of the call, in words.
    pub shapes: String,
    pub verdict: Verdict,
    /// `out` (and `lse` when returned) against fp64 from the call's inputs; `model` checks with
    /// `--model`.
    pub checks: Vec<RunnerCheck>,
    /// Why a call was not checked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl CallReport {
    /// The worst check: the first failing one, else the one with the largest value/bound.
    fn worst(&self) -> Option<&RunnerCheck> {
        self.checks
            .iter()
            .find(|c| c.status == Status::Fail)
            .or_else(|| {
                self.checks
                    .iter()
                    .filter_map(|c| Some((c, c.value? / c.bound.filter(|b| *b > 0.0)?)))
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .map(|(c, _)| c)
            })
    }

    /// `function #call (shapes): VERDICT worst rel-L2 … (bound …)`.
    pub fn line(&self) -> String {
        let tail = match (self.verdict, self.worst()) {
            (Verdict::NotChecked, _) => self.reason.clone().unwrap_or_default(),
            (_, Some(c)) => c.detail.clone(),
            (_, None) => String::new(),
        };
        format!(
            "{} #{}{} (pid {}): {}: {} — {}",
            self.function,
            self.call,
            self.replay
                .map(|n| format!(" replay {n}"))
                .unwrap_or_default(),
            self.pid,
            self.shapes,
            self.verdict.name(),
            tail
        )
    }
}

/// The report of a dump.
#[derive(Debug, Clone, Serialize)]
pub struct DumpReport {
    pub flashinfer_report_version: u32,
    pub dir: String,
    /// Where the call order came from (`session` or `timestamps`).
    pub order: Order,
    /// The model of `--model`, if given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub calls: Vec<CallReport>,
    /// Wrapper plans read (each paired with the runs after it).
    pub plans: usize,
    /// Calls of other functions, skipped, by function.
    pub skipped: BTreeMap<String, usize>,
    /// Every checked call passed, and at least one was checked.
    pub pass: bool,
    pub message: String,
}

impl DumpReport {
    pub fn exit_code(&self) -> i32 {
        match self.pass {
            true => 0,
            false => 1,
        }
    }

    /// One line per call, then the summary.
    pub fn text(&self) -> String {
        let mut s = String::new();
        for c in &self.calls {
            s.push_str(&c.line());
            s.push('\n');
        }
        s.push_str(&self.message);
        s.push('\n');
        s
    }

    pub fn json(&self) -> String {
        format!(
            "{}\n",
            serde_json::to_string_pretty(self).expect("the report serializes")
        )
    }

    /// JUnit XML: one suite, one case per call (a failure per failing call, skipped when not checked).
    pub fn junit(&self) -> String {
        use quick_junit::{NonSuccessKind, Report, TestCase, TestCaseStatus, TestSuite};
        let mut r = Report::new("mla-diff");
        let mut suite = TestSuite::new(format!("flashinfer {}", self.dir));
        for c in &self.calls {
            let mut status = match c.verdict {
                Verdict::Pass => TestCaseStatus::success(),
                Verdict::Fail => TestCaseStatus::non_success(NonSuccessKind::Failure),
                Verdict::NotChecked => TestCaseStatus::skipped(),
            };
            if c.verdict != Verdict::Pass {
                status.set_message(c.line());
            }
            let mut case = TestCase::new(format!("{} #{}", c.function, c.call), status);
            case.set_classname(c.folder.as_str());
            case.set_system_out(
                c.checks
                    .iter()
                    .map(RunnerCheck::line)
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
            suite.add_test_case(case);
        }
        r.add_test_suite(suite);
        r.to_string().expect("JUnit XML renders")
    }

    /// A Markdown summary: the verdict, then a table of the calls.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "## mla-diff: FlashInfer calls in `{}`\n\n**{}**\n\n",
            self.dir, self.message
        );
        s.push_str("| call | function | shapes | verdict | worst |\n|---|---|---|---|---|\n");
        for c in &self.calls {
            let worst = match (c.verdict, c.worst()) {
                (Verdict::NotChecked, _) => c.reason.clone().unwrap_or_default(),
                (_, Some(w)) => w.detail.clone(),
                _ => String::new(),
            };
            s.push_str(&format!(
                "| {} | `{}` | {} | {} | {} |\n",
                c.call,
                c.function,
                c.shapes,
                c.verdict.name(),
                worst.replace('|', "\\|")
            ));
        }
        s
    }
}
