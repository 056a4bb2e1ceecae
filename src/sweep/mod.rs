//! `mla-diff sweep`: many runs of one file, each an ordinary shadow-mode run (`crate::run::run`), to find
//! where a kernel's result depends on the problem's shape.
//!
//! - **Lengths** (`lengths.rs`): sequence lengths around every boundary of the schedule and of the kernel
//!   in use (pages, prefill chunks, the kernels' key tiles and per-warp key slices, the decode split
//!   partition) plus the user's `--lengths`; the smallest failing length, and a bisection (`bisect.rs`)
//!   of the gap below it when the lengths tried leave one.
//! - **Splits** (`splits.rs`): the same schedule with several split-KV counts; each run against fp64, and
//!   the decode outputs of each against the first count's within the noise model.
//!
//! The result is a [`SweepReport`], its own versioned JSON document (`sweep_version`,
//! `schema/sweep.schema.json`) of per-length (or per-count) summary records; `render.rs` writes the
//! table, JUnit and Markdown from it. Exit code, JSON `verdict.pass`, JUnit and Markdown agree.

pub mod bisect;
pub mod lengths;
pub mod render;
pub mod splits;

use crate::backend::{Backend, BackendInfo};
use crate::compare::ToleranceTable;
use crate::error::{Error, Result};
use crate::faults::FaultSet;
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::report::{Environment, FileInfo, Report, ToolInfo};
use crate::run::{InputSpec, Modes, RunOptions};
use crate::schedule::Schedule;
use serde::Serialize;
use std::ops::RangeInclusive;

/// Bumped on any breaking change of the sweep JSON; `schema/sweep.schema.json` describes it.
pub const SWEEP_VERSION: u32 = 1;

/// What every run of a sweep shares.
pub struct SweepOptions {
    pub layers: Vec<usize>,
    /// Seed of the random layer inputs (a sweep changes the token count, so captured inputs cannot be
    /// used).
    pub seed: u64,
    /// The schedule: every run's, except the prompt length (lengths) or the split count (splits).
    pub sched: Schedule,
    pub dtype: Dtype,
    pub tolerances: ToleranceTable,
    pub tolerance_source: String,
    pub faults: FaultSet,
    /// A progress bar on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Run a DSA model on lengths beyond its indexer's top_k (`--allow-dense-beyond-topk`; the runs'
    /// reports then carry the notice); refused otherwise.
    pub allow_dense_beyond_topk: bool,
}

/// What a length sweep tries.
#[derive(Debug, Clone, Default)]
pub struct LengthPlan {
    /// `--lengths` as given and the lengths and range it names; `None`: the default range.
    pub user: Option<(String, Vec<usize>, RangeInclusive<usize>)>,
    /// Add the boundary lengths inside the range (off: only the user's lengths).
    pub boundaries: bool,
    /// Extra key-tile sizes (`--tiles`).
    pub extra_tiles: Vec<usize>,
}

impl SweepOptions {
    /// The run options for one schedule: shadow mode (the layer's own error), the sweep's layers.
    fn run_options(&self, sched: Schedule) -> RunOptions {
        RunOptions {
            layers: Some(self.layers.clone()),
            input: InputSpec::Random { seed: self.seed },
            sched,
            dtype: self.dtype,
            modes: Modes {
                shadow: true,
                free: false,
            },
            tolerances: self.tolerances.clone(),
            tolerance_source: self.tolerance_source.clone(),
            faults: self.faults.clone(),
            ..RunOptions::default()
        }
    }
}

/// The worst check of a run: the largest metric ÷ tolerance (`CheckResult::ratio`; ≥ 1 fails; JSON null
/// for a non-finite mismatch).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Worst {
    pub layer: usize,
    pub check: String,
    pub ratio: f64,
}

/// The verdict of one run, as a sweep keeps it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub pass: bool,
    pub first_layer: Option<usize>,
    pub first_check: Option<String>,
    /// The first failing check's reasons.
    pub reasons: Vec<String>,
    pub worst: Option<Worst>,
}

