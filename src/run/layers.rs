//! The run's layers, one after another: each layer's weights loaded, its reference and optimized paths
//! side by side ([`paths`]), its DSA selections checked, and its judge (`judge.rs`) started on a thread
//! of its own next to the next layer's paths, collected in layer order.

use super::ahead::Ahead;
use super::judge::{judge, judge_free, Computed, Free, JudgeEnv, Judged, View};
use super::{
    add_residual, attn_out, profile, repeat, residual_after, DumpLayers, RunOptions, Setup,
};
use crate::backend::{Backend, LayerCtx};
use crate::compare::{self, LayerResult};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::input::LayerInputs;
use crate::model::{LayerWeights, MlaConfig};
use crate::report::repeat::LayerRepeat;
use crate::trace::LayerTrace;
use ndarray::Array2;
use std::path::PathBuf;

/// What the layers gave: each mode's results, the dumps written and the repeats' comparisons.
#[derive(Default)]
pub(super) struct Done {
    pub(super) shadow: Vec<LayerResult>,
    pub(super) free: Vec<LayerResult>,
    pub(super) dumped: Vec<PathBuf>,
    pub(super) repeats: Vec<LayerRepeat>,
}

/// The progress bar on stderr (hidden for a single layer or without `progress`).
pub(super) fn progress_bar(opts: &RunOptions, layers: usize) -> indicatif::ProgressBar {
    if opts.progress && layers > 1 {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(layers as u64),
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
    }
}

/// Every layer of `s` from the residual streams `(h_ref, h_opt)`, and the run's profile.
pub(super) fn run_layers(
    file: &GgufFile,
    backend: &mut dyn Backend,
    opts: &RunOptions,
    s: &mut Setup,
    (mut h_ref, mut h_opt, mut carried): super::Streams,
    bar: &indicatif::ProgressBar,
) -> Result<(Done, profile::Profile)> {
    let Setup {
        cfg,
        layers,
        inputs,
        tables,
        provided,
        sparse,
        ..
    } = s;
    let (cfg, tables, provided) = (&*cfg, &*tables, *provided);
    let mut done = Done::default();
    let mut prof = profile::Profile::from_env();
    let max_judges = max_judges(opts);
    let alone = super::footprint::alone(cfg, &opts.sched);
    let beside = Beside::default();
    std::thread::scope(|judges| -> Result<()> {
        let mut judging = std::collections::VecDeque::new();
        let mut ahead = Ahead::default();
        for (i, &l) in layers.iter().enumerate() {
            bar.set_message(format!("layer {l}"));
            if i > 0 {
                next_inputs(inputs, l, &mut h_ref, &mut h_opt, &mut carried)?;
            }
            // Read during the last layer's tail: one layer's weights alive at a time (`ahead.rs`).
            let mut w = ahead.take(file, cfg, l, &mut prof)?;
            let next = layers.get(i + 1).copied();
            let moved = super::carry::moved_input(&h_ref, carried.as_ref());
            let rounds = alone && sparse.is_none() && backend.reads_stored_weights_only();
            let (run, input) = ((cfg, &tables.rope, opts), (&h_ref, moved.as_ref()));
            let early = rounds.then(|| super::footprint::reference_first(&mut w, run, input));
            let dense_ctx = tables.ctx(cfg, &w, &opts.sched, opts.faults.active(l));
            let sel = match &sparse {
                Some(sp) => {
                    Some(prof.time("DSA selection", || sp.select(file, &dense_ctx, &h_ref))?)
                }
                None => None,
            };
            let ref_sel = sel.as_ref().map(|s| &s.reference);
            // Shadow mode's optimized path attends over the reference's selection: its stage checks then
            // see kernel errors only; the selections are checked apart (`dsa::RunSparse::check_layer`).
            let layer_ctx = LayerCtx {
                selection: ref_sel,
                ..dense_ctx
            };
            // What the backend's sparse layers lose (`Judging::sparse_layers`), only if this one is.
            let (layer_provided, outside) = backend.judging().layer_stages(provided, sel.is_some());
            let (ctx, free_ctx) = contexts(l, opts, tables, layer_provided);
            let lr = LayerRun {
                cfg,
                w: &w,
                rope: &tables.rope,
                opts,
                layer_ctx: &layer_ctx,
                ctx: &ctx,
                free_ctx: &free_ctx,
                ref_sel,
                // No view for an absorbed sparse prefill (not modelled: docs/dsa.md).
                view_wanted: !(sel.is_some() && backend.judging().sparse_prefill_absorbed),
                moved: moved.as_ref(),
                alone,
            };
            let streams = (&h_ref, &h_opt);
            let (reference, optimized) = paths(&lr, backend, streams, early, &mut done, &mut prof);
            let (reference, moved_ref) = reference?;
            let optimized = optimized?;
            // The reference residual after this layer: the next layer's shadow input and free mode's
            // yardstick; the optimized one: free mode's next input.
            let next_ref = residual_after(&h_ref, &reference)?;
            let refs = (&reference, moved_ref.as_ref(), &next_ref);
            let free_opt = optimized
                .1
                .map(|opt| free_drift(opt, &mut h_opt, &mut carried, refs, opts))
                .transpose()?;
            let (shadow_opt, free) = settle(&lr, &reference, optimized.0, free_opt, &mut prof)?;
            // What shadow mode's stage-local view needs, taken before the DSA check takes the selection:
            // the selection the path attended over (the reference's); no view for an absorbed sparse
            // prefill (not modelled: docs/dsa.md).
            let shadow = shadow_opt.map(|(opt, pre)| {
                let view = pre.map(|pre| shadow_view(backend, pre, &h_ref, sel.as_ref(), outside));
                (opt, view)
            });
            let dsa = sparse.as_mut().zip(sel);
            let checked = (&dense_ctx, &ctx, &h_ref, &reference);
            check_selection(dsa, checked, backend, (opts, &mut prof))?;
            ahead.start(alone, next, judges, (file, cfg), w);
            collect_until(&mut judging, max_judges - 1, &mut prof, &mut done)?;
            let layer = Computed {
                reference,
                shadow,
                free,
            };
            let dumped_before = !done.dumped.is_empty();
            judging.push_back(judges.spawn(move || {
                let env = JudgeEnv {
                    cfg,
                    rope: &tables.rope,
                    opts,
                    provided: layer_provided,
                };
                judge(layer, &env, &ctx, &free_ctx, dumped_before)
            }));
            h_ref = next_ref;
            let left = if alone { 0 } else { max_judges }; // alone: judged before the next layer
            collect_until(&mut judging, left, &mut prof, &mut done)?;
            release_memory(&mut prof, (!alone).then_some(&beside));
            bar.inc(1);
        }
        collect_until(&mut judging, 0, &mut prof, &mut done)
    })?;
    beside.report(&mut prof);
    Ok((done, prof))
}

