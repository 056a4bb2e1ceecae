//! Long fuzz runs over the GGUF → config → weights → dequant path (see docs/fuzzing.md):
//!
//! cargo run --release --example fuzz -- --execs 1000000 --seed 1 --corpus fixtures
//!
//! Exit status: 0 with no findings, 1 with findings (reproducers under --crash-dir), 2 on a usage error.

use clap::Parser;
use mla_diff::alloc::CountingAlloc;
use mla_diff::fuzz::{self, Options};
use std::path::PathBuf;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc(std::alloc::System);

#[derive(Parser)]
struct Args {
    /// RNG seed; iteration I of seed S always generates the same input.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of executions.
    #[arg(long, default_value_t = 100_000)]
    execs: u64,
    /// First iteration (with `--execs 1`, replays one input).
    #[arg(long, default_value_t = 0)]
    start: u64,
    /// Extra seed files, or directories whose *.gguf files are used (e.g. fixtures).
    #[arg(long)]
    corpus: Vec<PathBuf>,
    /// How often each corpus file is picked relative to a built-in seed (which weighs 10).
    #[arg(long, default_value_t = 1)]
    corpus_weight: u32,
    #[arg(long, default_value = "fuzz-crashes")]
    crash_dir: PathBuf,
    /// Per-execution time budget in seconds; longer counts as a hang.
    #[arg(long, default_value_t = 10)]
    hang_secs: u64,
    /// Stop after this many findings.
    #[arg(long)]
    max_findings: Option<u64>,
    /// Also write the summary as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() {
    if let Some(code) = fuzz::worker_from_env() {
        std::process::exit(code);
    }
    let a = Args::parse();
    let mut corpus = Vec::new();
    for c in &a.corpus {
        match std::fs::read_dir(c) {
            Ok(rd) => {
                let mut v: Vec<PathBuf> = rd
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
                    .collect();
                v.sort();
                corpus.extend(v);
            }
            Err(_) => corpus.push(c.clone()),
        }
    }
    let mut o = Options::new(a.seed, a.execs, a.crash_dir);
    o.start = a.start;
    o.corpus = corpus;
    o.corpus_weight = a.corpus_weight;
    o.hang_secs = a.hang_secs;
    o.progress = true;
    o.max_findings = a.max_findings.unwrap_or(u64::MAX);
    match fuzz::supervise(&o, &[]) {
        Ok(s) => {
            print!("{}", s.text());
            if let Some(p) = a.json {
                let j = serde_json::to_string_pretty(&s).expect("summary serialises");
                if let Err(e) = std::fs::write(&p, j) {
                    eprintln!("mla-diff fuzz: error: cannot write {}: {e}", p.display());
                    std::process::exit(2);
                }
            }
            std::process::exit(if s.findings.is_empty() { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("mla-diff fuzz: error: {e}");
            std::process::exit(2);
        }
    }
}
