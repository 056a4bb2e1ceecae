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
        /// Load layer L's attention weights (dequantized, shape-checked) and print per-tensor L2 norms.
        #[arg(long, value_name = "L")]
        load_layer: Option<usize>,
    },
    /// Write a synthetic MLA GGUF in llama.cpp's conventions (real models' attention dims, seeded random
    /// weights; attention tensors and token_embd only).
    Fixture {
        #[arg(long, value_enum)]
        preset: mla_diff::fixture::Preset,
        /// Number of layers (default: the model's).
        #[arg(long)]
        layers: Option<usize>,
        /// Weight type: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k..q6_k. 1-D tensors stay F32;
        /// rows that do not fit the block size fall back as llama.cpp's quantizer does.
        #[arg(long, default_value = "bf16")]
        quant: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Pre-llama.cpp-#12801 layout: one unsplit attn_kv_b, head_count_kv = heads, no *_mla keys.
        #[arg(long)]
        legacy_kv_b: bool,
        /// Override the hidden size (keeps the real head dims; for small files).
        #[arg(long)]
        hidden: Option<usize>,
        /// Override the number of attention heads.
        #[arg(long)]
        heads: Option<usize>,
        /// Override the q-LoRA rank (0: no q-LoRA, plain attn_q).
        #[arg(long)]
        q_lora_rank: Option<usize>,
        /// Rows of token_embd.weight.
        #[arg(long)]
        vocab: Option<usize>,
        /// Output file.
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: PathBuf,
    },
    /// Benchmarks (timings on this machine; not tests).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
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
}

fn run(cli: Cli) -> Result<i32, Error> {
    match cli.cmd {
        Cmd::Inspect {
            file,
            json,
            load_layer,
        } => {
            let f = mla_diff::gguf::GgufFile::open(&file)?;
            if let Some(layer) = load_layer {
                let norms = mla_diff::inspect::layer_norms(&f, layer)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&norms).expect("json"));
                } else {
                    print!("{}", mla_diff::inspect::layer_norms_text(&norms));
                }
            } else if json {
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
        Cmd::Bench { what } => match what {
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
        Cmd::Fixture {
            preset,
            layers,
            quant,
            seed,
            legacy_kv_b,
            hidden,
            heads,
            q_lora_rank,
            vocab,
            output,
        } => {
            use mla_diff::fixture;
            let quant = mla_diff::gguf::GgmlType::from_name(&quant).ok_or_else(|| {
                Error::Usage(format!(
                    "--quant {quant}: unknown type (choose one of: {})",
                    fixture::quant_names().join(", ")
                ))
            })?;
            let spec = fixture::Spec::from_options(&fixture::Options {
                preset,
                layers,
                quant,
                seed,
                legacy_kv_b,
                hidden,
                heads,
                q_lora_rank,
                vocab,
            })?;
            let s = fixture::write(&spec, &output)?;
            let types: Vec<String> = s.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
            println!(
                "wrote {}: {} tensors ({}), {:.1} MB",
                output.display(),
                s.tensors,
                types.join(", "),
                s.bytes as f64 / 1e6
            );
            Ok(0)
        }
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
