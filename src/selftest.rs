//! `mla-diff selftest`: plant every fault of the catalogue (`crate::faults`) in the optimized path, one run
//! each, and prove that the comparator catches it — at the fault's earliest stage, in the targeted layer
//! only — and that the same runs without the fault pass.
//!
//! A fault is only visible on a run that exercises what it breaks, so each fault's needs pick the run:
//! the fixture (a NORM or NEOX model with YaRN; a model whose absorbed query leaves the fp16 range) and
//! the schedule, grown from a minimal one (one short prefill chunk at position 0 in one page) by each
//! need. Every fault is injected into the middle layer of a 3-layer fixture; in shadow mode the other
//! layers get the reference's input, so they must stay clean.

mod cases;
mod fixtures;
mod matrix;
pub mod sensitivity;

pub use cases::{controls, schedule_for, target_for, Case, Control, CONTROLS, MINIMAL};
pub use fixtures::{scale_tensors, Fixture, Model, FIXTURES, GLM5_NEXT, LARGE_QABS_LOG2};
pub use matrix::{Outcome, Summary};

use crate::backend::runner::checks::Status;
use crate::backend::{Backend, BackendInfo};
use crate::error::{Error, Result};
use crate::faults::{Fault, FaultSet, Injection, Need};
use crate::gguf::GgufFile;
use crate::kv_format::KvFormat;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::report::Report;
use crate::run::v4::engine::V4Backend;
use crate::run::{InputSpec, Modes, RunOptions};
use crate::tiles::variants::need_met;
use std::path::{Path, PathBuf};

/// Layers of every selftest fixture but glm5-next's (`GLM5_NEXT`), and the layer each fault is injected
/// into but there and in DeepSeek-V4's (`target_for`).
pub const LAYERS: usize = 3;
pub const TARGET: usize = 1;

pub struct Options {
    /// Where the fixtures are written (kept); `None`: a temporary directory, removed afterwards.
    pub fixtures: Option<PathBuf>,
    /// Only these faults (empty: the whole catalogue).
    pub only: Vec<Fault>,
    /// Input seed of every run.
    pub seed: u64,
    /// DeepSeek-V4's optimized path (`run::v4`: the V4 CPU mirror or CUDA kernels), which the MLA
    /// backends of `BackendFactory` are not; `None`: V4's faults are left out, and said so.
    pub v4: Option<V4Backend>,
}

/// Makes the optimized path for a case's dtype (`backend::Factory::open`, which shares one GPU context
/// across cases). The case's faults reach the backend through each layer's `LayerCtx`; they are passed
/// here too so that a test can wrap a backend that misuses them.
/// A case's cache format (`Case::kv`) is the second argument: a backend that stores no quantized cache
/// refuses it, and those cases are left out.
pub type BackendFactory<'a> =
    dyn FnMut(Dtype, KvFormat, &FaultSet) -> Result<(Box<dyn Backend>, BackendInfo)> + 'a;