/// How many judges may be in flight. Each layer's stage-local view and comparison (its "judge") run on
/// their own thread next to the next layer's reference and optimized path (they need nothing of them,
/// nor they of it), collected in layer order, so that results and dumps come out as a sequential
/// run's. Two judges at a time where the threads are there for them (on the H200 host's 16 cores one
/// judge kept ~8 busy and set the pace); one when only the first failing layer is dumped (an earlier
/// dump must be known).
fn max_judges(opts: &RunOptions) -> usize {
    match &opts.dump {
        Some((_, DumpLayers::First)) => 1,
        _ if rayon::current_num_threads() >= 12 => 2,
        _ => 1,
    }
}

/// Layer `l`'s comparison contexts: shadow mode's (elementwise) and free mode's.
fn contexts<'a>(
    l: usize,
    opts: &'a RunOptions,
    tables: &'a crate::backend::RunTables,
    provided: crate::trace::StageSet,
) -> (compare::Ctx<'a>, compare::Ctx<'a>) {
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
    (ctx, free_ctx)
}

/// Free mode's trace `opt` added to the optimized stream `h_opt`, with its drift from the reference's
/// `next_ref`; its checks widened by the cache effect the stream carries (`carry`: `moved`, the
/// reference from the input that effect moved), which it advances.
fn free_drift(
    mut opt: LayerTrace,
    h_opt: &mut Array2<f64>,
    carried: &mut Option<Array2<f64>>,
    (reference, moved, next_ref): (&LayerTrace, Option<&LayerTrace>, &Array2<f64>),
    opts: &RunOptions,
) -> Result<(LayerTrace, f64)> {
    super::carry::absorb(&mut opt, reference, moved, &opts.sched, carried);
    add_residual(h_opt, attn_out(&opt)?);
    let drift = compare::metrics::rel_l2(
        next_ref.as_slice().expect("standard layout"),
        h_opt.as_slice().expect("standard layout"),
    );
    Ok((opt, drift))
}

