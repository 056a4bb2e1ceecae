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
use crate::compare::{self, LayerResult, ToleranceTable};
use crate::error::{Error, Result};
use crate::faults::FaultSet;
use crate::gguf::GgufFile;
use crate::input::LayerInputs;
use crate::model::rope_factors::RopeFactors;
use crate::model::{LayerWeights, MlaConfig};
use crate::precision::Dtype;
use crate::report::{Environment, FileInfo, ModeResult, Report, RunInfo, ToolInfo, SCHEMA_VERSION};
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage};
use ndarray::Array2;
use std::path::PathBuf;

mod baseline;
pub mod dsa;
pub mod profile;
pub mod repeat;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modes {
    pub shadow: bool,
    pub free: bool,
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
    run_from(file, backend, info, opts, None)
}

/// Where a run starts when it is a slice of a longer one (`crate::shard`): its layers, and the two
/// residual streams (reference, optimized) as the longer run had them before its first layer.
pub struct Start {
    pub layers: Vec<usize>,
    pub h_ref: Array2<f64>,
    pub h_opt: Array2<f64>,
}

/// [`run`], or with `start` the slice of it that begins there.
pub fn run_from(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &RunOptions,
    start: Option<Start>,
) -> Result<Report> {
    let cfg = MlaConfig::from_gguf(file)?;
    opts.sched.validate()?;
    // Before the inputs, the rope tables or any layer buffer is allocated.
    opts.sched.check_memory(&cfg)?;
    if !opts.modes.shadow && !opts.modes.free {
        return Err(Error::Usage("--mode selects no mode".into()));
    }
    if opts.repeat == 0 {
        return Err(Error::Usage("--repeat must be at least 1".into()));
    }
    let layers = match (&start, &opts.layers) {
        (Some(s), _) => s.layers.clone(),
        (None, Some(l)) => l.clone(),
        (None, None) => (0..cfg.n_layer).collect(),
    };
    if let Some(&l) = layers.iter().find(|&&l| l >= cfg.n_layer) {
        return Err(Error::Usage(format!(
            "layer {l} does not exist: the model has {} layers",
            cfg.n_layer
        )));
    }
    // A hybrid file (glm5-next): the linear-attention layers are not MLA. They are skipped, with a
    // notice; a selection with no MLA layer left is an error naming the MLA layers.
    let hybrid = crate::model::HybridLayout::from_gguf(file)?;
    let layers: Vec<usize> = match &hybrid {
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
    };
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
    if sparse.is_some() && !backend.sparse() {
        return Err(Error::Unsupported(format!(
            "{} has no sparse attention, but this DSA file's queries see more than its indexer's top_k ({} keys): run it on --backend cpu, or on at most top_k tokens",
            info.description,
            opts.sched.total_tokens()
        )));
    }

    let bar = if opts.progress && layers.len() > 1 {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(layers.len() as u64),
            indicatif::ProgressDrawTarget::stderr(),
        );
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} [{bar:30}] {pos}/{len} layers {msg} ({elapsed})",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        b.set_prefix("mla-diff");
        b
    } else {
        indicatif::ProgressBar::hidden()
    };

    let (mut h_ref, mut h_opt) = match start {
        Some(s) => (s.h_ref, s.h_opt),
        None => {
            let h = inputs.layer(layers[0])?;
            (h.clone(), h)
        }
    };
    // Per mode, the layers' results; the dumps written.
    let mut results = (Vec::<LayerResult>::new(), Vec::new(), Vec::new());
    let mut repeats = Vec::new();
    let mut prof = profile::Profile::from_env();
    // Each layer's stage-local view and comparison (its "judge") run on their own thread next to the
    // next layer's reference and optimized path (they need nothing of them, nor they of it), collected
    // in layer order, so that results and dumps come out as a sequential run's. Two judges at a time
    // where the threads are there for them (on the H200 host's 16 cores one judge kept ~8 busy and set
    // the pace); one when only the first failing layer is dumped (an earlier dump must be known).
    let max_judges = match &opts.dump {
        Some((_, DumpLayers::First)) => 1,
        _ if rayon::current_num_threads() >= 12 => 2,
        _ => 1,
    };
    std::thread::scope(|judges| -> Result<()> {
        let mut judging = std::collections::VecDeque::new();
        let collect = |j: std::thread::ScopedJoinHandle<Result<Judged>>,
                       prof: &mut profile::Profile,
                       out: &mut (Vec<LayerResult>, Vec<LayerResult>, Vec<PathBuf>)|
         -> Result<()> {
            let j = j.join().unwrap_or_else(|e| std::panic::resume_unwind(e))?;
            // A device error in the fp64 products ends the run (exit 2), not a report of host sums.
            crate::linalg::check_engine()?;
            out.0.extend(j.shadow);
            out.1.extend(j.free);
            out.2.extend(j.dump);
            prof.add("stage-local view", j.local);
            prof.add("compare + reports", j.took);
            Ok(())
        };
        for (i, &l) in layers.iter().enumerate() {
            bar.set_message(format!("layer {l}"));
            // Captured per-layer inputs replace the attention-only residual stream in shadow mode. A
            // capture's replace both streams: the engine's own stream is the captured one (it ran the
            // FFN, which is not modelled), so free mode's drift is each layer's attention error in the
            // residual it adds to (`docs/captures.md`).
            if i > 0 {
                match inputs {
                    LayerInputs::PerLayer(_) => h_ref = inputs.layer(l)?,
                    LayerInputs::Captured(_) => {
                        h_ref = inputs.layer(l)?;
                        h_opt = h_ref.clone();
                    }
                    LayerInputs::Shared(_) => {}
                }
            }
            // Loaded here, not ahead beside the reference: one layer's weights alive at a time (a
            // preloaded next layer cost 0.5 GB of peak RSS at GLM-5 dims for ~10 % of the time:
            // docs/scale.md).
            let (w, t_load) = load_layer(file, &cfg, l);
            prof.add("load + dequantize", t_load);
            let w = w?;
            let dense_ctx = tables.ctx(&cfg, &w, &opts.sched, opts.faults.active(l));
            let sel = match &sparse {
                Some(sp) => {
                    Some(prof.time("DSA selection", || sp.select(file, &dense_ctx, &h_ref))?)
                }
                None => None,
            };
            let ref_sel = sel.as_ref().map(|s| &s.reference);
            // Shadow mode's optimized path attends over the reference's selection: its stage checks then
            // see kernel errors only; the selections are checked apart (`dsa::RunSparse::check_layer`).
            let layer_ctx = crate::backend::LayerCtx {
                selection: ref_sel,
                ..dense_ctx
            };
            let ctx = compare::Ctx {
                elementwise: true,
                layer: l,
                sched: &opts.sched,
                block_table: &tables.block_table,
                provided,
            };
            let free_ctx = compare::Ctx {
                elementwise: false,
                ..ctx
            };
            // The fp64 reference on its own thread, next to what of the layer does not need it: shadow
            // mode's optimized path, its repeats and its stage-local view (or, without shadow mode, free
            // mode's). Each side computes what it did alone, so the results are the same.
            // No view for an absorbed sparse prefill (not modelled: docs/dsa.md).
            let view_wanted = !(sel.is_some() && backend.sparse_prefill_absorbed());
            let (reference, optimized) = std::thread::scope(|sc| {
                let (c, w, rope, h, sched) = (&cfg, &w, &tables.rope, &h_ref, &opts.sched);
                let r = sc.spawn(move || {
                    let t0 = std::time::Instant::now();
                    let r = crate::reference::run_layer_sel(c, w, rope, h, sched, ref_sel);
                    (r, t0.elapsed())
                });
                let optimized = (|| -> Result<OptTraces> {
                    let mut shadow_opt = None;
                    if opts.modes.shadow {
                        let opt =
                            prof.time("optimized path", || backend.run_layer(&layer_ctx, &h_ref))?;
                        if opts.repeat > 1 {
                            repeats.push(repeat::repeat_layer(
                                backend,
                                &layer_ctx,
                                &h_ref,
                                &opt,
                                opts.repeat,
                                &ctx,
                            )?);
                        }
                        shadow_opt = Some(opt);
                    }
                    // The stage-local view's products against the weights: made here, on their own
                    // thread next to free mode's pass (and the reference), not in the judge, so the
                    // layer's weights are let go before the next layer loads (two layers alive at
                    // once cost 0.66 GB of peak at GLM-5 dims: docs/scale.md).
                    let (pre, free_opt) = std::thread::scope(|ps| -> Result<_> {
                        let pre = shadow_opt.as_ref().filter(|_| view_wanted).map(|opt| {
                            let w = &w;
                            ps.spawn(move || {
                                let t0 = std::time::Instant::now();
                                let p = compare::local::prepare(c, w, opts.dtype, opt);
                                (p, t0.elapsed())
                            })
                        });
                        let free_opt = match opts.modes.free {
                            true => Some(free_layer(
                                backend,
                                &layer_ctx,
                                &h_opt,
                                opts,
                                &free_ctx,
                                &mut repeats,
                                &mut prof,
                            )?),
                            false => None,
                        };
                        let pre = pre.map(|j| {
                            let (p, took) =
                                j.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
                            prof.add("stage-local view (weights)", took);
                            p
                        });
                        Ok((pre, free_opt))
                    })?;
                    Ok((shadow_opt.map(|o| (o, pre)), free_opt))
                })();
                let (r, took) = r.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
                prof.add("reference (fp64)", took);
                (r, optimized)
            });
            let reference = reference?;
            let (shadow_opt, free_opt) = optimized?;
            // The reference residual after this layer: the next layer's shadow input and free mode's
            // yardstick; the optimized one: free mode's next input.
            let next_ref = residual_after(&h_ref, &reference)?;
            let free_opt = match free_opt {
                Some(opt) => {
                    add_residual(&mut h_opt, attn_out(&opt)?);
                    let drift = compare::metrics::rel_l2(
                        next_ref.as_slice().expect("standard layout"),
                        h_opt.as_slice().expect("standard layout"),
                    );
                    Some((opt, drift))
                }
                None => None,
            };
            // What shadow mode's stage-local view needs, taken before the DSA check takes the selection:
            // the selection the path attended over (the reference's); no view for an absorbed sparse
            // prefill (not modelled: docs/dsa.md).
            let shadow = shadow_opt.map(|(opt, pre)| {
                let view = pre.map(|pre| View {
                    pre,
                    x: h_ref.clone(),
                    known_attention: backend.known_attention(),
                    score_sum: backend.score_sum(),
                    outside: backend.outside_local_view(),
                    selection: sel.as_ref().map(|s| s.reference.clone()),
                });
                (opt, view)
            });
            if let (Some(sp), Some(sel)) = (sparse.as_mut(), sel) {
                let t_dsa = std::time::Instant::now();
                sp.check_layer(
                    &dense_ctx,
                    &ctx,
                    sel,
                    backend,
                    &h_ref,
                    &reference,
                    opts.dtype,
                    &opts.tolerances,
                )?;
                prof.add("DSA selection check", t_dsa.elapsed());
            }
            while judging.len() >= max_judges {
                let j = judging.pop_front().expect("a judge in flight");
                collect(j, &mut prof, &mut results)?;
            }
            let layer = Computed {
                reference,
                shadow,
                free: free_opt,
            };
            let dumped_before = !results.2.is_empty();
            let (cfg, tables) = (&cfg, &tables);
            judging.push_back(judges.spawn(move || {
                let env = JudgeEnv {
                    cfg,
                    rope: &tables.rope,
                    opts,
                    provided,
                };
                judge(layer, &env, &ctx, &free_ctx, dumped_before)
            }));
            h_ref = next_ref;
            release_memory();
            bar.inc(1);
        }
        while let Some(j) = judging.pop_front() {
            collect(j, &mut prof, &mut results)?;
        }
        Ok(())
    })?;
    crate::linalg::check_engine()?;
    let (shadow, free, dumped) = results;
    bar.finish_and_clear();
    prof.finish();

    let mut modes = Vec::new();
    if opts.modes.shadow {
        modes.push(ModeResult {
            mode: "shadow".into(),
            verdict: compare::verdict(&shadow),
            layers: shadow,
        });
    }
    if opts.modes.free {
        modes.push(ModeResult {
            mode: "free".into(),
            verdict: compare::verdict(&free),
            layers: free,
        });
    }
    let verdict = Report::overall_verdict(&modes);
    // After the run: a backend may choose its kernels per layer (CUDA compiles them for the layer's dims).
    let mut coverage = crate::coverage::compute(
        &backend.kernels(&cfg, &opts.sched),
        &cfg,
        &opts.sched,
        &backend.decode_extra(&opts.sched),
    );
    coverage
        .warnings
        .extend(backend.coverage_notes(&opts.sched));
    coverage.dsa = dsa_coverage(
        file,
        &cfg,
        &opts.sched,
        sparse.as_ref(),
        opts.dtype,
        info.kind.name(),
    )?;
    // The production variants the selection rules can pick for these dims (issue #35), on the device the
    // rules model: sm_90a (H200), the production device, whichever backend ran.
    let (variants, missed) = crate::coverage::variants(
        &cfg,
        &opts.sched,
        &backend.decode_extra(&opts.sched),
        &backend.aimed_variants(),
        &crate::tiles::choice::HOPPER,
        "sm_90a (H200) assumed",
        coverage.dsa.as_ref().map(|d| (d.top_k, d.sparse_queries)),
    );
    coverage.warnings.extend(missed);
    coverage.variants = Some(variants);
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
        dumps: dumped,
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
            repeats,
        ));
    }
    Ok(report)
}

