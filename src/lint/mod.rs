//! `mla-diff lint FILE`: checks an MLA GGUF's metadata against its own tensors, against the conventions
//! the loader and the reference follow (docs/conventions.md) and the catalogue of known models; with
//! `--backend cuda`, which of our attention kernels take its dims; with `--runner CMD`, whether an
//! external kernel takes them and applies the conventions it must (softmax scale, LSE base, cache row
//! order, page addressing), probed through the runner protocol with tiny synthetic requests.
//!
//! Every finding is an error (the model would be computed wrongly, or a kernel would misread it), a
//! warning (unusual, possibly intended) or a note (the numbers the checks worked from). Exit code 1 when
//! there is an error, 0 otherwise; an unreadable file or a runner that cannot run is exit 2, like `run`.

pub mod kernel;
pub mod model;
pub mod runner;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::precision::Dtype;
use serde::Serialize;
use std::path::Path;

/// Version of the `--json` object; bumped when a field changes meaning or goes away.
pub const LINT_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The model would be computed wrongly, or a kernel or runner would misread it.
    Error,
    /// Unusual, possibly intended; worth a look.
    Warning,
    /// A number a check worked from (the softmax scale, the kernel chosen, a matching model).
    Note,
}

impl Severity {
    pub fn name(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Note => "note",
        }
    }
}

/// One finding: what was checked, what was found, what was expected, and why it matters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    /// The metadata key (`deepseek2.rope.dimension_count`), tensor (`blk.0.attn_kv_a_mqa.weight`) or
    /// derived quantity (`softmax_scale`, `kernel.decode`, `runner.decode.lse_base`) checked.
    pub check: String,
    pub found: String,
    /// What the check expected; `None` for a note.
    pub expected: Option<String>,
    pub why: String,
}

/// The findings of one lint, in the order they were made.
#[derive(Debug, Default, Clone)]
pub struct Findings(pub Vec<Finding>);

impl Findings {
    fn push(
        &mut self,
        severity: Severity,
        check: &str,
        found: String,
        expected: Option<String>,
        why: String,
    ) {
        self.0.push(Finding {
            severity,
            check: check.to_string(),
            found,
            expected,
            why,
        });
    }
    pub fn error(
        &mut self,
        check: &str,
        found: impl Into<String>,
        expected: impl Into<String>,
        why: impl Into<String>,
    ) {
        self.push(
            Severity::Error,
            check,
            found.into(),
            Some(expected.into()),
            why.into(),
        );
    }
    pub fn warning(
        &mut self,
        check: &str,
        found: impl Into<String>,
        expected: impl Into<String>,
        why: impl Into<String>,
    ) {
        self.push(
            Severity::Warning,
            check,
            found.into(),
            Some(expected.into()),
            why.into(),
        );
    }
    pub fn note(&mut self, check: &str, found: impl Into<String>, why: impl Into<String>) {
        self.push(Severity::Note, check, found.into(), None, why.into());
    }
    pub fn count(&self, s: Severity) -> usize {
        self.0.iter().filter(|f| f.severity == s).count()
    }
    /// Whether a finding of severity `s` names `check`.
    pub fn has(&self, s: Severity, check: &str) -> bool {
        self.0.iter().any(|f| f.severity == s && f.check == check)
    }
}

/// Which optimized path to check the dims against (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The CPU mirror: any dims, any page size.
    Cpu,
    /// The CUDA kernels, compiled for `arch`.
    Cuda,
}

/// What to lint against besides the file itself.
#[derive(Debug, Clone)]
pub struct Options {
    pub target: Option<Target>,
    /// NVRTC target of the CUDA plan (`sm_90a` on an H100/H200).
    pub arch: String,
    pub runner: Option<String>,
    /// The page size a run would use (`--page-size`, else the default schedule's).
    pub page_size: usize,
    /// Whether `--page-size` was given: if not, a run moves to a page the runner takes (not an error).
    pub page_size_given: bool,
    /// Query tokens per decode step (rows of a decode request: q_len × heads).
    pub q_len: usize,
    pub dtype: Dtype,
    /// The cache format a run would send the runner (`--kv-cache-dtype`): probe 8's scale convention.
    pub kv_format: crate::kv_format::KvFormat,
}