/// A layer's optimized traces for its judge. Alone (`footprint.rs`): free mode's compared now and its
/// trace let go, then the stage-local view's products made, before the weights go; otherwise both are
/// the judge's, and the products were made beside free mode's pass.
fn settle(
    lr: &LayerRun,
    reference: &LayerTrace,
    shadow: ShadowOpt,
    free: Option<(LayerTrace, f64)>,
    prof: &mut profile::Profile,
) -> Result<(ShadowOpt, Option<Free>)> {
    if !lr.alone {
        return Ok((shadow, free.map(|(opt, drift)| Free::Trace(opt, drift))));
    }
    let free = free
        .map(|(opt, drift)| judge_free(reference, opt, drift, lr.free_ctx, lr.opts))
        .transpose()?
        .map(|j| Free::Judged(Box::new(j)));
    let shadow = shadow.map(|(opt, pre)| {
        let pre = match lr.view_wanted {
            true => Some(prof.time("stage-local view (weights)", || {
                compare::local::prepare(lr.cfg, lr.w, lr.opts.dtype, &opt)
            })),
            false => pre,
        };
        (opt, pre)
    });
    Ok((shadow, free))
}

/// The DSA check of a layer's selections (`dsa::RunSparse::check_layer`), from its contexts, its input
/// and its reference trace, timed; nothing for a dense layer.
fn check_selection(
    sparse: Option<(&mut super::dsa::RunSparse, super::dsa::LayerSelection)>,
    (dense_ctx, ctx, h_ref, reference): (&LayerCtx, &compare::Ctx, &Array2<f64>, &LayerTrace),
    backend: &mut dyn Backend,
    (opts, prof): (&RunOptions, &mut profile::Profile),
) -> Result<()> {
    let Some((sp, sel)) = sparse else {
        return Ok(());
    };
    let t_dsa = std::time::Instant::now();
    sp.check_layer(
        dense_ctx,
        ctx,
        sel,
        backend,
        h_ref,
        reference,
        opts.dtype,
        &opts.tolerances,
    )?;
    prof.add("DSA selection check", t_dsa.elapsed());
    Ok(())
}

/// A judge's results, collected in layer order.
fn collect(
    j: std::thread::ScopedJoinHandle<Result<Judged>>,
    prof: &mut profile::Profile,
    out: &mut Done,
) -> Result<()> {
    // The run loop's wait for the judge (its own time is the two lines below), with the peak resident
    // set's growth while it ran: a lone layer's judge (the view) is where its peak is expected (#39).
    let j = prof.time("waiting for judges", || {
        j.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
    });
    let j = j?;
    // A device error in the fp64 products ends the run (exit 2), not a report of host sums.
    crate::linalg::check_engine()?;
    out.shadow.extend(j.shadow);
    out.free.extend(j.free);
    out.dumped.extend(j.dump);
    prof.add("stage-local view", j.local);
    prof.add("compare + reports", j.took);
    Ok(())
}

/// Collect the judges in flight, oldest first, until at most `left` are.
fn collect_until(
    judging: &mut std::collections::VecDeque<std::thread::ScopedJoinHandle<Result<Judged>>>,
    left: usize,
    prof: &mut profile::Profile,
    out: &mut Done,
) -> Result<()> {
    while judging.len() > left {
        collect(judging.pop_front().expect("a judge in flight"), prof, out)?;
    }
    Ok(())
}

/// Layer `l`'s inputs after the first layer. Captured per-layer inputs replace the attention-only
/// residual stream in shadow mode. A capture's replace both streams: the engine's own stream is the
/// captured one (it ran the FFN, which is not modelled), so free mode's drift is each layer's attention
/// error in the residual it adds to (`docs/captures.md`), and no cache effect is carried (`carry`).
fn next_inputs(
    inputs: &LayerInputs,
    l: usize,
    h_ref: &mut Array2<f64>,
    h_opt: &mut Array2<f64>,
    carried: &mut Option<Array2<f64>>,
) -> Result<()> {
    match inputs {
        LayerInputs::PerLayer(_) => *h_ref = inputs.layer(l)?,
        LayerInputs::Captured(_) => {
            *h_ref = inputs.layer(l)?;
            *h_opt = h_ref.clone();
            *carried = None;
        }
        LayerInputs::Shared(_) => {}
    }
    Ok(())
}