/// Run the selftest. `on_outcome` sees each outcome as it is made (for progress lines).
pub fn run(
    opts: &Options,
    make_backend: &mut BackendFactory,
    on_outcome: &mut dyn FnMut(&Outcome),
) -> Result<Summary> {
    let started = std::time::Instant::now();
    let faults: Vec<Fault> = if opts.only.is_empty() {
        Fault::ALL.to_vec()
    } else {
        opts.only.clone()
    };
    let mut cases: Vec<Case> = faults.iter().map(|&f| Case::for_fault(f)).collect();
    cases.extend(
        controls()
            .into_iter()
            .filter(|c| c.fault.is_some_and(|f| faults.contains(&f))),
    );
    let (dir, temporary) = match &opts.fixtures {
        Some(d) => (d.clone(), false),
        None => {
            // Unique per call: several selftests may run at once in one process (tests).
            static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!("mla-diff-selftest-{}-{n}", std::process::id());
            (std::env::temp_dir().join(name), true)
        }
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    let result = run_cases(&cases, &dir, opts, make_backend, on_outcome);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (backend, outcomes, left_out) = result?;
    Ok(Summary {
        backend,
        outcomes,
        seconds: started.elapsed().as_secs_f64(),
        left_out,
    })
}

fn run_cases(
    cases: &[Case],
    dir: &Path,
    opts: &Options,
    make_backend: &mut BackendFactory,
    on_outcome: &mut dyn FnMut(&Outcome),
) -> Result<(String, Vec<Outcome>, Vec<String>)> {
    // The DSA fixture's runs need sparse attention (`Judging::sparse`): left out, and said so, where the
    // backend has none.
    let mut left_out = Vec::new();
    let needs_sparse = |c: &Case| c.model.is_sparse();
    // Indexer and k-pool faults need the backend's own indexer (`run`'s stand-in, the CPU mirror's,
    // takes no faults). (The same probe: whether the backend is the CPU mirror, where every fault has
    // its site.)
    let (sparse_ok, indexer_ok, kpool_ok, cpu) = match cases.iter().find(|c| needs_sparse(c)) {
        Some(c) => {
            let (b, info) = make_backend(c.dtype, KvFormat::Auto, &FaultSet::default())?;
            let j = b.judging();
            (
                j.sparse,
                j.has_indexer,
                j.has_kpool_indexer,
                info.kind == crate::backend::Kind::Cpu,
            )
        }
        None => (true, true, true, true),
    };
    // Cache faults need a backend that stores a quantized cache (the CPU mirror, issue #38).
    // A batch-launch cache fault needs a backend whose serving batches read their cache through it.
    let (kv_ok, batch_kv_ok) = match cases.iter().find(|c| !c.kv.is_auto()) {
        Some(c) => match make_backend(c.dtype, c.kv, &FaultSet::default()) {
            Ok((b, _)) => (true, b.judging().batch_cache_in_format),
            Err(_) => (false, false),
        },
        None => (true, true),
    };
    let cases: Vec<Case> = cases
        .iter()
        .filter(|c| {
            let why = match c.fault {
                _ if c.model.is_v4() && opts.v4.is_none() => {
                    "no DeepSeek-V4 path given (selftest::Options::v4)"
                }
                _ if !sparse_ok && needs_sparse(c) => "the backend has no sparse attention for DSA",
                _ if !kv_ok && !c.kv.is_auto() => {
                    "the backend stores no quantized kv cache (the CPU mirror only, issue #38)"
                }
                Some(f) if !batch_kv_ok && f.is_batch() => {
                    "the backend's serving batches do not read their cache through its format (the CPU mirror's do)"
                }
                Some(f) if !indexer_ok && f.is_indexer() && !f.is_kpool() => {
                    "the backend has no indexer of its own; the CPU mirror's stands in, without faults"
                }
                Some(f) if !kpool_ok && f.is_kpool() => {
                    "the backend has no k-pool indexer of its own; the CPU mirror's stands in, without faults"
                }
                Some(f) if !cpu && !c.model.is_v4() && !f.in_cuda() => {
                    "planted in the CPU mirror only (no CUDA site yet: docs/faults.md)"
                }
                _ => return true,
            };
            if let (Some(f), None) = (c.fault, c.lacking) {
                left_out.push(format!("{f} ({why})"));
            }
            false
        })
        .cloned()
        .collect();
    let cases = &cases[..];
    let mut files = std::collections::HashMap::new();
    for c in cases {
        if let std::collections::hash_map::Entry::Vacant(e) = files.entry(c.model) {
            let p = dir.join(c.model.file_name());
            c.model.write(&p)?;
            e.insert(GgufFile::open(&p)?);
        }
    }
    let mut backend_name = String::new();
    let mut outcomes = Vec::new();
    // The clean run of each distinct setup, first: a fault's detection counts only where its setup passes.
    let mut clean: Vec<(String, Report)> = Vec::new();
    for c in cases.iter().filter(|c| c.lacking.is_none()) {
        if clean.iter().any(|(k, _)| *k == c.setup_key()) {
            continue;
        }
        let cc = c.clean();
        let (rep, name) = run_case(&cc, &files[&c.model], opts, make_backend)?;
        // The backend without its dtype (the runs use several): "cpu-mirror", "cuda: NVIDIA H200"
        // (the MLA backend's; V4's path is another, named in its report).
        if !c.model.is_v4() || backend_name.is_empty() {
            backend_name = name.split(" (").next().unwrap_or(&name).to_string();
        }
        let o = judge(&cc, &rep, &files[&c.model], None);
        on_outcome(&o);
        outcomes.push(o);
        clean.push((c.setup_key(), rep));
    }
    for c in cases {
        let file = &files[&c.model];
        let (rep, _) = run_case(c, file, opts, make_backend)?;
        let clean_rep = clean
            .iter()
            .find(|(k, _)| *k == c.setup_key())
            .map(|(_, r)| r);
        let o = judge(c, &rep, file, clean_rep);
        on_outcome(&o);
        outcomes.push(o);
    }
    Ok((backend_name, outcomes, left_out))
}

fn run_case(
    c: &Case,
    file: &GgufFile,
    o: &Options,
    make_backend: &mut BackendFactory,
) -> Result<(Report, String)> {
    let faults = FaultSet(
        c.fault
            .map(|f| {
                vec![Injection {
                    name: f,
                    layer: Some(c.target),
                }]
            })
            .unwrap_or_default(),
    );
    if let (true, Some(v4)) = (c.model.is_v4(), &o.v4) {
        let v4o = crate::run::v4::V4Options {
            layers: (0..LAYERS).collect(),
            seed: o.seed,
            sched: c.sched.clone(),
            dtype: c.dtype,
            faults,
            backend: v4.clone(),
        };
        let rep = crate::run::v4::run(file, &v4o)?;
        let name = rep.environment.backend.clone();
        return Ok((rep, name));
    }
    let (mut backend, info) = make_backend(c.dtype, c.kv, &faults)?;
    let opts = RunOptions {
        input: InputSpec::Random { seed: o.seed },
        sched: c.sched.clone(),
        dtype: c.dtype,
        modes: Modes {
            shadow: true,
            free: false,
        },
        faults,
        indexer_keys: c.keys,
        ..RunOptions::default()
    };
    let rep = crate::run::run(file, backend.as_mut(), &info, &opts)?;
    Ok((rep, info.description))
}

/// Judge one run. A clean run must pass. A fault must be detected in layer `c.target` only, first at its
/// expected check, on a setup whose clean run passed and which meets the fault's needs. A control must
/// not be detected, on a run that really lacks the need it is about.
fn judge(c: &Case, rep: &Report, file: &GgufFile, clean: Option<&Report>) -> Outcome {
    let shadow = &rep.modes[0];
    // The stage checks first (dataflow order); where they pass, a failing DSA selection check; where
    // those pass, for a clean run and a kernel-variant fault (its cases and controls), a failing batch
    // aimed at a variant (`faults::VARIANT_CHECK`). (Other faults' controls lack a need of the stage
    // checks: a batch aimed at a variant has it, and catches them there.)
    let dsa_v = dsa_verdict(rep);
    let batch_v = batch_verdict_for(c, rep);
    let v = match (&shadow.verdict, &dsa_v, &batch_v) {
        (s, Some(d), _) if s.pass => d,
        (s, None, Some((b, _))) if s.pass => b,
        (s, _, _) => s,
    };
    let first_margin = shadow
        .layers
        .iter()
        .find(|l| !l.pass)
        .and_then(|l| l.checks.iter().find(|ch| !ch.pass))
        .map(|ch| ch.ratio())
        .or_else(|| dsa_margin(rep))
        .or_else(|| batch_v.as_ref().and_then(|(_, m)| *m));
    let mut problems = Vec::new();
    let target = c.target;
    let q_abs_large = q_abs_rms(rep, target).map(|r| (r, r > 65504.0));
    let cfg = mla_config(c, file, &mut problems);
    match (c.fault, c.lacking) {
        (None, _) => {
            if !v.pass {
                problems.push(format!("false alarm: {}", v.message));
            }
        }
        (Some(_), Some(n)) => {
            let lacks = match n {
                Need::LargeQAbs => q_abs_large.map(|(_, large)| !large),
                Need::F32 => Some(c.dtype != Dtype::F32),
                _ => cfg
                    .as_ref()
                    .and_then(|cfg| need_met(n, cfg, &c.sched).map(|m| !m)),
            };
            if lacks != Some(true) {
                problems.push(format!("the control run does not lack {}", n.name()));
            }
            if !v.pass {
                problems.push(format!(
                    "detected without {}: the need is not real ({})",
                    n.name(),
                    v.message
                ));
            }
        }
        (Some(f), None) => {
            let info = f.info();
            if clean.is_none_or(|r| !r.verdict.pass) {
                problems
                    .push("the clean run of this setup fails, so detection proves nothing".into());
            }
            if let Some(cfg) = &cfg {
                for n in info.needs {
                    if need_met(*n, cfg, &c.sched) == Some(false) {
                        problems.push(format!("the run lacks what the fault needs: {}", n.name()));
                    }
                }
            }
            let past_top_k = rep
                .coverage
                .as_ref()
                .and_then(|c| c.dsa.as_ref())
                .is_some_and(|d| d.sparse_queries > 0);
            if info.needs.contains(&Need::Dsa) && !past_top_k {
                problems.push("no query of the run sees more than the indexer's top_k".into());
            }
            if info.needs.contains(&Need::LargeQAbs) {
                if let Some((r, false)) = q_abs_large {
                    problems.push(format!(
                        "q_absorbed rms {r:.3e} is within the fp16 range: no overflow to expose"
                    ));
                }
            }
            if v.pass {
                problems.push("not detected".into());
            } else {
                if v.first_layer != Some(target) {
                    problems.push(format!(
                        "attributed to layer {:?}, injected into layer {target}",
                        v.first_layer
                    ));
                }
                if v.first_check.as_deref() != Some(info.expected) {
                    problems.push(format!(
                        "first diverging check {:?}, expected {}: {}",
                        v.first_check.as_deref().unwrap_or("-"),
                        info.expected,
                        v.reasons.join("; ")
                    ));
                }
                let others = other_failing_layers(rep, target);
                if !others.is_empty() {
                    problems.push(format!(
                        "layers {others:?} fail too; only {target} was injected"
                    ));
                }
            }
        }
    }
    Outcome {
        case: c.clone(),
        detected: !v.pass,
        first_layer: v.first_layer,
        first_check: v.first_check.clone(),
        margin: first_margin,
        reason: v.reasons.join("; "),
        ok: problems.is_empty(),
        problems,
    }
}

/// The fixture's MLA config; `None` for a V4 file, which has none (its one need, `Need::V4`, is its
/// fixture).
fn mla_config(c: &Case, file: &GgufFile, problems: &mut Vec<String>) -> Option<MlaConfig> {
    if c.model.is_v4() {
        return None;
    }
    MlaConfig::from_gguf(file)
        .map_err(|e| problems.push(format!("cannot read the fixture's config: {e}")))
        .ok()
}

/// The DSA selection check's verdict as a stage check's would read (`faults::SELECTION_CHECK`), when
/// it fails.
fn dsa_verdict(rep: &Report) -> Option<crate::compare::Verdict> {
    let d = rep.dsa.as_ref().filter(|d| !d.pass)?;
    let l = d.layers.iter().find(|l| !l.pass)?;
    Some(crate::compare::Verdict {
        pass: false,
        first_layer: Some(l.layer),
        first_check: Some(crate::faults::SELECTION_CHECK.into()),
        reasons: vec![l.failure()],
        message: d.message.clone(),
    })
}

/// The layers other than `target` that fail a stage check (shadow mode), the DSA selection or a batch.
fn other_failing_layers(rep: &Report, target: usize) -> Vec<usize> {
    let dsa_layers = rep.dsa.iter().flat_map(|d| &d.layers);
    let batches = rep.runner_checks.iter().flat_map(|r| &r.checks);
    let mut others: Vec<usize> = rep.modes[0]
        .layers
        .iter()
        .filter(|l| l.layer != target && !l.pass)
        .map(|l| l.layer)
        .chain(
            dsa_layers
                .filter(|l| l.layer != target && !l.pass)
                .map(|l| l.layer),
        )
        .chain(
            batches
                .filter(|b| b.status == Status::Fail)
                .filter_map(|b| b.layer.filter(|&l| l != target)),
        )
        .collect();
    others.sort_unstable();
    others.dedup();
    others
}

/// The batch check that decides `c` where its stage checks pass: for a clean run any failing batch;
/// for a variant or batch fault, a failing batch of its expected check; none for the others.
fn batch_verdict_for(c: &Case, rep: &Report) -> Option<(crate::compare::Verdict, Option<f64>)> {
    let checks = [crate::faults::VARIANT_CHECK, crate::faults::BATCH_CHECK];
    match c.fault {
        None => batch_verdict(rep, &checks),
        Some(f) if f.is_variant() || f.is_batch() => batch_verdict(rep, &[f.info().expected]),
        Some(_) => None,
    }
}

/// The first failing batch check of `checks` (`faults::VARIANT_CHECK`: a batch aimed at a variant;
/// `faults::BATCH_CHECK`: the serving batch; in `runner_checks`) as a stage check's verdict would
/// read, with its value ÷ bound.
fn batch_verdict(rep: &Report, checks: &[&str]) -> Option<(crate::compare::Verdict, Option<f64>)> {
    let rc = rep.runner_checks.as_ref()?;
    let b = rc
        .checks
        .iter()
        .find(|b| b.status == Status::Fail && checks.contains(&b.check.as_str()))?;
    let margin = match (b.value, b.bound) {
        (Some(v), Some(t)) if t > 0.0 => Some(v / t),
        // A non-finite value has no figure.
        _ => Some(f64::INFINITY),
    };
    let v = crate::compare::Verdict {
        pass: false,
        first_layer: b.layer,
        first_check: Some(b.check.clone()),
        reasons: vec![b.line()],
        message: rc.message.clone(),
    };
    Some((v, margin))
}

/// The first failing DSA layer's worst selection gap ÷ its noise margin.
fn dsa_margin(rep: &Report) -> Option<f64> {
    let l = rep.dsa.as_ref()?.layers.iter().find(|l| !l.pass)?;
    let s = l.selection.as_ref()?;
    match &s.worst {
        Some(m) if m.margin > 0.0 => Some(m.gap / m.margin),
        Some(_) => Some(f64::INFINITY),
        // A count mismatch alone has no gap.
        None => None,
    }
}

/// The rms of the reference q_absorbed in the target layer of a report (the exposure of fp16 overflow).
fn q_abs_rms(r: &Report, target: usize) -> Option<f64> {
    r.modes[0]
        .layers
        .iter()
        .find(|l| l.layer == target)?
        .checks
        .iter()
        .find(|c| c.check == "q_absorbed")
        .map(|c| c.metrics.ref_rms)
}
