//! `mla-diff run`: the comparison itself, its reports and the baseline gate.

use clap::ValueEnum;
use mla_diff::error::{Error, EXIT_DIVERGENCE, EXIT_PASS};
use mla_diff::faults::{FaultSet, Injection};
use mla_diff::gguf::GgufFile;
use mla_diff::model::MlaConfig;
use mla_diff::precision::Dtype;
use mla_diff::report::baseline::Identity;
use mla_diff::report::{self, Report};
use mla_diff::run::{plan, Modes, RunOptions};
use outputs::Outputs;
pub use plan::check_dense_beyond_top_k;
use std::path::PathBuf;

pub mod args;
mod capture;
mod outputs;
mod v4;

pub use args::{BackendArgs, FormatArgs, InputArgs, ReportArgs, ScheduleArgs, TolArgs};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    /// Each layer gets the reference's input: the layer's local error.
    Shadow,
    /// Each side feeds its own output forward: the accumulated drift.
    Free,
    Both,
}

#[derive(clap::Args)]
pub struct Args {
    /// The MLA (or DeepSeek-V4) GGUF file.
    file: PathBuf,
    /// Layers: `all`, `N`, `A..B` (half-open), `A..=B`, or a comma list.
    #[arg(long, default_value = "all")]
    layers: String,
    /// Storage precision of the optimized path (accumulation is f32).
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// Default: both, or shadow when --hidden holds per-layer captures.
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// Run a DSA model (GLM-5, DeepSeek-V3.2) without indexer tensors on a schedule where queries see
    /// more keys than the indexer's top_k: the run then checks dense attention, not the model. Without
    /// this flag such a run is refused; with it every report carries a notice. (A file with indexer
    /// tensors runs the sparse model past top_k: docs/dsa.md.)
    #[arg(long)]
    allow_dense_beyond_topk: bool,
    /// DSA: how the optimized indexer stores q and k: `storage` (the run's dtype) or `fp8` (Hadamard
    /// rotation, fp8 e4m3 with one scale per 128 values, as vLLM's indexer cache); the selection check's
    /// noise margin follows (docs/dsa.md). No effect on a file without an indexer.
    #[arg(long, value_enum, default_value = "storage")]
    indexer_keys: mla_diff::precision::KeyPrecision,
    /// Plant a bug from the catalogue in the optimized path, repeatable: NAME (every layer) or
    /// NAME@layer=L. `mla-diff selftest --list` shows the catalogue.
    #[arg(long = "inject", value_name = "NAME[@layer=L]")]
    inject: Vec<String>,
    /// Run the optimized path N times per layer on the same input and compare every stage bit for bit
    /// (NaNs equal to NaNs); any difference is nondeterminism and fails the run. 1: no repeat.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Run shard i of n (counted from 0) of the selected layers: a contiguous, balanced slice, started
    /// from the residual streams the whole run has there; `mla-diff merge` joins the shards' --json
    /// reports into the whole run's (docs/scale.md).
    #[arg(long, value_name = "i/n", conflicts_with_all = ["baseline", "write_baseline"])]
    shard: Option<String>,
    /// Spread the layers over this host's GPUs: `all`, a count N, or device indices (`0,1`; `0,0` puts
    /// two workers on one GPU). One worker process per GPU runs its --shard; the report is the one-GPU
    /// report (docs/scale.md). Needs the CUDA backend.
    #[arg(long, value_name = "all|N|LIST", conflicts_with = "shard")]
    gpus: Option<String>,
    /// Tensor parallel: run each layer as N ranks, each on its heads of q_b, k_b/v_b and its columns of
    /// o_proj, the partial outputs summed (all-reduce) as the engine does; report each rank against the
    /// fp64 reference of its heads, and the merged layer against the whole reference (docs/scale.md).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "runner")]
    tp: Option<u32>,
    /// With --tp: plant the --inject faults in rank r only.
    #[arg(long, value_name = "r", requires_all = ["tp", "inject"])]
    inject_rank: Option<usize>,
    /// Check what a serving engine computed: a capture folder (docs/captures.md) takes the optimized
    /// path's place, each layer's fp64 reference starting from the captured layer input. Repeatable:
    /// one folder per tensor-parallel rank. The capture's dtype and schedule are the run's.
    #[arg(long, value_name = "DIR", conflicts_with_all = [
        "runner", "tp", "gpus", "shard", "inject", "tokens", "hidden", "repeat", "write_capture",
        "dtype", "prompt_len", "decode_steps", "q_len", "chunk", "page_size", "num_splits",
        "no_shuffle", "pos_offset",
    ])]
    capture: Vec<PathBuf>,
    /// With --capture: the request to compare, by its manifest id (needed when a capture holds several).
    #[arg(long, value_name = "ID", requires = "capture")]
    capture_request: Option<u64>,
    /// Also write the optimized path's stages (with --inject: its planted bugs) as a capture into DIR
    /// (absent or empty), for `run --capture` (docs/captures.md).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["shard", "gpus"])]
    write_capture: Option<PathBuf>,
    // The groups last: clap keeps a group's help heading for the arguments after it.
    #[command(flatten)]
    input: InputArgs,
    #[command(flatten)]
    schedule: ScheduleArgs,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    tol: TolArgs,
    #[command(flatten)]
    report: ReportArgs,
}

