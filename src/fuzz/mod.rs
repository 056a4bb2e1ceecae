//! A structure-aware fuzzer for the path a GGUF file takes (header → config → layer weights → dequant),
//! on stable Rust. Driven by `examples/fuzz.rs` (long runs) and `tests/fuzz.rs` (the bounded CI pass).
//!
//! A supervisor process re-runs its own executable as a worker (the options travel in an environment
//! variable). The worker generates input `i` from `(seed, i)` alone, writes it to a tmpfs file, and runs
//! `target::exec` under `catch_unwind`, with a watchdog thread (a hang aborts) and a counting global
//! allocator (a request past the per-execution bound aborts). The supervisor reads the worker's progress
//! lines; when the worker dies it saves the current input as a reproducer and restarts it at `i + 1`.
//! Every finding is reproducible with `--seed S --start I --execs 1`.

pub mod doc;
pub mod mutate;
pub mod target;

use crate::alloc;
use crate::error::{Error, Result};
use mutate::Seed;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The environment variable that turns a driver process into a worker.
pub const WORKER_ENV: &str = "MLA_DIFF_FUZZ_WORKER";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Options {
    pub seed: u64,
    /// First iteration.
    pub start: u64,
    pub execs: u64,
    /// Extra seed files (GGUF), each picked `corpus_weight` times as often as nothing (built-ins weigh 10).
    pub corpus: Vec<PathBuf>,
    pub corpus_weight: u32,
    /// Where reproducers go.
    pub crash_dir: PathBuf,
    /// Scratch directory for the current input (tmpfs if possible).
    pub work_dir: PathBuf,
    /// Per-execution time budget.
    pub hang_secs: u64,
    /// Reproducers kept per distinct finding.
    pub keep_per_finding: usize,
    /// Print progress to stderr every few seconds.
    pub progress: bool,
    /// Stop once this many findings are counted (the run then has fewer executions than asked).
    pub max_findings: u64,
}

impl Options {
    pub fn new(seed: u64, execs: u64, crash_dir: PathBuf) -> Options {
        let shm = Path::new("/dev/shm");
        let tmp = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        Options {
            seed,
            start: 0,
            execs,
            corpus: Vec::new(),
            corpus_weight: 1,
            crash_dir,
            work_dir: tmp.join(format!("mla-diff-fuzz-{}-{seed}", std::process::id())),
            hang_secs: 10,
            keep_per_finding: 3,
            progress: false,
            max_findings: u64::MAX,
        }
    }
}

/// One distinct problem: all executions whose message has the same shape (digits removed).
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// `panic`, `over-allocation`, `hang`, `abort` or `message`.
    pub kind: String,
    pub message: String,
    pub first_iter: u64,
    pub count: u64,
    pub files: Vec<PathBuf>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub seed: u64,
    pub execs: u64,
    pub wall_s: f64,
    /// Executions rejected at open / stopped at config / stopped before layer 0 loaded / loaded layer 0.
    pub stages: [u64; 4],
    pub findings: Vec<Finding>,
    /// Largest heap peak of one execution, bytes.
    pub peak_max: u64,
    /// Largest peak / file size of one execution.
    pub peak_per_file_byte: f64,
    /// Largest peak / allowance of one execution (must stay < 1).
    pub peak_per_allowance: f64,
    pub worker_restarts: u64,
}

