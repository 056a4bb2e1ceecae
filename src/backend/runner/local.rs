//! fp64 attention from exactly the tensors a runner was given: the yardstick of the `@runner` checks,
//! where upstream rounding cancels and only the runner's own error is left.

use crate::precision::Dtype;
use crate::tolerance::Tolerance;
use crate::trace::{AtRunner, Stage, StageTensor};

/// One query's fp64 attention over `keys` (`score(j)` already scaled, `value(j)` its value row).
/// No key: out 0, lse −inf.
pub fn attend<'a>(
    keys: std::ops::Range<usize>,
    dim: usize,
    score: impl Fn(usize) -> f64,
    value: impl Fn(usize) -> &'a [f64],
) -> (Vec<f64>, f64) {
    let mut out = vec![0.0; dim];
    if keys.is_empty() {
        return (out, f64::NEG_INFINITY);
    }
    let s: Vec<f64> = keys.clone().map(&score).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut l = 0.0;
    for (j, &sj) in keys.zip(&s) {
        let p = (sj - m).exp();
        l += p;
        for (o, &v) in out.iter_mut().zip(value(j)) {
            *o += p * v;
        }
    }
    out.iter_mut().for_each(|o| *o /= l);
    (out, m + l.ln())
}

/// An fp64 dot product in four interleaved sums (vectorizes; a GLM-5 layer's yardstick is ~10¹¹ of
/// these products). Its rounding, ~10⁻¹⁶ relative, is far below every bound it serves.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..4 {
            acc[k] += x[k] * y[k];
        }
    }
    acc[0] + acc[1] + acc[2] + acc[3] + tail
}

/// Unit roundoff of a storage type by name.
fn unit(dtype: &str) -> f64 {
    match dtype {
        "bf16" => 2f64.powi(-8),
        "fp16" => 2f64.powi(-11),
        "f32" => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    }
}

/// The bound of an `@runner` check: the coarser of the run's storage type and the type the runner
/// returned, and for f32 the accumulation over `terms` products (`√terms · 2⁻²⁴`): rel-L2 ≤ 4u,
/// elementwise `|d| ≤ 16u·rms + 4u·|ref|`.
pub fn tolerance(run_dtype: &str, out_dtype: &str, terms: usize) -> Tolerance {
    let acc = (terms.max(1) as f64).sqrt() * 2f64.powi(-24);
    let u = unit(run_dtype).max(unit(out_dtype)).max(acc);
    Tolerance {
        rel_l2: 4.0 * u,
        atol_rms: 16.0 * u,
        rtol: 4.0 * u,
    }
}

/// The bound every `@runner` check of one op shares: the run's storage type and the number of
/// products behind each output (`tolerance`'s `terms`).
pub(crate) struct Yardstick {
    pub dtype: Dtype,
    pub terms: usize,
}

impl Yardstick {
    /// The `@runner` check `name`: the runner's output (`[reference, optimized]`, the fp64 from its
    /// inputs first) of `stage` in `shape`, judged at the bound of `out_dtype`, the type it came in.
    pub(crate) fn check(
        &self,
        name: &str,
        stage: Stage,
        shape: &[usize],
        [reference, optimized]: [Vec<f64>; 2],
        out_dtype: &'static str,
    ) -> AtRunner {
        AtRunner {
            check: name.into(),
            reference: StageTensor::new(stage, shape.to_vec(), reference),
            optimized: StageTensor::new(stage, shape.to_vec(), optimized),
            tolerance: tolerance(self.dtype.name(), out_dtype, self.terms),
            out_dtype,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dot_is_the_dot_product() {
        let a: Vec<f64> = (0..579).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..579).map(|i| (i as f64 * 0.11).cos()).collect();
        let plain: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((super::dot(&a, &b) - plain).abs() < 1e-12 * plain.abs().max(1.0));
    }
}
