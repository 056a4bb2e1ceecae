//! `run FILE --capture DIR…`: a capture of what a serving engine computed takes the optimized path's
//! place (docs/captures.md, `crate::capture`): the captures opened and checked against the model, the
//! run's options from them, then the shared run ([`super::execute::execute`]).

use super::execute::{execute, How, Job, Optimized, Prepared};
use super::request::Request;
use super::{InputSpec, Mode, RunOptions};
use crate::capture::{Capture, CaptureBackend};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::MlaConfig;

/// ` (stage_dtypes: cache_rows fp16, …)`, or nothing.
fn stage_dtypes(m: &crate::capture::Manifest) -> String {
    match m.stage_dtypes.is_empty() {
        true => String::new(),
        false => format!(
            " (stage_dtypes: {})",
            m.stage_dtypes
                .iter()
                .map(|(k, d)| format!("{k} {}", d.name()))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

pub fn exec(a: &Request, file: &GgufFile, cfg: &MlaConfig) -> Result<i32> {
    let caps = a
        .capture
        .iter()
        .map(|d| {
            let c = Capture::open(d)?;
            // Before any step file is read: a capture of another file is refused, naming the difference.
            c.manifest.check_identity(file, d)?;
            Ok(c)
        })
        .collect::<Result<Vec<_>>>()?;
    let dtype = caps[0].manifest.dtype;
    if let Some(c) = caps.iter().find(|c| {
        c.manifest.dtype != dtype || c.manifest.stage_dtypes != caps[0].manifest.stage_dtypes
    }) {
        return Err(Error::Usage(format!(
            "capture {} is {}{} but {} is {}{}: captures of one run share their dtypes",
            c.dir.display(),
            c.manifest.dtype.name(),
            stage_dtypes(&c.manifest),
            caps[0].dir.display(),
            dtype.name(),
            stage_dtypes(&caps[0].manifest)
        )));
    }
    // `--layers all` (the default): the layers the capture has.
    let layers = match a.layers.as_str() {
        "all" => {
            let l = caps[0].layers();
            if let Some(&bad) = l.iter().find(|&&l| l >= cfg.n_layer) {
                return Err(Error::Usage(format!(
                    "capture {} has layer {bad}, but the model has {} layers",
                    caps[0].dir.display(),
                    cfg.n_layer
                )));
            }
            if l.is_empty() {
                return Err(Error::Usage(format!(
                    "capture {} has no layer files",
                    caps[0].dir.display()
                )));
            }
            l
        }
        spec => super::parse_layers(spec, cfg.n_layer)?,
    };
    // Before the step files are read (a rank's head slice is checked there).
    if caps[0].manifest.tp.world_size > 1 {
        let s = caps[0].schedule(caps[0].request(a.capture_request)?)?;
        if super::dsa::sparse_for(file, cfg, &s)?.is_some() {
            return Err(Error::Usage(
                "a tensor-parallel capture past the DSA indexer's top_k is not compared yet (its ranks would be judged on dense attention): capture at most top_k tokens, or tp.world_size 1".into(),
            ));
        }
    }
    let read = caps
        .into_iter()
        .map(|c| {
            let r = c.read(cfg, a.capture_request, &layers)?;
            Ok((c, r))
        })
        .collect::<Result<Vec<_>>>()?;
    let captured = &read[0].1;
    let sched = captured.sched.clone();
    sched.check_memory(cfg)?;
    // Past top_k the run checks the engine's selection (its captured topk) and its attention over it.
    if super::dsa::sparse_for(file, cfg, &sched)?.is_some() {
        if let Some((c, _)) = read.iter().find(|(_, r)| r.topk.is_empty()) {
            return Err(Error::Usage(format!(
                "capture {}: this DSA capture's queries see more keys than the indexer's top_k but it has no topk: capture the engine's selection (docs/captures.md)",
                c.dir.display()
            )));
        }
    } else {
        super::plan::check_dense_beyond_top_k(file, cfg, &sched, a.allow_dense_beyond_topk)?;
    }
    let (tolerances, tolerance_source) = a.tol.table(dtype)?;
    let backend = CaptureBackend::new(cfg, &read, dtype, tolerances.clone())?;
    let dirs: Vec<String> = read
        .iter()
        .map(|(c, _)| c.dir.display().to_string())
        .collect();
    let opts = RunOptions {
        layers: Some(layers),
        input: InputSpec::Capture {
            dir: read[0].0.dir.clone(),
            request: captured.request,
            inputs: std::sync::Arc::new(captured.inputs.clone()),
            summary: backend.summary(&dirs),
        },
        sched,
        dtype,
        modes: a.mode.unwrap_or(Mode::Both).into(),
        tolerances,
        tolerance_source,
        dump: super::dump_of(&a.report, cfg.n_layer)?,
        progress: !a.report.formats.quiet,
        indexer_keys: a.indexer_keys,
        ..RunOptions::default()
    };
    let ready = Prepared::check(file, cfg, &opts, &a.report)?;
    let job = Job {
        file,
        cfg,
        opts: &opts,
    };
    let path = Optimized::Capture(Box::new(backend));
    execute(job, ready, path, &a.report, &[], How::default())
}