impl Summary {
    pub fn finding_count(&self) -> u64 {
        self.findings.iter().map(|f| f.count).sum()
    }
    pub fn text(&self) -> String {
        let mut s = format!(
            "fuzz: seed {}: {} executions in {:.1} s ({:.0}/s); rejected at open {}, at config {}, at layer 0 {}, layer 0 loaded {}; peak heap {} bytes, max {:.1}× the file, max {:.3} of the allowance; {} findings ({} distinct)\n",
            self.seed,
            self.execs,
            self.wall_s,
            self.execs as f64 / self.wall_s.max(1e-9),
            self.stages[0],
            self.stages[1],
            self.stages[2],
            self.stages[3],
            self.peak_max,
            self.peak_per_file_byte,
            self.peak_per_allowance,
            self.finding_count(),
            self.findings.len()
        );
        for f in &self.findings {
            s += &format!(
                "  {} ×{} (first at iteration {}): {}\n    e.g. {}\n",
                f.kind,
                f.count,
                f.first_iter,
                &f.message[..f.message.floor_char_boundary(300)],
                f.files
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        s
    }
}

/// The input of iteration `iter`: its own RNG stream, so any iteration is reproducible alone.
pub fn input(seeds: &[Seed], seed: u64, iter: u64) -> Vec<u8> {
    let mut z = seed ^ iter.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // splitmix64 finaliser: nearby (seed, iter) pairs get unrelated streams.
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let mut rng = StdRng::seed_from_u64(z ^ (z >> 31));
    mutate::generate(seeds, &mut rng)
}

/// The built-in seeds: the tiny preset in every type the fixture writer produces, plus one small file per
/// preset (their real per-head dims), written under `dir`; then the `corpus` files.
pub fn seeds(dir: &Path, corpus: &[PathBuf], corpus_weight: u32) -> Result<Vec<Seed>> {
    use crate::fixture::{Options as F, Preset, Spec};
    use crate::gguf::GgmlType;
    let base = |preset| F {
        preset,
        layers: Some(1),
        quant: GgmlType::from_name("Q4_0").expect("type"),
        seed: 0,
        legacy_kv_b: false,
        hidden: Some(256),
        heads: Some(1),
        q_lora_rank: None,
        vocab: Some(4),
    };
    let mut specs = Vec::new();
    for q in crate::fixture::quant_names() {
        specs.push(F {
            heads: Some(2),
            quant: GgmlType::from_name(&q).expect("type"),
            ..base(Preset::Tiny)
        });
    }
    specs.push(F {
        legacy_kv_b: true,
        quant: GgmlType::from_name("Q8_0").expect("type"),
        ..base(Preset::Tiny)
    });
    specs.push(F {
        q_lora_rank: Some(0),
        quant: GgmlType::from_name("F16").expect("type"),
        ..base(Preset::Tiny)
    });
    for p in [
        Preset::DeepseekV3,
        Preset::DeepseekV2Lite,
        Preset::KimiK2,
        Preset::Glm47Flash,
        Preset::Glm5,
        Preset::Minicpm3,
    ] {
        specs.push(F {
            q_lora_rank: (p != Preset::DeepseekV2Lite).then_some(32),
            ..base(p)
        });
    }
    let mut out = Vec::new();
    for (i, o) in specs.iter().enumerate() {
        let p = dir.join(format!("seed-{i}.gguf"));
        crate::fixture::write(&Spec::from_options(o)?, &p)?;
        let b = std::fs::read(&p).map_err(|e| Error::io(format!("reading {}", p.display()), e))?;
        std::fs::remove_file(&p).ok();
        out.push(Seed::new(format!("{:?} {}", o.preset, o.quant.name), b, 10));
    }
    for c in corpus {
        let b = std::fs::read(c).map_err(|e| Error::io(format!("reading {}", c.display()), e))?;
        out.push(Seed::new(c.display().to_string(), b, corpus_weight));
    }
    Ok(out)
}

static LAST_PANIC: Mutex<String> = Mutex::new(String::new());
/// Start of the running execution in ms since `T0` (0: idle), and its iteration, for the watchdog.
static EXEC_START_MS: AtomicU64 = AtomicU64::new(0);
static EXEC_ITER: AtomicU64 = AtomicU64::new(0);

fn proto(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(line.as_bytes());
    let _ = o.flush();
}

/// One line, no control characters (the protocol is line-based).
fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// If this process was started as a worker, run it and return its exit code.
pub fn worker_from_env() -> Option<i32> {
    let v = std::env::var(WORKER_ENV).ok()?;
    let code = match serde_json::from_str::<Options>(&v)
        .map_err(|e| Error::Usage(format!("bad {WORKER_ENV}: {e}")))
        .and_then(|o| worker(&o))
    {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("fuzz worker: error: {e}");
            3
        }
    };
    Some(code)
}

fn worker(o: &Options) -> Result<()> {
    if !alloc::installed() {
        return Err(Error::Usage(
            "the fuzz driver must install mla_diff::alloc::CountingAlloc as its global allocator"
                .into(),
        ));
    }
    let seeds = seeds(&o.work_dir, &o.corpus, o.corpus_weight)?;
    let cur = o.work_dir.join("cur.gguf");
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = format!("{msg}{at}");
    }));
    let t0 = Instant::now();
    let hang_ms = o.hang_secs * 1000;
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(50));
        let s = EXEC_START_MS.load(Relaxed);
        if s != 0 && (t0.elapsed().as_millis() as u64).saturating_sub(s) > hang_ms {
            eprintln!(
                "fuzz: hang: iteration {} ran past {} s",
                EXEC_ITER.load(Relaxed),
                hang_ms / 1000
            );
            std::process::abort();
        }
    });
    let mut st = Summary::default();
    let mut kept = std::collections::HashMap::new();
    for iter in o.start..o.start + o.execs {
        let bytes = input(&seeds, o.seed, iter);
        std::fs::write(&cur, &bytes)
            .map_err(|e| Error::io(format!("writing {}", cur.display()), e))?;
        proto(&format!("@fuzz I {iter}\n"));
        EXEC_ITER.store(iter, Relaxed);
        EXEC_START_MS.store(t0.elapsed().as_millis() as u64 + 1, Relaxed);
        let base = alloc::arm(target::header_allowance(bytes.len() as u64) as usize);
        let r = std::panic::catch_unwind(|| target::exec(&cur, base, bytes.len() as u64));
        let peak = alloc::disarm(base) as u64;
        EXEC_START_MS.store(0, Relaxed);
        let (finding, allowed) = match r {
            Ok(out) => {
                st.stages[out.stage as usize] += 1;
                (out.bad.map(|m| ("message", m)), out.allowance)
            }
            Err(_) => (
                Some((
                    "panic",
                    std::mem::take(&mut *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner())),
                )),
                target::header_allowance(bytes.len() as u64),
            ),
        };
        if let Some((kind, msg)) = finding {
            // Saved here: the next iteration overwrites `cur` before the supervisor reads this line.
            let n = kept.entry((kind, shape(&msg))).or_insert(0usize);
            *n += 1;
            let file = if *n <= o.keep_per_finding {
                let p = crash_path(o, iter, kind);
                std::fs::copy(&cur, &p)
                    .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
                p.display().to_string()
            } else {
                "-".into()
            };
            proto(&format!(
                "@fuzz F {iter} {kind} {file} {}\n",
                one_line(&msg)
            ));
        }
        st.execs += 1;
        st.peak_max = st.peak_max.max(peak);
        st.peak_per_file_byte = st
            .peak_per_file_byte
            .max(peak as f64 / bytes.len().max(1) as f64);
        st.peak_per_allowance = st.peak_per_allowance.max(peak as f64 / allowed as f64);
        if st.execs % 256 == 0 || iter + 1 == o.start + o.execs {
            proto(&format!(
                "@fuzz S {} {} {} {} {} {} {} {}\n",
                st.execs,
                st.stages[0],
                st.stages[1],
                st.stages[2],
                st.stages[3],
                st.peak_max,
                st.peak_per_file_byte,
                st.peak_per_allowance
            ));
        }
    }
    Ok(())
}

