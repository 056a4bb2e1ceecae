//! `run --repeat N`: determinism of the optimized path. Each layer's optimized path runs N times on the
//! same input (the deciding mode's: the reference's input in shadow mode) and every stage tensor of runs
//! 2..N is compared with run 1's bit for bit. A kernel whose result depends on scheduling (atomics in a
//! split-KV combine, a reduction order that follows thread timing) shows here even when every run is
//! within tolerance of the reference, and nondeterminism fails the run: a result that changes between
//! identical calls cannot be pinned by a baseline or reproduced in a bug report.
//!
//! "Bit for bit" compares the f64 bit patterns of the trace (each an exact widening of what the kernel
//! stored), except that any two NaNs are equal: a NaN's payload is not a value, but a NaN in one run and a
//! number in the other is a difference.

use crate::backend::{Backend, LayerCtx};
use crate::compare::{self, Position};
use crate::error::Result;
use crate::trace::LayerTrace;
use ndarray::Array2;
use serde::{Deserialize, Serialize};

/// The repeat check of a run (`Report::repeat`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepeatResult {
    /// N: runs of the optimized path per layer, the first included.
    pub runs: usize,
    /// The mode whose input the repeats used (`shadow` when it ran).
    pub mode: String,
    /// No stage of any layer differed between runs.
    pub pass: bool,
    pub layers: Vec<LayerRepeat>,
    pub message: String,
}

/// One layer's repeats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerRepeat {
    pub layer: usize,
    /// Every stage of runs 2..N bit-identical to run 1's.
    pub identical: bool,
    /// The stages that differed, in dataflow order, each at the first repeat where it did.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub differing: Vec<RepeatDiff>,
}

/// A stage whose values changed between identical runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepeatDiff {
    pub stage: String,
    /// The first repeat (2..=N) whose values differ from run 1's.
    pub run: usize,
    /// How many elements differ in that repeat (all of them when the shapes differ).
    pub elements: usize,
    /// The first differing element: its flat index in the stage tensor, the check it belongs to and its
    /// named coordinates (absent when the shapes differ).
    pub first_index: usize,
    pub first_check: String,
    pub first_at: Option<Position>,
    /// That element in run 1 and in the repeat, as decimal text (shortest round trip; `NaN`, `inf`).
    pub values: [String; 2],
}

impl RepeatDiff {
    /// "E element(s), first at POSITION (CHECK: a vs b)": how much changed and where first.
    pub fn where_first(&self) -> String {
        format!(
            "{} element(s), first at {} ({}: {} vs {})",
            self.elements,
            self.first_at
                .as_ref()
                .map(|p| p.to_string())
                .unwrap_or_else(|| format!("index {}", self.first_index)),
            self.first_check,
            self.values[0],
            self.values[1]
        )
    }
}

/// Equal as bit patterns, or both NaN.
fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// How `again` (repeat `run`) differs from `first`, stage by stage.
pub fn differences(
    ctx: &compare::Ctx,
    first: &LayerTrace,
    again: &LayerTrace,
    run: usize,
) -> Vec<RepeatDiff> {
    let mut out = Vec::new();
    for a in &first.stages {
        let Some(b) = again.get(a.stage) else {
            out.push(RepeatDiff {
                stage: a.stage.name().into(),
                run,
                elements: a.data.len(),
                first_index: 0,
                first_check: a.stage.name().into(),
                first_at: None,
                values: ["present".into(), "missing".into()],
            });
            continue;
        };
        if a.shape != b.shape {
            out.push(RepeatDiff {
                stage: a.stage.name().into(),
                run,
                elements: a.data.len().max(b.data.len()),
                first_index: 0,
                first_check: a.stage.name().into(),
                first_at: None,
                values: [
                    format!("shape {:?}", a.shape),
                    format!("shape {:?}", b.shape),
                ],
            });
            continue;
        }
        let mut diff = a
            .data
            .iter()
            .zip(&b.data)
            .enumerate()
            .filter(|(_, (x, y))| !same(**x, **y));
        let Some((i, (x, y))) = diff.next() else {
            continue;
        };
        let (check, at) = compare::locate(ctx, a, i);
        out.push(RepeatDiff {
            stage: a.stage.name().into(),
            run,
            elements: 1 + diff.count(),
            first_index: i,
            first_check: check,
            first_at: Some(at),
            values: [x.to_string(), y.to_string()],
        });
    }
    out
}

/// Runs 2..=`n` of one layer on `x`, each compared with `first` (run 1's trace).
pub fn repeat_layer(
    backend: &mut dyn Backend,
    lctx: &LayerCtx,
    x: &Array2<f64>,
    first: &LayerTrace,
    n: usize,
    ctx: &compare::Ctx,
) -> Result<LayerRepeat> {
    let mut differing: Vec<RepeatDiff> = Vec::new();
    for run in 2..=n {
        let again = backend.run_layer(lctx, x)?;
        for d in differences(ctx, first, &again, run) {
            // Each stage at the first repeat where it changed.
            if !differing.iter().any(|e| e.stage == d.stage) {
                differing.push(d);
            }
        }
    }
    differing.sort_by_key(|d| crate::trace::Stage::from_name(&d.stage).map(|s| s.order()));
    Ok(LayerRepeat {
        layer: ctx.layer,
        identical: differing.is_empty(),
        differing,
    })
}

impl RepeatResult {
    pub fn new(runs: usize, mode: &str, layers: Vec<LayerRepeat>) -> RepeatResult {
        let bad: Vec<&LayerRepeat> = layers.iter().filter(|l| !l.identical).collect();
        let message = match bad.first().and_then(|l| l.differing.first().map(|d| (l, d))) {
            None => format!(
                "deterministic: {runs} runs of the optimized path bit-identical in {} layer(s)",
                layers.len()
            ),
            Some((l, d)) => format!(
                "NONDETERMINISTIC: {} of {} layer(s) differ between {runs} identical runs; first at layer {}, {} (run {} vs run 1): {}",
                bad.len(),
                layers.len(),
                l.layer,
                d.stage,
                d.run,
                d.where_first()
            ),
        };
        RepeatResult {
            runs,
            mode: mode.into(),
            pass: bad.is_empty(),
            layers,
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_payloads_are_equal_but_signed_zeros_are_not() {
        let quiet = f64::NAN;
        let other = f64::from_bits(quiet.to_bits() | 1);
        assert!(other.is_nan() && other.to_bits() != quiet.to_bits());
        assert!(same(quiet, other));
        assert!(!same(0.0, -0.0));
        assert!(!same(1.0, f64::NAN));
        assert!(same(1.5, 1.5));
    }
}
