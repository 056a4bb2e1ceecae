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

/// Every metric a check reports ([`All`]), in two passes over the pair (the first for rms(r), which
/// sets the second's floors) instead of one pass per metric: each sum in its own function's order,
/// so the same bits as those functions (`all_is_each` below), with their chains side by side.
#[derive(Debug, Clone, PartialEq)]
pub struct All {
    pub ref_l2: f64,
    pub opt_l2: f64,
    pub ref_rms: f64,
    /// [`max_abs_diff`], [`max_rel_diff`] (floor `REL_FLOOR_RMS`·rms(r)), [`count_outside`] (atol
    /// `atol_rms`·rms(r)).
    pub max_abs: (f64, Option<usize>),
    pub max_rel: (f64, Option<usize>),
    pub outside: (usize, Option<usize>),
    pub nonfinite: NonFinite,
    pub mean_abs: f64,
    pub rel_l2: f64,
    pub cos_diff: f64,
    pub sqnr_db: Option<f64>,
    pub tol_factor_needed: f64,
}

/// [`All`] of `r` against `o` with `atol = atol_rms·rms(r)` and `rtol`.
pub fn all(r: &[f64], o: &[f64], atol_rms: f64, rtol: f64) -> All {
    // The start of a `sum()` (the l2 norms are sums).
    let zero: f64 = std::iter::empty::<f64>().sum();
    let (mut rr, mut oo, mut nr) = (zero, zero, 0usize);
    for (&a, &b) in r.iter().zip(o) {
        if a.is_finite() {
            rr += a * a;
            nr += 1;
        }
        if b.is_finite() {
            oo += b * b;
        }
    }
    // `l2_norm(o)` runs over all of o, `zip` over the shorter.
    for &b in o.iter().skip(r.len()) {
        if b.is_finite() {
            oo += b * b;
        }
    }
    let ref_l2 = rr.sqrt();
    let ref_rms = match nr {
        0 => 0.0,
        n => ref_l2 / (n as f64).sqrt(),
    };
    let (atol, floor) = (atol_rms * ref_rms, REL_FLOOR_RMS * ref_rms);
    let mut nf = NonFinite::default();
    let (mut max_abs, mut max_rel) = ((0.0, None), (0.0, None));
    let (mut outside, mut first_out) = (0usize, None);
    let (mut s_abs, mut n_fin) = (0.0, 0usize);
    let (mut num, mut den, mut xy, mut xx, mut tf) = (0.0, 0.0, 0.0, 0.0, 0.0f64);
    for (i, (&a, &b)) in r.iter().zip(o).enumerate() {
        nf.ref_nan += a.is_nan() as usize;
        nf.ref_inf += a.is_infinite() as usize;
        nf.opt_nan += b.is_nan() as usize;
        nf.opt_inf += b.is_infinite() as usize;
        let same_inf = a.is_infinite() && a == b;
        if (!a.is_finite() || !b.is_finite()) && !same_inf {
            nf.mismatches += 1;
            if nf.first_mismatches.len() < 8 {
                nf.first_mismatches.push(i);
            }
        }
        if !both_finite(a, b) {
            continue;
        }
        let d = (b - a).abs();
        if d > max_abs.0 || max_abs.1.is_none() {
            max_abs = (d, Some(i));
        }
        let rel = d / a.abs().max(floor).max(f64::MIN_POSITIVE);
        if rel > max_rel.0 || max_rel.1.is_none() {
            max_rel = (rel, Some(i));
        }
        if d > atol + rtol * a.abs() {
            outside += 1;
            first_out.get_or_insert(i);
        }
        s_abs += d;
        n_fin += 1;
        num += (b - a) * (b - a);
        den += a * a;
        xy += a * b;
        xx = xx + a * a + b * b;
        tf = tf.max(d / (atol + rtol * a.abs()).max(f64::MIN_POSITIVE));
    }
    All {
        ref_l2,
        opt_l2: oo.sqrt(),
        ref_rms,
        max_abs,
        max_rel,
        outside: (outside, first_out),
        nonfinite: nf,
        mean_abs: match n_fin {
            0 => 0.0,
            n => s_abs / n as f64,
        },
        rel_l2: match den == 0.0 {
            true => num.sqrt(),
            false => (num / den).sqrt(),
        },
        cos_diff: 1.0 - 2.0 * xy / xx.max(1e-12),
        // sqnr's sums are rel_l2's: ‖r‖² and ‖o − r‖² over the finite pairs, in the same order.
        sqnr_db: (num > 0.0).then(|| 10.0 * (den / num).log10()),
        tol_factor_needed: tf.min(f64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`all`] is each metric's own function, bit for bit, non-finite values and empty pairs included.
    #[test]
    fn all_is_each() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let special = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0];
        for case in 0..300 {
            let n = rng.random_range(0..200);
            let v = |rng: &mut rand::rngs::StdRng| match rng.random_range(0..30) {
                0 if case % 3 == 0 => special[rng.random_range(0..special.len())],
                _ => rng.random_range(-2.0..2.0) * 10f64.powi(rng.random_range(-5..5)),
            };
            let r: Vec<f64> = (0..n).map(|_| v(&mut rng)).collect();
            let o: Vec<f64> = r
                .iter()
                .map(|&x| match rng.random_range(0..4) {
                    0 => v(&mut rng),
                    _ => x * (1.0 + rng.random_range(-1e-3..1e-3)),
                })
                .collect();
            let (atol_rms, rtol) = (rng.random_range(0.0..0.1), rng.random_range(0.0..0.1));
            let got = all(&r, &o, atol_rms, rtol);
            let ref_rms = rms(&r);
            let atol = atol_rms * ref_rms;
            let bits = |x: f64| x.to_bits();
            assert_eq!(bits(got.ref_l2), bits(l2_norm(&r)), "{case}");
            assert_eq!(bits(got.opt_l2), bits(l2_norm(&o)), "{case}");
            assert_eq!(bits(got.ref_rms), bits(ref_rms), "{case}");
            let (ma, mi) = max_abs_diff(&r, &o);
            assert_eq!(
                (bits(got.max_abs.0), got.max_abs.1),
                (bits(ma), mi),
                "{case}"
            );
            let (mr, ri) = max_rel_diff(&r, &o, REL_FLOOR_RMS * ref_rms);
            assert_eq!(
                (bits(got.max_rel.0), got.max_rel.1),
                (bits(mr), ri),
                "{case}"
            );
            assert_eq!(got.outside, count_outside(&r, &o, atol, rtol), "{case}");
            assert_eq!(got.nonfinite, nonfinite(&r, &o), "{case}");
            assert_eq!(bits(got.mean_abs), bits(mean_abs_diff(&r, &o)), "{case}");
            assert_eq!(bits(got.rel_l2), bits(rel_l2(&r, &o)), "{case}");
            assert_eq!(bits(got.cos_diff), bits(cos_diff(&r, &o)), "{case}");
            assert_eq!(got.sqnr_db.map(bits), sqnr_db(&r, &o).map(bits), "{case}");
            let tf = tolerance_factor_needed(&r, &o, atol, rtol);
            assert_eq!(bits(got.tol_factor_needed), bits(tf), "{case}");
        }
    }

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