/// Run `o.execs` executions from `o.start` in worker processes: `current_exe() worker_args…` with
/// `WORKER_ENV` set. Returns the merged summary; findings do not make it an `Err`.
pub fn supervise(o: &Options, worker_args: &[&str]) -> Result<Summary> {
    let exe = std::env::current_exe().map_err(|e| Error::io("current_exe", e))?;
    for d in [&o.crash_dir, &o.work_dir] {
        std::fs::create_dir_all(d)
            .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
    }
    let t0 = Instant::now();
    let end = o.start + o.execs;
    let mut next = o.start;
    let mut sum = Summary {
        seed: o.seed,
        ..Summary::default()
    };
    let mut last_progress = Instant::now();
    while next < end {
        let (mut child, err_tail) = spawn_worker(&exe, worker_args, o, next, end)?;
        let (last_iter, seg) = follow_worker(o, &mut child, &mut sum, t0, &mut last_progress);
        let status = child
            .wait()
            .map_err(|e| Error::io("waiting for the fuzz worker", e))?;
        let tail = err_tail.join().unwrap_or_default();
        for i in 0..4 {
            sum.stages[i] += seg.stages[i];
        }
        sum.peak_max = sum.peak_max.max(seg.peak_max);
        sum.peak_per_file_byte = sum.peak_per_file_byte.max(seg.peak_per_file_byte);
        sum.peak_per_allowance = sum.peak_per_allowance.max(seg.peak_per_allowance);
        if status.success() || sum.finding_count() >= o.max_findings {
            break;
        }
        let Some(iter) = last_iter else {
            return Err(Error::Environment(format!(
                "the fuzz worker failed before its first execution ({status}): {}",
                tail.trim()
            )));
        };
        record_death(o, &mut sum, iter, status, &tail);
        sum.worker_restarts += 1;
        next = iter + 1;
    }
    sum.wall_s = t0.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&o.work_dir).ok();
    Ok(sum)
}

/// A worker for iterations `next..end`, and a thread keeping the tail of its stderr (what a crash,
/// hang or over-allocation says before the process dies).
fn spawn_worker(
    exe: &Path,
    worker_args: &[&str],
    o: &Options,
    next: u64,
    end: u64,
) -> Result<(std::process::Child, std::thread::JoinHandle<String>)> {
    let w = Options {
        start: next,
        execs: end - next,
        ..o.clone()
    };
    let mut child = Command::new(exe)
        .args(worker_args)
        .env(
            WORKER_ENV,
            serde_json::to_string(&w).expect("options serialise"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting fuzz worker {}", exe.display()), e))?;
    let mut err = child.stderr.take().expect("piped");
    let err_tail = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        let s = String::from_utf8_lossy(&v).into_owned();
        s[s.floor_char_boundary(s.len().saturating_sub(4000))..].to_string()
    });
    Ok((child, err_tail))
}

