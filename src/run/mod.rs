//! `mla-diff run`: every selected layer through the fp64 reference and the optimized backend, in shadow
//! mode (each layer gets the reference's input: the layer's local error) and/or free-running mode (each
//! side feeds its own output forward through the residual `h ← h + attn(h)`: the accumulated drift).
//!
//! With `repeat` > 1 the deciding mode's optimized path runs that many times per layer and every stage is
//! compared bit for bit between the runs (`repeat.rs`).
//!
//! Only attention is modelled: the FFN/MoE blocks between layers are not, so the "residual stream" here is
//! the attention-only one. That is enough to see whether an attention error grows or washes out.

use crate::backend::{Backend, BackendInfo, RunTables};
use crate::compare::ToleranceTable;
use crate::error::{Error, Result};
use crate::faults::FaultSet;
use crate::gguf::GgufFile;
use crate::input::LayerInputs;
use crate::model::rope_factors::RopeFactors;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::report::Report;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage};
use ndarray::Array2;
use std::path::PathBuf;

mod ahead;
mod assemble;
mod baseline;
mod capture;
mod carry;
pub mod command;
pub mod dsa;
pub mod execute;
mod footprint;
mod judge;
pub mod kpool;
mod layers;
pub mod plan;
pub mod profile;
pub mod repeat;
pub mod request;
pub mod shard;
mod split;
pub mod v4;

/// Where layer inputs come from.
#[derive(Debug, Clone)]
pub enum InputSpec {
    /// Seeded random hidden states with a few large-magnitude channels.
    Random { seed: u64 },
    /// Token ids through `token_embd`.
    Tokens(Vec<u32>),
    /// Captured activations, `[T, hidden]` or `[layers, T, hidden]`.
    Npy(PathBuf),
    /// A capture's layer inputs (`run --capture`, `crate::capture`): the folder, the request, and `x`
    /// by layer.
    Capture {
        dir: PathBuf,
        request: u64,
        inputs: std::sync::Arc<std::collections::BTreeMap<usize, Array2<f64>>>,
        /// What the report's `run.input` says besides: the engine, the folders, the stages captured
        /// and not (an object, merged in).
        summary: serde_json::Value,
    },
}

/// Which layers get `.npy` dumps.
#[derive(Debug, Clone, PartialEq)]
pub enum DumpLayers {
    /// The first diverging layer (of the first failing mode), or nothing when all pass.
    First,
    All,
    List(Vec<usize>),
}

impl DumpLayers {
    /// Parse `--dump-layers`: `first`, `all`, or a layer list as `--layers` takes it.
    pub fn parse(spec: &str, n_layer: usize) -> Result<DumpLayers> {
        Ok(match spec {
            "first" => DumpLayers::First,
            "all" => DumpLayers::All,
            list => DumpLayers::List(parse_layers(list, n_layer)?),
        })
    }
}

