//! Error metrics between a reference tensor (fp64) and an optimized one, each a small named function.
//!
//! Conventions: `r` is the reference, `o` the optimized values, both flat and row-major.
//! Non-finite values are never averaged away: they are counted separately (see `nonfinite`), and the
//! finite-value metrics below skip positions where either side is non-finite.

use serde::{Deserialize, Serialize};

/// Relative differences use `|r|` floored at `REL_FLOOR_RMS × rms(r)`, so that near-zero reference
/// values do not turn rounding noise into huge relative errors.
pub const REL_FLOOR_RMS: f64 = 1e-3;

fn both_finite(r: f64, o: f64) -> bool {
    r.is_finite() && o.is_finite()
}

/// L2 norm of the finite values.
pub fn l2_norm(x: &[f64]) -> f64 {
    x.iter()
        .filter(|v| v.is_finite())
        .map(|v| v * v)
        .sum::<f64>()
        .sqrt()
}

/// Root mean square of the finite values.
pub fn rms(x: &[f64]) -> f64 {
    let n = x.iter().filter(|v| v.is_finite()).count();
    if n == 0 {
        0.0
    } else {
        l2_norm(x) / (n as f64).sqrt()
    }
}

/// Largest |o − r| and its flat index.
pub fn max_abs_diff(r: &[f64], o: &[f64]) -> (f64, Option<usize>) {
    let mut best = (0.0, None);
    for (i, (&a, &b)) in r.iter().zip(o).enumerate() {
        if both_finite(a, b) {
            let d = (b - a).abs();
            if d > best.0 || best.1.is_none() {
                best = (d, Some(i));
            }
        }
    }
    best
}

/// Largest |o − r| / max(|r|, floor) and its flat index.
pub fn max_rel_diff(r: &[f64], o: &[f64], floor: f64) -> (f64, Option<usize>) {
    let mut best = (0.0, None);
    for (i, (&a, &b)) in r.iter().zip(o).enumerate() {
        if both_finite(a, b) {
            let d = (b - a).abs() / a.abs().max(floor).max(f64::MIN_POSITIVE);
            if d > best.0 || best.1.is_none() {
                best = (d, Some(i));
            }
        }
    }
    best
}

/// Mean |o − r| over finite pairs.
pub fn mean_abs_diff(r: &[f64], o: &[f64]) -> f64 {
    let (s, n) = r
        .iter()
        .zip(o)
        .filter(|(a, b)| both_finite(**a, **b))
        .fold((0.0, 0usize), |(s, n), (a, b)| (s + (b - a).abs(), n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// ‖o − r‖ / ‖r‖ (√NMSE). With ‖r‖ = 0 it is ‖o − r‖ itself.
pub fn rel_l2(r: &[f64], o: &[f64]) -> f64 {
    let (num, den) = r
        .iter()
        .zip(o)
        .filter(|(a, b)| both_finite(**a, **b))
        .fold((0.0, 0.0), |(n, d), (a, b)| {
            (n + (b - a) * (b - a), d + a * a)
        });
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// FlashMLA's cos_diff: 1 − 2⟨r,o⟩ / max(‖r‖² + ‖o‖², 1e-12).
pub fn cos_diff(r: &[f64], o: &[f64]) -> f64 {
    let (xy, xx) = r
        .iter()
        .zip(o)
        .filter(|(a, b)| both_finite(**a, **b))
        .fold((0.0, 0.0), |(xy, xx), (a, b)| {
            (xy + a * b, xx + a * a + b * b)
        });
    1.0 - 2.0 * xy / xx.max(1e-12)
}

/// Signal-to-quantization-noise ratio in dB: 10·log10(‖r‖² / ‖o − r‖²); `None` when identical.
pub fn sqnr_db(r: &[f64], o: &[f64]) -> Option<f64> {
    let (sig, noise) = r
        .iter()
        .zip(o)
        .filter(|(a, b)| both_finite(**a, **b))
        .fold((0.0, 0.0), |(s, n), (a, b)| {
            (s + a * a, n + (b - a) * (b - a))
        });
    (noise > 0.0).then(|| 10.0 * (sig / noise).log10())
}

/// Elements with |o − r| > atol + rtol·|r| (finite pairs only): count and first flat index.
pub fn count_outside(r: &[f64], o: &[f64], atol: f64, rtol: f64) -> (usize, Option<usize>) {
    let mut n = 0;
    let mut first = None;
    for (i, (&a, &b)) in r.iter().zip(o).enumerate() {
        if both_finite(a, b) && (b - a).abs() > atol + rtol * a.abs() {
            n += 1;
            first.get_or_insert(i);
        }
    }
    (n, first)
}

/// Smallest factor k such that every finite element satisfies |o − r| ≤ k·(atol + rtol·|r|).
pub fn tolerance_factor_needed(r: &[f64], o: &[f64], atol: f64, rtol: f64) -> f64 {
    r.iter()
        .zip(o)
        .filter(|(a, b)| both_finite(**a, **b))
        .map(|(a, b)| (b - a).abs() / (atol + rtol * a.abs()).max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
        .min(f64::MAX) // JSON has no infinity
}

/// Non-finite values on either side. A mismatch is a position where the two sides are not the same
/// non-finite value (NaN vs anything, or an infinity that the other side does not share).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NonFinite {
    pub ref_nan: usize,
    pub ref_inf: usize,
    pub opt_nan: usize,
    pub opt_inf: usize,
    /// Positions where the optimized value is non-finite but the reference is finite, or the sides differ.
    pub mismatches: usize,
    /// First few mismatching flat indices.
    pub first_mismatches: Vec<usize>,
}

pub fn nonfinite(r: &[f64], o: &[f64]) -> NonFinite {
    let mut nf = NonFinite::default();
    for (i, (&a, &b)) in r.iter().zip(o).enumerate() {
        nf.ref_nan += a.is_nan() as usize;
        nf.ref_inf += a.is_infinite() as usize;
        nf.opt_nan += b.is_nan() as usize;
        nf.opt_inf += b.is_infinite() as usize;
        // Equal infinities (e.g. −inf lse of an empty split on both sides) agree; NaN never agrees.
        let same_inf = a.is_infinite() && a == b;
        if (!a.is_finite() || !b.is_finite()) && !same_inf {
            nf.mismatches += 1;
            if nf.first_mismatches.len() < 8 {
                nf.first_mismatches.push(i);
            }
        }
    }
    nf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_never_agrees() {
        let nf = nonfinite(
            &[1.0, f64::NAN, f64::NEG_INFINITY],
            &[f64::NAN, f64::NAN, f64::NEG_INFINITY],
        );
        assert_eq!(nf.mismatches, 2);
        assert_eq!(nf.first_mismatches, vec![0, 1]);
    }

    #[test]
    fn metrics_on_known_values() {
        let r = [3.0, 4.0];
        let o = [3.0, 4.5];
        assert!((rel_l2(&r, &o) - 0.1).abs() < 1e-15);
        assert_eq!(max_abs_diff(&r, &o), (0.5, Some(1)));
        assert!((sqnr_db(&r, &o).unwrap() - 20.0).abs() < 1e-12);
        assert_eq!(count_outside(&r, &o, 0.1, 0.0), (1, Some(1)));
        assert!((tolerance_factor_needed(&r, &o, 0.25, 0.0) - 2.0).abs() < 1e-15);
        assert!(sqnr_db(&r, &r).is_none());
        assert!(cos_diff(&r, &r).abs() < 1e-15);
    }
}
