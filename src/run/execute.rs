//! The run once its options are made and its outputs checked, shared by `run`, `run --capture` and
//! `replay` ([`execute`]): the optimized path opened, run (split as [`How`] says), gated against its
//! baseline, the reports written; the exit code.

use super::RunOptions;
use crate::backend::open::Spec;
use crate::backend::{Backend, BackendInfo};
use crate::error::{Result, EXIT_DIVERGENCE, EXIT_PASS};
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::report::baseline::Identity;
use crate::report::outputs::{Outputs, ReportOptions};
use crate::report::Report;
use crate::shard::Shard;
use crate::tp::TpSpec;
use std::path::PathBuf;

/// What a run runs: the file, its config and the run's options.
#[derive(Clone, Copy)]
pub struct Job<'a> {
    pub file: &'a GgufFile,
    pub cfg: &'a MlaConfig,
    pub opts: &'a RunOptions,
}

/// How a run splits its work (`--shard`, `--tp`) and what it writes besides (`--write-capture`);
/// `How::default()`: one piece.
#[derive(Default)]
pub struct How {
    pub shard: Option<Shard>,
    pub tp: Option<TpSpec>,
    pub write_capture: Option<PathBuf>,
}

/// The optimized path of a run: a backend opened from its spec (with the page a runner was moved
/// to), or a capture of what an engine computed.
pub enum Optimized<'a> {
    Open(&'a Spec, Option<(usize, usize)>),
    Capture(Box<crate::capture::CaptureBackend>),
}

/// What is checked before the (possibly long) run, so that an unusable output path or a mismatched
/// baseline fails at once: the report targets and the --baseline report.
pub struct Prepared {
    outputs: Outputs,
    baseline: Option<(Report, Vec<String>)>,
}

impl Prepared {
    pub fn check(
        file: &GgufFile,
        cfg: &MlaConfig,
        opts: &RunOptions,
        r: &ReportOptions,
    ) -> Result<Prepared> {
        Ok(Prepared {
            outputs: Outputs::check(r)?,
            baseline: r.baseline(&Identity::planned(file, cfg, opts)?)?,
        })
    }
}

/// The run once its options are made and its outputs checked, shared by `run`, `run --capture` and
/// `replay`: the optimized path opened, run (split as `how` says), gated, the reports written; the
/// exit code. `notices` are added to the report's.
pub fn execute(
    job: Job,
    ready: Prepared,
    path: Optimized,
    r: &ReportOptions,
    notices: &[String],
    how: How,
) -> Result<i32> {
    let Job { file, cfg, opts } = job;
    let started = std::time::Instant::now();
    let mut rep = match path {
        Optimized::Open(spec, page_moved) => {
            if !r.formats.quiet {
                for b in blind_spots(cfg, &opts.faults, &opts.sched, opts.split.as_ref()) {
                    eprintln!("mla-diff: note: injected fault {b} may not show on this run");
                }
            }
            let (mut backend, info) = spec.open(opts.dtype, page_moved)?;
            on_opened(job, backend.as_mut(), info, r, how)?
        }
        Optimized::Capture(mut b) => {
            let info = BackendInfo {
                kind: crate::backend::Kind::Capture,
                description: b.describe(),
                gpu: None,
            };
            let mut rep = super::run(file, b.as_mut(), &info, opts)?;
            let layers = opts.layers.clone().unwrap_or_default();
            if let Some(t) = b.tp_result(cfg, &layers) {
                rep.set_tp(t);
            }
            rep
        }
    };
    rep.run.notices.extend(notices.iter().cloned());
    finish(rep, ready, r, started)
}

/// The injected faults the run may not show, each judged by the schedule of the layers it is planted
/// in: with a split (`crate::schedule::Split`), a fault planted in a rest layer runs the rest's schedule
/// only.
fn blind_spots(
    cfg: &MlaConfig,
    faults: &crate::faults::FaultSet,
    covering: &crate::schedule::Schedule,
    split: Option<&crate::schedule::Split>,
) -> Vec<String> {
    faults
        .0
        .iter()
        .flat_map(|i| {
            let sched = match (split, i.layer) {
                (Some(sp), Some(l)) => sp.schedule_of(l, covering),
                _ => covering,
            };
            let met = |n| crate::tiles::variants::need_met(n, cfg, sched);
            crate::faults::FaultSet(vec![*i]).blind_spots(&met)
        })
        .collect()
}