/// The dump directory and the layers to dump that `r` asks for, for a model of `n_layer` layers.
pub fn dump_of(
    r: &crate::report::outputs::ReportOptions,
    n_layer: usize,
) -> Result<Option<(PathBuf, DumpLayers)>> {
    Ok(match &r.dump_dir {
        None => None,
        Some(d) => Some((d.clone(), DumpLayers::parse(&r.dump_layers, n_layer)?)),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modes {
    pub shadow: bool,
    pub free: bool,
}

/// The modes of a run as a command names them (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Each layer gets the reference's input: the layer's local error.
    Shadow,
    /// Each side feeds its own output forward: the accumulated drift.
    Free,
    Both,
}

impl From<Mode> for Modes {
    fn from(m: Mode) -> Modes {
        Modes {
            shadow: m != Mode::Free,
            free: m != Mode::Shadow,
        }
    }
}

pub struct RunOptions {
    pub layers: Option<Vec<usize>>,
    pub input: InputSpec,
    pub sched: Schedule,
    pub dtype: Dtype,
    pub modes: Modes,
    pub tolerances: ToleranceTable,
    pub tolerance_source: String,
    pub dump: Option<(PathBuf, DumpLayers)>,
    /// Planted bugs in the optimized path (`--inject`); each layer's run gets those active in it.
    pub faults: FaultSet,
    /// Show a progress bar on stderr (it hides itself when stderr is not a terminal).
    pub progress: bool,
    /// Runs of the optimized path per layer (`--repeat`): above 1, runs 2..N are compared with run 1
    /// bit for bit and any difference fails the run.
    pub repeat: usize,
    /// DSA: how the optimized indexer stores q and k (`--indexer-keys`; the run's dtype by default).
    pub indexer_keys: crate::precision::KeyPrecision,
    /// The covering `sched` on the first layers only, a cheaper schedule on the rest (`split.rs`);
    /// `None`: every layer on `sched`.
    pub split: Option<crate::schedule::Split>,
}

/// A plain `run`'s options: every layer, random inputs of seed 0, the default schedule, bf16, both
/// modes, the calibrated tolerances, no dump, no fault, one repeat, no split. Callers name only
/// what they change (`..RunOptions::default()`), so a new option touches its field and this.
impl Default for RunOptions {
    fn default() -> RunOptions {
        RunOptions {
            layers: None,
            input: InputSpec::Random { seed: 0 },
            sched: Schedule::default(),
            dtype: Dtype::Bf16,
            modes: Modes {
                shadow: true,
                free: true,
            },
            tolerances: ToleranceTable::defaults(),
            tolerance_source: ToleranceTable::DEFAULTS_SOURCE.into(),
            dump: None,
            faults: FaultSet::default(),
            progress: false,
            repeat: 1,
            indexer_keys: Default::default(),
            split: None,
        }
    }
}

/// Parse `--layers`: `all`, `N`, `A..B` (half-open), `A..=B`, or a comma list of those.
pub fn parse_layers(spec: &str, n_layer: usize) -> Result<Vec<usize>> {
    let bad = |m: String| Error::Usage(format!("--layers {spec:?}: {m}"));
    if spec == "all" {
        return Ok((0..n_layer).collect());
    }
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let num = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("{s:?} is not a layer number")))
        };
        // Ranges are checked against the model before they are expanded (`0..18446744073709551615`).
        let past = |l: usize| {
            bad(format!(
                "layer {l} does not exist: the model has {n_layer} layers (0..{n_layer})"
            ))
        };
        if let Some((a, b)) = part.split_once("..=") {
            let (a, b) = (num(a)?, num(b)?);
            if b >= n_layer && a <= b {
                return Err(past(b));
            }
            out.extend(a..=b);
        } else if let Some((a, b)) = part.split_once("..") {
            let (a, end) = (num(a)?, if b.is_empty() { n_layer } else { num(b)? });
            if end > n_layer && a < end {
                return Err(past(end - 1));
            }
            out.extend(a..end);
        } else {
            out.push(num(part)?);
        }
    }
    if out.is_empty() {
        return Err(bad("selects no layer".into()));
    }
    if let Some(&l) = out.iter().find(|&&l| l >= n_layer) {
        return Err(bad(format!(
            "layer {l} does not exist: the model has {n_layer} layers (0..{n_layer})"
        )));
    }
    let mut sorted = out.clone();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != out.len() || sorted != out {
        return Err(bad("layers must be increasing and distinct".into()));
    }
    Ok(out)
}

pub fn input_json(spec: &InputSpec) -> serde_json::Value {
    match spec {
        InputSpec::Random { seed } => serde_json::json!({ "kind": "random", "seed": seed }),
        InputSpec::Tokens(t) => serde_json::json!({ "kind": "tokens", "count": t.len(), "ids": t }),
        InputSpec::Npy(p) => serde_json::json!({ "kind": "npy", "path": p.display().to_string() }),
        InputSpec::Capture {
            dir,
            request,
            summary,
            ..
        } => {
            let mut j = serde_json::json!({
                "kind": "capture",
                "path": dir.display().to_string(),
                "request": request,
            });
            if let (Some(o), Some(extra)) = (j.as_object_mut(), summary.as_object()) {
                o.extend(extra.clone());
            }
            j
        }
    }
}

/// The layer inputs a run's input spec gives, for `sched`'s tokens: one `[T, hidden]` for every layer,
/// or one per layer (a `[layers, T, hidden]` capture).
pub fn load_inputs(
    file: &GgufFile,
    cfg: &MlaConfig,
    input: &InputSpec,
    sched: &Schedule,
) -> Result<LayerInputs> {
    let t = sched.total_tokens();
    Ok(match input {
        InputSpec::Random { seed } => {
            LayerInputs::Shared(crate::input::random_hidden(cfg.hidden, t, *seed))
        }
        InputSpec::Tokens(ids) => {
            if ids.len() != t {
                return Err(Error::Usage(format!(
                    "{} token ids given but the schedule has {t} tokens (prompt {} + {} decode steps × {}); adjust --prompt-len/--decode-steps",
                    ids.len(),
                    sched.prompt_len,
                    sched.decode_steps,
                    sched.q_len
                )));
            }
            LayerInputs::Shared(crate::input::from_token_ids(file, cfg, ids)?)
        }
        InputSpec::Npy(p) => crate::input::load_npy(p, cfg.hidden, t)?,
        InputSpec::Capture { inputs, .. } => LayerInputs::Captured(inputs.clone()),
    })
}