impl Outcome {
    pub fn of(r: &Report) -> Outcome {
        let mut worst: Option<Worst> = None;
        for m in r
            .modes
            .iter()
            .filter(|m| Some(m.mode.as_str()) == r.decisive_mode())
        {
            for l in &m.layers {
                for c in &l.checks {
                    let ratio = c.ratio();
                    // NaN ratios do not occur (a non-finite mismatch is ∞); `>` keeps the first maximum.
                    if worst.as_ref().is_none_or(|w| ratio > w.ratio) {
                        worst = Some(Worst {
                            layer: l.layer,
                            check: c.check.clone(),
                            ratio,
                        });
                    }
                }
            }
        }
        Outcome {
            pass: r.pass(),
            first_layer: r.verdict.first_layer,
            first_check: r.verdict.first_check.clone(),
            reasons: r.verdict.reasons.clone(),
            worst,
        }
    }
}

/// One length of a length sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LengthPoint {
    /// L: the run's tokens.
    pub length: usize,
    /// L − decode tokens.
    pub prompt_len: usize,
    /// Why it was run: boundaries ("page L=32+1", "decode flash tile L=4x64-1"), "range start"/"range
    /// end", "--lengths", "bisect".
    pub origins: Vec<String>,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// A length sweep's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LengthSweep {
    /// The lengths' range, inclusive.
    pub range: [usize; 2],
    /// `--lengths` as given; absent for the default range.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requested: Option<String>,
    /// The kernel in use, as the backend reported it after the first run.
    pub key_tiles: crate::backend::KeyTiles,
    /// The boundary families the lengths were put around (empty with --no-boundaries).
    pub boundaries: Vec<lengths::Boundary>,
    /// Every length run, ascending (bisection probes included).
    pub points: Vec<LengthPoint>,
    pub smallest_failing: Option<usize>,
    /// The bisection of the gap below the smallest failing length the boundaries found, when there was
    /// one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bisection: Option<bisect::Bisection>,
}

/// What a sweep ran with (like a run report's `run`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepRun {
    /// `lengths` or `splits`.
    pub kind: String,
    pub backend: String,
    pub dtype: String,
    pub layers: Vec<usize>,
    /// The schedule shared by the runs; each length sets its own prompt_len, each split count its
    /// num_splits.
    pub schedule: Schedule,
    pub input: serde_json::Value,
    pub tolerances: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub injected: Vec<crate::faults::Injection>,
    /// Every distinct notice of the runs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepVerdict {
    pub pass: bool,
    pub message: String,
    /// The first failure's reasons.
    pub reasons: Vec<String>,
}

/// `mla-diff sweep --json`: the versioned sweep document.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepReport {
    pub sweep_version: u32,
    pub tool: ToolInfo,
    pub file: FileInfo,
    pub run: SweepRun,
    pub environment: Environment,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lengths: Option<LengthSweep>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub splits: Option<splits::SplitSweep>,
    pub verdict: SweepVerdict,
}

impl SweepReport {
    pub fn pass(&self) -> bool {
        self.verdict.pass
    }
    pub fn to_json(&self) -> String {
        crate::report::outputs::pretty_json(self)
    }
    /// The sweep's frame from its first run's report.
    fn frame(kind: &str, opts: &SweepOptions, first: &Report) -> SweepReport {
        SweepReport {
            sweep_version: SWEEP_VERSION,
            tool: first.tool.clone(),
            file: first.file.clone(),
            run: SweepRun {
                kind: kind.into(),
                backend: first.run.backend.clone(),
                dtype: first.run.dtype.clone(),
                layers: first.run.layers.clone(),
                schedule: opts.sched.clone(),
                input: first.run.input.clone(),
                tolerances: first.run.tolerances.clone(),
                injected: first.run.injected.clone(),
                notices: Vec::new(),
            },
            environment: first.environment.clone(),
            lengths: None,
            splits: None,
            verdict: SweepVerdict {
                pass: true,
                message: String::new(),
                reasons: Vec::new(),
            },
        }
    }
    fn add_notices(&mut self, r: &Report) {
        for n in &r.run.notices {
            if !self.run.notices.contains(n) {
                self.run.notices.push(n.clone());
            }
        }
    }
}

