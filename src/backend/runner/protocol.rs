//! The runner protocol (docs/runners.md): `CMD --describe` once, then one long-lived `CMD --serve`
//! answering JSON-line requests whose tensors travel in safetensors files.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

// The version lives with the file format that stamps it (tensors.rs imports nothing from here).
use super::tensors::PROTOCOL;
/// A runner that exits with this code cannot take the case (unsupported, not a failure).
pub const EXIT_UNSUPPORTED: i32 = 3;

/// How long a runner may take to answer `--describe` or one request before it is killed and the run
/// stops (exit 2): `--runner-timeout`, default [`DEFAULT_TIMEOUT_S`].
static TIMEOUT_S: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT_S);
/// Five minutes: a first request that JIT-compiles its kernel (Triton, FlashInfer) takes a minute or
/// two on an H200; a runner silent for longer has hung.
pub const DEFAULT_TIMEOUT_S: u64 = 300;

/// Set the per-request timeout (`--runner-timeout SECONDS`, at least 1).
pub fn set_timeout(seconds: u64) {
    TIMEOUT_S.store(seconds.max(1), Ordering::Relaxed);
}
pub(super) fn timeout() -> Duration {
    Duration::from_secs(TIMEOUT_S.load(Ordering::Relaxed))
}

/// `RUNNER --describe`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Describe {
    pub protocol: u32,
    pub name: String,
    pub version: String,
    pub ops: Ops,
    #[serde(default)]
    pub supports: Supports,
    #[serde(default)]
    pub conventions: Conventions,
    /// The runner declares its kernels batch-invariant: a request's output is the same, bit for bit,
    /// alone or in any batch. Only then does a difference fail the run (issue #32 item 8); without it
    /// the difference is reported.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch_invariant: bool,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Ops {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<OpSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<OpSpec>,
    /// DSA: absorbed attention of a prefill chunk over each query's selected cache slots (FlashMLA's
    /// `flash_mla_sparse_fwd`); used on layers past the indexer's top_k only (docs/dsa.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse_prefill: Option<OpSpec>,
    /// DSA: absorbed attention of the decode steps over each query's selected cache slots (FlashMLA's
    /// `flash_mla_with_kvcache(..., indices=...)`); on layers past top_k only. Its `kv_cache` says the
    /// cache precision the kernel reads (docs/dsa.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse_decode: Option<OpSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpSpec {
    /// Stage names it returns.
    pub outputs: Vec<String>,
    /// The cache the kernel reads, when it is not the rows as sent: `fp8_v32` (FlashMLA's 656-byte
    /// fp8 cache, written by the runner from them; `super::fp8_cache`). Absent: as sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<String>,
    /// How the kernel cuts the work, when the runner says (issue #32 item 10): coverage, the default
    /// schedule and `sweep` then aim at its boundaries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub geometry: Option<OpGeometry>,
}

/// A runner kernel's tile geometry (`describe` `ops.OP.geometry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpGeometry {
    /// Keys per tile of its online softmax.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_tile: Option<usize>,
    /// Rows one CTA takes (decode: (query, head) rows of a request; prefill: queries of a head); absent:
    /// 1, each row its own key range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_tile: Option<usize>,
    /// `vllm` (the default): split partials over the harness's `num_splits` with vLLM's partition;
    /// `own`: the kernel chooses its split count and partition (FlashMLA), and its partials are checked
    /// by merge consistency.
    #[serde(default)]
    pub split_partition: SplitPartition,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitPartition {
    #[default]
    Vllm,
    Own,
}

impl OpGeometry {
    /// The coverage geometry, when a key tile is declared.
    pub fn coverage(&self) -> Option<crate::kernel_use::Geometry> {
        let rows = self.row_tile.unwrap_or(1);
        self.key_tile.map(|k| crate::kernel_use::Geometry {
            rows_per_cta: rows,
            keys_per_tile: k,
            key_slices: 1,
            stages: 1,
            per_row_ranges: rows == 1,
        })
    }
}