/// What a layer's [`paths`] read.
struct LayerRun<'a> {
    cfg: &'a MlaConfig,
    w: &'a LayerWeights,
    rope: &'a crate::rope::RopeTables,
    opts: &'a RunOptions,
    layer_ctx: &'a LayerCtx<'a>,
    ctx: &'a compare::Ctx<'a>,
    free_ctx: &'a compare::Ctx<'a>,
    /// The reference's DSA selection, which the optimized paths attend over too.
    ref_sel: Option<&'a crate::reference::sparse::Selection>,
    /// Whether shadow mode's trace gets a stage-local view.
    view_wanted: bool,
    /// Free mode: the reference's input moved by the cache effect the stream carries (`carry`).
    moved: Option<&'a Array2<f64>>,
    /// The layer runs alone (`footprint.rs`): its reference before its optimized path, the view's
    /// products after free mode's comparison.
    alone: bool,
}

/// The fp64 reference on its own thread, next to what of the layer does not need it: shadow mode's
/// optimized path, its repeats and its stage-local view (or, without shadow mode, free mode's), from
/// the streams `(h_ref, h_opt)`. Each side computes what it did alone, so the results are the same.
fn paths(
    lr: &LayerRun,
    backend: &mut dyn Backend,
    (h_ref, h_opt): (&Array2<f64>, &Array2<f64>),
    early: Option<(Result<RefTraces>, std::time::Duration)>,
    done: &mut Done,
    prof: &mut profile::Profile,
) -> (Result<RefTraces>, Result<OptTraces>) {
    let (opts, repeats) = (lr.opts, &mut done.repeats);
    std::thread::scope(|sc| {
        let (c, w, rope, ref_sel) = (lr.cfg, lr.w, lr.rope, lr.ref_sel);
        let moved = lr.moved;
        let reference = move || reference(c, w, (rope, &opts.sched, ref_sel), (h_ref, moved));
        // Alone: the reference first, not beside the optimized path (its buffers and the path's peak
        // together: `footprint.rs`), or made already (`footprint::reference_first`).
        let r = match (early, lr.alone) {
            (Some(made), _) => Err(made),
            (None, true) => Err(reference()),
            (None, false) => Ok(sc.spawn(reference)),
        };
        // Alone: what the reference freed (its intermediates, in the workers' heaps) handed back
        // before the path's buffers and traces are made (`release_memory`).
        if lr.alone {
            release_memory(prof, None);
        }
        let optimized = (|| -> Result<OptTraces> {
            let mut shadow_opt = None;
            if opts.modes.shadow {
                let opt = prof.time("optimized path", || backend.run_layer(lr.layer_ctx, h_ref))?;
                if opts.repeat > 1 {
                    repeats.push(repeat::repeat_layer(
                        backend,
                        lr.layer_ctx,
                        h_ref,
                        &opt,
                        opts.repeat,
                        lr.ctx,
                    )?);
                }
                shadow_opt = Some(opt);
                if lr.alone {
                    release_memory(prof, None);
                }
            }
            // The stage-local view's products against the weights: made here, on their own
            // thread next to free mode's pass (and the reference), not in the judge, so the
            // layer's weights are let go before the next layer loads (two layers alive at
            // once cost 0.66 GB of peak at GLM-5 dims: docs/scale.md).
            let (pre, free_opt) = std::thread::scope(|ps| -> Result<_> {
                let wanted = lr.view_wanted && !lr.alone;
                let pre = shadow_opt.as_ref().filter(|_| wanted).map(|opt| {
                    ps.spawn(move || {
                        let t0 = std::time::Instant::now();
                        let p = compare::local::prepare(c, w, opts.dtype, opt);
                        (p, t0.elapsed())
                    })
                });
                let free_opt = match opts.modes.free {
                    true => Some(free_layer(
                        backend,
                        lr.layer_ctx,
                        h_opt,
                        opts,
                        lr.free_ctx,
                        repeats,
                        prof,
                    )?),
                    false => None,
                };
                let pre = pre.map(|j| {
                    let (p, took) = j.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
                    prof.add("stage-local view (weights)", took);
                    p
                });
                Ok((pre, free_opt))
            })?;
            Ok((shadow_opt.map(|o| (o, pre)), free_opt))
        })();
        let (r, took) = r.map_or_else(
            |done| done,
            |r| r.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
        );
        prof.add("reference (fp64)", took);
        (r, optimized)
    })
}