/// A progress bar over runs.
fn progress(on: bool, what: &str) -> indicatif::ProgressBar {
    if !on {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    b.set_prefix(format!("mla-diff sweep {what}"));
    b
}

/// The length sweep. `backend` is the optimized path, `info` its facts.
pub fn sweep_lengths(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &SweepOptions,
    plan: &LengthPlan,
) -> Result<SweepReport> {
    let cfg = MlaConfig::from_gguf(file)?;
    let base = &opts.sched;
    let min = lengths::min_length(base);
    plan.check(base, min)?;
    let start = plan
        .user
        .as_ref()
        .map(|(_, _, r)| *r.start())
        .unwrap_or(min);
    let bar = progress(opts.progress, "lengths");
    let run_at = |l: usize, backend: &mut dyn Backend| -> Result<Report> {
        bar.set_message(format!("length {l}"));
        let r = crate::run::run(
            file,
            backend,
            info,
            &opts.run_options(lengths::schedule_at(base, l)?),
        )?;
        bar.inc(1);
        Ok(r)
    };
    // The first run picks the kernels (a GPU backend chooses its tiles for the layer's dims), so the
    // boundaries are known after it.
    let first = run_at(start, backend)?;
    let tiles = backend.judging().key_tiles;
    let bounds = if plan.boundaries {
        lengths::boundaries(base, &tiles, &plan.extra_tiles)
    } else {
        Vec::new()
    };
    let range = match &plan.user {
        Some((_, _, r)) => r.clone(),
        None => min..=lengths::default_max(base, &bounds),
    };
    check_longest(file, &cfg, opts, *range.end())?;
    let todo = plan.lengths(base, &bounds, &range);
    bar.set_length(todo.len() as u64);
    let mut rep = SweepReport::frame("lengths", opts, &first);
    let mut points = Vec::new();
    let mut first = Some(first);
    for (l, origins) in todo {
        let r = match first.take() {
            Some(r) if l == start => r,
            _ => run_at(l, backend)?,
        };
        rep.add_notices(&r);
        points.push(LengthPoint {
            length: l,
            prompt_len: l - base.decode_tokens(),
            origins,
            outcome: Outcome::of(&r),
        });
    }
    let tried: Vec<(usize, bool)> = points.iter().map(|p| (p.length, p.outcome.pass)).collect();
    let bisection = match bisect::gap(&tried) {
        None => None,
        Some((pass, fail)) => {
            bar.inc_length(bisect_probes(fail - pass));
            let mut probed = Vec::new();
            let b = bisect::bisect(pass, fail, |l| {
                let r = run_at(l, backend)?;
                rep.add_notices(&r);
                let o = Outcome::of(&r);
                let ok = o.pass;
                probed.push(LengthPoint {
                    length: l,
                    prompt_len: l - base.decode_tokens(),
                    origins: vec!["bisect".into()],
                    outcome: o,
                });
                Ok::<bool, Error>(ok)
            })?;
            points.extend(probed);
            Some(b)
        }
    };
    bar.finish_and_clear();
    points.sort_by_key(|p| p.length);
    let smallest_failing = points.iter().find(|p| !p.outcome.pass).map(|p| p.length);
    rep.verdict = length_verdict(&points, smallest_failing, bisection.as_ref());
    rep.lengths = Some(LengthSweep {
        range: [*range.start(), *range.end()],
        requested: plan.user.as_ref().map(|(s, _, _)| s.clone()),
        key_tiles: tiles,
        boundaries: bounds,
        points,
        smallest_failing,
        bisection,
    });
    Ok(rep)
}

/// Probes a bisection of a gap takes: ceil(log2(gap)).
impl LengthPlan {
    /// The plan's own lengths start at the schedule's decode tokens, and there is some length to run.
    fn check(&self, base: &Schedule, min: usize) -> Result<()> {
        if let Some((spec, ls, _)) = &self.user {
            if let Some(&l) = ls.iter().find(|&&l| l < min) {
                return Err(Error::Usage(format!(
                    "--lengths {spec:?}: length {l} is shorter than the schedule's {} decode tokens (--decode-steps {} × --q-len {}); lengths start at {min}",
                    base.decode_tokens(),
                    base.decode_steps,
                    base.q_len
                )));
            }
        }
        if !self.boundaries && self.user.is_none() {
            return Err(Error::Usage(
                "--no-boundaries leaves no length: give --lengths".into(),
            ));
        }
        Ok(())
    }

    /// Every length to run, with why: the boundary lengths within `range`, then the `--lengths` given
    /// or else the range's two ends.
    fn lengths(
        &self,
        base: &Schedule,
        bounds: &[lengths::Boundary],
        range: &std::ops::RangeInclusive<usize>,
    ) -> std::collections::BTreeMap<usize, Vec<String>> {
        let mut todo: std::collections::BTreeMap<usize, Vec<String>> = if self.boundaries {
            lengths::boundary_lengths(base, bounds, range)
        } else {
            Default::default()
        };
        match &self.user {
            Some((_, ls, _)) => ls
                .iter()
                .for_each(|&l| todo.entry(l).or_default().push("--lengths".into())),
            None => {
                todo.entry(*range.start())
                    .or_default()
                    .push("range start".into());
                todo.entry(*range.end())
                    .or_default()
                    .push("range end".into());
            }
        }
        todo
    }
}

/// Checked before the long part: the longest length's memory, and on a DSA model its top_k.
fn check_longest(
    file: &GgufFile,
    cfg: &MlaConfig,
    opts: &SweepOptions,
    longest: usize,
) -> Result<()> {
    let longest = lengths::schedule_at(&opts.sched, longest)?;
    longest.check_memory(cfg)?;
    if let Some(n) = crate::run::dense_beyond_top_k(file, cfg, &longest) {
        if !opts.allow_dense_beyond_topk {
            return Err(Error::Usage(format!(
                "{n}. Pass --allow-dense-beyond-topk to run anyway, or sweep at most top_k tokens (--lengths)"
            )));
        }
    }
    Ok(())
}

fn bisect_probes(gap: usize) -> u64 {
    (usize::BITS - gap.saturating_sub(1).leading_zeros()) as u64
}

fn length_verdict(
    points: &[LengthPoint],
    smallest: Option<usize>,
    b: Option<&bisect::Bisection>,
) -> SweepVerdict {
    let n = points.len();
    let failing = points.iter().filter(|p| !p.outcome.pass).count();
    let (lo, hi) = (
        points.first().map(|p| p.length).unwrap_or(0),
        points.last().map(|p| p.length).unwrap_or(0),
    );
    match smallest.and_then(|l| points.iter().find(|p| p.length == l)) {
        None => SweepVerdict {
            pass: true,
            message: format!("PASS: {n} lengths ({lo}..={hi}) within tolerance"),
            reasons: Vec::new(),
        },
        Some(p) => {
            let how = match b {
                Some(b) => format!(
                    "; bisected between {} (pass) and {} (fail) in {} runs",
                    b.pass,
                    b.fail,
                    b.probes.len()
                ),
                None => String::new(),
            };
            SweepVerdict {
                pass: false,
                message: format!(
                    "DIVERGENCE: smallest failing length {} (prompt {}{how}), {failing} of {n} lengths fail; at layer {}, {}: {}",
                    p.length,
                    p.prompt_len,
                    p.outcome
                        .first_layer
                        .map(|l| l.to_string())
                        .unwrap_or_else(|| "?".into()),
                    p.outcome.first_check.as_deref().unwrap_or("?"),
                    p.outcome.reasons.join("; ")
                ),
                reasons: p.outcome.reasons.clone(),
            }
        }
    }
}
