//! The bounded CI fuzz pass: a fixed seed and execution count, so a failure reproduces exactly.
//! MLA_DIFF_FUZZ_SEED / MLA_DIFF_FUZZ_EXECS vary them; longer runs: `examples/fuzz.rs`, docs/fuzzing.md.

use mla_diff::alloc::CountingAlloc;
use mla_diff::fuzz::{self, Options};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc(std::alloc::System);

/// Not a test: the worker process the supervisor starts (this binary, re-run with the worker env var).
#[test]
#[ignore]
fn fuzz_worker() {
    if let Some(code) = fuzz::worker_from_env() {
        std::process::exit(code);
    }
}

fn env_u64(k: &str, default: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn fuzz_bounded_pass() {
    let seed = env_u64("MLA_DIFF_FUZZ_SEED", 20261130);
    let execs = env_u64("MLA_DIFF_FUZZ_EXECS", 10_000);
    let crash_dir = std::env::temp_dir().join(format!("mla-diff-fuzz-ci-{}", std::process::id()));
    let corpus = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        // The 10 MB GLM-5 file would dominate the time; its layout is covered by the glm-5 built-in seed.
        .filter(|p| std::fs::metadata(p).unwrap().len() < 4 << 20)
        .collect::<Vec<_>>();
    let mut o = Options::new(seed, execs, crash_dir.clone());
    o.corpus = corpus;
    // Bounded time even when the code under test hangs: executions take milliseconds.
    o.hang_secs = 5;
    o.max_findings = 10;
    let s = fuzz::supervise(
        &o,
        &[
            "--exact",
            "fuzz_worker",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ],
    )
    .unwrap();
    eprint!("{}", s.text());
    assert!(
        s.findings.is_empty(),
        "fuzz findings (reproducers in {}):\n{}",
        crash_dir.display(),
        s.text()
    );
    assert_eq!(s.execs, execs, "every execution ran");
    // The target must get past the header often enough to test the later stages.
    assert!(
        s.stages[3] > execs / 50,
        "few inputs reach layer 0: {:?}",
        s.stages
    );
    assert!(
        s.findings.is_empty(),
        "fuzz findings (reproducers in {}):\n{}",
        crash_dir.display(),
        s.text()
    );
    std::fs::remove_dir_all(&crash_dir).ok();
}