/// The run on an opened backend: `--write-capture` wraps the path the ranks run on (each rank's call
/// is written as its own capture), `--tp` wraps that.
fn on_opened(
    job: Job,
    backend: &mut dyn Backend,
    mut info: BackendInfo,
    r: &ReportOptions,
    how: How,
) -> Result<Report> {
    let Job { file, cfg, opts } = job;
    let mut writer = None;
    let inner: &mut dyn Backend = match &how.write_capture {
        Some(dir) => writer.insert(crate::capture::write::WriteCapture::new(
            backend,
            dir,
            file,
            opts.dtype,
            &opts.sched,
            how.tp.map_or(1, |t| t.size),
        )?),
        None => backend,
    };
    let mut tp = None;
    let b: &mut dyn Backend = match how.tp {
        Some(spec) => {
            let tolerances = opts.tolerances.clone();
            let t = tp.insert(crate::tp::TpBackend::new(
                inner, spec, opts.dtype, tolerances,
            ));
            info.description = t.describe();
            t
        }
        None => inner,
    };
    let mut rep = match how.shard {
        Some(s) => super::shard::run(file, b, &info, opts, s)?,
        None => super::run(file, b, &info, opts)?,
    };
    if let Some(t) = tp {
        let layers = rep.run.layers.clone();
        rep.set_tp(t.result(cfg, &layers));
    }
    if let Some(w) = writer {
        let tokens = match &opts.input {
            super::InputSpec::Tokens(ids) => Some(ids.as_slice()),
            _ => None,
        };
        let dirs = w.finish(tokens, rep.environment.backend.clone())?;
        if !r.formats.quiet {
            for d in dirs {
                eprintln!("mla-diff: capture written to {}", d.display());
            }
        }
    }
    Ok(rep)
}

/// A run's report gated against its --baseline and written; the exit code.
pub(super) fn finish(
    mut rep: Report,
    ready: Prepared,
    r: &ReportOptions,
    started: std::time::Instant,
) -> Result<i32> {
    let Prepared { outputs, baseline } = ready;
    if let (Some((b, diffs)), Some(p)) = (baseline, &r.baseline) {
        let mut g =
            crate::report::baseline::gate(&rep, &b, &p.display().to_string(), r.baseline_factor);
        g.across = diffs;
        rep.set_baseline(g);
    }
    outputs.write(&rep, r)?;
    if !r.formats.quiet {
        if let Some(d) = &r.dump_dir {
            if rep.dumps.is_empty() {
                eprintln!(
                    "mla-diff: no layer dumped into {} (--dump-layers {}: nothing selected)",
                    d.display(),
                    r.dump_layers
                );
            }
            for d in &rep.dumps {
                eprintln!("mla-diff: dumped {}", d.display());
            }
        }
        eprintln!(
            "mla-diff: {} layer(s) in {:.2} s",
            rep.run.layers.len(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(if rep.pass() {
        EXIT_PASS
    } else {
        EXIT_DIVERGENCE
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::{FaultSet, Injection};
    use crate::schedule::{Schedule, Split};

    /// A fault planted in a layer that runs the classic schedule of a split is judged by that schedule
    /// (`read_past_end` needs the sequence to end inside a page: the classic 64 tokens fill their pages).
    #[test]
    fn a_fault_in_a_rest_layer_is_judged_by_the_rest_schedule() {
        let cfg = crate::model::catalogue::Preset::Tiny.test_config();
        let covering = crate::coverage::covering::covering(&cfg);
        let split = Split::of(&[0, 1, 2], 2, &covering, Schedule::default()).unwrap();
        let at = |spec: &str| FaultSet(vec![Injection::parse(spec).unwrap()]);
        let spots = |f: &FaultSet, s| blind_spots(&cfg, f, &covering, s);
        assert!(spots(&at("read_past_end@layer=1"), Some(&split)).is_empty());
        assert!(spots(&at("read_past_end"), Some(&split)).is_empty());
        let rest = spots(&at("read_past_end@layer=2"), Some(&split));
        assert_eq!(rest.len(), 1, "{rest:?}");
        assert!(spots(&at("read_past_end@layer=2"), None).is_empty());
    }
}
