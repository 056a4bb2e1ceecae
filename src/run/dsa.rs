//! One DSA layer (GLM-5 `glm-dsa`, DeepSeek-V3.2 `deepseek32`) through the fp64 reference and the
//! optimized path, told apart into a kernel error and a selection difference (docs/dsa.md):
//!
//! 1. the fp64 indexer selects each query's keys; the sparse reference attends over them;
//! 2. the optimized path runs **with the reference's selection** (`LayerCtx::selection`): its stages are
//!    compared as usual (`compare::compare_layer`), so a kernel error shows there and only there;
//! 3. the optimized path's own indexer selects too; its index sets are compared with the reference's,
//!    tie-aware (`compare::selection`);
//! 4. the optimized path also runs **with its own selection**, checked against fp64 attention over that
//!    same selection (its own error on its own path), and fp64 over its selection is compared with fp64
//!    over the reference's (what the selection difference costs the output; informational).

use crate::backend::cpu::indexer::{self as mirror_indexer, Plan};
use crate::backend::{Backend, LayerCtx};
use crate::compare::metrics::rel_l2;
use crate::compare::selection::{self, ScoreNoise, SelectionResult};
use crate::error::{Error, Result};
use crate::model::{IndexerConfig, IndexerWeights, KpoolIndexer};
use crate::precision::{Dtype, KeyPrecision};
use crate::reference::indexer::{self as ref_indexer, Reading};
use crate::reference::sparse::Selection;
use crate::report::dsa::{DsaLayerResult, DsaResult};
use crate::trace::{LayerTrace, Stage};
use ndarray::Array2;

/// What one DSA layer gives.
#[derive(Debug, Clone)]
pub struct DsaLayer {
    /// The sparse fp64 reference over the reference's selection.
    pub reference: LayerTrace,
    /// The optimized path over the reference's selection (compare these two as usual).
    pub optimized: LayerTrace,
    pub ref_selection: Selection,
    pub opt_selection: Selection,
    pub selection: SelectionResult,
    /// rel-L2 of `attn_out`: the optimized path over its own selection vs fp64 over that selection.
    pub own_path_error: f64,
    /// rel-L2 of `attn_out`: fp64 over the optimized selection vs fp64 over the reference's.
    pub selection_effect: f64,
}

/// The reference's fp64 indexer: its scores `[T, T]`, and the q, k and weights the selection check's
/// noise model needs (`selection::ScoreNoise`).
pub type Scores = ref_indexer::IndexerOut;

/// The selection for a layer: its own indexer's (with its scores), or (GLM-5.2 shared layers, no
/// indexer tensors) the previous full layer's.
pub fn ref_selection(
    ctx: &LayerCtx,
    ic: &IndexerConfig,
    iw: Option<&IndexerWeights>,
    prev: Option<&Selection>,
    x: &Array2<f64>,
) -> Result<(Selection, Option<Scores>)> {
    match (iw, prev) {
        (Some(iw), _) => {
            let attn_in = crate::reference::front::attn_in(ctx.cfg, ctx.weights, x.view());
            let o = ref_indexer::run(
                ctx.cfg,
                ic,
                iw,
                ctx.weights,
                ctx.rope,
                attn_in.view(),
                Reading::default(),
            );
            Ok((o.selection.clone(), Some(o)))
        }
        (None, Some(p)) => Ok((p.clone(), None)),
        (None, None) => Err(Error::Tensor(format!(
            "layer {}: no indexer tensors (blk.{}.indexer.*) and no earlier full indexer layer to share from",
            ctx.layer, ctx.layer
        ))),
    }
}

fn attn_out(t: &LayerTrace) -> &[f64] {
    &t.get(Stage::AttnOut)
        .expect("every backend provides attn_out")
        .data
}

