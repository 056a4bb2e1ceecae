//! The `mla-diff` command line: a thin layer over the library.

use clap::{Args, Parser, Subcommand, ValueEnum};
use mla_diff::backend::{Backend, Dtype};
use mla_diff::compare::ToleranceTable;
use mla_diff::error::{Error, EXIT_DIVERGENCE, EXIT_ERROR, EXIT_PASS};
use mla_diff::faults::{Fault, FaultSet, Injection};
use mla_diff::report;
use mla_diff::run::{DumpLayers, InputSpec, Modes, RunOptions};
use mla_diff::schedule::Schedule;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "mla-diff", version, about = "Where does the fast MLA path stop computing the model?", after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

const EXIT_CODES: &str = "Exit codes: 0 pass, 1 divergence found (or baseline regression), 2 usage/input/environment error.";

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// The CPU mirror of the fused path.
    Cpu,
    /// The CUDA kernels in kernels/ (needs an NVIDIA GPU and driver).
    Cuda,
    /// CUDA when a GPU is present, else the CPU mirror.
    Auto,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    /// Each layer gets the reference's input: the layer's local error.
    Shadow,
    /// Each side feeds its own output forward: the accumulated drift.
    Free,
    Both,
}

#[derive(Args)]
struct RunArgs {
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
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
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
    /// Plant a bug from the catalogue in the optimized path, repeatable: NAME (every layer) or
    /// NAME@layer=L. `mla-diff selftest --list` shows the catalogue.
    #[arg(long = "inject", value_name = "NAME[@layer=L]")]
    inject: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SelftestBackend {
    /// The CPU mirror of the fused path.
    Cpu,
    /// The CUDA kernels (faults switched on by their MLA_FAULT_* defines).
    Cuda,
}

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
    /// Run every layer's attention through the fp64 reference and the optimized path and compare stage by stage.
    Run(Box<RunArgs>),
    /// Measure the CPU mirror's noise on GGUF files and write the tolerance table it implies.
    Calibrate {
        files: Vec<PathBuf>,
        /// Factor applied to the worst observed noise.
        #[arg(long, default_value_t = 4.0)]
        margin: f64,
        /// Input seeds; every schedule runs with each (the worst case over all is kept).
        #[arg(long, value_delimiter = ',', default_value = "0,1,2,3,4")]
        seeds: Vec<u64>,
        /// Output file (default: stdout).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Plant every bug of the fault catalogue in the optimized path, one run each on small fixtures, and
    /// check that each is detected in the injected layer at its earliest stage, and that the clean runs
    /// pass. Exit 0 when all of that holds, 1 otherwise.
    Selftest {
        #[arg(long, value_enum, default_value_t = SelftestBackend::Cpu)]
        backend: SelftestBackend,
        /// Write the selftest's fixtures into this directory and keep them (default: a temporary one).
        #[arg(long)]
        fixtures: Option<PathBuf>,
        /// Only these faults (repeatable; default: the whole catalogue).
        #[arg(long = "fault", value_name = "NAME")]
        only: Vec<String>,
        /// Seed of the random layer inputs.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print the catalogue (name, define, expected stage, needs, the bug it models, CUDA site) and exit.
        #[arg(long)]
        list: bool,
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
        #[arg(
            long,
            default_value = "sm_90a,sm_90,sm_80,sm_120",
            value_delimiter = ','
        )]
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
        /// Head counts to time (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "16,128")]
        heads: Vec<usize>,
        /// Time only the first (preferred) tile of each head count, not the alternatives.
        #[arg(long)]
        best_only: bool,
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

fn cuda_bench(
    decode: bool,
    kernels: Option<PathBuf>,
    json: Option<PathBuf>,
    decode_heads: Vec<usize>,
    best_only: bool,
) -> Result<i32, Error> {
    let opts = mla_diff::backend::cuda::bench::BenchOptions {
        kernels_dir: kernels,
        decode,
        prefill: !decode,
        iters: 50,
        decode_heads,
        best_only,
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
            for w in &s.warnings {
                println!("ptxas: {w}");
            }
            // A serialized wgmma still computes the right answer, only slowly: fail so it is seen.
            if let Some(w) = s.warnings.iter().find(|w| w.contains("wgmma")) {
                return Err(Error::Environment(format!(
                    "ptxas serialized the warpgroup MMAs: {w}"
                )));
            }
            Ok(0)
        }
        Cmd::GpuValidate(a) => mla_diff::backend::cuda::validate::run(&a),
        Cmd::Bench { what } => match what {
            BenchCmd::Decode {
                backend: BenchBackend::Cuda,
                kernels,
                json,
                heads,
                best_only,
            } => cuda_bench(true, kernels, json, heads, best_only),
            BenchCmd::Prefill {
                backend: BenchBackend::Cuda,
                kernels,
                json,
            } => cuda_bench(false, kernels, json, vec![], false),
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
        Cmd::Run(args) => run_cmd(*args),
        Cmd::Selftest {
            backend,
            fixtures,
            only,
            seed,
            list,
        } => selftest_cmd(backend, fixtures, only, seed, list),
        Cmd::Calibrate {
            files,
            margin,
            seeds,
            output,
        } => {
            if files.is_empty() {
                return Err(Error::Usage(
                    "calibrate needs at least one GGUF file".into(),
                ));
            }
            let (table, summary) = mla_diff::calibrate::calibrate(
                &files,
                margin,
                &[Dtype::Bf16, Dtype::F16, Dtype::F32],
                &seeds,
            )?;
            eprint!("{summary}");
            let json = serde_json::to_string_pretty(&table).expect("json") + "\n";
            match output {
                Some(p) => report::write_file(&p, &json)?,
                None => print!("{json}"),
            }
            Ok(0)
        }
    }
}

/// The optimized backend the user asked for, with its facts (kind, description, GPU).
fn make_backend(
    choice: BackendArg,
    dtype: Dtype,
    kernels: Option<PathBuf>,
) -> Result<(Box<dyn Backend>, mla_diff::backend::BackendInfo), Error> {
    use mla_diff::backend::Choice;
    let choice = match choice {
        BackendArg::Cpu => Choice::Cpu,
        BackendArg::Cuda => Choice::Cuda,
        BackendArg::Auto => Choice::Auto,
    };
    let o = mla_diff::backend::Options {
        dtype,
        kernels_dir: kernels,
    };
    mla_diff::backend::open(choice, &o)
}

fn run_cmd(a: RunArgs) -> Result<i32, Error> {
    // Unknown fault names are usage errors before anything is read.
    let faults = FaultSet(
        a.inject
            .iter()
            .map(|s| Injection::parse(s))
            .collect::<Result<_, _>>()?,
    );
    let file = mla_diff::gguf::GgufFile::open(&a.file)?;
    let cfg = mla_diff::model::MlaConfig::from_gguf(&file)?;
    let sched = Schedule {
        prompt_len: a.prompt_len,
        chunk: a.chunk,
        decode_steps: a.decode_steps,
        q_len: a.q_len,
        page_size: a.page_size,
        num_splits: a.num_splits,
        shuffle_seed: if a.no_shuffle {
            None
        } else {
            Schedule::default().shuffle_seed
        },
        spare_pages: Schedule::default().spare_pages,
        pos_offset: a.pos_offset,
    };
    sched.validate()?;
    let mut tolerances = ToleranceTable::defaults();
    let mut source = "defaults (calibrated, src/compare/tolerances.json)".to_string();
    if let Some(p) = &a.tol_file {
        for (dtype, o) in ToleranceTable::overrides_from_file(p)? {
            tolerances.apply(dtype, &o)?;
        }
        source = format!("defaults + {}", p.display());
    }
    for t in &a.tol {
        tolerances.apply(a.dtype, &ToleranceTable::parse_override(t)?)?;
    }
    if !a.tol.is_empty() {
        source.push_str(&format!(" + --tol {}", a.tol.join(" --tol ")));
    }
    let dump = match &a.dump_dir {
        None => None,
        Some(d) => Some((
            d.clone(),
            match a.dump_layers.as_str() {
                "first" => DumpLayers::First,
                "all" => DumpLayers::All,
                list => DumpLayers::List(mla_diff::run::parse_layers(list, cfg.n_layer)?),
            },
        )),
    };
    let input = match (&a.tokens, &a.hidden) {
        (Some(t), _) => InputSpec::Tokens(t.clone()),
        (None, Some(p)) => InputSpec::Npy(p.clone()),
        (None, None) => InputSpec::Random { seed: a.seed },
    };
    let layers = mla_diff::run::parse_layers(&a.layers, cfg.n_layer)?;
    faults.check_layers(cfg.n_layer, &layers)?;
    if let Some(n) = mla_diff::run::dense_beyond_top_k(&file, &cfg, &sched) {
        if !a.allow_dense_beyond_topk {
            return Err(Error::Usage(format!(
                "{n}. Pass --allow-dense-beyond-topk to run anyway, or use at most top_k tokens"
            )));
        }
        eprintln!("mla-diff: note: {n}");
    }
    let mode = match (a.mode, &a.hidden) {
        (Some(m), _) => m,
        // Per-layer captures restart the reference at each layer, so free mode has no meaning there.
        (None, Some(p)) if a.tokens.is_none() && mla_diff::input::npy_ndim(p)? == 3 => {
            eprintln!(
                "mla-diff: note: per-layer captures in {}: shadow mode only",
                p.display()
            );
            ModeArg::Shadow
        }
        (None, _) => ModeArg::Both,
    };
    // Fail on unusable output paths and a mismatched baseline before the (possibly long) run.
    let targets = report::output::file_targets(&[
        ("--json", a.json.as_deref()),
        ("--junit", a.junit.as_deref()),
        ("--markdown", a.markdown.as_deref()),
        ("--plot", a.plot.as_deref()),
        ("--write-baseline", a.write_baseline.as_deref()),
    ])?;
    let [json, junit, markdown, plot, write_baseline]: [Option<report::output::Target>; 5] =
        targets.try_into().expect("five outputs");
    if let Some(d) = &a.dump_dir {
        report::output::dir_target("--dump-dir", d)?;
    }
    let stdout_taken = [&json, &junit, &markdown, &plot, &write_baseline]
        .iter()
        .any(|t| **t == Some(report::output::Target::Stdout));
    let mut tol_by_check = std::collections::BTreeMap::new();
    for c in mla_diff::compare::checks_for(&sched) {
        tol_by_check.insert(c.name(), tolerances.get(a.dtype, &c)?);
    }
    let planned = report::baseline::Identity {
        file: a
            .file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        size: file.file_size,
        architecture: cfg.arch.gguf_name().into(),
        dtype: a.dtype.name().into(),
        schedule: serde_json::to_value(&sched).expect("schedule serialises"),
        input: mla_diff::run::input_json(&input),
        layers: layers.clone(),
        tolerances: tol_by_check,
    };
    let baseline = match &a.baseline {
        Some(p) => {
            let b = report::Report::from_json_file(p)?;
            let diffs = planned.differences(&report::baseline::Identity::of(&b));
            if !diffs.is_empty() && !a.allow_baseline_mismatch {
                return Err(Error::Usage(format!(
                    "--baseline {} is a report of another run: {} (--allow-baseline-mismatch compares anyway)",
                    p.display(),
                    diffs.join("; ")
                )));
            }
            Some((b, diffs))
        }
        None => None,
    };
    if !a.quiet {
        for b in faults.blind_spots(&cfg, &sched) {
            eprintln!("mla-diff: note: injected fault {b} may not show on this run");
        }
    }
    let opts = RunOptions {
        layers: Some(layers),
        input,
        sched,
        dtype: a.dtype,
        modes: Modes {
            shadow: mode != ModeArg::Free,
            free: mode != ModeArg::Shadow,
        },
        tolerances,
        tolerance_source: source,
        dump,
        faults,
        progress: !a.quiet,
    };
    let (mut backend, info) = make_backend(a.backend, a.dtype, a.kernels.clone())?;
    let started = std::time::Instant::now();
    let mut rep = mla_diff::run::run(&file, backend.as_mut(), &info, &opts)?;
    if let (Some((b, diffs)), Some(p)) = (baseline, &a.baseline) {
        let mut g = report::baseline::gate(&rep, &b, &p.display().to_string(), a.baseline_factor);
        g.across = diffs;
        rep.set_baseline(g);
    }
    // The table (or, with -q, the verdict line) goes to stdout unless a report took it.
    let to_terminal = {
        use std::io::IsTerminal;
        if stdout_taken {
            std::io::stderr().is_terminal()
        } else {
            std::io::stdout().is_terminal()
        }
    };
    let style = report::table::Style::new(a.color, to_terminal);
    let text = if a.quiet {
        report::table::verdict_line(&rep, &style)
    } else {
        report::table::render(&rep, &style)
    };
    if stdout_taken {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    if let Some(t) = &json {
        t.write(&rep.to_json())?;
    }
    if let Some(t) = &write_baseline {
        let mut b = rep.clone();
        // A baseline is this run's measurements, not its comparison with an older one.
        b.baseline = None;
        b.verdict = report::Report::overall_verdict(&b.modes);
        t.write(&b.to_json())?;
    }
    if let Some(t) = &junit {
        t.write(&report::junit::render(&rep))?;
    }
    if let Some(t) = &markdown {
        t.write(&report::markdown::render(&rep))?;
    }
    if let Some(t) = &plot {
        t.write(&report::svg::render(&rep)?)?;
    }
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

fn selftest_cmd(
    backend: SelftestBackend,
    fixtures: Option<PathBuf>,
    only: Vec<String>,
    seed: u64,
    list: bool,
) -> Result<i32, Error> {
    use mla_diff::selftest;
    if list {
        for f in Fault::ALL {
            let i = f.info();
            let needs: Vec<&str> = i.needs.iter().map(|n| n.name()).collect();
            println!("{}  ({})", i.name, i.define);
            println!("    {}", i.summary);
            println!("    expected first failure: {}", i.expected);
            println!(
                "    needs: {}",
                if needs.is_empty() {
                    "-".to_string()
                } else {
                    needs.join(", ")
                }
            );
            println!("    models: {}", i.models);
            println!("    cuda: {}", i.cuda_site);
        }
        return Ok(EXIT_PASS);
    }
    let only = only
        .iter()
        .map(|n| {
            Fault::from_name(n).ok_or_else(|| {
                Error::Usage(format!(
                    "--fault {n:?}: unknown fault; the catalogue: {}",
                    mla_diff::faults::catalogue_names()
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let kind = match backend {
        SelftestBackend::Cpu => mla_diff::backend::Kind::Cpu,
        SelftestBackend::Cuda => mla_diff::backend::Kind::Cuda,
    };
    let opts = selftest::Options {
        fixtures,
        only,
        seed,
    };
    println!("mla-diff selftest: backend {}, every fault injected into layer {} of a {}-layer fixture, shadow mode", kind.name(), selftest::TARGET, selftest::LAYERS);
    // One GPU context and kernel cache for all cases (opened by the first case).
    let mut backends = mla_diff::backend::Factory::new();
    let choice = mla_diff::backend::Choice::from(kind);
    let factory: &mut selftest::BackendFactory = &mut |dtype, _faults| {
        let o = mla_diff::backend::Options {
            dtype,
            kernels_dir: None,
        };
        backends.open(choice, &o)
    };
    let summary = selftest::run(&opts, factory, &mut |o| println!("{}", o.line()))?;
    println!("\n{}", summary.matrix());
    let controls = summary.controls_matrix();
    if controls.lines().count() > 2 {
        println!("Controls: each fault on a run lacking one of its needs must stay undetected.\n\n{controls}");
    }
    let (n_ok, n) = (
        summary.outcomes.iter().filter(|o| o.ok).count(),
        summary.outcomes.len(),
    );
    println!(
        "{n_ok}/{n} runs OK on {}: {} in {:.2} s",
        summary.backend,
        if summary.pass() { "PASS" } else { "FAIL" },
        summary.seconds
    );
    Ok(if summary.pass() {
        EXIT_PASS
    } else {
        EXIT_DIVERGENCE
    })
}

fn main() {
    // Die quietly on a closed pipe (`mla-diff ... | head`) like other Unix tools, instead of panicking in println!.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
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
            eprintln!(
                "mla-diff: error: {}",
                mla_diff::error::one_line(&e.to_string())
            );
            std::process::exit(EXIT_ERROR);
        }
    }
}