/// The reference residual after a layer: its input plus the reference's attention output, the next
/// layer's shadow input (`h ← h + attn(h)`; FFN/MoE blocks are not modelled).
pub fn residual_after(h: &Array2<f64>, reference: &LayerTrace) -> Result<Array2<f64>> {
    let mut next = h.clone();
    add_residual(&mut next, attn_out(reference)?);
    Ok(next)
}

fn attn_out(t: &LayerTrace) -> Result<&[f64]> {
    t.get(Stage::AttnOut)
        .map(|s| s.data.as_slice())
        .ok_or_else(|| Error::Usage("trace has no attn_out stage".into()))
}

fn add_residual(h: &mut Array2<f64>, out: &[f64]) {
    for (a, b) in h.iter_mut().zip(out) {
        *a += b;
    }
}

/// Run the comparison and build the report. `backend` is the optimized path, `info` its facts
/// (`backend::open`).
pub fn run(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &RunOptions,
) -> Result<Report> {
    match &opts.split {
        Some(s) => split::run(file, backend, info, opts, s),
        None => run_from(file, backend, info, opts, None),
    }
}

/// Where a run starts when it is a slice of a longer one (`crate::shard`): its layers, and the two
/// residual streams (reference, optimized) as the longer run had them before its first layer.
pub struct Start {
    pub layers: Vec<usize>,
    pub h_ref: Array2<f64>,
    pub h_opt: Array2<f64>,
    /// Free mode: the quantized cache's effect the optimized stream carries (`carry`).
    pub carried: Option<Array2<f64>>,
}

/// The residual streams a run's layers start from: the reference's, the optimized path's, and the cache
/// effect the optimized one carries (free mode, a quantized cache: `carry`).
type Streams = (Array2<f64>, Array2<f64>, Option<Array2<f64>>);

/// [`run`], or with `start` the slice of it that begins there: the run checked and set up, every layer
/// through both paths and judged ([`layers::run_layers`]), then the report ([`assemble::report`]).
pub fn run_from(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &RunOptions,
    start: Option<Start>,
) -> Result<Report> {
    let mut setup = Setup::new(file, backend, info, opts, start.as_ref().map(|s| &s.layers))?;
    let bar = layers::progress_bar(opts, setup.layers.len());
    let streams = match start {
        Some(s) => (s.h_ref, s.h_opt, s.carried),
        None => {
            let h = setup.inputs.layer(setup.layers[0])?;
            (h.clone(), h, None)
        }
    };
    let (done, prof) = layers::run_layers(file, backend, opts, &mut setup, streams, &bar)?;
    crate::linalg::check_engine()?;
    bar.finish_and_clear();
    prof.finish();
    assemble::report(file, backend, info, opts, setup, done)
}

/// A run checked and ready for its layers: the model, the layers it runs (a hybrid file's MLA ones),
/// their inputs, the rope tables, the stages the backend provides, and (DSA past top_k) the sparse
/// model.
struct Setup {
    cfg: MlaConfig,
    layers: Vec<usize>,
    hybrid: Option<crate::model::HybridLayout>,
    inputs: LayerInputs,
    tables: RunTables,
    provided: crate::trace::StageSet,
    sparse: Option<dsa::RunSparse>,
}