/// Run one DSA layer with its own indexer (`iw`); the optimized side's indexer is the CPU mirror's at
/// `dtype` with `plan` (a CUDA indexer plugs in here: it only has to return a `Selection`).
#[allow(clippy::too_many_arguments)]
pub fn run_layer(
    ctx: &LayerCtx,
    ic: &IndexerConfig,
    iw: &IndexerWeights,
    backend: &mut dyn Backend,
    x: &Array2<f64>,
    dtype: Dtype,
    plan: Plan,
) -> Result<DsaLayer> {
    let (cfg, w, rope, sched) = (ctx.cfg, ctx.weights, ctx.rope, ctx.sched);
    let (ref_sel, scores) = ref_selection(ctx, ic, Some(iw), None, x)?;
    let scores = scores.expect("a full layer has scores");
    let reference = crate::reference::run_layer_sel(cfg, w, rope, x, sched, Some(&ref_sel))?;
    let optimized = backend.run_layer(
        &LayerCtx {
            selection: Some(&ref_sel),
            ..*ctx
        },
        x,
    )?;
    let opt_sel = mirror_indexer::run(cfg, ic, iw, w, rope, x, dtype, plan)?.selection;
    let noise = ScoreNoise::new(&scores, dtype, plan.keys);
    let selection = selection::compare(&scores.scores, &noise, &ref_sel, &opt_sel);
    let own = backend.run_layer(
        &LayerCtx {
            selection: Some(&opt_sel),
            ..*ctx
        },
        x,
    )?;
    let ref_on_own = crate::reference::run_layer_sel(cfg, w, rope, x, sched, Some(&opt_sel))?;
    Ok(DsaLayer {
        own_path_error: rel_l2(attn_out(&ref_on_own), attn_out(&own)),
        selection_effect: rel_l2(attn_out(&reference), attn_out(&ref_on_own)),
        reference,
        optimized,
        ref_selection: ref_sel,
        opt_selection: opt_sel,
        selection,
    })
}

// ---- `mla-diff run` on a DSA file (src/run/layers.rs calls these) ----

/// The run-level DSA state: the indexer, once some query of the schedule sees more than top_k keys.
pub struct RunSparse {
    pub ic: IndexerConfig,
    /// The reference's selection of the last full indexer layer (GLM-5.2 shared layers reuse it), with
    /// that layer and the optimized side's own selection.
    prev: Option<(usize, Selection, Selection)>,
    pub layers: Vec<DsaLayerResult>,
    /// Whether the backend's own indexer ran (`Backend::indexer`), or the CPU mirror's stood in.
    own_indexer: Option<bool>,
    /// How the optimized indexer stores q and k (`--indexer-keys`).
    pub keys: KeyPrecision,
    /// glm5-next's k-pool indexer (`reference::kpool`, `run::kpool`): the selections are of pools.
    pub kpool: Option<super::kpool::KpoolRun>,
}

/// The sparse model runs when the file has an indexer (its keys and some layer's tensors) and the last
/// query sees more than top_k keys (causal: it sees every key of the run); otherwise DSA is dense
/// attention exactly (a file without indexer tensors runs dense beyond top_k, with a notice).
pub fn sparse_for(
    file: &crate::gguf::GgufFile,
    cfg: &crate::model::MlaConfig,
    sched: &crate::schedule::Schedule,
) -> Result<Option<RunSparse>> {
    if let Some(k) = KpoolIndexer::from_gguf(file, cfg)? {
        let has_tensors = (0..cfg.n_layer).any(|l| {
            crate::model::kpool::tensor_names(l)
                .iter()
                .any(|n| file.tensor(n).is_some())
        });
        return Ok(
            (has_tensors && sched.total_tokens() > k.ic.top_k).then(|| RunSparse {
                ic: k.ic,
                prev: None,
                layers: Vec::new(),
                own_indexer: None,
                keys: KeyPrecision::Storage,
                kpool: Some(super::kpool::KpoolRun::new(k)),
            }),
        );
    }
    let has_tensors = (0..cfg.n_layer).any(|l| {
        crate::model::indexer::tensor_names(l)
            .iter()
            .any(|n| file.tensor(n).is_some())
    });
    Ok(IndexerConfig::from_gguf(file, cfg)?
        .filter(|ic| has_tensors && sched.total_tokens() > ic.top_k)
        .map(|ic| RunSparse {
            ic,
            prev: None,
            layers: Vec::new(),
            own_indexer: None,
            keys: KeyPrecision::Storage,
            kpool: None,
        }))
}

/// One layer's selections for a run: the reference's (with its fp64 scores, `None` on a shared layer)
/// and the layer's indexer weights.
pub struct LayerSelection {
    pub reference: Selection,
    scores: Option<Scores>,
    iw: Option<IndexerWeights>,
    /// A k-pool layer's reference side (`run::kpool`).
    kpool: Option<super::kpool::KpoolSel>,
}

