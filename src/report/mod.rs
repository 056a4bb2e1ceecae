//! Reports of a run: the versioned JSON document (the source of truth; every other format is rendered
//! from it), a terminal table, JUnit XML, Markdown, an SVG heat map, `.npy` dumps, and the baseline gate.

pub mod baseline;
pub mod dsa;
pub mod junit;
pub mod markdown;
pub mod npy;
pub mod output;
pub mod outputs;
pub mod repeat;
pub mod svg;
pub mod table;
pub mod tp;

use crate::compare::{LayerResult, Verdict};
use crate::error::{Error, Result};
use crate::schedule::Schedule;
use serde::{Deserialize, Serialize};

/// Bumped on any breaking change of the JSON layout; `schema/report.schema.json` describes it.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolInfo {
    pub name: String,
    pub version: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    pub path: String,
    pub architecture: String,
    pub name: Option<String>,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub backend: String,
    pub dtype: String,
    pub modes: Vec<String>,
    pub layers: Vec<usize>,
    pub schedule: Schedule,
    /// How layer inputs were made: `{"kind": "random", "seed": 0}`, `{"kind": "tokens", ...}`, `{"kind": "npy", ...}`.
    pub input: serde_json::Value,
    pub tolerances: String,
    /// Faults planted in the optimized path (`--inject`); absent for a real run.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub injected: Vec<crate::faults::Injection>,
    /// Caveats of the run that every output format repeats (e.g. dense attention beyond a DSA top-k).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub notices: Vec<String>,
    /// `run --shard i/n`: this report is shard i of n of the run over `of` (`crate::shard`); absent
    /// for a whole run, and in what `mla-diff merge` writes.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub shard: Option<ShardInfo>,
    /// The layers that ran another schedule than `schedule` (issue #39, `crate::schedule::Split`):
    /// `schedule` is then the covering layers', and `coverage` its; absent when every layer ran
    /// `schedule`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub split: Option<crate::schedule::Split>,
}

/// What a shard's report records (`run.shard`): which shard it is, and the whole run's layers, so that
/// `merge` can tell a missing or overlapping shard from a complete set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub index: usize,
    pub count: usize,
    /// Every layer of the whole run, in order; this shard ran `run.layers`, its slice of them.
    pub of: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Environment {
    /// The optimized backend as it described itself.
    pub backend: String,
    pub gpu: Option<String>,
    pub crate_version: String,
    pub os: String,
    pub arch: String,
    /// Where the reference's and the stage-local view's fp64 products ran when not on the host
    /// ("cuBLAS DGEMM on NVIDIA H200"); absent: the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp64_products: Option<String>,
    /// `run --runner`: the runner as it described itself, the dtypes it returned and its command;
    /// absent without a runner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<crate::backend::runner::RunnerInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeResult {
    /// `shadow` (each layer gets the reference's input: local error) or `free` (each side feeds itself: drift).
    pub mode: String,
    pub verdict: Verdict,
    pub layers: Vec<LayerResult>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub schema_version: u32,
    pub tool: ToolInfo,
    pub file: FileInfo,
    pub config: serde_json::Value,
    pub run: RunInfo,
    pub environment: Environment,
    pub modes: Vec<ModeResult>,
    pub verdict: Verdict,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub baseline: Option<baseline::BaselineResult>,
    /// `run --repeat N`: the optimized path's runs compared bit for bit; absent without --repeat.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub repeat: Option<repeat::RepeatResult>,
    /// Which kernels ran and which of their boundary classes the schedule crossed (`crate::coverage`);
    /// absent in reports of mla-diff before #14.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub coverage: Option<crate::coverage::Coverage>,
    /// `run --tp N`: each tensor-parallel rank against the fp64 reference of its heads; absent without --tp.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tp: Option<tp::TpResult>,
    /// A DSA file past top_k: the selection checks (`crate::run::dsa`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dsa: Option<dsa::DsaResult>,
    /// `run --runner` with a decode or other op: the serving batch, padding, batch invariance, input
    /// mutation and merge consistency checks (`backend::runner::checks`); absent without a runner.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub runner_checks: Option<crate::backend::runner::checks::RunnerChecks>,
    /// Directories the run wrote `.npy` dumps into (printed, not part of the JSON: paths are local).
    #[serde(skip)]
    pub dumps: Vec<std::path::PathBuf>,
}