impl Args {
    /// The run's schedule: the options given over the classic default, or, given none (and random
    /// inputs, which the schedule is free to fit), the kernel-aware one (`run::plan::default_schedule`),
    /// with the page choice a runner made.
    fn default_schedule(
        &self,
        cfg: &MlaConfig,
    ) -> Result<(mla_diff::schedule::Schedule, Option<(usize, usize)>), Error> {
        let fixed =
            self.schedule.given() || self.input.tokens.is_some() || self.input.hidden.is_some();
        if fixed {
            return Ok((self.schedule.schedule()?, None));
        }
        plan::default_schedule(cfg, self.backend.runner.as_deref())
    }

    /// A `--gpus` worker (`gpus::Worker`): its shard, its JSON report where the parent reads it, and
    /// nothing else written or gated (the parent does that with the joined report).
    fn become_worker(&mut self, w: &mla_diff::gpus::Worker) {
        self.shard = Some(w.shard.to_string());
        self.gpus = None;
        self.report = ReportArgs {
            formats: FormatArgs {
                json: Some(w.json.clone()),
                junit: None,
                markdown: None,
                color: report::table::ColorChoice::Never,
                quiet: true,
            },
            plot: None,
            dump_dir: None,
            dump_layers: "first".into(),
            baseline: None,
            baseline_factor: self.report.baseline_factor,
            allow_baseline_mismatch: false,
            write_baseline: None,
        };
    }

    /// `--gpus`: this run's layers over the GPUs, one worker process each (`gpus::fan_out`), then the
    /// joined report written and gated as a one-GPU run's.
    fn spread(
        &self,
        spec: &str,
        cfg: &MlaConfig,
        opts: &RunOptions,
        ready: Prepared,
    ) -> Result<i32, Error> {
        use mla_diff::backend::open::Choice;
        if self.backend.backend == Choice::Cpu {
            return Err(Error::Usage(
                "--gpus spreads a run over GPUs: it needs --backend cuda (or auto on a GPU machine)"
                    .into(),
            ));
        }
        if self.report.dump_dir.is_some() {
            return Err(Error::Usage(
                "--gpus does not dump tensors (each worker sees only its layers): dump from a one-GPU run, e.g. with --layers".into(),
            ));
        }
        let count = mla_diff::backend::cuda::device::device_count()?;
        let devices = mla_diff::gpus::devices(spec, &mla_diff::gpus::visible(count))?;
        let layers = opts.layers.as_ref().map_or(cfg.n_layer, Vec::len);
        let exe = std::env::current_exe()
            .map_err(|e| Error::io("--gpus: cannot find this program to start its workers", e))?;
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        let started = std::time::Instant::now();
        let quiet = self.report.formats.quiet;
        let rep = mla_diff::gpus::fan_out(&exe, &args, &devices, layers, !quiet)?;
        finish(rep, ready, &self.report, started)
    }

    /// The planted faults; unknown names are usage errors before anything is read.
    fn faults(&self) -> Result<FaultSet, Error> {
        Ok(FaultSet(
            self.inject
                .iter()
                .map(|s| Injection::parse(s))
                .collect::<Result<_, _>>()?,
        ))
    }

