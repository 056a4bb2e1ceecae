//! `mla-diff bench`: timings on this machine (not tests).

use clap::Subcommand;
use mla_diff::backend::Kind;
use mla_diff::error::Error;
use mla_diff::model::synthetic::{Dims, Family};
use mla_diff::precision::Dtype;
use mla_diff::tools::bench::BenchOptions;
use mla_diff::tools::table;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: BenchCmd,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Time the fp64 reference of one synthetic layer next to a plain f64 GEMM of the same FLOP count.
    Reference(ReferenceArgs),
    /// Split-KV absorbed MLA decode at DeepSeek-V3 dims (B=64, s_k=4096, page 64; 16 and 128 heads).
    Decode(DecodeArgs),
    /// Causal prefill flash attention at 4k tokens (qk 192 / v 128, 128 heads; 256 / 256, 64 heads).
    Prefill(PrefillArgs),
    /// Issue #16's table in one run: 4 decode and 2 prefill shapes per dtype, our fastest correct
    /// configuration, the peers on the same inputs, the ceilings, ratios, correctness and floor verdicts.
    Table(TableArgs),
    /// The floor under a whole-file run's time: every layer's attention tensors read from the file, then
    /// loaded and dequantized to f32 as `run` does, layers in parallel on all cores (nothing judged).
    Load(LoadArgs),
}

#[derive(clap::Args)]
struct LoadArgs {
    /// The MLA GGUF file.
    file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ReferenceArgs {
    /// Layer shape family (per-head dims, rope, scaling); full model sizes unless overridden.
    #[arg(long, value_enum, default_value = "deepseek-v3")]
    preset: Family,
    /// Hidden size (default: the preset's real model).
    #[arg(long)]
    hidden: Option<usize>,
    /// Attention heads (default: the preset's real model).
    #[arg(long)]
    heads: Option<usize>,
    /// q-LoRA rank (0: no q-LoRA).
    #[arg(long)]
    q_lora: Option<usize>,
    /// kv latent rank (default: the preset's).
    #[arg(long)]
    kv_lora: Option<usize>,
    /// Tokens of the run (prefill + decode).
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Of the tokens, how many are decode steps (one token each).
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// Timed repetitions of each side (best of).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// What every GPU bench takes.
#[derive(clap::Args)]
struct GpuArgs {
    /// Only `cuda` (the CPU mirror is not timed).
    #[arg(long, value_enum, default_value = "cuda")]
    backend: Kind,
    /// Read the kernel sources from this directory instead of the embedded copy.
    #[arg(long)]
    kernels: Option<PathBuf>,
    /// Back-to-back launches per timed sample, ours and the peers' alike (1: one launch after a
    /// synchronize, which counts the host's dispatch latency, the Python peers' most).
    #[arg(long, default_value_t = LAUNCHES, value_parser = clap::value_parser!(u32).range(1..=1000))]
    launches: u32,
}

impl GpuArgs {
    /// The options of a decode or prefill bench (decode: its head counts and whether the best tile only).
    fn options(
        &self,
        decode: Option<(&[usize], bool)>,
        peers: &[String],
    ) -> Result<BenchOptions, Error> {
        only_cuda(self.backend)?;
        Ok(BenchOptions {
            kernels_dir: self.kernels.clone(),
            decode: decode.is_some(),
            prefill: decode.is_none(),
            iters: ITERS,
            decode_heads: decode.map(|d| d.0.to_vec()).unwrap_or_default(),
            best_only: decode.is_some_and(|d| d.1),
            peers: peers.to_vec(),
            launches: self.launches as usize,
        })
    }
}

#[derive(clap::Args)]
struct DecodeArgs {
    #[command(flatten)]
    gpu: GpuArgs,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Head counts to time (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "16,128")]
    heads: Vec<usize>,
    /// Time only the first (preferred) tile of each head count, not the alternatives.
    #[arg(long)]
    best_only: bool,
    /// Other projects' decode kernels to time on the same inputs, through their runners: `flashmla`,
    /// `vllm-triton` (runners/, under MLA_DIFF_PYTHON or python3), or a runner command line.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
}

#[derive(clap::Args)]
struct PrefillArgs {
    #[command(flatten)]
    gpu: GpuArgs,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Other projects' prefill kernels to time on the same inputs, through their runners: `torch`
    /// (runners/torch_sdpa.py; its SDPA kernel from MLA_DIFF_SDPA_BACKEND, e.g. cudnn), or a runner
    /// command line.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Time only Hopper's warpgroup-MMA tiles (kernel probes), not the mma.sync fallbacks.
    #[arg(long)]
    wgmma_only: bool,
}

#[derive(clap::Args)]
struct TableArgs {
    #[command(flatten)]
    gpu: GpuArgs,
    /// Also write the whole record (every timing, the summary, the floors) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write the summary table as Markdown to this file.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Storage types (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "bf16,fp16")]
    dtypes: Vec<Dtype>,
    /// Peers (as for `bench decode --peers`); the prefill floor is against torch on cuDNN
    /// (MLA_DIFF_SDPA_BACKEND=cudnn). Empty (`--peers ''`): ours and the ceilings only.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "flashmla,vllm-triton,torch"
    )]
    peers: Vec<String>,
    /// Only these rows of the table (1-6, in the order: decode H=128, H=16, B=128 H=64,
    /// B=16 s_k=32k, prefill 192/128, prefill 256/256).
    #[arg(long, value_delimiter = ',')]
    only: Vec<usize>,
}