/// The `--json` object.
#[derive(Debug, Clone, Serialize)]
pub struct LintReport {
    pub lint_version: u32,
    pub file: String,
    pub errors: usize,
    pub warnings: usize,
    pub findings: Vec<Finding>,
}

impl LintReport {
    /// The runner cannot take this model (a `runner.supports.*` error): what `run` refuses with exit 2.
    pub fn unsupported(&self) -> bool {
        self.findings
            .iter()
            .any(|f| f.severity == Severity::Error && f.check.starts_with("runner.supports."))
    }

    /// 2 when the runner cannot take the model (unsupported, as `run` exits: this kernel cannot take
    /// this model), else 1 when any error was found (this kernel or file is wrong), else 0.
    pub fn exit_code(&self) -> i32 {
        if self.unsupported() {
            crate::error::EXIT_ERROR
        } else if self.errors > 0 {
            crate::error::EXIT_DIVERGENCE
        } else {
            crate::error::EXIT_PASS
        }
    }

    /// One line per finding: severity, check, found, expected, why; then a verdict line.
    pub fn text(&self) -> String {
        let mut s = format!("{}\n", self.file);
        for f in &self.findings {
            match &f.expected {
                Some(e) => s.push_str(&format!(
                    "{:<7}  {}: found {}; expected {} — {}\n",
                    f.severity.name(),
                    f.check,
                    f.found,
                    e,
                    f.why
                )),
                None => s.push_str(&format!(
                    "{:<7}  {}: {} — {}\n",
                    f.severity.name(),
                    f.check,
                    f.found,
                    f.why
                )),
            }
        }
        let plural = |n: usize, w: &str| format!("{n} {w}{}", if n == 1 { "" } else { "s" });
        s.push_str(&format!(
            "lint: {}, {} ({})\n",
            plural(self.errors, "error"),
            plural(self.warnings, "warning"),
            if self.unsupported() {
                "unsupported: the runner cannot take this model, exit 2 as in run"
            } else if self.errors > 0 {
                "diverges: see the errors"
            } else if self.warnings > 0 {
                "no errors"
            } else {
                "clean"
            }
        ));
        s
    }
}

/// Lint `path`. An unreadable file, a non-MLA architecture, or a runner that cannot be started or fails
/// a request is an `Err` (exit 2); everything the lint finds is in the report.
pub fn lint(path: &Path, opts: &Options) -> Result<LintReport> {
    if opts.page_size == 0 {
        return Err(Error::Usage("--page-size must be at least 1".into()));
    }
    if opts.q_len == 0 {
        return Err(Error::Usage("--q-len must be at least 1".into()));
    }
    let f = GgufFile::open(path)?;
    let mut out = Findings::default();
    let facts = model::lint(&f, &mut out)?;
    if f.architecture() == Some(crate::model::v4::ARCH) {
        if let Some(what) = [
            opts.target.map(|_| "--backend cuda"),
            opts.runner.as_ref().map(|_| "--runner"),
        ]
        .into_iter()
        .flatten()
        .next()
        {
            return Err(Error::Unsupported(format!(
                "{}: lint {what}: no optimized path is built for DeepSeek-V4 (deepseek4) yet (#37, docs/deepseek-v4.md); `lint FILE` checks its keys and tensors",
                path.display()
            )));
        }
    }
    if let Some(t) = opts.target {
        kernel::lint(facts.cfg.as_ref(), t, opts, &mut out)?;
    }
    if let Some(cmd) = &opts.runner {
        runner::lint(cmd, facts.cfg.as_ref(), opts, &mut out)?;
    }
    Ok(LintReport {
        lint_version: LINT_VERSION,
        file: path.display().to_string(),
        errors: out.count(Severity::Error),
        warnings: out.count(Severity::Warning),
        findings: out.0,
    })
}

/// A number for a message: integers as such, others with 6 significant digits.
pub(crate) fn num(x: f64) -> String {
    if x.is_finite() && x == x.trunc() && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else if x != 0.0 && (x.abs() < 1e-3 || x.abs() >= 1e6) {
        format!("{x:.6e}")
    } else {
        format!("{}", (x * 1e6).round() / 1e6)
    }
}