impl RunSparse {
    /// How the optimized side's indexer computed (reports' coverage).
    pub fn indexer_name(&self, dtype: Dtype, backend: &str) -> String {
        let (keys, own, what) = match &self.kpool {
            Some(k) => (
                format!(
                    "k-pool (glm5-next, pools of {}): q, k, gate scores and pooled keys in {}",
                    k.k.kp.kpool,
                    dtype.name()
                ),
                k.own_indexer,
                "pooled keys",
            ),
            None => (format!("q/k in {}", dtype.name()), self.own_indexer, "q/k"),
        };
        let keys = match self.keys {
            KeyPrecision::Storage => keys,
            KeyPrecision::Fp8 => {
                format!("{keys}, then q and {what} Hadamard-rotated fp8 e4m3 with per-128 scales")
            }
        };
        match own {
            Some(true) if backend == "capture" => "the engine's own (its captured topk)".into(),
            Some(true) => format!("{backend}'s own, {keys}"),
            Some(false) => format!("cpu mirror standing in (the backend has none), {keys}"),
            None => "not run".into(),
        }
    }

    /// The reference's selection for layer `l` on input `x` (the shadow stream).
    pub fn select(
        &self,
        file: &crate::gguf::GgufFile,
        ctx: &LayerCtx,
        x: &Array2<f64>,
    ) -> Result<LayerSelection> {
        if let Some(k) = &self.kpool {
            let prev = self.prev.as_ref().map(|(_, r, _)| r);
            let (reference, ks) = k.select(file, ctx, x, prev)?;
            return Ok(LayerSelection {
                reference,
                scores: None,
                iw: None,
                kpool: Some(ks),
            });
        }
        let iw = IndexerWeights::load(file, ctx.cfg, &self.ic, ctx.layer)?;
        let prev = self.prev.as_ref().map(|(_, r, _)| r);
        let (reference, scores) = ref_selection(ctx, &self.ic, iw.as_ref(), prev, x)?;
        Ok(LayerSelection {
            reference,
            scores,
            iw,
            kpool: None,
        })
    }

    /// The optimized side's own selection on input `x`: the backend's indexer's (or the CPU mirror's
    /// standing in, without faults: a backend without an indexer has none to plant them in), or on a
    /// shared layer the last full layer's own one.
    pub fn own_selection(
        &mut self,
        ctx: &LayerCtx,
        sel: &LayerSelection,
        backend: &mut dyn Backend,
        x: &Array2<f64>,
        dtype: Dtype,
    ) -> Result<Selection> {
        match &sel.iw {
            Some(iw) => {
                if let Some(s) = backend.indexer(ctx, &self.ic, iw, x, self.keys)? {
                    self.own_indexer = Some(true);
                    return Ok(s);
                }
                self.own_indexer = Some(false);
                let plan = mirror_indexer::plan_for(crate::faults::Active::NONE, self.keys);
                Ok(mirror_indexer::run(
                    ctx.cfg,
                    &self.ic,
                    iw,
                    ctx.weights,
                    ctx.rope,
                    x,
                    dtype,
                    plan,
                )?
                .selection)
            }
            None => Ok(self
                .prev
                .as_ref()
                .map(|(_, _, o)| o.clone())
                .unwrap_or_else(|| sel.reference.clone())),
        }
    }