impl ModeResult {
    /// The checks of its layers as the columns of a layer × check table: their union in dataflow
    /// order, each after the checks it follows in a layer (layers of one kind have the same checks; a
    /// DeepSeek-V4 window layer lacks the compressed ones).
    pub fn columns(&self) -> Vec<&str> {
        let mut cols: Vec<&str> = Vec::new();
        for l in &self.layers {
            let mut at = 0;
            for c in &l.checks {
                match cols.iter().position(|x| *x == c.check) {
                    Some(i) => at = i + 1,
                    None => {
                        cols.insert(at, &c.check);
                        at += 1;
                    }
                }
            }
        }
        cols
    }
    /// Layer `l`'s check of column `col`, if it has one.
    pub fn cell<'a>(l: &'a LayerResult, col: &str) -> Option<&'a crate::compare::CheckResult> {
        l.checks.iter().find(|c| c.check == col)
    }
    /// The checks the backend did not provide (`LayerResult::not_provided`), each with the layers it
    /// was left out of, in check order.
    pub fn not_provided(&self) -> Vec<(String, Vec<usize>)> {
        let mut out: Vec<(String, Vec<usize>)> = Vec::new();
        for l in &self.layers {
            for c in &l.not_provided {
                match out.iter_mut().find(|(n, _)| n == c) {
                    Some((_, ls)) => ls.push(l.layer),
                    None => out.push((c.clone(), vec![l.layer])),
                }
            }
        }
        out
    }
}

/// The line every format prints under the schedule when the run's layers were split over two
/// schedules (`run.split`); `None` when they were not.
pub fn split_line(r: &Report) -> Option<String> {
    let sp = r.run.split.as_ref()?;
    let c = &sp.rest;
    Some(format!(
        "layers {} ran the schedule above (the coverage is theirs); layers {} ran the classic one: prompt {} in chunks of {}, {} decode steps x {} tokens, page {}, {} splits (--covering-layers)",
        crate::model::config::ranges(&sp.covering_layers),
        crate::model::config::ranges(&sp.rest_layers),
        c.prompt_len,
        c.chunk,
        c.decode_steps,
        c.q_len,
        c.page_size,
        c.num_splits
    ))
}

/// `0, 1, 2` for a list of layers.
pub fn layer_list(layers: &[usize]) -> String {
    let v: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
    v.join(", ")
}

impl FileInfo {
    /// The file's name without its directory: what reports show, so that they do not depend on where
    /// a checkout lives.
    pub fn base_name(&self) -> String {
        std::path::Path::new(&self.path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.clone())
    }
}

