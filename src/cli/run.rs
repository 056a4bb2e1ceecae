//! `mla-diff run`: the comparison itself, its reports and the baseline gate.

use clap::ValueEnum;
use mla_diff::backend::{Choice, Dtype};
use mla_diff::compare::ToleranceTable;
use mla_diff::error::{Error, EXIT_DIVERGENCE, EXIT_PASS};
use mla_diff::faults::{FaultSet, Injection};
use mla_diff::gguf::GgufFile;
use mla_diff::model::MlaConfig;
use mla_diff::report::baseline::Identity;
use mla_diff::report::{self, Report};
use mla_diff::run::{DumpLayers, InputSpec, Modes, RunOptions};
use mla_diff::schedule::Schedule;
use outputs::Outputs;
use std::path::PathBuf;

mod outputs;

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
    /// The MLA GGUF file.
    file: PathBuf,
    /// Layers: `all`, `N`, `A..B` (half-open), `A..=B`, or a comma list.
    #[arg(long, default_value = "all")]
    layers: String,
    /// Token ids (comma-separated) fed through token_embd; their count must equal the schedule's tokens.
    #[arg(long, value_delimiter = ',', conflicts_with = "hidden")]
    tokens: Option<Vec<u32>>,
    /// Seed of the random hidden states (used when neither --tokens nor --hidden is given).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Captured activations (.npy as numpy writes it: float16/32/64, C or Fortran order): [T, hidden] or
    /// [layers, T, hidden] (per-layer captures: shadow mode only).
    #[arg(long)]
    hidden: Option<PathBuf>,
    /// Tokens processed by prefill. All tokens (prompt + decode steps × q-len) at most 2^20, and at most
    /// what memory allows: the fp64 reference keeps T×T scores per head, so a layer needs O(T²) bytes;
    /// the run stops with the estimate when it exceeds MemAvailable (or MLA_DIFF_MAX_MEMORY, bytes).
    #[arg(long, default_value_t = Schedule::default().prompt_len)]
    prompt_len: usize,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = Schedule::default().decode_steps)]
    decode_steps: usize,
    /// Query tokens per decode step (> 1: speculative / MTP decode).
    #[arg(long, default_value_t = 1)]
    q_len: usize,
    /// Prefill chunk size.
    #[arg(long, default_value_t = Schedule::default().chunk)]
    chunk: usize,
    /// Rows per cache page (at most 2^20).
    #[arg(long, default_value_t = Schedule::default().page_size)]
    page_size: usize,
    /// Split-KV ways for decode (at most 2^20).
    #[arg(long, default_value_t = Schedule::default().num_splits)]
    num_splits: usize,
    /// Keep the block table in order instead of shuffling it.
    #[arg(long)]
    no_shuffle: bool,
    /// Position of the first token (rope offset; the last position must stay below 2^31).
    #[arg(long, default_value_t = 0)]
    pos_offset: usize,
    /// Storage precision of the optimized path (accumulation is f32).
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    #[arg(long, value_enum, default_value_t = Choice::Auto)]
    backend: Choice,
    /// Default: both, or shadow when --hidden holds per-layer captures.
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// Run a DSA model (GLM-5, DeepSeek-V3.2) on a schedule where queries see more keys than the
    /// indexer's top_k: the reference is dense, so the run then checks dense attention, not the model.
    /// Without this flag such a run is refused; with it every report carries a notice.
    #[arg(long)]
    allow_dense_beyond_topk: bool,
    /// Tolerance override for --dtype, repeatable: `STAGE=FIELD:X,...` with FIELD rel_l2, atol_rms or rtol
    /// (any subset). STAGE: a long or table name (`attn_out`, `out`), all phases, or one phase
    /// (`attn_out[decode]`, `out.d`).
    #[arg(long = "tol", value_name = "STAGE=FIELD:X,...")]
    tol: Vec<String>,
    /// Tolerance file `{"dtypes": {DTYPE: {STAGE: {FIELD: X}}}}` (the format of `mla-diff calibrate`;
    /// keys and partial entries as for --tol), laid over the defaults.
    #[arg(long)]
    tol_file: Option<PathBuf>,
    /// Write the JSON report here. `-` is stdout for every format (one of them at most; the table then
    /// goes to stderr).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write JUnit XML here (`-` for stdout).
    #[arg(long)]
    junit: Option<PathBuf>,
    /// Write a Markdown summary here (`-` for stdout).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write an SVG heat map of error over layer × stage here (`-` for stdout).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Colour the table: `auto` on a terminal unless NO_COLOR is set. Failing cells carry `!` either way.
    #[arg(long, value_enum, default_value_t = report::table::ColorChoice::Auto)]
    color: report::table::ColorChoice,
    /// Print only the verdict line (and errors): no table, progress or notes.
    #[arg(short, long)]
    quiet: bool,
    /// Dump reference and optimized stage tensors as .npy into this directory.
    #[arg(long)]
    dump_dir: Option<PathBuf>,
    /// Which layers to dump: `first` (first diverging), `all`, or a comma list.
    #[arg(long, default_value = "first")]
    dump_layers: String,
    /// Fail when any metric is worse than this earlier report by more than --baseline-factor.
    #[arg(long)]
    baseline: Option<PathBuf>,
    #[arg(long, default_value_t = report::baseline::DEFAULT_FACTOR)]
    baseline_factor: f64,
    /// Compare against a --baseline of another file, architecture, dtype, schedule, input or tolerance
    /// set (refused by default, exit 2); the report records each difference.
    #[arg(long)]
    allow_baseline_mismatch: bool,
    /// Write this run's report as the new baseline (`-` for stdout).
    #[arg(long)]
    write_baseline: Option<PathBuf>,
    /// Directory of edited kernels (.cu) to compile at run time instead of the built-in ones.
    #[arg(long)]
    kernels: Option<PathBuf>,
    /// An external kernel to check (docs/runners.md): `CMD ARGS…` of a runner speaking mla-diff's
    /// protocol, e.g. 'python3 runners/flashmla.py'. Its ops (decode, prefill) replace the --backend's
    /// stages; each of its stages is also checked against fp64 from its own inputs (`STAGE@runner`).
    #[arg(long, value_name = "CMD")]
    runner: Option<String>,
    /// Plant a bug from the catalogue in the optimized path, repeatable: NAME (every layer) or
    /// NAME@layer=L. `mla-diff selftest --list` shows the catalogue.
    #[arg(long = "inject", value_name = "NAME[@layer=L]")]
    inject: Vec<String>,
}