    /// The selection check of one layer (on the shadow stream `x`): the optimized indexer's sets against
    /// the reference's, tie-aware, and the optimized path over its own selection against fp64 over that
    /// selection (`compare_layer` with the run's tolerances). `reference` is the sparse fp64 trace over
    /// the reference's selection.
    #[allow(clippy::too_many_arguments)]
    pub fn check_layer(
        &mut self,
        ctx: &LayerCtx,
        cmp: &crate::compare::Ctx,
        mut sel: LayerSelection,
        backend: &mut dyn Backend,
        x: &Array2<f64>,
        reference: &LayerTrace,
        dtype: Dtype,
        tolerances: &crate::compare::ToleranceTable,
    ) -> Result<()> {
        let full = sel.iw.is_some() || sel.kpool.as_ref().is_some_and(|k| k.is_full());
        let (own, selection, shared_from) = match (&mut self.kpool, sel.kpool.take()) {
            (Some(kr), Some(ks)) => {
                let (own, s, from) = kr.own(ctx, ks, backend, x, dtype, self.keys)?;
                (own, Some(s), from)
            }
            _ => {
                let own = self.own_selection(ctx, &sel, backend, x, dtype)?;
                let selection = sel.scores.as_ref().map(|o| {
                    let noise = ScoreNoise::new(o, dtype, self.keys);
                    selection::compare(&o.scores, &noise, &sel.reference, &own)
                });
                let from = match sel.scores {
                    Some(_) => None,
                    None => self.prev.as_ref().map(|(l, _, _)| *l),
                };
                (own, selection, from)
            }
        };
        let opt_own = backend.run_layer(
            &LayerCtx {
                selection: Some(&own),
                ..*ctx
            },
            x,
        )?;
        let ref_own = crate::reference::run_layer_sel(
            ctx.cfg,
            ctx.weights,
            ctx.rope,
            x,
            ctx.sched,
            Some(&own),
        )?;
        let local = own_local_view(ctx, cmp, backend, x, dtype, &opt_own, &own);
        let own_cmp = crate::compare::compare_layer(
            cmp,
            &ref_own,
            &opt_own,
            dtype,
            tolerances,
            Some(&local),
        )?;
        let own_first = own_cmp
            .checks
            .iter()
            .find(|c| !c.pass)
            .map(|c| c.check.clone());
        let own_path_error = rel_l2(attn_out(&ref_own), attn_out(&opt_own));
        let pass = selection.as_ref().is_none_or(|s| s.pass) && own_cmp.pass;
        self.layers.push(DsaLayerResult {
            layer: ctx.layer,
            sparse_queries: sel.reference.sparse_queries(),
            shared_from,
            selection,
            own_path_error: finite(own_path_error),
            own_path_first_failing: own_first,
            selection_effect: finite(rel_l2(attn_out(reference), attn_out(&ref_own))),
            pass,
        });
        if full {
            self.prev = Some((ctx.layer, sel.reference, own));
        }
        Ok(())
    }

    /// The run's DSA section (`Report::dsa`).
    /// `origin`: where a query token came from (`Backend::query_origin`), added to the message.
    pub fn result(
        self,
        dtype: Dtype,
        backend: &str,
        origin: &dyn Fn(usize) -> Option<String>,
    ) -> DsaResult {
        let indexer = self.indexer_name(dtype, backend);
        let failing = self.layers.iter().find(|l| !l.pass);
        let message = match failing {
            None if self.kpool.is_some() => format!(
                "DSA k-pool: {} layer(s) sparse past top_k {}, pool selections and own-selection paths within tolerance",
                self.layers.len(),
                self.ic.top_k
            ),
            None => format!(
                "DSA: {} layer(s) sparse past top_k {}, selections and own-selection paths within tolerance",
                self.layers.len(),
                self.ic.top_k
            ),
            Some(l) => {
                let at = l
                    .selection
                    .as_ref()
                    .filter(|s| !s.pass)
                    .and_then(|s| s.worst.as_ref())
                    .and_then(|m| origin(m.query).map(|o| format!(" at {o} (query {})", m.query)))
                    .unwrap_or_default();
                format!("DSA layer {}{at}: {}", l.layer, l.failure())
            }
        };
        DsaResult {
            top_k: self.ic.top_k,
            indexer,
            pass: failing.is_none(),
            first_layer: failing.map(|l| l.layer),
            message,
            layers: self.layers,
        }
    }
}

/// The stage-local view of the optimized path over its own selection (`compare::local::Sparse`): the
/// attentions recomputed over the keys its own indexer chose, so its stage checks judge the kernels on
/// that path as shadow mode's do on the reference's selection.
fn own_local_view(
    ctx: &LayerCtx,
    cmp: &crate::compare::Ctx,
    backend: &dyn Backend,
    x: &Array2<f64>,
    dtype: Dtype,
    opt: &LayerTrace,
    own: &Selection,
) -> crate::compare::local::Local {
    use crate::compare::local;
    // An absorbed sparse prefill is not modelled (docs/dsa.md): no local view, end to end decides.
    let judging = backend.judging();
    if judging.sparse_prefill_absorbed {
        return local::Local::default();
    }
    let inp = local::Inputs {
        weights: ctx.weights,
        frame: local::Frame {
            cfg: ctx.cfg,
            rope: ctx.rope,
            sched: ctx.sched,
            x,
            dtype,
            provided: cmp.provided,
            judging: &judging,
        },
    };
    let sp = local::Sparse { selection: own };
    let mut l = local::compute_sparse(&inp, opt, sp);
    // Its own selection's layer runs sparse as the reference's does (`cmp.provided` is that layer's).
    let (_, outside) = judging.layer_stages(cmp.provided, true);
    l.stages.retain(|s| !outside.contains(s.stage));
    l
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}