impl Describe {
    /// The decode op's split partition (`vllm` when it says nothing).
    pub fn decode_partition(&self) -> SplitPartition {
        self.ops
            .decode
            .as_ref()
            .and_then(|d| d.geometry)
            .map(|g| g.split_partition)
            .unwrap_or_default()
    }
}

impl OpSpec {
    pub fn has(&self, name: &str) -> bool {
        self.outputs.iter().any(|o| o == name)
    }
}

/// The keys of `supports`, every one of which [`Supports`] reads.
pub const SUPPORTS_KEYS: [&str; 9] = [
    "dtypes",
    "cache_formats",
    "page_sizes",
    "heads",
    "kv_lora_rank",
    "qk_rope",
    "qk_head_dim",
    "v_head_dim",
    "max_q_len",
];

/// What a runner accepts: each list `None` (JSON null or absent) for any value.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Supports {
    #[serde(default)]
    pub dtypes: Option<Vec<String>>,
    #[serde(default)]
    pub page_sizes: Option<Vec<usize>>,
    #[serde(default)]
    pub heads: Option<Vec<usize>>,
    #[serde(default)]
    pub kv_lora_rank: Option<Vec<usize>>,
    #[serde(default)]
    pub qk_rope: Option<Vec<usize>>,
    #[serde(default)]
    pub qk_head_dim: Option<Vec<usize>>,
    #[serde(default)]
    pub v_head_dim: Option<Vec<usize>>,
    #[serde(default)]
    pub max_q_len: Option<usize>,
    /// The quantized cache byte formats (`run --kv-cache-dtype`, `crate::kv_format` names) the decode
    /// op reads from `kv_cache` as u8 bytes with `meta.cache.format`. Unlike the other keys, absent or
    /// null is none: the cache then travels in the run's dtype only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_formats: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum LseBase {
    #[default]
    #[serde(rename = "e")]
    E,
    #[serde(rename = "2")]
    Two,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LseLayout {
    #[default]
    TokenHead,
    HeadToken,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Conventions {
    #[serde(default)]
    pub lse_base: LseBase,
    #[serde(default)]
    pub lse_layout: LseLayout,
    /// The cache format with which the decode kernel also reads q in float8 e4m3 (FlashMLA's dense fp8
    /// decode: q and cache both e4m3, one descale each). mla-diff then sends q on that grid with its
    /// scale (`meta.q_scale`) and judges the kernel over that q (`super::q_fp8`). Absent: q as sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_fp8: Option<Fp8With>,
    /// `"dtype"`: the decode kernel reads a quantized cache as its dequantized rows rounded to the
    /// run's dtype (vLLM's Triton decode: `(k.to(float32) * k_scale).to(q.dtype)`, nope and rope, its
    /// V the same rounded rows). mla-diff then judges it over those rounded rows (`super::decode`).
    /// Absent: the rows as the format decodes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dequant: Option<CacheDequant>,
    /// The cache format with which the decode kernel rounds P (exp(s − running max), ≤ 1) to float8
    /// e4m3, unscaled, before its P·V (FlashMLA's dense fp8 decode; its row sum and LSE from P
    /// unrounded). The stage-local view then carries that rounding (`Judging::decode_p_e4m3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p_fp8: Option<Fp8With>,
    /// `"e8mN"`: the accumulator of the decode's fp8 QKᵀ MMA (with `q_fp8`: q and the cache both
    /// e4m3), 8 exponent bits and N fraction bits, truncating after each 32-wide k-step (FlashMLA's
    /// dense fp8 decode on Hopper: `"e8m13"`). The stage-local view then carries that accumulation's
    /// truncation in each score (`Judging::decode_qk_acc`). Absent: an f32 accumulator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_acc: Option<QkAcc>,
}

pub use super::qk_acc::QkAcc;

/// `conventions.q_fp8` / `p_fp8`: the cache format that brings the e4m3 read with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8With {
    /// The per-tensor `fp8` cache (docs/cache-formats.md).
    Fp8,
}