/// A check beside the modes that decides the verdict too (its `set_*` folds a failure into
/// `verdict`). Every renderer walks `Report::gates` and matches on this: a new gate is one variant here,
/// one line in `gates`, and an arm each renderer cannot forget.
pub enum Gate<'a> {
    /// `--baseline`: no metric more than the factor worse than the baseline report's.
    Baseline(&'a baseline::BaselineResult),
    /// `--repeat`: the optimized path's runs bit for bit identical.
    Repeat(&'a repeat::RepeatResult),
    /// `--runner`: the serving batch and input checks.
    RunnerChecks(&'a crate::backend::runner::checks::RunnerChecks),
    /// `--tp`: each tensor-parallel rank against the fp64 reference of its heads.
    Tp(&'a tp::TpResult),
    /// A DSA file past top_k: the selection checks.
    Dsa(&'a dsa::DsaResult),
}

impl Gate<'_> {
    pub fn pass(&self) -> bool {
        match self {
            Gate::Baseline(b) => b.pass,
            Gate::Repeat(r) => r.pass,
            Gate::RunnerChecks(r) => r.pass,
            Gate::Tp(t) => t.pass,
            Gate::Dsa(d) => d.pass,
        }
    }
}

impl Report {
    /// Overall pass: every mode passed, no baseline regression and no nondeterminism (the same as
    /// `verdict.pass` once set with [`Report::set_baseline`] and [`Report::set_repeat`]).
    pub fn pass(&self) -> bool {
        self.verdict.pass && self.gates().iter().all(Gate::pass)
    }
    /// The gates this run has, in the one order every renderer walks them.
    pub fn gates(&self) -> Vec<Gate<'_>> {
        let mut g = Vec::new();
        g.extend(self.baseline.as_ref().map(Gate::Baseline));
        g.extend(self.repeat.as_ref().map(Gate::Repeat));
        g.extend(self.runner_checks.as_ref().map(Gate::RunnerChecks));
        g.extend(self.tp.as_ref().map(Gate::Tp));
        g.extend(self.dsa.as_ref().map(Gate::Dsa));
        g
    }
    /// Record the baseline gate's result and fold it into the top-level verdict, so that the exit
    /// code, `verdict.pass`, JUnit and Markdown all say the same.
    pub fn set_baseline(&mut self, b: baseline::BaselineResult) {
        if !b.pass {
            self.fail_with(&b.message);
        }
        self.baseline = Some(b);
    }
    /// Record the repeat check (`--repeat`) and fold nondeterminism into the top-level verdict, as
    /// the baseline gate is.
    pub fn set_repeat(&mut self, r: repeat::RepeatResult) {
        if !r.pass {
            self.fail_with(&r.message);
        }
        self.repeat = Some(r);
    }
    /// Record the tensor-parallel ranks' own results (`--tp`) and fold a failing rank into the
    /// top-level verdict, as the baseline gate is.
    pub fn set_tp(&mut self, t: tp::TpResult) {
        if !t.pass {
            self.fail_with(&t.message);
        }
        self.tp = Some(t);
    }
    /// Record the DSA selection checks and fold a failing one into the top-level verdict, as the
    /// baseline gate is.
    pub fn set_dsa(&mut self, d: dsa::DsaResult) {
        if !d.pass {
            self.fail_with(&d.message);
        }
        self.dsa = Some(d);
    }
    /// Record a runner's batch and input checks and fold a failing one into the top-level verdict, as
    /// the baseline gate is.
    pub fn set_runner_checks(&mut self, r: crate::backend::runner::checks::RunnerChecks) {
        if !r.pass {
            self.fail_with(&r.message);
        }
        self.runner_checks = Some(r);
    }
    /// A failure beside the modes' verdict: first in the message when the modes passed, else after.
    fn fail_with(&mut self, message: &str) {
        let v = &mut self.verdict;
        v.message = if v.pass {
            format!("{message}; {}", v.message)
        } else {
            format!("{}; {message}", v.message)
        };
        v.reasons.push(message.to_string());
        v.pass = false;
    }
    /// The mode whose verdict decides the run (see [`Report::overall_verdict`]).
    pub fn decisive_mode(&self) -> Option<&str> {
        Self::decisive(&self.modes).map(|m| m.mode.as_str())
    }
    fn decisive(modes: &[ModeResult]) -> Option<&ModeResult> {
        modes.iter().find(|m| m.mode == "shadow").or(modes.first())
    }
    pub fn to_json(&self) -> String {
        outputs::pretty_json(self)
    }
    pub fn from_json_file(path: &std::path::Path) -> Result<Report> {
        let s = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read report {}", path.display()), e))?;
        let v: serde_json::Value = serde_json::from_str(&s)
            .map_err(|e| Error::Usage(format!("{}: not JSON: {e}", path.display())))?;
        match v.get("schema_version").and_then(|x| x.as_u64()) {
            Some(x) if x == SCHEMA_VERSION as u64 => {}
            other => {
                return Err(Error::Usage(format!(
                    "{}: report schema_version {:?}, this mla-diff reads version {SCHEMA_VERSION}",
                    path.display(),
                    other
                )))
            }
        }
        // From the text, not the Value: a Value's maps are sorted, and positions keep their axis order.
        serde_json::from_str(&s)
            .map_err(|e| Error::Usage(format!("{}: not an mla-diff report: {e}", path.display())))
    }
    /// The overall verdict. With shadow mode it decides: a layer's local error is the kernel's fault,
    /// while free-running drift grows with depth even for a correct kernel, so the layer where the drift
    /// crosses the tolerance is reported (in the free mode's own verdict) without failing the run.
    /// Free mode alone decides only when shadow mode was not run.
    pub fn overall_verdict(modes: &[ModeResult]) -> Verdict {
        let decisive = Self::decisive(modes);
        let mut v = decisive.map(|m| m.verdict.clone()).unwrap_or(Verdict {
            pass: false,
            first_layer: None,
            first_check: None,
            reasons: vec![],
            message: "no mode ran".into(),
        });
        if let Some(m) = decisive {
            v.message = format!("[{}] {}", m.mode, v.message);
        }
        for m in modes.iter().filter(|m| Some(m) != decisive.as_ref()) {
            match m.verdict.first_layer {
                Some(l) => v.message.push_str(&format!(
                    "; [{}] accumulated drift crosses the tolerance at layer {l} ({})",
                    m.mode,
                    m.verdict.first_check.as_deref().unwrap_or("?")
                )),
                None => v
                    .message
                    .push_str(&format!("; [{}] within tolerance", m.mode)),
            }
        }
        v
    }
}

/// Write text to a file with a clear error.
pub fn write_file(path: &std::path::Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents)
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}