/// One layer's weights, dequantized, and the time it took; the file's pages of the layer are released
/// (the weights are copies: those pages are not read again).
fn load_layer(
    file: &GgufFile,
    cfg: &MlaConfig,
    l: usize,
) -> (Result<LayerWeights>, std::time::Duration) {
    let t0 = std::time::Instant::now();
    let w = LayerWeights::load(file, cfg, l);
    file.release(
        crate::model::weights::tensor_names(l)
            .iter()
            .filter_map(|n| file.tensor(n)),
    );
    (w, t0.elapsed())
}

/// Hand the memory freed during the layer back to the system, through the hook the binary installs
/// ([`crate::alloc::set_release`]). The binary's allocator (mimalloc) keeps freed pages for reuse, per
/// thread, until the owning thread collects them: the run loop's and the ended threads' (reference,
/// judges) here, every rayon worker's by a broadcast — 0.1–0.3 GB of a GLM-5 run's peak resident set
/// each. Once per layer, not at every free (`MIMALLOC_PURGE_DELAY=0` cost 5× the system time). A no-op
/// without a hook.
fn release_memory() {
    if let Some(release) = crate::alloc::release_hook() {
        release();
        rayon::broadcast(|_| release());
    }
}

/// A layer's optimized traces computed next to its reference: shadow mode's, with its stage-local
/// view's products against the weights where it has a view, and free mode's.
type OptTraces = (
    Option<(LayerTrace, Option<compare::local::Prepared>)>,
    Option<LayerTrace>,
);

