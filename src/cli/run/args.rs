//! The groups of `run`'s options that other commands take too, each a struct flattened into the
//! commands' `Args` (cargo's style): `export` takes the input and schedule options, `replay` the backend,
//! tolerance and report options. Each turns into the library's plain options (`spec`, `overrides`,
//! `options`): a new backend option (an external runner, say) is one field here and one in
//! `mla_diff::backend::open::Spec`, and then every command that runs a backend has it.

use mla_diff::backend::Choice;
use mla_diff::report;
use mla_diff::report::outputs::{Formats, ReportOptions};
use mla_diff::run::InputSpec;
use std::path::PathBuf;

/// Where the layer inputs come from.
#[derive(clap::Args)]
#[command(next_help_heading = "Input")]
pub struct InputArgs {
    /// Token ids (comma-separated) fed through token_embd; their count must equal the schedule's tokens.
    #[arg(long, value_delimiter = ',', conflicts_with = "hidden")]
    pub tokens: Option<Vec<u32>>,
    /// Seed of the random hidden states (used when neither --tokens nor --hidden is given).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Captured activations (.npy as numpy writes it: float16/32/64, C or Fortran order): [T, hidden] or
    /// [layers, T, hidden] (per-layer captures: shadow mode only).
    #[arg(long)]
    pub hidden: Option<PathBuf>,
}

impl InputArgs {
    pub fn spec(&self) -> InputSpec {
        match (&self.tokens, &self.hidden) {
            (Some(t), _) => InputSpec::Tokens(t.clone()),
            (None, Some(p)) => InputSpec::Npy(p.clone()),
            (None, None) => InputSpec::Random { seed: self.seed },
        }
    }
}

/// The serving schedule. Each option not given takes the classic default (`Schedule::default()`: 48
/// prompt tokens in chunks of 32, 16 decode steps of 1 token, page 16, 4 splits); `run` given none of them
/// (and no --tokens or --hidden) uses the kernel-aware schedule instead (docs/coverage.md; with
/// --runner, within what the runner supports: docs/runners.md).
#[derive(clap::Args)]
#[command(next_help_heading = "Schedule")]
pub struct ScheduleArgs {
    /// Tokens processed by prefill [classic default: 48]. All tokens (prompt + decode steps × q-len) at
    /// most 2^20, and at most what memory allows: the fp64 reference keeps T×T scores per head, so a layer
    /// needs O(T²) bytes; the run stops with the estimate when it exceeds MemAvailable (or
    /// MLA_DIFF_MAX_MEMORY, bytes).
    #[arg(long, value_name = "N")]
    pub prompt_len: Option<usize>,
    /// Decode steps after the prompt [classic default: 16].
    #[arg(long, value_name = "N")]
    pub decode_steps: Option<usize>,
    /// Query tokens per decode step (> 1: speculative / MTP decode) [classic default: 1].
    #[arg(long, value_name = "N")]
    pub q_len: Option<usize>,
    /// Prefill chunk size [classic default: 32].
    #[arg(long, value_name = "N")]
    pub chunk: Option<usize>,
    /// Rows per cache page (at most 2^20) [classic default: 16].
    #[arg(long, value_name = "N")]
    pub page_size: Option<usize>,
    /// Split-KV ways for decode (at most 2^20) [classic default: 4].
    #[arg(long, value_name = "N")]
    pub num_splits: Option<usize>,
    /// Keep the block table in order instead of shuffling it.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Position of the first token (rope offset; the last position must stay below 2^31) [default: 0].
    #[arg(long, value_name = "N")]
    pub pos_offset: Option<usize>,
}

impl ScheduleArgs {
    pub fn overrides(&self) -> mla_diff::schedule::Overrides {
        mla_diff::schedule::Overrides {
            prompt_len: self.prompt_len,
            decode_steps: self.decode_steps,
            q_len: self.q_len,
            chunk: self.chunk,
            page_size: self.page_size,
            num_splits: self.num_splits,
            no_shuffle: self.no_shuffle,
            pos_offset: self.pos_offset,
        }
    }
}

/// Which optimized path runs, and how it is made.
#[derive(clap::Args)]
#[command(next_help_heading = "Backend")]
pub struct BackendArgs {
    #[arg(long, value_enum, default_value_t = Choice::Auto)]
    pub backend: Choice,
    /// Directory of edited kernels (.cu) to compile at run time instead of the built-in ones.
    #[arg(long)]
    pub kernels: Option<PathBuf>,
    /// An external kernel to check (docs/runners.md): `CMD ARGS…` of a runner speaking mla-diff's
    /// protocol, e.g. 'python3 runners/flashmla.py'. Its ops (decode, prefill) replace the --backend's
    /// stages; each of its stages is also checked against fp64 from its own inputs (`STAGE@runner`).
    #[arg(long, value_name = "CMD")]
    pub runner: Option<String>,
    /// Seconds a runner may take to describe itself or answer one request before it is killed and the
    /// run stops (exit 2) — a hung kernel must not hang the run.
    #[arg(long, value_name = "SECONDS", default_value_t = mla_diff::backend::runner::protocol::DEFAULT_TIMEOUT_S, value_parser = clap::value_parser!(u64).range(1..))]
    pub runner_timeout: u64,
    /// How the optimized path stores its latent cache: `auto` (the run's --dtype), `fp8` (e4m3, one scale
    /// per layer), `fp8_ds_mla` (656 B/token), `fp8_ds_mla_nope`, `fp8_v41` (528 B), `fp4_v41` (288 B);
    /// docs/cache-formats.md. CPU mirror only for now.
    #[arg(long, value_enum, default_value = "auto", value_name = "FORMAT")]
    pub kv_cache_dtype: mla_diff::kv_format::KvFormat,
}