impl ReferenceArgs {
    /// The preset's full dims with the overrides laid over them.
    fn dims(&self) -> Result<Dims, Error> {
        let mut d = self.preset.full_dims();
        d.hidden = self.hidden.unwrap_or(d.hidden);
        d.n_head = self.heads.unwrap_or(d.n_head);
        d.q_lora = self.q_lora.map_or(d.q_lora, |r| (r > 0).then_some(r));
        d.kv_lora = self.kv_lora.unwrap_or(d.kv_lora);
        if d.hidden == 0 || d.n_head == 0 || d.kv_lora == 0 || self.tokens == 0 {
            return Err(Error::Usage(
                "bench: hidden, heads, kv_lora and tokens must be at least 1".into(),
            ));
        }
        Ok(d)
    }
}

/// Timed launches per kernel configuration (the median is reported).
const ITERS: usize = 50;
/// Back-to-back launches per timed sample by default: enough that a Python peer's dispatch (tens of µs)
/// runs ahead of the GPU instead of inside the timed interval.
const LAUNCHES: u32 = 10;

pub fn exec(a: Args) -> Result<i32, Error> {
    match a.what {
        BenchCmd::Reference(a) => {
            let r =
                mla_diff::bench::reference(a.preset, a.dims()?, a.tokens, a.decode_steps, a.reps)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r).expect("json"));
            } else {
                print!("{}", r.text());
            }
            Ok(0)
        }
        BenchCmd::Decode(a) => cuda_bench(
            &a.gpu.options(Some((&a.heads, a.best_only)), &a.peers)?,
            a.json.as_deref(),
        ),
        BenchCmd::Prefill(a) => {
            let mut o = a.gpu.options(None, &a.peers)?;
            o.best_only = a.wgmma_only;
            cuda_bench(&o, a.json.as_deref())
        }
        BenchCmd::Table(a) => table(a),
        BenchCmd::Load(a) => {
            let r = mla_diff::bench::load::measure(&a.file)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r).expect("json"));
            } else {
                print!("{}", r.text());
            }
            Ok(0)
        }
    }
}

fn table(a: TableArgs) -> Result<i32, Error> {
    only_cuda(a.gpu.backend)?;
    let n = table::CASES.len();
    if let Some(bad) = a.only.iter().find(|&&i| i == 0 || i > n) {
        return Err(Error::Usage(format!(
            "bench table --only {bad}: rows are 1..={n}"
        )));
    }
    if a.dtypes.contains(&Dtype::F32) {
        return Err(Error::Usage(
            "bench table --dtypes: bf16 and fp16 (the tensor-core kernels and the peers are 16-bit)".into(),
        ));
    }
    let opts = table::TableOptions {
        kernels_dir: a.gpu.kernels,
        dtypes: a.dtypes,
        peers: a.peers.into_iter().filter(|p| !p.is_empty()).collect(),
        only: a.only.iter().map(|i| i - 1).collect(),
        launches: a.gpu.launches as usize,
    };
    let (rep, text) = table::table(&opts)?;
    print!("{text}");
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&rep).expect("json"))
            .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    if let Some(p) = &a.markdown {
        std::fs::write(p, table::markdown(&rep))
            .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    // A wrong output of ours is a failure; a missed floor is a measurement.
    Ok(if rep.correct { 0 } else { 1 })
}

fn cuda_bench(opts: &BenchOptions, json: Option<&std::path::Path>) -> Result<i32, Error> {
    let (rep, text) = mla_diff::tools::bench::bench(opts)?;
    print!("{text}");
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_string_pretty(&rep).expect("json"))
            .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    Ok(0)
}

/// The benches time GPU kernels: the CPU mirror is an executable specification, not a contender.
fn only_cuda(k: Kind) -> Result<(), Error> {
    match k {
        Kind::Cuda => Ok(()),
        Kind::Cpu | Kind::Capture => Err(Error::Usage(
            "bench times the CUDA kernels: --backend cuda (the CPU mirror is not timed)".into(),
        )),
    }
}