/// Read a worker's progress lines until it ends (or enough findings are counted, when it is killed):
/// executions and findings go into `sum` as they come; returns the last iteration it started and its
/// own statistics (the `S` line: they cover only this worker's executions).
fn follow_worker(
    o: &Options,
    child: &mut std::process::Child,
    sum: &mut Summary,
    t0: Instant,
    last_progress: &mut Instant,
) -> (Option<u64>, Summary) {
    let mut last_iter = None;
    let mut seg = Summary::default();
    let out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    for line in out.lines() {
        let Ok(line) = line else { break };
        // libtest may have printed `test fuzz_worker ... ` without a newline just before.
        let Some(at) = line.find("@fuzz ") else {
            continue;
        };
        let line = &line[at..];
        let p: Vec<&str> = line.splitn(6, ' ').collect();
        if p.len() < 3 {
            continue;
        }
        match p[1] {
            "I" => {
                last_iter = p[2].parse::<u64>().ok();
                sum.execs += 1;
            }
            "F" if p.len() == 6 => {
                let file = (p[4] != "-").then(|| PathBuf::from(p[4]));
                let iter = p[2].parse().unwrap_or(0);
                record(o, sum, p[3], p[5], iter, file);
            }
            "S" => {
                let v: Vec<&str> = line.split(' ').skip(3).collect();
                if v.len() == 7 {
                    let u = |i: usize| v[i].parse::<u64>().unwrap_or(0);
                    let f = |i: usize| v[i].parse::<f64>().unwrap_or(f64::NAN);
                    seg.stages = [u(0), u(1), u(2), u(3)];
                    seg.peak_max = u(4);
                    seg.peak_per_file_byte = f(5);
                    seg.peak_per_allowance = f(6);
                }
            }
            _ => {}
        }
        if sum.finding_count() >= o.max_findings {
            let _ = child.kill();
            break;
        }
        if o.progress && last_progress.elapsed() > Duration::from_secs(10) {
            *last_progress = Instant::now();
            eprintln!(
                "fuzz: {}/{} executions, {:.0}/s, {} findings",
                sum.execs,
                o.execs,
                sum.execs as f64 / t0.elapsed().as_secs_f64(),
                sum.finding_count()
            );
        }
    }
    (last_iter, seg)
}

/// A worker that died at iteration `iter`: a finding of the kind its stderr tail names (over-allocation,
/// hang, else abort), with the input it died on kept as the reproducer.
fn record_death(
    o: &Options,
    sum: &mut Summary,
    iter: u64,
    status: std::process::ExitStatus,
    tail: &str,
) {
    let kind = if tail.contains("fuzz: over-allocation") {
        "over-allocation"
    } else if tail.contains("fuzz: hang") {
        "hang"
    } else {
        "abort"
    };
    let msg = tail
        .lines()
        .rev()
        .find(|l| l.starts_with("fuzz: "))
        .or_else(|| tail.lines().rev().find(|l| l.contains("memory allocation")))
        .or_else(|| tail.lines().rev().find(|l| !l.trim().is_empty()))
        .unwrap_or("")
        .to_string();
    let msg = format!("{} ({status})", one_line(&msg));
    let p = crash_path(o, iter, kind);
    let file = std::fs::copy(o.work_dir.join("cur.gguf"), &p)
        .is_ok()
        .then_some(p);
    record(o, sum, kind, &msg, iter, file);
}

fn crash_path(o: &Options, iter: u64, kind: &str) -> PathBuf {
    o.crash_dir
        .join(format!("seed{}-iter{iter}-{kind}.gguf", o.seed))
}

/// A message with its numbers dropped: the same bug hit with other sizes counts as one finding.
fn shape(m: &str) -> String {
    m.chars().filter(|c| !c.is_ascii_digit()).collect()
}

/// Count a finding under its shape, keeping its first few reproducers (extra ones are deleted).
fn record(o: &Options, sum: &mut Summary, kind: &str, msg: &str, iter: u64, file: Option<PathBuf>) {
    let key = shape(msg);
    let i = match sum
        .findings
        .iter()
        .position(|f| f.kind == kind && shape(&f.message) == key)
    {
        Some(i) => i,
        None => {
            sum.findings.push(Finding {
                kind: kind.to_string(),
                message: msg.to_string(),
                first_iter: iter,
                count: 0,
                files: Vec::new(),
            });
            sum.findings.len() - 1
        }
    };
    let f = &mut sum.findings[i];
    f.count += 1;
    if let Some(p) = file {
        if f.files.len() < o.keep_per_finding {
            f.files.push(p);
        } else {
            std::fs::remove_file(p).ok();
        }
    }
}
