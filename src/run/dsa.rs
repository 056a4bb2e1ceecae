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
use crate::backend::{Backend, Dtype, LayerCtx};
use crate::compare::metrics::rel_l2;
use crate::compare::selection::{self, SelectionResult};
use crate::error::{Error, Result};
use crate::model::{IndexerConfig, IndexerWeights};
use crate::reference::indexer::{self as ref_indexer, Reading};
use crate::reference::sparse::Selection;
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

/// The reference's fp64 index scores `[T, T]` and per-query error scales (`indexer::error_scale`).
pub type Scores = (Array2<f64>, Vec<f64>);

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
            let scale = ref_indexer::error_scale(&o);
            Ok((o.selection, Some((o.scores, scale))))
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
    let (scores, scale) = scores.expect("a full layer has scores");
    let reference = crate::reference::run_layer_sel(cfg, w, rope, x, sched, Some(&ref_sel))?;
    let optimized = backend.run_layer(
        &LayerCtx {
            selection: Some(&ref_sel),
            ..*ctx
        },
        x,
    )?;
    let opt_sel = mirror_indexer::run(cfg, ic, iw, w, rope, x, dtype, plan)?.selection;
    let selection = selection::compare(&scores, &scale, &ref_sel, &opt_sel, dtype.round_unit());
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
