//! DeepSeek-V4's checks: the fp64 reference against the V4 mirror, one check per `V4Stage` in dataflow
//! order, judged end to end as the MLA stages are (`check_result`: non-finite mismatches, rel-L2 and the
//! elementwise bound, by dtype), with the tolerances of `v4_tolerances.json` (measured by
//! `run::v4::calibrate`, margin 4). There is no stage-local view for V4 yet: the MLA one models the
//! MLA mirror's roundings (`local/`), not V4's.
//!
//! Two checks differ from a plain pair of tensors:
//! - `topk_indices`: a selection, not values. Exactly tied indexer scores make the set
//!   implementation-defined (docs/deepseek-v4.md, step 7), so the check compares what the selection is
//!   worth: per query, the reference's scores of the mirror's selected entries against the reference's
//!   scores of its own top-k, both sorted (−inf for an empty slot; NaN for an entry the reference has
//!   not got). A swap among ties gives the same values; a near tie moves by the scores' noise; a wrong
//!   entry (past the causal threshold, a worse one) shows as a difference or a non-finite mismatch.
//! - `compressed`, `index_scores`: a side with fewer entries than the other is padded with NaN
//!   entries, so a window closed early or late fails as non-finite (never a shape error).
//!
//! The attention stages are judged against the reference run over the mirror's own selection
//! (`reference::v4::run_layer_selecting`), as the golden is: the selection itself is `topk_indices`.

use super::{check_result, CheckResult, LayerResult, Position};
use crate::error::{Error, Result};
use crate::precision::Dtype;
use crate::reference::v4::V4Layer;
use crate::tolerance::Tolerance;
use crate::trace::V4Stage;
use std::collections::BTreeMap;
use std::ops::Range;

/// The built-in tolerance table: dtype → stage → tolerance.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct V4Tolerances {
    pub derived_from: String,
    pub margin: f64,
    pub dtypes: BTreeMap<String, BTreeMap<String, Tolerance>>,
}

const TABLE: &str = include_str!("v4_tolerances.json");

impl V4Tolerances {
    pub fn builtin() -> V4Tolerances {
        serde_json::from_str(TABLE).expect("v4_tolerances.json parses")
    }
    pub fn get(&self, dt: Dtype, stage: V4Stage) -> Result<Tolerance> {
        self.dtypes
            .get(dt.name())
            .and_then(|m| m.get(stage.name()))
            .copied()
            .ok_or_else(|| {
                Error::Usage(format!(
                    "no DeepSeek-V4 tolerance for {} {} (src/compare/v4_tolerances.json)",
                    dt.name(),
                    stage.name()
                ))
            })
    }
}

/// What a V4 position is decoded with: the layer and the forward passes.
pub struct V4Ctx<'a> {
    pub layer: usize,
    pub passes: &'a [Range<usize>],
}

fn position(ctx: &V4Ctx, stage: V4Stage, shape: &[usize], flat: usize) -> Position {
    let mut idx = vec![0; shape.len()];
    let mut rest = flat;
    for (i, &n) in shape.iter().enumerate().rev() {
        idx[i] = rest % n.max(1);
        rest /= n.max(1);
    }
    let mut coords = vec![("layer".to_string(), ctx.layer)];
    for (axis, &i) in stage.axes().iter().zip(&idx) {
        coords.push((axis.to_string(), i));
        if *axis == "token" {
            coords.push(("pos".into(), i));
            if let Some(p) = ctx.passes.iter().position(|r| r.contains(&i)) {
                coords.push(("pass".into(), p));
            }
        }
    }
    Position { coords }
}

/// Rows of a `[n, …]` tensor padded with NaN rows to `n` (or cut to it).
fn rows_to(shape: &[usize], v: &[f64], n: usize) -> Vec<f64> {
    let per: usize = shape[1..].iter().product();
    let mut out: Vec<f64> = v.iter().copied().take(n * per).collect();
    out.resize(n * per, f64::NAN);
    out
}

