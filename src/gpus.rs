//! `run --gpus all|N|LIST`: the run's layers spread over the GPUs of one host.
//!
//! One worker process per GPU, each pinned to its device by `CUDA_VISIBLE_DEVICES` and running its
//! shard of the layers (`crate::shard`), the reports joined by `crate::merge`. It is the path a cluster's
//! shards take, so the report is the one-GPU report byte for byte (a homogeneous host: the report names
//! the GPU model, not the device). Processes, not threads, because every worker needs its own CUDA
//! context, fp64 product engine (`crate::linalg`) and kernel cache, and a worker's failure must not
//! take the others' state with it.
//!
//! What it cannot spread: layer l's input is the residual stream after the layers before it, so worker
//! i also recomputes the streams before its slice (`crate::shard`); the speed-up is below the GPU count.

use crate::error::{Error, Result};
use crate::report::Report;
use crate::shard::Shard;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

/// Set on a worker: `i/n:PATH`, shard i of n, its JSON report to PATH. A worker ignores `--gpus`.
pub const WORKER_ENV: &str = "MLA_DIFF_GPU_WORKER";

/// What a worker process was told by its parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub shard: Shard,
    pub json: PathBuf,
}

impl Worker {
    /// This process's worker assignment, if it is one.
    pub fn from_env() -> Result<Option<Worker>> {
        let Some(v) = std::env::var_os(WORKER_ENV) else {
            return Ok(None);
        };
        let v = v.to_string_lossy().into_owned();
        let bad = || {
            Error::Usage(format!(
                "{WORKER_ENV}={v:?}: expected i/n:PATH (set by `run --gpus`)"
            ))
        };
        let (s, p) = v.split_once(':').ok_or_else(bad)?;
        if p.is_empty() {
            return Err(bad());
        }
        Ok(Some(Worker {
            shard: Shard::parse(s)?,
            json: PathBuf::from(p),
        }))
    }
}

/// The devices `spec` names, as `CUDA_VISIBLE_DEVICES` entries: `all`, a count `N` (the first N), or a
/// comma list of indices into the visible devices (`0,1`; repeats allowed: `0,0` runs two workers on
/// one GPU, which tries the split on a one-GPU machine). `visible` is what this process sees: the
/// entries of its own `CUDA_VISIBLE_DEVICES` when set, else `0..count`.
pub fn devices(spec: &str, visible: &[String]) -> Result<Vec<String>> {
    let bad = |m: String| Error::Usage(format!("--gpus {spec:?}: {m}"));
    let spec = spec.trim();
    if spec == "all" {
        return Ok(visible.to_vec());
    }
    let num = |s: &str| {
        s.trim().parse::<usize>().map_err(|_| {
            bad(format!(
                "{s:?} is not `all`, a count or a list of device indices"
            ))
        })
    };
    let picked: Vec<String> = if spec.contains(',') {
        spec.split(',')
            .map(|s| {
                let i = num(s)?;
                visible.get(i).cloned().ok_or_else(|| {
                    bad(format!(
                        "device {i} is not visible: this process sees {} GPU(s)",
                        visible.len()
                    ))
                })
            })
            .collect::<Result<_>>()?
    } else {
        let n = num(spec)?;
        if n == 0 || n > visible.len() {
            return Err(bad(format!(
                "needs 1 to {} GPUs (the ones this process sees)",
                visible.len()
            )));
        }
        visible[..n].to_vec()
    };
    Ok(picked)
}

/// The GPUs this process sees, as `CUDA_VISIBLE_DEVICES` entries for its workers.
pub fn visible(count: usize) -> Vec<String> {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|s| s.trim().to_string())
            .take(count)
            .collect(),
        _ => (0..count).map(|i| i.to_string()).collect(),
    }
}

/// Run `exe args` once per device as workers of a run of `layers` layers (at most one worker per
/// layer), wait for all, and join their reports. A worker that ends in error (exit 2, a signal) stops
/// the others and is the run's error; its stderr is the parent's. `log`: a line per worker on stderr.
pub fn fan_out(
    exe: &Path,
    args: &[OsString],
    devices: &[String],
    layers: usize,
    log: bool,
) -> Result<Report> {
    let n = devices.len().min(layers);
    if n == 0 {
        return Err(Error::Usage("--gpus: no layer to run".into()));
    }
    let dir = std::env::temp_dir().join(format!("mla-diff-gpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    let result = spawn_and_join(exe, args, &devices[..n], layers, log, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn spawn_and_join(
    exe: &Path,
    args: &[OsString],
    devices: &[String],
    layers: usize,
    log: bool,
    dir: &Path,
) -> Result<Report> {
    let n = devices.len();
    let started = Instant::now();
    let mut children: Vec<(usize, Child, PathBuf)> = Vec::new();
    for (i, dev) in devices.iter().enumerate() {
        let shard = Shard { index: i, count: n };
        let json = dir.join(format!("worker-{i}.json"));
        if log {
            let r = shard.range(layers, "layers")?;
            eprintln!(
                "mla-diff: GPU worker {i} (CUDA_VISIBLE_DEVICES={dev}): layers {}..{} of the {layers} selected",
                r.start, r.end
            );
        }
        let child = Command::new(exe)
            .args(args)
            .env(WORKER_ENV, format!("{shard}:{}", json.display()))
            .env("CUDA_VISIBLE_DEVICES", dev)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| Error::io(format!("cannot start {}", exe.display()), e));
        match child {
            Ok(c) => children.push((i, c, json)),
            Err(e) => {
                stop(&mut children);
                return Err(e);
            }
        }
    }
    let mut reports = Vec::with_capacity(n);
    let mut left: Vec<(usize, Child, PathBuf)> = children;
    while !left.is_empty() {
        let mut still = Vec::new();
        for (i, mut c, json) in left {
            match c
                .try_wait()
                .map_err(|e| Error::io(format!("GPU worker {i}"), e))?
            {
                None => still.push((i, c, json)),
                // 0 pass, 1 divergence: both are results.
                Some(st) if matches!(st.code(), Some(0 | 1)) => {
                    if log {
                        eprintln!(
                            "mla-diff: GPU worker {i} done after {:.1} s",
                            started.elapsed().as_secs_f64()
                        );
                    }
                    reports.push((json.clone(), Report::from_json_file(&json)?));
                }
                Some(st) => {
                    stop(&mut still);
                    return Err(Error::Environment(format!(
                        "GPU worker {i} of {n} failed ({st}); its error is above"
                    )));
                }
            }
        }
        left = still;
        if !left.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    crate::merge::merge(reports)
}

/// Kill and reap the workers still running.
fn stop(children: &mut [(usize, Child, PathBuf)]) {
    for (_, c, _) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs() {
        let vis: Vec<String> = ["3", "5"].map(String::from).to_vec();
        assert_eq!(devices("all", &vis).unwrap(), vis);
        assert_eq!(devices("1", &vis).unwrap(), vec!["3"]);
        assert_eq!(devices("1,0", &vis).unwrap(), vec!["5", "3"]);
        assert_eq!(devices("0,0", &vis).unwrap(), vec!["3", "3"]);
        for bad in ["0", "3", "2,0", "x", "", "1,,0"] {
            assert!(devices(bad, &vis).is_err(), "{bad}");
        }
    }
}