/// `conventions.cache_dequant`: how the decode kernel holds the rows it dequantizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheDequant {
    /// Rounded to the run's dtype (bf16/fp16) before the dots and P·V.
    Dtype,
}

/// One request line.
#[derive(Debug, Serialize)]
pub struct Request<'a> {
    pub id: u64,
    pub op: &'a str,
    pub layer: usize,
    pub input: &'a Path,
    pub output: &'a Path,
    pub meta: &'a serde_json::Value,
}

#[derive(Debug, Deserialize)]
pub(super) struct Reply {
    pub(super) id: u64,
    pub(super) status: String,
    #[serde(default)]
    pub(super) reason: Option<String>,
    #[serde(default)]
    pub(super) message: Option<String>,
    /// Kernel time when the request asked for it (`meta.bench`, `mla-diff bench --peers`).
    #[serde(default)]
    pub(super) time_us: Option<Timing>,
}

/// A runner's own timing of its kernel (CUDA events), µs.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Timing {
    pub median: f64,
    pub min: f64,
}

/// The command line, split as a POSIX shell would (no shell runs it).
pub fn split_command(cmd: &str) -> Result<Vec<String>> {
    let words = shell_words::split(cmd)
        .map_err(|e| Error::Usage(format!("--runner '{cmd}': cannot split the command: {e}")))?;
    if words.is_empty() {
        return Err(Error::Usage("--runner is empty".into()));
    }
    Ok(words)
}

pub(super) fn spawn_error(cmd: &str, e: std::io::Error) -> Error {
    Error::Environment(format!("--runner '{cmd}': cannot start it: {e}"))
}

/// The last non-empty lines of a runner's stderr, on one line (errors are one line).
pub(super) fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The page of a runner that takes `pages` for a schedule that wants `want`: `want` if it is listed,
/// else the largest listed one below it (still inside the tiles the schedule aims at), else the
/// smallest listed.
pub fn pick_page(want: usize, pages: &[usize]) -> usize {
    let ok = || pages.iter().copied().filter(|&p| p > 0);
    match pages.contains(&want) {
        true => want,
        false => ok()
            .filter(|&p| p <= want)
            .max()
            .or_else(|| ok().min())
            .unwrap_or(want),
    }
}

/// The page of a run through the runner described by `d` without --page-size, the schedule wanting `want` (the
/// default schedule's covering page, or the one other schedule options give): [`pick_page`] within its
/// `supports.page_sizes`. The one place a runner's page is chosen; a move reaches the report's
/// notice through the runner backend's options (`backend::Options::runner_page_moved`).
pub fn page_for(d: &Describe, want: usize) -> usize {
    let decodes = d.ops.decode.is_some() || d.ops.sparse_decode.is_some();
    let page = match d.supports.page_sizes.as_deref() {
        Some(l) if decodes => pick_page(want, l),
        _ => want,
    };
    page
}

