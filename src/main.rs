//! The `mla-diff` command line: a thin layer over the library.

use clap::{Parser, Subcommand};
use mla_diff::error::{Error, EXIT_ERROR};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "mla-diff", version, about = "Where does the fast MLA path stop computing the model?", after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

const EXIT_CODES: &str = "Exit codes: 0 pass, 1 divergence found, 2 usage/input/environment error.";

#[derive(Subcommand)]
enum Cmd {
    /// Describe an MLA GGUF file: dims, rope/YaRN, softmax scale, attention tensors (reads the header only).
    Inspect {
        file: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// CUDA kernel tools (no GPU needed for `check`).
    Kernels {
        #[command(subcommand)]
        cmd: KernelsCmd,
    },
    /// Run the CUDA path on synthetic layers with real model dims and compare every stage with the CPU
    /// mirror and the fp64 reference (needs a GPU).
    GpuValidate(mla_diff::backend::cuda::validate::ValidateArgs),
    /// Benchmarks (timings on this machine; not tests).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand)]
enum KernelsCmd {
    /// Compile every kernel with NVRTC to PTX and CUBIN for several architectures, dims and dtypes;
    /// print ptxas registers and spills per kernel. Exit 2 on a compile error.
    Check {
        /// Comma-separated target architectures.
        #[arg(long, default_value = "sm_90,sm_80,sm_120", value_delimiter = ',')]
        arch: Vec<String>,
        /// Read the kernel sources from this directory instead of the embedded copy.
        #[arg(long)]
        kernels: Option<PathBuf>,
        /// Also write every compiled PTX and CUBIN into this directory.
        #[arg(long)]
        dump: Option<PathBuf>,
    },
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
enum BenchBackend {
    Cuda,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Time the fp64 reference of one synthetic layer next to a plain f64 GEMM of the same FLOP count.
    Reference {
        /// Layer shape family (per-head dims, rope, scaling); full model sizes unless overridden.
        #[arg(long, value_enum, default_value = "deepseek-v3")]
        preset: mla_diff::model::synthetic::Family,
        #[arg(long)]
        hidden: Option<usize>,
        #[arg(long)]
        heads: Option<usize>,
        /// q-LoRA rank (0: no q-LoRA).
        #[arg(long)]
        q_lora: Option<usize>,
        #[arg(long)]
        kv_lora: Option<usize>,
        #[arg(long, default_value_t = 128)]
        tokens: usize,
        /// Of the tokens, how many are decode steps (one token each).
        #[arg(long, default_value_t = 16)]
        decode_steps: usize,
        #[arg(long, default_value_t = 3)]
        reps: usize,
        #[arg(long)]
        json: bool,
    },
    /// Split-KV absorbed MLA decode at DeepSeek-V3 dims (B=64, s_k=4096, page 64; 16 and 128 heads).
    Decode {
        #[arg(long, value_enum, default_value = "cuda")]
        backend: BenchBackend,
        #[arg(long)]
        kernels: Option<PathBuf>,
        /// Also write the results as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Causal prefill flash attention at 4k tokens (qk 192 / v 128, 128 heads; 256 / 256, 64 heads).
    Prefill {
        #[arg(long, value_enum, default_value = "cuda")]
        backend: BenchBackend,
        #[arg(long)]
        kernels: Option<PathBuf>,
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn cuda_bench(decode: bool, kernels: Option<PathBuf>, json: Option<PathBuf>) -> Result<i32, Error> {
    let opts = mla_diff::backend::cuda::bench::BenchOptions {
        kernels_dir: kernels,
        decode,
        prefill: !decode,
        iters: 50,
    };
    let (rep, text) = mla_diff::backend::cuda::bench::bench(&opts)?;
    print!("{text}");
    if let Some(p) = json {
        std::fs::write(&p, serde_json::to_string_pretty(&rep).expect("json"))
            .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    Ok(0)
}

fn run(cli: Cli) -> Result<i32, Error> {
    match cli.cmd {
        Cmd::Inspect { file, json } => {
            let f = mla_diff::gguf::GgufFile::open(&file)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&mla_diff::inspect::inspect_json(&f)?)
                        .expect("json")
                );
            } else {
                print!("{}", mla_diff::inspect::inspect_text(&f)?);
            }
            Ok(0)
        }
        Cmd::Kernels {
            cmd:
                KernelsCmd::Check {
                    arch,
                    kernels,
                    dump,
                },
        } => {
            let s = mla_diff::backend::cuda::check::kernels_check(
                &arch,
                kernels.as_deref(),
                dump.as_deref(),
            )?;
            print!("{}", s.report);
            println!(
                "{} compilations OK (PTX + CUBIN); {} kernel(s) with register spills{}",
                s.compiles,
                s.spilling.len(),
                if s.spilling.is_empty() {
                    String::new()
                } else {
                    format!(": {}", s.spilling.join("; "))
                }
            );
            Ok(0)
        }
        Cmd::GpuValidate(a) => mla_diff::backend::cuda::validate::run(&a),
        Cmd::Bench { what } => match what {
            BenchCmd::Decode {
                backend: BenchBackend::Cuda,
                kernels,
                json,
            } => cuda_bench(true, kernels, json),
            BenchCmd::Prefill {
                backend: BenchBackend::Cuda,
                kernels,
                json,
            } => cuda_bench(false, kernels, json),
            BenchCmd::Reference {
                preset,
                hidden,
                heads,
                q_lora,
                kv_lora,
                tokens,
                decode_steps,
                reps,
                json,
            } => {
                let mut d = preset.full_dims();
                d.hidden = hidden.unwrap_or(d.hidden);
                d.n_head = heads.unwrap_or(d.n_head);
                d.q_lora = q_lora.map_or(d.q_lora, |r| (r > 0).then_some(r));
                d.kv_lora = kv_lora.unwrap_or(d.kv_lora);
                if d.hidden == 0 || d.n_head == 0 || d.kv_lora == 0 || tokens == 0 {
                    return Err(Error::Usage(
                        "bench: hidden, heads, kv_lora and tokens must be at least 1".into(),
                    ));
                }
                let r = mla_diff::bench::reference(preset, d, tokens, decode_steps, reps)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&r).expect("json"));
                } else {
                    print!("{}", r.text());
                }
                Ok(0)
            }
        },
    }
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_ERROR } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("mla-diff: error: {e}");
            std::process::exit(EXIT_ERROR);
        }
    }
}
