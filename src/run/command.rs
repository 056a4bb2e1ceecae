//! `mla-diff run` as a library operation: a [`Request`] (what the command line says, as plain values)
//! checked against the model, run through the optimized path it names (a backend, split by shard or
//! tp, or a capture; `replay` comes in at [`execute`]), gated and written; the exit code.

use super::{plan, Mode, RunOptions};
use crate::backend::open::Spec;
use crate::backend::{Backend, BackendInfo};
use crate::error::{Error, Result, EXIT_DIVERGENCE, EXIT_PASS};
use crate::faults::FaultSet;
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::precision::{Dtype, KeyPrecision};
use crate::report::baseline::Identity;
use crate::report::outputs::{Formats, Outputs, ReportOptions};
use crate::report::Report;
use crate::shard::Shard;
use crate::tp::TpSpec;
use std::ffi::OsString;
use std::path::PathBuf;

/// Everything a run is asked, as plain values (the command line's `run` options; `Request::new(file)`
/// is `mla-diff run FILE`).
#[derive(Debug, Clone)]
pub struct Request {
    pub file: PathBuf,
    /// `all`, `N`, `A..B`, `A..=B` or a comma list ([`super::parse_layers`]).
    pub layers: String,
    pub dtype: Dtype,
    /// `None`: both, or shadow for per-layer captured inputs.
    pub mode: Option<Mode>,
    /// Run a DSA file without indexer tensors past its top_k (dense attention, with a notice).
    pub allow_dense_beyond_topk: bool,
    pub indexer_keys: KeyPrecision,
    pub faults: FaultSet,
    /// Runs of the optimized path per layer, compared bit for bit (1: no repeat).
    pub repeat: usize,
    pub shard: Option<Shard>,
    /// Spread the layers over this host's GPUs, one worker process each (`crate::gpus`).
    pub gpus: Option<Spread>,
    pub tp: Option<TpSpec>,
    /// Capture folders (one per TP rank) that take the optimized path's place (`run --capture`).
    pub capture: Vec<PathBuf>,
    /// The capture's request, by its manifest id.
    pub capture_request: Option<u64>,
    /// Also write the optimized path's stages as a capture into this folder.
    pub write_capture: Option<PathBuf>,
    pub input: super::InputSpec,
    /// Laid over the classic default; none set (and random inputs): the kernel-aware schedule.
    pub schedule: crate::schedule::Overrides,
    pub backend: Spec,
    pub tol: crate::compare::tolerance::Overrides,
    pub report: ReportOptions,
}

/// `--gpus`: the devices (`all`, a count or indices) and the command line each worker reruns with its
/// shard (`gpus::fan_out`).
#[derive(Debug, Clone)]
pub struct Spread {
    pub spec: String,
    pub args: Vec<OsString>,
}

impl Request {
    /// `mla-diff run FILE`: every default.
    pub fn new(file: PathBuf) -> Request {
        Request {
            file,
            layers: "all".into(),
            dtype: Dtype::Bf16,
            mode: None,
            allow_dense_beyond_topk: false,
            indexer_keys: KeyPrecision::default(),
            faults: FaultSet::default(),
            repeat: 1,
            shard: None,
            gpus: None,
            tp: None,
            capture: Vec::new(),
            capture_request: None,
            write_capture: None,
            input: super::InputSpec::Random { seed: 0 },
            schedule: Default::default(),
            backend: Spec::default(),
            tol: Default::default(),
            report: ReportOptions::default(),
        }
    }

    /// A `--gpus` worker (`gpus::Worker`): its shard, its JSON report where the parent reads it, and
    /// nothing else written or gated (the parent does that with the joined report).
    pub fn become_worker(&mut self, w: &crate::gpus::Worker) {
        self.shard = Some(w.shard);
        self.gpus = None;
        self.report = ReportOptions {
            formats: Formats {
                json: Some(w.json.clone()),
                color: crate::report::table::ColorChoice::Never,
                quiet: true,
                ..Formats::default()
            },
            baseline_factor: self.report.baseline_factor,
            ..ReportOptions::default()
        };
    }
}