/// A layer's traces, computed, for [`judge`]: the reference, shadow mode's optimized trace with what
/// its stage-local view needs (none where it is not modelled), free mode's with its drift.
struct Computed {
    reference: LayerTrace,
    shadow: Option<(LayerTrace, Option<View>)>,
    free: Option<(LayerTrace, f64)>,
}

/// What a layer's stage-local view needs besides the run's tables: the layer's weights and input, the
/// backend's answers about its path, and (DSA) the selection the path attended over.
struct View {
    /// The view's products against the layer's weights, made next to the reference
    /// ([`compare::local::prepare`]): a judge holds no copy of the layer.
    pre: compare::local::Prepared,
    x: Array2<f64>,
    known_attention: bool,
    score_sum: crate::precision::ScoreSum,
    outside: crate::trace::StageSet,
    selection: Option<crate::reference::sparse::Selection>,
}

/// What every layer's [`judge`] shares.
struct JudgeEnv<'a> {
    cfg: &'a MlaConfig,
    rope: &'a crate::rope::RopeTables,
    opts: &'a RunOptions,
    provided: crate::trace::StageSet,
}

/// A layer's comparisons: its results per mode, its dump, and how long its local view and the rest took.
struct Judged {
    shadow: Option<LayerResult>,
    free: Option<LayerResult>,
    dump: Option<PathBuf>,
    local: std::time::Duration,
    took: std::time::Duration,
}