/// `Command::output`, killed past the timeout (a runner that hangs while importing, say).
fn output_within(c: &mut Command, cmd: &str) -> Result<std::process::Output> {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| spawn_error(cmd, e))?;
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped")));
    let err = drain(Box::new(child.stderr.take().expect("piped")));
    let deadline = Instant::now() + timeout();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Environment(format!(
                    "runner '{cmd}' did not answer --describe within {} s (--runner-timeout); killed",
                    timeout().as_secs()
                )));
            }
        }
    };
    Ok(std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// Run `CMD --describe` and parse its answer; once per command and process (the default schedule
/// asks before the runner is started, and importing torch is seconds).
pub fn describe(cmd: &str) -> Result<Describe> {
    // An `inproc:NAME` runner (the Python API's) answers in process, and is not cached.
    if let Some(name) = cmd.strip_prefix(IN_PROCESS) {
        let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
        let r = reg.get_mut(name).ok_or_else(|| {
            Error::Usage(format!(
                "--runner {cmd}: no in-process runner {name:?} is registered (inproc: runners come from the Python API)"
            ))
        })?;
        return validate(r.describe()?);
    }
    static SEEN: Mutex<BTreeMap<String, Describe>> = Mutex::new(BTreeMap::new());
    if let Some(d) = SEEN.lock().ok().and_then(|m| m.get(cmd).cloned()) {
        return Ok(d);
    }
    let d = describe_uncached(cmd)?;
    if let Ok(mut m) = SEEN.lock() {
        m.insert(cmd.to_string(), d.clone());
    }
    Ok(d)
}

fn describe_uncached(cmd: &str) -> Result<Describe> {
    let words = split_command(cmd)?;
    let out = output_within(
        Command::new(&words[0])
            .args(&words[1..])
            .arg("--describe")
            .stdin(Stdio::null()),
        cmd,
    )?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(EXIT_UNSUPPORTED) {
        return Err(Error::Unsupported(format!(
            "runner '{cmd}' is unsupported here: {}",
            tail(&stderr, 1)
        )));
    }
    if !out.status.success() {
        return Err(Error::Environment(format!(
            "--runner '{cmd}' --describe failed ({}): {}",
            out.status,
            tail(&stderr, 8)
        )));
    }
    let bad = |e: String| {
        Error::Usage(format!(
            "--runner '{cmd}' --describe did not print a valid description: {e}"
        ))
    };
    let raw: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| bad(e.to_string()))?;
    let d: Describe = serde_json::from_value(raw.clone()).map_err(|e| bad(e.to_string()))?;
    // A key mla-diff does not know would otherwise read as "any" (supports) or the default
    // (conventions): a typo that silently widens what the runner claims.
    for (section, known) in [
        ("supports", &SUPPORTS_KEYS[..]),
        (
            "conventions",
            &[
                "lse_base",
                "lse_layout",
                "q_fp8",
                "cache_dequant",
                "p_fp8",
                "qk_acc",
            ][..],
        ),
    ] {
        if let Some(obj) = raw.get(section).and_then(|v| v.as_object()) {
            if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
                let near = known
                    .iter()
                    .map(|n| (strsim::levenshtein(k, n), n))
                    .min()
                    .filter(|(dist, _)| *dist <= 3)
                    .map(|(_, n)| format!(" (did you mean '{n}'?)"))
                    .unwrap_or_default();
                return Err(Error::Usage(format!(
                    "runner {}: describe's {section} has an unknown key '{k}'{near}; it knows {}",
                    d.name,
                    known.join(", ")
                )));
            }
        }
    }
    validate(d)
}

