//! Sizes and file kinds: absurd counts rejected fast, large arrays held compactly (peak RSS of the child process), lengths beyond the file, FIFOs and directories.

use super::*;
use mla_diff::gguf::Array;
use std::time::{Duration, Instant};

fn block_count_file(d: &Path, n: u64) -> PathBuf {
    rewrite(
        &valid(d),
        &d.join(format!("bc{n}.gguf")),
        |m| {
            let e = m
                .iter_mut()
                .find(|(k, _)| k == "deepseek2.block_count")
                .unwrap();
            e.1 = Value::U64(n);
        },
        |_| {},
    )
}

/// A header's layer count is bounded by the tensors the file holds before anything loops over layers
/// (2^64-2 hung `inspect`, 1e7 took 46 s and 14 GB, `run` panicked with capacity overflow).
#[test]
fn absurd_block_count_is_rejected_fast() {
    let d = tempfile::tempdir().unwrap();
    for n in [u64::MAX - 1, 10_000_000, 960_000_000, 20] {
        let p = block_count_file(d.path(), n);
        let path = p.to_str().unwrap();
        for args in [
            vec!["inspect", path],
            vec!["inspect", path, "--json"],
            vec!["inspect", path, "--load-layer", "0"],
            vec!["run", path, "--backend", "cpu"],
        ] {
            let t = Instant::now();
            let o = run(&args);
            assert_clean_error(&o, &format!("block_count {n} is impossible"));
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{args:?} took {:?}",
                t.elapsed()
            );
        }
    }
}

/// Run the binary and return its exit code and peak resident memory in bytes. Measured from a fresh
/// copy of this test binary (`rss_probe`): a child's `ru_maxrss` starts at the high-water mark of the
/// process it was spawned from (Linux records the old address space's peak at exec), so measured from
/// this process it read the whole test run's peak and failed when another test had used 200 MB.
fn peak_rss(args: &[&str]) -> (Option<i32>, u64) {
    let o = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "bad_input::sizes::rss_probe",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PROBE_ARGS, args.join("\u{1f}"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find_map(|l| l.split_once("rss_probe: ").map(|x| x.1))
        .unwrap_or_else(|| panic!("rss_probe printed no result: {out}"));
    let (code, rss) = line.split_once(' ').unwrap();
    (code.parse().ok(), rss.parse().unwrap())
}

const PROBE_ARGS: &str = "MLA_DIFF_RSS_PROBE_ARGS";

/// `peak_rss`'s measuring process (run only by it): spawns the binary with the arguments in
/// `PROBE_ARGS`, reaps it with wait4 and prints its exit code and `ru_maxrss` in bytes.
#[test]
#[ignore = "run by peak_rss in a fresh process"]
// The child is reaped by wait4 (which also gives its rusage), not by Child::wait.
#[allow(clippy::zombie_processes)]
fn rss_probe() {
    let Ok(args) = std::env::var(PROBE_ARGS) else {
        return;
    };
    let child = common::bin()
        .args(args.split('\u{1f}'))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: plain syscall on our own child; the Child is not waited on elsewhere.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(pid, child.id() as i32);
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    let code = code.map_or("none".to_string(), |c| c.to_string());
    println!("rss_probe: {code} {}", ru.ru_maxrss as u64 * 1024);
}

/// A u8 metadata array of 64 Mi elements (a 64 MiB file) took 2.2 GB (32 bytes an element).
#[test]
fn large_u8_array_is_held_compactly() {
    let d = tempfile::tempdir().unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("arr.gguf"),
        |m| m.push(("big".into(), Value::Array(Array::U8(vec![7; 64 << 20])))),
        |_| {},
    );
    let (code, rss) = peak_rss(&["inspect", p.to_str().unwrap(), "--json"]);
    assert_eq!(code, Some(0));
    eprintln!(
        "inspect --json of a 64 Mi-element u8 array: peak RSS {} MB",
        rss >> 20
    );
    // The file's pages (64 MiB, mapped) plus the array (64 MiB) plus the program.
    assert!(rss < 200 << 20, "peak RSS {} MB", rss >> 20);
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(
        f.get("big").map(|v| v.display_short()).as_deref(),
        Some("[67108864 items]")
    );
}

/// An array whose length times its element size exceeds the file is corrupt, before any allocation.
#[test]
fn array_length_beyond_the_file() {
    let d = tempfile::tempdir().unwrap();
    let src = rewrite(
        &valid(d.path()),
        &d.path().join("a.gguf"),
        |m| m.push(("arr.u64".into(), Value::Array(Array::U64(vec![1, 2])))),
        |_| {},
    );
    let p = patch(&src, &d.path().join("t.gguf"), |b| {
        // key "arr.u64", type 9, element type 10, length 2 → a length of a quarter of the file size
        let at = b.windows(7).position(|w| w == b"arr.u64").unwrap() + 7 + 8;
        let len = b.len() as u64 / 4;
        b[at..at + 8].copy_from_slice(&len.to_le_bytes());
    });
    assert_clean_error(&inspect(&p), "array length");
}

/// `inspect` of a FIFO blocked in open() forever; a directory is no model either.
#[test]
fn non_regular_files_are_rejected_without_blocking() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("fifo.gguf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for p in [&fifo, &d.path().to_path_buf()] {
        let mut child = common::bin()
            .args(["inspect", p.to_str().unwrap()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(10) {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("inspect {} hangs", p.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_clean_error(&child.wait_with_output().unwrap(), "not a regular file");
    }
}
