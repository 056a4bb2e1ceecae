//! `mla-diff run`: the command line of a run, turned into the library's plain options
//! (`mla_diff::run::command::Request`), which does the rest.

use mla_diff::error::Error;
use mla_diff::faults::{FaultSet, Injection};
use mla_diff::precision::Dtype;
use mla_diff::run::command::{self, Request, Spread};
use mla_diff::run::Mode;
use std::path::PathBuf;

pub mod args;

pub use args::{BackendArgs, FormatArgs, InputArgs, ReportArgs, ScheduleArgs, TolArgs};

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
    mode: Option<Mode>,
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
    /// With the kernel-aware default schedule: how many of the selected layers, the first ones, run
    /// it; the others run the classic 64-token schedule, in a second pass whose residual streams are
    /// recomputed over the first layers at its tokens (the report's `run.split`; docs/scale.md). `all`:
    /// every layer on the kernel-aware schedule. Not split: runs with --runner, --tp, --shard, --gpus or
    /// --write-capture, and a DSA file's sparse model.
    #[arg(long, value_name = "N|all", default_value = "2", value_parser = covering_layers)]
    covering_layers: usize,
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
    /// The library's request: the same options as plain values. Planted faults and a shard are parsed
    /// here (unknown names are usage errors before anything is read); the rest is checked against the
    /// model by the library.
    fn request(self) -> Result<Request, Error> {
        let faults = self.inject.iter().map(|s| Injection::parse(s));
        let shard = self.shard.as_deref();
        Ok(Request {
            file: self.file,
            layers: self.layers,
            dtype: self.dtype,
            mode: self.mode,
            allow_dense_beyond_topk: self.allow_dense_beyond_topk,
            indexer_keys: self.indexer_keys,
            faults: FaultSet(faults.collect::<Result<_, _>>()?),
            repeat: self.repeat as usize,
            shard: shard.map(mla_diff::shard::Shard::parse).transpose()?,
            // The workers rerun this command line, each with its shard (`gpus::fan_out`).
            gpus: self.gpus.map(|spec| Spread {
                spec,
                args: std::env::args_os().skip(1).collect(),
            }),
            tp: self.tp.map(|n| mla_diff::tp::TpSpec {
                size: n as usize,
                fault_rank: self.inject_rank,
            }),
            capture: self.capture,
            capture_request: self.capture_request,
            write_capture: self.write_capture,
            input: self.input.spec(),
            schedule: self.schedule.overrides(),
            covering_layers: self.covering_layers,
            backend: self.backend.spec(),
            tol: self.tol.overrides(),
            report: self.report.options(),
        })
    }
}

/// `--covering-layers`: a count of at least 1, or `all`.
fn covering_layers(s: &str) -> Result<usize, String> {
    match s {
        "all" => Ok(usize::MAX),
        n => match n.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(format!("{n:?}: a count of layers (at least 1) or `all`")),
        },
    }
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let worker = mla_diff::gpus::Worker::from_env()?;
    let mut req = a.request()?;
    if let Some(w) = &worker {
        req.become_worker(w);
    }
    command::exec(req)
}