impl Args {
    /// The planted faults; unknown names are usage errors before anything is read.
    fn faults(&self) -> Result<FaultSet, Error> {
        Ok(FaultSet(
            self.inject
                .iter()
                .map(|s| Injection::parse(s))
                .collect::<Result<_, _>>()?,
        ))
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            prompt_len: self.prompt_len,
            chunk: self.chunk,
            decode_steps: self.decode_steps,
            q_len: self.q_len,
            page_size: self.page_size,
            num_splits: self.num_splits,
            shuffle_seed: if self.no_shuffle {
                None
            } else {
                Schedule::default().shuffle_seed
            },
            pos_offset: self.pos_offset,
            ..Schedule::default()
        }
    }

    /// The library's options for a run on `file`, every choice checked against the model (with the
    /// notes a choice calls for on stderr).
    fn options(
        &self,
        file: &GgufFile,
        cfg: &MlaConfig,
        faults: FaultSet,
    ) -> Result<RunOptions, Error> {
        let sched = self.schedule();
        sched.validate()?;
        let (tolerances, tolerance_source) =
            ToleranceTable::with_overrides(self.dtype, self.tol_file.as_deref(), &self.tol)?;
        let dump = match &self.dump_dir {
            None => None,
            Some(d) => Some((
                d.clone(),
                DumpLayers::parse(&self.dump_layers, cfg.n_layer)?,
            )),
        };
        let input = match (&self.tokens, &self.hidden) {
            (Some(t), _) => InputSpec::Tokens(t.clone()),
            (None, Some(p)) => InputSpec::Npy(p.clone()),
            (None, None) => InputSpec::Random { seed: self.seed },
        };
        let layers = mla_diff::run::parse_layers(&self.layers, cfg.n_layer)?;
        faults.check_layers(cfg.n_layer, &layers)?;
        if let Some(n) = mla_diff::run::dense_beyond_top_k(file, cfg, &sched) {
            if !self.allow_dense_beyond_topk {
                return Err(Error::Usage(format!(
                    "{n}. Pass --allow-dense-beyond-topk to run anyway, or use at most top_k tokens"
                )));
            }
            eprintln!("mla-diff: note: {n}");
        }
        let mode = match (self.mode, &self.hidden) {
            (Some(m), _) => m,
            // Per-layer captures restart the reference at each layer, so free mode has no meaning there.
            (None, Some(p)) if self.tokens.is_none() && mla_diff::input::npy_ndim(p)? == 3 => {
                eprintln!(
                    "mla-diff: note: per-layer captures in {}: shadow mode only",
                    p.display()
                );
                ModeArg::Shadow
            }
            (None, _) => ModeArg::Both,
        };
        Ok(RunOptions {
            layers: Some(layers),
            input,
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
            progress: !self.quiet,
        })
    }

    /// The --baseline report and how it differs from this run; a report of another run is refused
    /// unless --allow-baseline-mismatch.
    fn baseline(&self, planned: &Identity) -> Result<Option<(Report, Vec<String>)>, Error> {
        let Some(p) = &self.baseline else {
            return Ok(None);
        };
        let b = Report::from_json_file(p)?;
        let diffs = planned.differences(&Identity::of(&b));
        if !diffs.is_empty() && !self.allow_baseline_mismatch {
            return Err(Error::Usage(format!(
                "--baseline {} is a report of another run: {} (--allow-baseline-mismatch compares anyway)",
                p.display(),
                diffs.join("; ")
            )));
        }
        Ok(Some((b, diffs)))
    }
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let faults = a.faults()?;
    let file = GgufFile::open(&a.file)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let opts = a.options(&file, &cfg, faults)?;
    // Fail on unusable output paths and a mismatched baseline before the (possibly long) run.
    let outputs = Outputs::check(&a)?;
    let baseline = a.baseline(&Identity::planned(&file, &cfg, &opts)?)?;
    if !a.quiet {
        for b in opts.faults.blind_spots(&cfg, &opts.sched) {
            eprintln!("mla-diff: note: injected fault {b} may not show on this run");
        }
    }
    let (mut backend, info) = mla_diff::backend::open(
        a.backend,
        &mla_diff::backend::Options {
            dtype: a.dtype,
            kernels_dir: a.kernels.clone(),
            runner: a.runner.clone(),
        },
    )?;
    let started = std::time::Instant::now();
    let mut rep = mla_diff::run::run(&file, backend.as_mut(), &info, &opts)?;
    if let (Some((b, diffs)), Some(p)) = (baseline, &a.baseline) {
        let mut g = report::baseline::gate(&rep, &b, &p.display().to_string(), a.baseline_factor);
        g.across = diffs;
        rep.set_baseline(g);
    }
    outputs.write(&rep, &a)?;
    if !a.quiet {
        if let Some(d) = &a.dump_dir {
            if rep.dumps.is_empty() {
                eprintln!(
                    "mla-diff: no layer dumped into {} (--dump-layers {}: nothing selected)",
                    d.display(),
                    a.dump_layers
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