/// Columns of a `[T, n]` tensor padded with NaN columns to `n` (or cut to it).
fn cols_to(shape: &[usize], v: &[f64], n: usize) -> Vec<f64> {
    let (t, m) = (shape[0], shape[1]);
    (0..t)
        .flat_map(|r| (0..n).map(move |c| if c < m { v[r * m + c] } else { f64::NAN }))
        .collect()
}

/// The `topk_indices` check's values: per query, `scores` (the reference's) of `sel`, sorted.
fn selection_worth(scores: &ndarray::Array2<f64>, sel: &ndarray::Array2<i64>) -> Vec<f64> {
    let mut out = Vec::with_capacity(sel.len());
    for (t, row) in sel.outer_iter().enumerate() {
        let mut v: Vec<f64> = row
            .iter()
            .map(|&e| match e {
                e if e < 0 => f64::NEG_INFINITY,
                e if (e as usize) < scores.ncols() => scores[[t, e as usize]],
                _ => f64::NAN,
            })
            .collect();
        v.sort_by(|a, b| b.total_cmp(a));
        out.extend(v);
    }
    out
}

/// The compared pairs of one V4 layer, in `V4Stage` order: `(stage, shape, reference, optimized)`,
/// the entries padded and the selection turned into its worth as the checks judge them.
pub type Pair = (V4Stage, Vec<usize>, Vec<f64>, Vec<f64>);

pub fn pairs(layer: usize, r: &V4Layer, o: &V4Layer) -> Result<Vec<Pair>> {
    let os = o.stages();
    let mut out = Vec::new();
    for (stage, shape, rv) in r.stages() {
        let ov = os.iter().find(|s| s.0 == stage).ok_or_else(|| {
            Error::Usage(format!(
                "layer {layer}: the V4 mirror has no stage {}",
                stage.name()
            ))
        })?;
        let ov = match stage {
            V4Stage::Compressed => rows_to(&ov.1, &ov.2, shape[0]),
            V4Stage::IndexScores => cols_to(&ov.1, &ov.2, shape[1]),
            V4Stage::TopkIndices => {
                let scores = r.index_scores.as_ref().expect("CSA has scores");
                let (rk, ok) = (r.topk_indices.as_ref(), o.topk_indices.as_ref());
                let (rk, ok) = (rk.expect("CSA selects"), ok.expect("CSA selects"));
                out.push((stage, shape, selection_worth(scores, rk), selection_worth(scores, ok)));
                continue;
            }
            _ if ov.1 != shape => {
                return Err(Error::Usage(format!(
                    "layer {layer}: stage {} has shape {shape:?} in the reference but {:?} in the V4 mirror",
                    stage.name(),
                    ov.1
                )))
            }
            _ => ov.2.clone(),
        };
        out.push((stage, shape, rv, ov));
    }
    Ok(out)
}

/// Every check of one V4 layer, reference `r` against the mirror's `o`.
pub fn compare_layer(
    ctx: &V4Ctx,
    r: &V4Layer,
    o: &V4Layer,
    dt: Dtype,
    tols: &V4Tolerances,
) -> Result<LayerResult> {
    let mut checks: Vec<CheckResult> = Vec::new();
    for (stage, shape, rv, ov) in pairs(ctx.layer, r, o)? {
        let tol = tols.get(dt, stage)?;
        let axes = stage.axes().iter().map(|s| s.to_string()).collect();
        let pos = |flat: usize| position(ctx, stage, &shape, flat);
        let name = stage.name().to_string();
        checks.push(check_result(
            name,
            axes,
            shape.clone(),
            (&rv, &ov),
            tol,
            true,
            &pos,
        ));
    }
    let first_failure = checks.iter().find(|c| !c.pass).map(|c| c.check.clone());
    Ok(LayerResult {
        layer: ctx.layer,
        pass: first_failure.is_none(),
        first_failure,
        drift: None,
        checks,
        not_provided: Vec::new(),
    })
}