/// The stage-local view of shadow mode's trace, from its products against the weights made already.
fn local_view(env: &JudgeEnv, opt: &LayerTrace, v: Option<View>) -> compare::local::Local {
    let Some(v) = v else {
        return Default::default();
    };
    let frame = compare::local::Frame {
        cfg: env.cfg,
        rope: env.rope,
        sched: &env.opts.sched,
        x: &v.x,
        dtype: env.opts.dtype,
        provided: env.provided,
        known_attention: v.known_attention,
        score_sum: v.score_sum,
    };
    let sp = v
        .selection
        .as_ref()
        .map(|selection| compare::local::Sparse { selection });
    let mut local = compare::local::finish(frame, opt, v.pre, sp);
    local.stages.retain(|s| !v.outside.contains(s.stage));
    local
}

/// A computed layer's stage-local view and comparison in each mode, and its dump as `--dump-dir` asks
/// (`dumped_before`: an earlier layer was dumped).
fn judge(
    c: Computed,
    env: &JudgeEnv,
    ctx: &compare::Ctx,
    free_ctx: &compare::Ctx,
    dumped_before: bool,
) -> Result<Judged> {
    let opts = env.opts;
    let t_local = std::time::Instant::now();
    let shadow_opt = c.shadow.map(|(opt, v)| {
        let local = local_view(env, &opt, v);
        (opt, local)
    });
    let local = t_local.elapsed();
    let t0 = std::time::Instant::now();
    // The traces are kept for `--dump-dir` only: each is dropped once compared, with its local view.
    let keep = opts.dump.is_some();
    let mut traces: Vec<(LayerTrace, bool)> = Vec::new();
    let mut shadow = None;
    if let Some((opt, local)) = shadow_opt {
        let r = compare::compare_layer(
            ctx,
            &c.reference,
            &opt,
            opts.dtype,
            &opts.tolerances,
            Some(&local),
        )?;
        if keep {
            traces.push((opt, r.pass));
        }
        shadow = Some(r);
    }
    let mut free = None;
    if let Some((opt, drift)) = c.free {
        let mut r = compare::compare_layer(
            free_ctx,
            &c.reference,
            &opt,
            opts.dtype,
            &opts.tolerances,
            None,
        )?;
        r.drift = Some(drift);
        if keep {
            traces.push((opt, r.pass));
        }
        free = Some(r);
    }
    let mut dump = None;
    if let Some((dir, which)) = &opts.dump {
        let failing = traces.iter().find(|(_, pass)| !pass).map(|(t, _)| t);
        let chosen = match which {
            DumpLayers::All => traces.first().map(|(t, _)| t),
            DumpLayers::List(ls) if ls.contains(&ctx.layer) => traces.first().map(|(t, _)| t),
            DumpLayers::First if !dumped_before => failing,
            _ => None,
        };
        if let Some(opt) = chosen {
            dump = Some(crate::report::npy::dump_layer(dir, &c.reference, opt)?);
        }
    }
    Ok(Judged {
        shadow,
        free,
        dump,
        local,
        took: t0.elapsed(),
    })
}

