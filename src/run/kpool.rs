//! glm5-next's k-pool layers in a run (`dsa::RunSparse::kpool`, docs/dsa.md "glm5-next"): the
//! reference's k-pool selection (`reference::kpool`), the optimized side's own (`Backend::kpool_indexer`:
//! the CPU mirror's `backend::cpu::kpool`, or that mirror standing in, without faults, for a backend
//! without one), and the tie-aware check of one against the other on pools
//! (`compare::selection::kpool`). A shared layer (`indexer.types` false) reuses the last full layer's
//! selection on both sides, and is judged against that layer's pool scores: an engine that reuses the
//! right selection passes as its source did, one that recomputes a selection or reuses another layer's
//! fails there (`Fault::KpoolSharedOwnIndexer`, `KpoolSharedWrongLayer`).

use crate::backend::cpu::kpool as mirror;
use crate::backend::{Backend, LayerCtx};
use crate::compare::selection::{kpool as check, ScoreNoise, SelectionResult};
use crate::error::{Error, Result};
use crate::faults::Fault;
use crate::model::{KpoolIndexer, KpoolLayer};
use crate::precision::{Dtype, KeyPrecision};
use crate::reference::kpool::KpoolOut;
use crate::reference::sparse::Selection;
use ndarray::Array2;

/// A full layer's state a later shared layer reuses.
struct Full {
    layer: usize,
    out: KpoolOut,
    noise: ScoreNoise,
    kw: KpoolLayer,
    own: Selection,
}

/// The run-level k-pool state.
pub struct KpoolRun {
    pub k: KpoolIndexer,
    /// The last full layer: its fp64 k-pool indexer, the noise of its pool scores, its tensors and the
    /// optimized side's own selection.
    last: Option<Full>,
    /// The first full layer's own selection (what `KpoolSharedWrongLayer` reuses).
    first_own: Option<Selection>,
    /// Whether the backend's own k-pool indexer ran (`None`: not yet).
    pub own_indexer: Option<bool>,
}

/// One layer's reference side: a full layer's fp64 k-pool indexer and tensors, `None` on a shared one.
pub struct KpoolSel(Option<Box<(KpoolOut, KpoolLayer)>>);

impl KpoolSel {
    pub fn is_full(&self) -> bool {
        self.0.is_some()
    }
}

impl KpoolRun {
    pub fn new(k: KpoolIndexer) -> KpoolRun {
        KpoolRun {
            k,
            last: None,
            first_own: None,
            own_indexer: None,
        }
    }

    /// The reference's selection of a layer: its own k-pool indexer's on a full layer, `prev` (the last
    /// full layer's) on a shared one.
    pub fn select(
        &self,
        file: &crate::gguf::GgufFile,
        ctx: &LayerCtx,
        x: &Array2<f64>,
        prev: Option<&Selection>,
    ) -> Result<(Selection, KpoolSel)> {
        match KpoolLayer::load(file, ctx.cfg, &self.k, ctx.layer)? {
            Some(kw) => {
                let attn_in = crate::reference::front::attn_in(ctx.cfg, ctx.weights, x.view());
                let o = crate::reference::kpool::run(
                    ctx.cfg,
                    &self.k,
                    &kw,
                    ctx.weights,
                    attn_in.view(),
                    crate::reference::kpool::Reading::default(),
                );
                Ok((o.selection.clone(), KpoolSel(Some(Box::new((o, kw))))))
            }
            None => match prev {
                Some(p) => Ok((p.clone(), KpoolSel(None))),
                None => Err(Error::Tensor(format!(
                    "layer {}: a shared k-pool indexer layer and no earlier full indexer layer to share from",
                    ctx.layer
                ))),
            },
        }
    }

    /// The optimized side's own k-pool selection on input `x` with a full layer's tensors `kw`: the
    /// backend's indexer, or the CPU mirror's standing in (without faults).
    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        kw: &KpoolLayer,
        backend: &mut dyn Backend,
        x: &Array2<f64>,
        dtype: Dtype,
        keys: KeyPrecision,
    ) -> Result<Selection> {
        if let Some(s) = backend.kpool_indexer(ctx, &self.k, kw, x, keys)? {
            self.own_indexer = Some(true);
            return Ok(s);
        }
        self.own_indexer = Some(false);
        let plan = mirror::plan_for(crate::faults::Active::NONE, keys, 0);
        let w = ctx.weights;
        Ok(mirror::run(ctx.cfg, &self.k, kw, w, ctx.rope, x, dtype, plan)?.selection)
    }

    /// The optimized side's own selection of a layer and its check against the reference's (on a
    /// shared layer, against its source's), with the source layer of a shared one.
    #[allow(clippy::too_many_arguments)]
    pub fn own(
        &mut self,
        ctx: &LayerCtx,
        sel: KpoolSel,
        backend: &mut dyn Backend,
        x: &Array2<f64>,
        dtype: Dtype,
        keys: KeyPrecision,
    ) -> Result<(Selection, SelectionResult, Option<usize>)> {
        let (kpool, tail) = (self.k.kp.kpool, self.k.kp.select_tail);
        if let Some(full) = sel.0 {
            let (out, kw) = *full;
            let own = self.indexer(ctx, &kw, backend, x, dtype, keys)?;
            let noise = ScoreNoise::kpool(&out, dtype, keys);
            let result = check::compare(&out, &noise, kpool, tail, &own);
            self.first_own.get_or_insert_with(|| own.clone());
            self.last = Some(Full {
                layer: ctx.layer,
                out,
                noise,
                kw,
                own: own.clone(),
            });
            return Ok((own, result, None));
        }
        let own = self.own_shared(ctx, backend, x, dtype, keys)?;
        let last = self.last.as_ref().expect("select found the source layer");
        let result = check::compare(&last.out, &last.noise, kpool, tail, &own);
        Ok((own, result, Some(last.layer)))
    }

    /// A shared layer's own selection: the last full layer's own one, or with a planted routing bug
    /// (only where the backend's own k-pool indexer ran: a stand-in takes no faults) an indexer of its
    /// own (the source layer's tensors on this layer's input) or the first full layer's selection.
    fn own_shared(
        &mut self,
        ctx: &LayerCtx,
        backend: &mut dyn Backend,
        x: &Array2<f64>,
        dtype: Dtype,
        keys: KeyPrecision,
    ) -> Result<Selection> {
        let fx = match self.own_indexer {
            Some(true) => ctx.faults,
            _ => crate::faults::Active::NONE,
        };
        let last = self.last.take().expect("select found the source layer");
        let own = if fx.on(Fault::KpoolSharedOwnIndexer) {
            self.indexer(ctx, &last.kw, backend, x, dtype, keys)
        } else if fx.on(Fault::KpoolSharedWrongLayer) {
            Ok(self.first_own.clone().expect("set with last"))
        } else {
            Ok(last.own.clone())
        };
        self.last = Some(last);
        own
    }
}
