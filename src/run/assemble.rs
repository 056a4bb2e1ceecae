//! The run's report from its layers' results: each mode's verdict, the coverage (the kernels, the DSA
//! sparsity, the production variants reached), the run's facts and the sections its options add.

use super::layers::Done;
use super::{dense_beyond_top_k, dsa, input_json, RunOptions, Setup};
use crate::backend::{Backend, BackendInfo};
use crate::compare;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::report::{Environment, FileInfo, ModeResult, Report, RunInfo, ToolInfo, SCHEMA_VERSION};
use crate::schedule::Schedule;

/// The report of the run set up as `s`, whose layers gave `done`.
pub(super) fn report(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &RunOptions,
    s: Setup,
    done: Done,
) -> Result<Report> {
    let Setup {
        cfg,
        layers,
        hybrid,
        sparse,
        ..
    } = s;
    let mut modes = Vec::new();
    if opts.modes.shadow {
        modes.push(ModeResult {
            mode: "shadow".into(),
            verdict: compare::verdict(&done.shadow),
            layers: done.shadow,
        });
    }
    if opts.modes.free {
        modes.push(ModeResult {
            mode: "free".into(),
            verdict: compare::verdict(&done.free),
            layers: done.free,
        });
    }
    let verdict = Report::overall_verdict(&modes);
    let coverage = coverage(file, backend, info, opts, &cfg, sparse.as_ref())?;
    let mut report = Report {
        schema_version: SCHEMA_VERSION,
        tool: ToolInfo {
            name: "mla-diff".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
        file: FileInfo {
            path: file.path.display().to_string(),
            architecture: cfg.arch.gguf_name().into(),
            name: file
                .get("general.name")
                .and_then(|v| v.as_str())
                .map(String::from),
            size: file.file_size,
        },
        config: serde_json::to_value(&cfg).expect("config serialises"),
        run: RunInfo {
            backend: info.kind.name().into(),
            dtype: opts.dtype.name().into(),
            modes: modes.iter().map(|m| m.mode.clone()).collect(),
            layers,
            schedule: opts.sched.clone(),
            input: input_json(&opts.input),
            tolerances: opts.tolerance_source.clone(),
            injected: opts.faults.0.clone(),
            notices: sparse
                .is_none()
                .then(|| dense_beyond_top_k(file, &cfg, &opts.sched))
                .flatten()
                .into_iter()
                .chain(backend.notices())
                .chain(hybrid.as_ref().and_then(|h| h.skip_message()))
                .collect(),
            shard: None,
            split: None,
        },
        environment: Environment {
            backend: match opts.faults.is_empty() {
                true => info.description.clone(),
                false => format!("{} with injected faults: {}", info.description, opts.faults),
            },
            gpu: info.gpu.clone(),
            crate_version: env!("CARGO_PKG_VERSION").into(),
            os: std::env::consts::OS.into(),
            arch: std::env::consts::ARCH.into(),
            fp64_products: crate::linalg::engine(),
            runner: backend.runner(),
        },
        modes,
        verdict,
        baseline: None,
        repeat: None,
        coverage: Some(coverage),
        tp: None,
        dsa: None,
        runner_checks: None,
        dumps: done.dumped,
    };
    if let Some(sp) = sparse {
        report.set_dsa(sp.result(opts.dtype, info.kind.name(), &|t| backend.query_origin(t)));
    }
    if let Some(rc) = backend.runner_checks() {
        report.set_runner_checks(rc.of_layers(&report.run.layers));
    }
    if opts.repeat > 1 {
        let mode = if opts.modes.shadow { "shadow" } else { "free" };
        report.set_repeat(crate::report::repeat::RepeatResult::new(
            opts.repeat,
            mode,
            done.repeats,
        ));
    }
    Ok(report)
}

/// What the run covered, asked after the run: a backend may choose its kernels per layer (CUDA
/// compiles them for the layer's dims).
fn coverage(
    file: &GgufFile,
    backend: &dyn Backend,
    info: &BackendInfo,
    opts: &RunOptions,
    cfg: &MlaConfig,
    sparse: Option<&dsa::RunSparse>,
) -> Result<crate::coverage::Coverage> {
    let mut coverage = crate::coverage::compute(
        &backend.kernels(cfg, &opts.sched),
        cfg,
        &opts.sched,
        &backend.decode_extra(&opts.sched),
    );
    coverage
        .warnings
        .extend(backend.coverage_notes(&opts.sched));
    coverage.dsa = dsa_coverage(file, cfg, &opts.sched, sparse, opts.dtype, info.kind.name())?;
    // The production variants the selection rules can pick for these dims (issue #35), on the device the
    // rules model: sm_90a (H200), the production device, whichever backend ran.
    let (variants, missed) = crate::coverage::variants(
        cfg,
        &opts.sched,
        &backend.decode_extra(&opts.sched),
        &backend.aimed_variants(),
        &crate::tiles::choice::HOPPER,
        "sm_90a (H200) assumed",
        coverage.dsa.as_ref().map(|d| (d.top_k, d.sparse_queries)),
    );
    coverage.warnings.extend(missed);
    coverage.variants = Some(variants);
    Ok(coverage)
}

/// What a run on a DSA file covered: whether the sparsity bit (queries past top_k) and the optimized
/// indexer's precision; `None` for a dense architecture or a DSA file without indexer keys.
fn dsa_coverage(
    file: &GgufFile,
    cfg: &MlaConfig,
    sched: &Schedule,
    sparse: Option<&dsa::RunSparse>,
    dtype: Dtype,
    backend: &str,
) -> Result<Option<crate::coverage::DsaCoverage>> {
    let Some(ic) = crate::model::IndexerConfig::from_gguf(file, cfg)? else {
        return Ok(None);
    };
    let t = sched.total_tokens();
    Ok(Some(crate::coverage::DsaCoverage {
        top_k: ic.top_k,
        max_keys: t,
        // Causal: query i (0-based) sees i + 1 keys.
        sparse_queries: t.saturating_sub(ic.top_k),
        indexer: sparse.map(|sp| sp.indexer_name(dtype, backend)),
    }))
}
