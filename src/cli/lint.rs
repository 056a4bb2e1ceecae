//! `mla-diff lint FILE`: the file's metadata against its tensors, the conventions, the catalogue, and
//! optionally the CUDA kernels' specialisations and an external runner's conventions.

use mla_diff::error::Error;
use mla_diff::lint::{self, Options, Target};
use mla_diff::precision::Dtype;
use mla_diff::report::output::{file_target, Target as Out};
use mla_diff::schedule::Schedule;
use std::path::PathBuf;

/// Which optimized path to check the dims against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LintBackend {
    /// The CPU mirror (takes any dims).
    Cpu,
    /// The CUDA kernels: which one each phase launches for these dims (no GPU needed).
    Cuda,
}

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file (any shard of a split model).
    file: PathBuf,
    /// Also check an external kernel (docs/runners.md): its `supports` against the model, and its
    /// softmax scale, LSE base, cache row order and page addressing, probed with tiny requests.
    #[arg(long, value_name = "CMD")]
    runner: Option<String>,
    /// Seconds the runner may take to describe itself or answer one probe before it is killed (exit 2).
    #[arg(long, value_name = "SECONDS", default_value_t = mla_diff::backend::runner::protocol::DEFAULT_TIMEOUT_S, value_parser = clap::value_parser!(u64).range(1..))]
    runner_timeout: u64,
    /// The page size a run would use (the runner's supports and the paging probe).
    #[arg(long, value_name = "N")]
    page_size: Option<usize>,
    /// Query tokens per decode step (the decode kernel's rows are q_len × heads).
    #[arg(long, default_value_t = Schedule::default().q_len)]
    q_len: usize,
    /// The latent cache format a run would send the runner (docs/cache-formats.md): the runner must
    /// list it in `supports.cache_formats`, and its scale convention is probed with exact rows.
    #[arg(long, value_enum, default_value_t = mla_diff::kv_format::KvFormat::Auto)]
    kv_cache_dtype: mla_diff::kv_format::KvFormat,
    /// Report which kernels of this optimized path take the model's dims.
    #[arg(long, value_enum)]
    backend: Option<LintBackend>,
    /// NVRTC target for `--backend cuda` (sm_90a: H100/H200).
    #[arg(long, default_value = "sm_90a")]
    arch: String,
    /// Storage precision a run would use.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// Write the findings as JSON (`lint_version` 1; `-` for stdout, the text then goes to stderr).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Print only errors and warnings (and the verdict line).
    #[arg(short, long)]
    quiet: bool,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    mla_diff::backend::runner::protocol::set_timeout(a.runner_timeout);
    let json = a
        .json
        .as_deref()
        .map(|p| file_target("--json", p))
        .transpose()?;
    let opts = Options {
        target: a.backend.map(|b| match b {
            LintBackend::Cpu => Target::Cpu,
            LintBackend::Cuda => Target::Cuda,
        }),
        arch: a.arch,
        runner: a.runner,
        page_size: a.page_size.unwrap_or(Schedule::default().page_size),
        page_size_given: a.page_size.is_some(),
        q_len: a.q_len,
        dtype: a.dtype,
        kv_format: a.kv_cache_dtype,
    };
    let mut report = lint::lint(&a.file, &opts)?;
    if let Some(t) = &json {
        t.write(&format!(
            "{}\n",
            serde_json::to_string_pretty(&report).expect("lint report serializes")
        ))?;
    }
    if a.quiet {
        report
            .findings
            .retain(|f| f.severity != lint::Severity::Note);
    }
    let text = report.text();
    if json == Some(Out::Stdout) {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    Ok(report.exit_code())
}
