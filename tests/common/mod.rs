//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mla-diff"))
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures_dir().join(name)
}

/// Run the binary, panicking only if it cannot be started.
pub fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run mla-diff")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `inspect --json` on a file; the command must succeed.
pub fn inspect_json(path: &Path) -> serde_json::Value {
    let o = run(&["inspect", path.to_str().unwrap(), "--json"]);
    assert!(
        o.status.success(),
        "inspect {} failed: {}",
        path.display(),
        stderr(&o)
    );
    serde_json::from_slice(&o.stdout).expect("inspect --json prints JSON")
}

/// The contract for bad input: exit code 2, exactly one line on stderr naming the problem, no panic.
pub fn assert_clean_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "expected exit code 2, got {:?}; stderr: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "panic: {err}");
    assert_eq!(
        err.lines().count(),
        1,
        "expected one stderr line, got: {err:?}"
    );
    assert!(
        err.starts_with("mla-diff: error: "),
        "unexpected stderr: {err}"
    );
    assert!(
        err.contains(needle),
        "stderr should mention {needle:?}: {err}"
    );
}

/// Generate a fixture with the binary into `dir`.
pub fn make_fixture(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let path = dir.join(name);
    let mut all = vec!["fixture"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["-o", path.to_str().unwrap()]);
    let o = run(&all);
    assert!(
        o.status.success(),
        "fixture {args:?} failed: {}",
        stderr(&o)
    );
    path
}