    /// The library's options for a run on `file`, every choice checked against the model (with the
    /// notes a choice calls for on stderr); and `(schedule's page, page run)` when the page was moved
    /// to one the runner takes (the runner backend's notice).
    fn options(
        &self,
        file: &GgufFile,
        cfg: &MlaConfig,
        faults: FaultSet,
    ) -> Result<(RunOptions, Option<(usize, usize)>), Error> {
        // The runner is asked to describe itself from here on (page choice, --inject): timed already.
        mla_diff::backend::runner::protocol::set_timeout(self.backend.runner_timeout);
        let (mut sched, mut choice) = self.default_schedule(cfg)?;
        // A runner that does not take the schedule's page gets one it does (the report says so); the
        // default schedule chose its own already (`default_schedule`).
        if let (Some(cmd), None, None) = (&self.backend.runner, self.schedule.page_size, choice) {
            choice = Some(plan::fit_runner_page(&mut sched, cmd)?);
        }
        let page_moved = choice.filter(|(want, page)| want != page);
        if let Some(cmd) = &self.backend.runner {
            plan::refuse_inject_under_runner(&faults, cmd)?;
        }
        let (tolerances, tolerance_source) = self.tol.table(self.dtype)?;
        let dump = self.report.dump(cfg.n_layer)?;
        let layers = mla_diff::run::parse_layers(&self.layers, cfg.n_layer)?;
        faults.check_layers(cfg.n_layer, &layers)?;
        // A file with an indexer runs the sparse model past top_k (`run::dsa`); only a DSA file without
        // one would run dense there.
        let sparse = mla_diff::run::dsa::sparse_for(file, cfg, &sched)?.is_some();
        if sparse && (self.shard.is_some() || self.gpus.is_some() || self.tp.is_some()) {
            return Err(Error::Usage(
                "--shard, --gpus and --tp do not run the DSA sparse model yet: use at most top_k tokens on this file, or run without them".into(),
            ));
        }
        if !sparse {
            check_dense_beyond_top_k(file, cfg, &sched, self.allow_dense_beyond_topk)?;
        }
        let hidden = &self.input.hidden;
        let mode = match (self.mode, hidden) {
            (Some(m), _) => m,
            // Per-layer captures restart the reference at each layer, so free mode has no meaning there.
            (None, Some(p))
                if self.input.tokens.is_none() && mla_diff::input::npy_ndim(p)? == 3 =>
            {
                eprintln!(
                    "mla-diff: note: per-layer captures in {}: shadow mode only",
                    p.display()
                );
                ModeArg::Shadow
            }
            (None, _) => ModeArg::Both,
        };
        let opts = RunOptions {
            layers: Some(layers),
            input: self.input.spec(),
            sched,
            dtype: self.dtype,
            modes: Modes {
                shadow: mode != ModeArg::Free,
                free: mode != ModeArg::Shadow,
            },
            tolerances,
            tolerance_source,
            dump,
            faults,
            progress: !self.report.formats.quiet,
            repeat: self.repeat as usize,
            indexer_keys: self.indexer_keys,
        };
        Ok((opts, page_moved))
    }
}

pub fn exec(mut a: Args) -> Result<i32, Error> {
    let worker = mla_diff::gpus::Worker::from_env()?;
    if let Some(w) = &worker {
        a.become_worker(w);
    }
    let faults = a.faults()?;
    // A capture neither says nor keeps the cache's byte format yet (issue #38, the runner protocol's
    // `cache.format`): refused rather than judged as the dtype's cache.
    let kv = a.backend.kv_cache_dtype;
    if !kv.is_auto() && (!a.capture.is_empty() || a.write_capture.is_some()) {
        return Err(Error::Usage(format!(
            "--kv-cache-dtype {kv}: captures (--capture, --write-capture) carry the dtype's cache only so far (issue #38)"
        )));
    }
    let file = GgufFile::open(&a.file)?;
    if mla_diff::run::v4::is_v4(&file) {
        return v4::exec(&a, &file, faults);
    }
    let cfg = MlaConfig::from_gguf(&file)?;
    if !a.capture.is_empty() {
        return capture::exec(&a, &file, &cfg);
    }
    let shard = a
        .shard
        .as_deref()
        .map(mla_diff::shard::Shard::parse)
        .transpose()?;
    let (opts, page_moved) = a.options(&file, &cfg, faults)?;
    a.backend.runner_page_moved = page_moved;
    if let Some(s) = shard {
        // Before the run: a shard count larger than the layers is a usage error.
        let n = opts.layers.as_ref().map_or(cfg.n_layer, Vec::len);
        s.range(n, "layers")?;
    }
    let tp = a.tp.map(|n| mla_diff::tp::TpSpec {
        size: n as usize,
        fault_rank: a.inject_rank,
    });
    if let Some(t) = &tp {
        t.check(&cfg)?;
    }
    let ready = Prepared::check(&file, &cfg, &opts, &a.report)?;
    if let Some(spec) = &a.gpus {
        return a.spread(spec, &cfg, &opts, ready);
    }
    let job = Job {
        file: &file,
        cfg: &cfg,
        opts: &opts,
    };
    let how = How {
        shard,
        tp,
        write_capture: a.write_capture.clone(),
    };
    execute(job, ready, &a.backend, &a.report, &[], how)
}