/// A description's protocol, ops and outputs checked (the same for a process and an in-process runner).
pub fn validate(d: Describe) -> Result<Describe> {
    if d.protocol != PROTOCOL {
        return Err(Error::Usage(format!(
            "runner {} speaks protocol {}, this mla-diff speaks {PROTOCOL}",
            d.name, d.protocol
        )));
    }
    if d.ops.decode.is_none()
        && d.ops.prefill.is_none()
        && d.ops.sparse_prefill.is_none()
        && d.ops.sparse_decode.is_none()
    {
        return Err(Error::Usage(format!(
            "runner {} describes no op (decode, prefill, sparse_prefill or sparse_decode)",
            d.name
        )));
    }
    super::qk_acc::needs_q_fp8(&d)?;
    for (op, spec, allowed) in [
        (
            "decode",
            &d.ops.decode,
            &["attn_latent", "lse", "split_out", "split_lse"][..],
        ),
        ("prefill", &d.ops.prefill, &["attn_heads", "lse"][..]),
        (
            "sparse_prefill",
            &d.ops.sparse_prefill,
            &["attn_latent", "lse"][..],
        ),
        (
            "sparse_decode",
            &d.ops.sparse_decode,
            &["attn_latent", "lse"][..],
        ),
    ] {
        if let Some(s) = spec {
            let caches: &[&str] = match op {
                "sparse_decode" => &[super::fp8_cache::FP8_V32],
                _ => &[],
            };
            if let Some(c) = s.kv_cache.as_deref().filter(|c| !caches.contains(c)) {
                return Err(Error::Usage(format!(
                    "runner {}: op {op} reads a kv_cache '{c}' this mla-diff does not model (it knows {caches:?} for this op)",
                    d.name
                )));
            }
            if let Some(bad) = s.outputs.iter().find(|o| !allowed.contains(&o.as_str())) {
                return Err(Error::Usage(format!(
                    "runner {}: op {op} lists output '{bad}'; it may return {allowed:?}",
                    d.name
                )));
            }
            for need in &allowed[..2] {
                if !s.has(need) {
                    return Err(Error::Usage(format!(
                        "runner {}: op {op} must return {need}",
                        d.name
                    )));
                }
            }
            if let Some(g) = &s.geometry {
                if g.key_tile == Some(0) || g.row_tile == Some(0) {
                    return Err(Error::Usage(format!(
                        "runner {}: op {op}'s geometry has a tile of 0",
                        d.name
                    )));
                }
                if g.split_partition == SplitPartition::Own && op != "decode" {
                    return Err(Error::Usage(format!(
                        "runner {}: split_partition is a decode op's (op {op} has no split partials)",
                        d.name
                    )));
                }
            }
            if op == "decode" && s.has("split_out") != s.has("split_lse") {
                return Err(Error::Usage(format!(
                    "runner {}: the decode op returns split_out and split_lse together or neither",
                    d.name
                )));
            }
        }
    }
    Ok(d)
}

/// `--runner inproc:NAME`: a runner registered in this process ([`register_in_process`]), answering
/// with tensors in memory instead of files — the Python API's (`mla_diff.check`, crates/mla-diff-py),
/// so that a check in a test suite runs the same code as `run --runner` without a subprocess.
pub const IN_PROCESS: &str = "inproc:";

/// A runner living in this process.
pub trait InProcess: Send {
    /// Its describe JSON (checked by [`validate`] like a process's).
    fn describe(&mut self) -> Result<Describe>;
    /// Answer one request: the outputs, or `Err(reason)` when it declines the case (unsupported).
    fn call(
        &mut self,
        op: &str,
        layer: usize,
        meta: &serde_json::Value,
        inputs: &[super::tensors::Named],
    ) -> Result<std::result::Result<super::tensors::Outputs, String>>;
}

type Registry = BTreeMap<String, Box<dyn InProcess>>;
static REGISTRY: Mutex<Registry> = Mutex::new(BTreeMap::new());

/// Make `runner` the one `--runner inproc:NAME` opens (once: opening takes it out).
pub fn register_in_process(name: &str, runner: Box<dyn InProcess>) {
    REGISTRY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), runner);
}

/// Take the in-process runner `cmd` (`inproc:NAME`) names; `None` when `cmd` is a command line.
pub fn take_in_process(cmd: &str) -> Option<Result<Box<dyn InProcess>>> {
    let name = cmd.strip_prefix(IN_PROCESS)?;
    let r = REGISTRY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(name);
    Some(r.ok_or_else(|| {
        Error::Usage(format!(
            "--runner {cmd}: no in-process runner {name:?} is registered (inproc: runners come from the Python API)"
        ))
    }))
}

// The serving process lives in its own file; its names stay reachable from here.
pub use super::process::{Exchange, Outcome, Process};

#[cfg(test)]
mod tests {
    use super::pick_page;

    #[test]
    fn a_runners_page_is_the_largest_it_takes_below_the_schedules() {
        assert_eq!(pick_page(16, &[16, 64]), 16);
        assert_eq!(pick_page(32, &[1, 16, 64]), 16);
        // None below: its smallest (FlashMLA's [64] runs page 64).
        assert_eq!(pick_page(16, &[128, 64]), 64);
        assert_eq!(pick_page(16, &[]), 16);
    }
}
