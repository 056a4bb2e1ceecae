//! `mla-diff run` as a library operation: a [`Request`] (what the command line says, as plain values)
//! checked against the model, run through the optimized path it names (a backend, split by shard or
//! tp, or a capture; `replay` comes in at [`execute`]), gated and written; the exit code.

use super::execute::finish;
pub use super::execute::{execute, How, Job, Optimized, Prepared};
pub use super::request::{Request, Spread};
use super::{plan, RunOptions};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::MlaConfig;

/// Run what `req` asks; the exit code.
pub fn exec(req: Request) -> Result<i32> {
    // A capture neither says nor keeps the cache's byte format yet (issue #38, the runner protocol's
    // `cache.format`): refused rather than judged as the dtype's cache.
    let kv = req.backend.kv_format;
    if !kv.is_auto() && (!req.capture.is_empty() || req.write_capture.is_some()) {
        return Err(Error::Usage(format!(
            "--kv-cache-dtype {kv}: captures (--capture, --write-capture) carry the dtype's cache only so far (issue #38)"
        )));
    }
    let file = GgufFile::open(&req.file)?;
    // The one dispatch point: the attention the file has, then what takes the optimized path's place.
    if super::v4::is_v4(&file) {
        return super::v4::command::exec(&req, &file);
    }
    let cfg = MlaConfig::from_gguf(&file)?;
    match req.capture.is_empty() {
        false => super::capture::exec(&req, &file, &cfg),
        true => on_backend(&req, &file, &cfg),
    }
}

/// The run on a backend (`req.backend`), split as `--shard`, `--tp` or `--gpus` say.
fn on_backend(req: &Request, file: &GgufFile, cfg: &MlaConfig) -> Result<i32> {
    let (opts, page_moved) = plan::options(req, file, cfg)?;
    if let Some(s) = req.shard {
        // Before the run: a shard count larger than the layers is a usage error.
        let n = opts.layers.as_ref().map_or(cfg.n_layer, Vec::len);
        s.range(n, "layers")?;
    }
    if let Some(t) = &req.tp {
        t.check(cfg)?;
    }
    let ready = Prepared::check(file, cfg, &opts, &req.report)?;
    if let Some(g) = &req.gpus {
        return spread(req, g, cfg, &opts, ready);
    }
    let how = How {
        shard: req.shard,
        tp: req.tp,
        write_capture: req.write_capture.clone(),
    };
    let path = Optimized::Open(&req.backend, page_moved);
    execute(
        Job {
            file,
            cfg,
            opts: &opts,
        },
        ready,
        path,
        &req.report,
        &[],
        how,
    )
}

/// `--gpus`: this run's layers over the GPUs, one worker process each (`gpus::fan_out`), then the
/// joined report written and gated as a one-GPU run's.
fn spread(
    req: &Request,
    g: &Spread,
    cfg: &MlaConfig,
    opts: &RunOptions,
    ready: Prepared,
) -> Result<i32> {
    if req.backend.choice == crate::backend::Choice::Cpu {
        return Err(Error::Usage(
            "--gpus spreads a run over GPUs: it needs --backend cuda (or auto on a GPU machine)"
                .into(),
        ));
    }
    if req.report.dump_dir.is_some() {
        return Err(Error::Usage(
            "--gpus does not dump tensors (each worker sees only its layers): dump from a one-GPU run, e.g. with --layers".into(),
        ));
    }
    let count = crate::backend::cuda::device::device_count()?;
    let devices = crate::gpus::devices(&g.spec, &crate::gpus::visible(count))?;
    let layers = opts.layers.as_ref().map_or(cfg.n_layer, Vec::len);
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("--gpus: cannot find this program to start its workers", e))?;
    let started = std::time::Instant::now();
    let quiet = req.report.formats.quiet;
    let rep = crate::gpus::fan_out(&exe, &g.args, &devices, layers, !quiet)?;
    finish(rep, ready, &req.report, started)
}
