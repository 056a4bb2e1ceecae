//! The commands, one module each (cargo's layout): a clap `Args` struct, its conversion into the
//! library's plain options, and an `exec` that returns the exit code.

use clap::{Parser, Subcommand};
use mla_diff::error::Error;

mod bench;
mod calibrate;
mod export;
mod fixture;
mod flashinfer;
mod gpu_validate;
mod inspect;
mod kernels;
mod lint;
mod merge;
mod replay;
mod run;
mod selftest;
mod sweep;

#[derive(Parser)]
#[command(name = "mla-diff", version, about = "Where does the fast MLA path stop computing the model?", after_help = EXIT_CODES)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

const EXIT_CODES: &str = "Exit codes: 0 pass, 1 divergence found (or baseline regression), 2 usage/input/environment error.";

// The variants' doc comments are the commands' help texts (the Args structs carry none, so these win).
#[derive(Subcommand)]
enum Cmd {
    /// Describe an MLA GGUF file: dims, rope/YaRN, softmax scale, attention tensors (reads the header only).
    Inspect(inspect::Args),
    /// Check an MLA GGUF's metadata against its own tensors, the conventions (softmax scale with YaRN
    /// mscale², rope, head dims, eps) and the known models; with --backend cuda, which kernels take its
    /// dims; with --runner, an external kernel's supports and conventions, probed. Exit 1 on an error; 2 when the runner cannot take the model (unsupported, as run).
    Lint(lint::Args),
    /// Write a synthetic MLA GGUF in llama.cpp's conventions (real models' attention dims, seeded random
    /// weights; attention tensors and token_embd only).
    Fixture(fixture::Args),
    /// Run every layer's attention through the fp64 reference and the optimized path and compare stage by stage.
    Run(Box<run::Args>),
    /// Run many sequence lengths around the kernel's boundaries (pages, chunks, key tiles, the split
    /// partition) and report the smallest failing length, bisecting the gap below it; or, with --splits,
    /// check that split-KV counts agree within tolerance. Same report formats as `run`.
    Sweep(Box<sweep::Args>),
    /// Merge the JSON reports of a run's shards (`run --shard i/n`) into the report, JUnit and Markdown
    /// the whole run writes (refusing reports of different runs, overlapping or missing shards); exit
    /// code: the merged verdict.
    Merge(merge::Args),
    /// Write one layer of a model as a self-contained capsule directory (its tensors' bytes as stored, the
    /// layer input, the fp64 reference stages, a manifest): the repro to attach to a bug report.
    Export(Box<export::Args>),
    /// Replay a capsule written by `export`: check its weights still give its reference, run its layer
    /// through the fp64 reference and the optimized path, and write the same reports as `run`.
    Replay(Box<replay::Args>),
    /// Check every MLA call of a FlashInfer API-logging dump (FLASHINFER_LOGLEVEL=10,
    /// FLASHINFER_DUMP_SAFETENSORS=1) against fp64 attention from the call's own inputs: one line per
    /// call. A kernel-level check of the engine's calls (no layer weights); --model adds the model's
    /// softmax scale and dims.
    Flashinfer(flashinfer::Args),
    /// Measure the CPU mirror's noise on GGUF files and write the tolerance table it implies.
    Calibrate(calibrate::Args),
    /// Plant every bug of the fault catalogue in the optimized path, one run each on small fixtures, and
    /// check that each is detected in the injected layer at its earliest stage, and that the clean runs
    /// pass. Exit 0 when all of that holds, 1 otherwise.
    Selftest(selftest::Args),
    /// CUDA kernel tools (no GPU needed for `check`).
    Kernels(kernels::Args),
    /// Run the CUDA path on synthetic layers with real model dims and compare every stage with the CPU
    /// mirror and the fp64 reference (needs a GPU).
    GpuValidate(gpu_validate::Args),
    /// Benchmarks (timings on this machine; not tests).
    Bench(bench::Args),
}

/// Run the parsed command; its exit code.
pub fn exec(cli: Cli) -> Result<i32, Error> {
    match cli.cmd {
        Cmd::Inspect(a) => inspect::exec(a),
        Cmd::Lint(a) => lint::exec(a),
        Cmd::Fixture(a) => fixture::exec(a),
        Cmd::Run(a) => run::exec(*a),
        Cmd::Sweep(a) => sweep::exec(*a),
        Cmd::Merge(a) => merge::exec(a),
        Cmd::Export(a) => export::exec(*a),
        Cmd::Replay(a) => replay::exec(*a),
        Cmd::Flashinfer(a) => flashinfer::exec(a),
        Cmd::Calibrate(a) => calibrate::exec(a),
        Cmd::Selftest(a) => selftest::exec(a),
        Cmd::Kernels(a) => kernels::exec(a),
        Cmd::GpuValidate(a) => gpu_validate::exec(a),
        Cmd::Bench(a) => bench::exec(a),
    }
}