impl BackendArgs {
    pub fn spec(&self) -> mla_diff::backend::open::Spec {
        mla_diff::backend::open::Spec {
            choice: self.backend,
            kernels_dir: self.kernels.clone(),
            runner: self.runner.clone(),
            runner_timeout: self.runner_timeout,
            kv_format: self.kv_cache_dtype,
        }
    }
}

/// Tolerance overrides laid over the calibrated defaults.
#[derive(clap::Args)]
#[command(next_help_heading = "Tolerances")]
pub struct TolArgs {
    /// Tolerance override for the run's dtype, repeatable: `STAGE=FIELD:X,...` with FIELD rel_l2,
    /// atol_rms or rtol (any subset). STAGE: a long or table name (`attn_out`, `out`), all phases, or
    /// one phase (`attn_out[decode]`, `out.d`).
    #[arg(long = "tol", value_name = "STAGE=FIELD:X,...")]
    pub tol: Vec<String>,
    /// Tolerance file `{"dtypes": {DTYPE: {STAGE: {FIELD: X}}}}` (the format of `mla-diff calibrate`;
    /// keys and partial entries as for --tol), laid over the defaults.
    #[arg(long)]
    pub tol_file: Option<PathBuf>,
}

impl TolArgs {
    pub fn overrides(&self) -> mla_diff::compare::tolerance::Overrides {
        mla_diff::compare::tolerance::Overrides {
            file: self.tol_file.clone(),
            entries: self.tol.clone(),
        }
    }
}

/// The report formats and the terminal output: what every command that writes a verdict report takes
/// (`run`, `replay`, `sweep`).
#[derive(clap::Args)]
#[command(next_help_heading = "Reports")]
pub struct FormatArgs {
    /// Write the JSON report here. `-` is stdout for every format (one of them at most; the table then
    /// goes to stderr).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write JUnit XML here (`-` for stdout).
    #[arg(long)]
    pub junit: Option<PathBuf>,
    /// Write a Markdown summary here (`-` for stdout).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Colour the table: `auto` on a terminal unless NO_COLOR is set. Failing cells carry `!` either way.
    #[arg(long, value_enum, default_value_t = report::table::ColorChoice::Auto)]
    pub color: report::table::ColorChoice,
    /// Print only the verdict line (and errors): no table, progress or notes.
    #[arg(short, long)]
    pub quiet: bool,
}

/// The reports, the `.npy` dumps and the baseline gate.
#[derive(clap::Args)]
#[command(next_help_heading = "Reports")]
pub struct ReportArgs {
    #[command(flatten)]
    pub formats: FormatArgs,
    /// Write an SVG heat map of error over layer × stage here (`-` for stdout).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Dump reference and optimized stage tensors as .npy into this directory.
    #[arg(long)]
    pub dump_dir: Option<PathBuf>,
    /// Which layers to dump: `first` (first diverging), `all`, or a comma list.
    #[arg(long, default_value = "first")]
    pub dump_layers: String,
    /// Fail when any metric is worse than this earlier report by more than --baseline-factor.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    #[arg(long, default_value_t = report::baseline::DEFAULT_FACTOR)]
    pub baseline_factor: f64,
    /// Compare against a --baseline of another file, architecture, dtype, schedule, input or tolerance
    /// set (refused by default, exit 2); the report records each difference.
    #[arg(long)]
    pub allow_baseline_mismatch: bool,
    /// Write this run's report as the new baseline (`-` for stdout).
    #[arg(long)]
    pub write_baseline: Option<PathBuf>,
}

impl FormatArgs {
    pub fn formats(&self) -> Formats {
        Formats {
            json: self.json.clone(),
            junit: self.junit.clone(),
            markdown: self.markdown.clone(),
            color: self.color,
            quiet: self.quiet,
        }
    }
}

impl ReportArgs {
    pub fn options(&self) -> ReportOptions {
        ReportOptions {
            formats: self.formats.formats(),
            plot: self.plot.clone(),
            dump_dir: self.dump_dir.clone(),
            dump_layers: self.dump_layers.clone(),
            baseline: self.baseline.clone(),
            baseline_factor: self.baseline_factor,
            allow_baseline_mismatch: self.allow_baseline_mismatch,
            write_baseline: self.write_baseline.clone(),
        }
    }
}
