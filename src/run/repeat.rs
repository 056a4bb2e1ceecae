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
use crate::compare;
use crate::error::Result;
use crate::report::repeat::{LayerRepeat, RepeatDiff};
use crate::trace::LayerTrace;
use ndarray::Array2;

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