/// Run what `req` asks; the exit code.
pub fn exec(req: Request) -> Result<i32> {
    // A capture neither says nor keeps the cache's byte format yet (issue #38, the runner protocol's
    // `cache.format`): refused rather than judged as the dtype's cache.
    let kv = req.backend.kv_format;
    if !kv.is_auto() && (!req.capture.is_empty() || req.write_capture.is_some()) {
        return Err(Error::Usage(format!(
            "--kv-cache-dtype {kv}: captures (--capture, --write-capture) carry the dtype's cache only so far (issue #38)"
        )));
    }
    let file = GgufFile::open(&req.file)?;
    // The one dispatch point: the attention the file has, then what takes the optimized path's place.
    if super::v4::is_v4(&file) {
        return super::v4::command::exec(&req, &file);
    }
    let cfg = MlaConfig::from_gguf(&file)?;
    match req.capture.is_empty() {
        false => super::capture::exec(&req, &file, &cfg),
        true => on_backend(&req, &file, &cfg),
    }
}

/// The run on a backend (`req.backend`), split as `--shard`, `--tp` or `--gpus` say.
fn on_backend(req: &Request, file: &GgufFile, cfg: &MlaConfig) -> Result<i32> {
    let (opts, page_moved) = plan::options(req, file, cfg)?;
    if let Some(s) = req.shard {
        // Before the run: a shard count larger than the layers is a usage error.
        let n = opts.layers.as_ref().map_or(cfg.n_layer, Vec::len);
        s.range(n, "layers")?;
    }
    if let Some(t) = &req.tp {
        t.check(cfg)?;
    }
    let ready = Prepared::check(file, cfg, &opts, &req.report)?;
    if let Some(g) = &req.gpus {
        return spread(req, g, cfg, &opts, ready);
    }
    let how = How {
        shard: req.shard,
        tp: req.tp,
        write_capture: req.write_capture.clone(),
    };
    let path = Optimized::Open(&req.backend, page_moved);
    execute(
        Job {
            file,
            cfg,
            opts: &opts,
        },
        ready,
        path,
        &req.report,
        &[],
        how,
    )
}

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
                let met = |n| crate::tiles::variants::need_met(n, cfg, &opts.sched);
                for b in opts.faults.blind_spots(&met) {
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
        Some(s) => crate::shard::run(file, b, &info, opts, s)?,
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

/// `--gpus`: this run's layers over the GPUs, one worker process each (`gpus::fan_out`), then the
/// joined report written and gated as a one-GPU run's.
fn spread(
    req: &Request,
    g: &Spread,
    cfg: &MlaConfig,
    opts: &RunOptions,
    ready: Prepared,
) -> Result<i32> {
    if req.backend.choice == crate::backend::Choice::Cpu {
        return Err(Error::Usage(
            "--gpus spreads a run over GPUs: it needs --backend cuda (or auto on a GPU machine)"
                .into(),
        ));
    }
    if req.report.dump_dir.is_some() {
        return Err(Error::Usage(
            "--gpus does not dump tensors (each worker sees only its layers): dump from a one-GPU run, e.g. with --layers".into(),
        ));
    }
    let count = crate::backend::cuda::device::device_count()?;
    let devices = crate::gpus::devices(&g.spec, &crate::gpus::visible(count))?;
    let layers = opts.layers.as_ref().map_or(cfg.n_layer, Vec::len);
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("--gpus: cannot find this program to start its workers", e))?;
    let started = std::time::Instant::now();
    let quiet = req.report.formats.quiet;
    let rep = crate::gpus::fan_out(&exe, &g.args, &devices, layers, !quiet)?;
    finish(rep, ready, &req.report, started)
}

/// A run's report gated against its --baseline and written; the exit code.
fn finish(
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
