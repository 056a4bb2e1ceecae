//! `mla-diff run` on a DeepSeek-V4 file (docs/deepseek-v4.md): per layer, the fp64 reference against
//! the V4 CPU mirror (`backend::cpu::v4`) at every `V4Stage`, judged by `compare::v4`, into the same
//! `Report` every renderer reads (text, JSON, Markdown, JUnit; one verdict).
//!
//! The run: seeded hidden states at positions `0..T` (`--seed`), a schedule of forward passes (the
//! prompt's chunks, then decode steps: `passes`); shadow mode only (each layer gets the reference's
//! attention-only residual stream over the selected layers). The CSA attention is judged against the
//! reference over the mirror's own selection; the selection is judged by `topk_indices`.

pub mod calibrate;
pub mod command;
mod coverage;
pub mod engine;

use crate::compare::v4::{compare_layer, V4Ctx, V4Tolerances};
use crate::compare::LayerResult;
use crate::error::{Error, Result};
use crate::faults::FaultSet;
use crate::gguf::GgufFile;
use crate::model::v4::{LayerKind, V4Config, V4Weights};
use crate::precision::Dtype;
use crate::report::{Environment, FileInfo, ModeResult, Report, RunInfo, ToolInfo, SCHEMA_VERSION};
use crate::schedule::Schedule;
use engine::{Engine, V4Backend};
use std::ops::Range;

/// A V4 run's options.
#[derive(Debug, Clone)]
pub struct V4Options {
    pub layers: Vec<usize>,
    pub seed: u64,
    pub sched: Schedule,
    pub dtype: Dtype,
    pub faults: FaultSet,
    /// The optimized path: the CPU mirror or the CUDA kernels.
    pub backend: V4Backend,
}

/// The default V4 schedule: a prompt past the window and two HCA windows but four tokens, in chunks
/// of 64 (every compression window of a chunk boundary carried across it), then 8 decode steps that
/// close two CSA windows and HCA's second one in later forward passes.
pub fn default_schedule(c: &V4Config) -> Schedule {
    let hca = LayerKind::Hca.ratio();
    let prompt = (2 * hca - 4).max((c.sliding_window + 16).next_multiple_of(4));
    Schedule {
        prompt_len: prompt,
        chunk: 64,
        decode_steps: 8,
        q_len: 1,
        ..Schedule::default()
    }
}

/// The schedule's forward passes: the prompt's chunks, then each decode step.
pub fn passes(s: &Schedule) -> Vec<Range<usize>> {
    let mut v = s.prefill_chunks();
    v.extend(s.decode_ranges());
    v
}

/// Whether `f` is a DeepSeek-V4 file.
pub fn is_v4(f: &GgufFile) -> bool {
    f.get("general.architecture").and_then(|v| v.as_str()) == Some(crate::model::v4::ARCH)
}

/// The options checked against the model: the schedule, the faults (V4's only) and their layers.
fn check(c: &V4Config, o: &V4Options) -> Result<()> {
    o.sched.validate()?;
    if o.sched.pos_offset != 0 {
        return Err(Error::Usage(
            "--pos-offset: the DeepSeek-V4 reference runs positions 0..T (its compressors' windows start at 0)".into(),
        ));
    }
    if let Some(i) = o.faults.0.iter().find(|i| !i.name.is_v4()) {
        return Err(Error::Usage(format!(
            "--inject {i}: an MLA fault; a DeepSeek-V4 file takes V4's: window_off_by_one, compress_group_off_by_one, compressor_state_dropped, sink_dropped"
        )));
    }
    o.faults.check_targets(c.n_layer, &o.layers)
}

/// One layer: the optimized path, then the reference over its selection, compared; and the
/// reference's output.
pub fn run_layer(
    c: &V4Config,
    w: &V4Weights,
    l: usize,
    x: ndarray::ArrayView2<f64>,
    o: &V4Options,
    tols: &V4Tolerances,
    engine: &mut Engine,
) -> Result<(LayerResult, ndarray::Array2<f64>)> {
    let passes = passes(&o.sched);
    let opt = engine.run_layer(c, w, l, x, &passes, o.faults.active(l))?;
    // An entry the reference has not got (a fault's) is no key of its attention; `topk_indices` shows it.
    let entries = x.nrows() / c.kind(l).ratio().max(1);
    let sel = opt.topk_indices.as_ref().map(|k| {
        k.mapv(|e| match e >= 0 && (e as usize) < entries {
            true => e,
            false => -1,
        })
    });
    let r = crate::reference::v4::run_layer_selecting(c, w, l, x, sel.as_ref());
    let ctx = V4Ctx {
        layer: l,
        passes: &passes,
    };
    let res = compare_layer(&ctx, &r, &opt, o.dtype, tols)?;
    Ok((res, r.attn_out))
}

/// Run `o.layers` of the V4 file `f`.
pub fn run(f: &GgufFile, o: &V4Options) -> Result<Report> {
    let c = V4Config::from_gguf(f)?;
    check(&c, o)?;
    let tols = V4Tolerances::builtin();
    let mut engine = Engine::open(&o.backend, o.dtype)?;
    let mut h = crate::input::random_hidden(c.hidden, o.sched.total_tokens(), o.seed);
    let mut layers = Vec::new();
    for &l in &o.layers {
        let w = V4Weights::load(f, &c, l)?;
        let (res, out) = run_layer(&c, &w, l, h.view(), o, &tols, &mut engine)?;
        layers.push(res);
        h += &out;
    }
    Ok(report(f, &c, o, layers, &engine))
}

fn report(
    f: &GgufFile,
    c: &V4Config,
    o: &V4Options,
    layers: Vec<LayerResult>,
    engine: &Engine,
) -> Report {
    let modes = vec![ModeResult {
        mode: "shadow".into(),
        verdict: crate::compare::verdict(&layers),
        layers,
    }];
    let verdict = Report::overall_verdict(&modes);
    let description = engine.describe();
    Report {
        schema_version: SCHEMA_VERSION,
        tool: ToolInfo {
            name: "mla-diff".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
        file: FileInfo {
            path: f.path.display().to_string(),
            architecture: crate::model::v4::ARCH.into(),
            name: f
                .get("general.name")
                .and_then(|v| v.as_str())
                .map(String::from),
            size: f.file_size,
        },
        config: serde_json::to_value(c).expect("config serialises"),
        run: RunInfo {
            backend: engine.name().into(),
            dtype: o.dtype.name().into(),
            modes: vec!["shadow".into()],
            layers: o.layers.clone(),
            schedule: o.sched.clone(),
            input: serde_json::json!({ "kind": "random", "seed": o.seed }),
            tolerances: format!(
                "built-in DeepSeek-V4 table (src/compare/v4_tolerances.json): {}",
                V4Tolerances::builtin().derived_from
            ),
            injected: o.faults.0.clone(),
            notices: vec![engine.notice().into()],
            shard: None,
            split: None,
        },
        environment: Environment {
            backend: match o.faults.is_empty() {
                true => description,
                false => format!("{description} with injected faults: {}", o.faults),
            },
            gpu: engine.gpu(),
            crate_version: env!("CARGO_PKG_VERSION").into(),
            os: std::env::consts::OS.into(),
            arch: std::env::consts::ARCH.into(),
            fp64_products: crate::linalg::engine(),
            runner: None,
        },
        modes,
        verdict,
        baseline: None,
        repeat: None,
        coverage: Some(coverage::coverage(c, &o.layers, &o.sched, engine.kernel())),
        tp: None,
        dsa: None,
        runner_checks: None,
        dumps: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