/// A layer's fp64 reference from its input `h_ref` (and from `moved`, free mode's input moved by the
/// carried cache effect), over the DSA selection `sel` if any, and the time it took.
pub(super) fn reference(
    cfg: &MlaConfig,
    w: &LayerWeights,
    (rope, sched, sel): (
        &crate::rope::RopeTables,
        &crate::schedule::Schedule,
        Option<&crate::reference::sparse::Selection>,
    ),
    (h_ref, moved): (&Array2<f64>, Option<&Array2<f64>>),
) -> (Result<RefTraces>, std::time::Duration) {
    let t0 = std::time::Instant::now();
    let run = |x| crate::reference::run_layer_sel(cfg, w, rope, x, sched, sel);
    let r = run(h_ref).and_then(|r| Ok((r, moved.map(run).transpose()?)));
    (r, t0.elapsed())
}

/// What shadow mode's stage-local view needs besides the run's tables: the products `pre`, the
/// layer's input `x`, the backend's answers about its path, and (DSA) the reference's selection.
fn shadow_view(
    backend: &dyn Backend,
    pre: compare::local::Prepared,
    x: &Array2<f64>,
    sel: Option<&super::dsa::LayerSelection>,
    outside: crate::trace::StageSet,
) -> View {
    View {
        pre,
        x: x.clone(),
        judging: crate::judging::Judging {
            outside_local_view: outside,
            ..backend.judging()
        },
        selection: sel.map(|s| s.reference.clone()),
    }
}

/// One layer's weights, dequantized (into the buffers `spare` where they fit:
/// `LayerWeights::load_reusing`), and the time it took; the file's pages of the layer are released
/// (the weights are copies: those pages are not read again).
pub(super) fn load_layer(
    file: &GgufFile,
    cfg: &MlaConfig,
    l: usize,
    spare: Vec<Vec<f32>>,
) -> (Result<LayerWeights>, std::time::Duration) {
    let t0 = std::time::Instant::now();
    let w = LayerWeights::load_reusing(file, cfg, l, spare);
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
/// without a hook. After a lone layer (`footprint.rs`: the run's peak), and within it after its
/// reference and shadow mode's pass (`paths`: −150 to −180 MB of the GPU host's peak, docs/scale.md),
/// the loop waits for every worker to have collected; after the others the workers collect when they
/// are next free (`rayon::spawn_broadcast`), beside the loop: a blocking broadcast waits for every
/// worker to finish what it runs (the judges' work), 7–9 s of the 78-layer file's loop on the GPU host
/// (#39). Their own time is summed in `beside`; none: the loop waits.
fn release_memory(prof: &mut profile::Profile, beside: Option<&Beside>) {
    let Some(release) = crate::alloc::release_hook() else {
        return;
    };
    prof.time("freed memory handed back", || {
        release();
        match beside {
            None => drop(rayon::broadcast(|_| release())),
            Some(beside) => {
                let beside = beside.clone();
                rayon::spawn_broadcast(move |_| {
                    let t0 = std::time::Instant::now();
                    release();
                    beside.add(t0.elapsed());
                });
            }
        }
    });
}

/// Nanoseconds the rayon workers spent handing freed memory back beside the loop (`release_memory`).
#[derive(Clone, Default)]
struct Beside(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl Beside {
    fn add(&self, d: std::time::Duration) {
        let ns = d.as_nanos() as u64;
        self.0.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }

    /// Their sum, as a phase of its own: not on the loop's path.
    fn report(&self, prof: &mut profile::Profile) {
        match self.0.load(std::sync::atomic::Ordering::Relaxed) {
            0 => {}
            ns => prof.add(
                "hand-back beside (workers)",
                std::time::Duration::from_nanos(ns),
            ),
        }
    }
}

/// A layer's reference, and free mode's reference from the input the carried cache effect moved.
pub(super) type RefTraces = (LayerTrace, Option<LayerTrace>);

/// Shadow mode's optimized trace, with its stage-local view's products against the weights where it
/// has a view (made).
type ShadowOpt = Option<(LayerTrace, Option<compare::local::Prepared>)>;

/// A layer's optimized traces computed next to its reference: shadow mode's and free mode's.
type OptTraces = (ShadowOpt, Option<LayerTrace>);

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