impl Setup {
    /// The run's options checked against the file and the backend; `layers`: a shard's own.
    fn new(
        file: &GgufFile,
        backend: &dyn Backend,
        info: &BackendInfo,
        opts: &RunOptions,
        layers: Option<&Vec<usize>>,
    ) -> Result<Setup> {
        let cfg = MlaConfig::from_gguf(file)?;
        opts.sched.validate()?;
        opts.faults.refuse_v4()?;
        // Before the inputs, the rope tables or any layer buffer is allocated.
        opts.sched.check_memory(&cfg)?;
        if !opts.modes.shadow && !opts.modes.free {
            return Err(Error::Usage("--mode selects no mode".into()));
        }
        if opts.repeat == 0 {
            return Err(Error::Usage("--repeat must be at least 1".into()));
        }
        let layers = match (layers, &opts.layers) {
            (Some(s), _) => s.clone(),
            (None, Some(l)) => l.clone(),
            (None, None) => (0..cfg.n_layer).collect(),
        };
        if let Some(&l) = layers.iter().find(|&&l| l >= cfg.n_layer) {
            return Err(Error::Usage(format!(
                "layer {l} does not exist: the model has {} layers",
                cfg.n_layer
            )));
        }
        let hybrid = crate::model::HybridLayout::from_gguf(file)?;
        let layers = mla_layers(layers, hybrid.as_ref())?;
        let inputs = load_inputs(file, &cfg, &opts.input, &opts.sched)?;
        // Free mode needs each side to feed its own output forward, but per-layer captures restart the
        // reference at every layer: the "drift" would compare two different streams.
        if opts.modes.free {
            if let LayerInputs::PerLayer(_) = inputs {
                return Err(Error::Usage(
                    "free-running mode cannot use per-layer captures ([layers, T, hidden] .npy): the reference would restart from each capture while the optimized path runs on; use --mode shadow, or a [T, hidden] capture".into(),
                ));
            }
        }
        let factors = RopeFactors::load(file, &cfg)?;
        let tables = RunTables::new(&cfg, factors.as_ref(), &opts.sched)?;
        let provided = backend.provides();
        // A DSA file past top_k runs the sparse model (`dsa`); otherwise DSA is dense attention exactly.
        let mut sparse = dsa::sparse_for(file, &cfg, &opts.sched)?;
        if let Some(sp) = sparse.as_mut() {
            sp.keys = opts.indexer_keys;
        }
        if sparse.is_some() && !backend.judging().sparse {
            return Err(Error::Unsupported(format!(
                "{} has no sparse attention, but this DSA file's queries see more than its indexer's top_k ({} keys): run it on --backend cpu, or on at most top_k tokens",
                info.description,
                opts.sched.total_tokens()
            )));
        }
        Ok(Setup {
            cfg,
            layers,
            hybrid,
            inputs,
            tables,
            provided,
            sparse,
        })
    }
}

/// A hybrid file (glm5-next): the linear-attention layers are not MLA. They are skipped, with a
/// notice; a selection with no MLA layer left is an error naming the MLA layers.
pub(super) fn mla_layers(
    layers: Vec<usize>,
    hybrid: Option<&crate::model::HybridLayout>,
) -> Result<Vec<usize>> {
    Ok(match hybrid {
        None => layers,
        Some(h) => {
            let kept: Vec<usize> = layers
                .iter()
                .copied()
                .filter(|l| !h.linear_layers.contains(l))
                .collect();
            if kept.is_empty() {
                return Err(Error::Usage(format!(
                    "layers {} are linear attention (head_count_kv 0), not MLA: mla-diff checks the MLA layers {}",
                    crate::model::config::ranges(&layers),
                    crate::model::config::ranges(&h.mla_layers)
                )));
            }
            kept
        }
    })
}

/// The lightning indexer's `top_k` of a DSA model (GLM-5 `glm-dsa`, DeepSeek-V3.2 `deepseek32`, glm5-next's
/// k-pool indexer), `None`
/// for dense-attention architectures; `Some(None)` when a DSA file lacks the key.
pub fn dsa_top_k(file: &GgufFile, cfg: &MlaConfig) -> Option<Option<u64>> {
    use crate::model::config::Arch;
    matches!(cfg.arch, Arch::GlmDsa | Arch::Deepseek32 | Arch::Glm5Next).then(|| {
        file.get(&format!("{}.attention.indexer.top_k", cfg.arch.gguf_name()))
            .and_then(|v| v.as_u64())
    })
}

/// A notice when the schedule lets a query see more keys than a DSA model's indexer keeps: the model
/// attends to its top_k keys only, the reference (and mla-diff's optimized paths) to all of them.
pub fn dense_beyond_top_k(file: &GgufFile, cfg: &MlaConfig, sched: &Schedule) -> Option<String> {
    // The last token sees every key of the run (causal).
    let keys = sched.total_tokens() as u64;
    match dsa_top_k(file, cfg)? {
        Some(k) if keys <= k => None,
        Some(k) => Some(format!(
            "dense attention beyond the DSA top-k: queries see up to {keys} keys but the model's lightning indexer keeps {k} ({}.attention.indexer.top_k); the reference is dense (no indexer), so this run does not check what the model computes",
            cfg.arch.gguf_name()
        )),
        None => Some(format!(
            "dense attention on a DSA model whose indexer top_k is unknown ({}.attention.indexer.top_k is missing); the reference is dense (no indexer), exact only while queries see at most top_k keys",
            cfg.arch.gguf_name()
        )),
    }
}