/// Free mode's optimized path of one layer on the optimized stream `h_opt` (and, without shadow mode,
/// its repeats).
fn free_layer(
    backend: &mut dyn Backend,
    layer_ctx: &crate::backend::LayerCtx,
    h_opt: &Array2<f64>,
    opts: &RunOptions,
    free_ctx: &compare::Ctx,
    repeats: &mut Vec<crate::report::repeat::LayerRepeat>,
    prof: &mut profile::Profile,
) -> Result<LayerTrace> {
    // DSA: over the reference's selection too, so that the stages stay comparable (a near-tie flip
    // makes whole split partials incomparable); what selections cost is the `dsa` section's.
    let opt = prof.time("optimized path", || backend.run_layer(layer_ctx, h_opt))?;
    // Without shadow mode the repeats take free mode's input (the optimized stream).
    if opts.repeat > 1 && !opts.modes.shadow {
        repeats.push(repeat::repeat_layer(
            backend,
            layer_ctx,
            h_opt,
            &opt,
            opts.repeat,
            free_ctx,
        )?);
    }
    Ok(opt)
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

/// The lightning indexer's `top_k` of a DSA model (GLM-5 `glm-dsa`, DeepSeek-V3.2 `deepseek32`), `None`
/// for dense-attention architectures; `Some(None)` when a DSA file lacks the key.
pub fn dsa_top_k(file: &GgufFile, cfg: &MlaConfig) -> Option<Option<u64>> {
    use crate::model::config::Arch;
    matches!(cfg.arch, Arch::GlmDsa | Arch::Deepseek32).then(|| {
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
