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