/// What a run runs: the file, its config and the run's options, made by `run` or `replay`.
#[derive(Clone, Copy)]
pub struct Job<'a> {
    pub file: &'a GgufFile,
    pub cfg: &'a MlaConfig,
    pub opts: &'a RunOptions,
}

/// How `run` splits its work (`--shard`, `--tp`); `How::default()` for `replay`.
#[derive(Default)]
pub struct How {
    pub shard: Option<mla_diff::shard::Shard>,
    pub tp: Option<mla_diff::tp::TpSpec>,
    /// `--write-capture DIR`.
    pub write_capture: Option<PathBuf>,
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
        r: &ReportArgs,
    ) -> Result<Prepared, Error> {
        Ok(Prepared {
            outputs: Outputs::check(r)?,
            baseline: r.baseline(&Identity::planned(file, cfg, opts)?)?,
        })
    }
}

/// The run once its options are made and its outputs checked, shared by `run` and `replay`: open the
/// backend, run (split as `how` says), gate, write the reports; the exit code. `notices` are added to
/// the report's.
pub fn execute(
    job: Job,
    ready: Prepared,
    backend: &BackendArgs,
    r: &ReportArgs,
    notices: &[String],
    how: How,
) -> Result<i32, Error> {
    let Job { file, cfg, opts } = job;
    let Prepared { outputs, baseline } = ready;
    if !r.formats.quiet {
        let met = |n| mla_diff::tiles::variants::need_met(n, cfg, &opts.sched);
        for b in opts.faults.blind_spots(&met) {
            eprintln!("mla-diff: note: injected fault {b} may not show on this run");
        }
    }
    let (mut backend, mut info) = backend.open(opts.dtype)?;
    // --write-capture wraps the path the ranks run on (each rank's call is written as its own
    // capture), --tp wraps that.
    let mut writer = None;
    let inner: &mut dyn mla_diff::backend::Backend = match &how.write_capture {
        Some(dir) => writer.insert(mla_diff::capture::write::WriteCapture::new(
            backend.as_mut(),
            dir,
            file,
            opts.dtype,
            &opts.sched,
            how.tp.map_or(1, |t| t.size),
        )?),
        None => backend.as_mut(),
    };
    let mut tp = None;
    let b: &mut dyn mla_diff::backend::Backend = match how.tp {
        Some(spec) => {
            let tolerances = opts.tolerances.clone();
            let t = tp.insert(mla_diff::tp::TpBackend::new(
                inner, spec, opts.dtype, tolerances,
            ));
            info.description = mla_diff::backend::Backend::describe(t);
            t
        }
        None => inner,
    };
    let started = std::time::Instant::now();
    let mut rep = match how.shard {
        Some(s) => mla_diff::shard::run(file, b, &info, opts, s)?,
        None => mla_diff::run::run(file, b, &info, opts)?,
    };
    if let Some(t) = tp {
        let layers = rep.run.layers.clone();
        rep.set_tp(t.result(cfg, &layers));
    }
    if let Some(w) = writer {
        let tokens = match &opts.input {
            mla_diff::run::InputSpec::Tokens(ids) => Some(ids.as_slice()),
            _ => None,
        };
        let dirs = w.finish(tokens, rep.environment.backend.clone())?;
        if !r.formats.quiet {
            for d in dirs {
                eprintln!("mla-diff: capture written to {}", d.display());
            }
        }
    }
    rep.run.notices.extend(notices.iter().cloned());
    finish(rep, Prepared { outputs, baseline }, r, started)
}

/// A run's report gated against its --baseline and written; the exit code.
fn finish(
    mut rep: Report,
    ready: Prepared,
    r: &ReportArgs,
    started: std::time::Instant,
) -> Result<i32, Error> {
    let Prepared { outputs, baseline } = ready;
    if let (Some((b, diffs)), Some(p)) = (baseline, &r.baseline) {
        let mut g = report::baseline::gate(&rep, &b, &p.display().to_string(), r.baseline_factor);
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
