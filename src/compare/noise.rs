//! The noise model of the stage-local view (`local/`): how far an optimized stage may honestly sit
//! from fp64 recomputed from its own stored inputs, per element, and the judge that turns that into a
//! pass or a failure.
//!
//! Each element's predicted error variance σ² is the sum of
//! - the rounding of the stored output to its storage type (inferred from the values: a bf16 tensor
//!   is all bf16 numbers), `ulp²/12`;
//! - roundings the path makes on the way but does not store in the trace (q-LoRA's latent, kv before its
//!   norm, q/k before rope, P before P·V, prefill's decompressed k/v, a prefill part before its merge),
//!   propagated to the output by `local/`;
//! - f32 arithmetic: sums (their random part and the part common to all partial sums), products, exp.
//!
//! The judge bounds three statistics by `K` × the model's prediction, each with a chi-square or
//! Gaussian tail for the number of degrees of freedom and of rows or elements looked at, so that a clean
//! run fails with probability ≲ `ALPHA` per check while an error a few times the noise is caught.

use serde::{Deserialize, Serialize};

mod residuals;
use residuals::{ratio_of, whole_dof, Residuals};

/// f32 unit roundoff.
pub const U32: f64 = 1.0 / 16_777_216.0;

/// Variance of one f32 operation's relative rounding (uniform in ±u): u²/3.
pub const F32_OP: f64 = U32 * U32 / 3.0;

/// Relative error variance of an f32 `exp` (a correctly rounded one is ~1 ulp; GPU fast-math
/// `ex2.approx` a few ulp): taken as 4 ulp for every backend.
pub const EXP_REL_VAR: f64 = 16.0 * U32 * U32;

/// How much the measured error energy may exceed the prediction: the model's own inaccuracy (measured:
/// prediction within 1–6 % on the CPU mirror, up to 5× conservative for f32 LSEs) and the backends'
/// differences in summation order and exp.
pub const K: f64 = 2.0;

/// The false-alarm probability each statistic is bounded at (per check).
pub const ALPHA: f64 = 1e-6;

/// The most a truncating accumulator can lose per k-step, in units of `U32`·|partial sum|: under one
/// ulp, which is at most 2u of the value (`Prediction::truncation`).
pub const KAPPA_MAX: f64 = 2.0;

/// Storage type of a stage's values, inferred from the values themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Store {
    Bf16,
    Fp16,
    F32,
    /// Values no f32 holds exactly: the path stored f64.
    F64,
}

impl Store {
    /// The narrowest type that holds every finite value exactly (bf16 before fp16: a tensor of small
    /// integers is both, and then its rounding is immaterial).
    pub fn infer(values: &[f64]) -> Store {
        let fin = || values.iter().copied().filter(|v| v.is_finite());
        if fin().all(|v| half::bf16::from_f64(v).to_f64() == v) {
            Store::Bf16
        } else if fin().all(|v| half::f16::from_f64(v).to_f64() == v) {
            Store::Fp16
        } else if fin().all(|v| (v as f32) as f64 == v) {
            Store::F32
        } else {
            Store::F64
        }
    }
    /// (mantissa bits after the point, smallest normal exponent)
    fn format(self) -> (i32, i32) {
        match self {
            Store::Bf16 => (7, -126),
            Store::Fp16 => (10, -14),
            Store::F32 => (23, -126),
            Store::F64 => (52, -1022),
        }
    }
    /// The spacing of this type's numbers at |y|. From y's exponent bits (floor(log2 |y|) exactly;
    /// a rounded log2 can land on the next binade just below a power of two, and was a tenth of the
    /// comparison's time).
    pub fn ulp(self, y: f64) -> f64 {
        let (m, emin) = self.format();
        let biased = ((y.to_bits() >> 52) & 0x7ff) as i32;
        // Zero and f64 subnormals (biased 0) are below every type's emin; inf and NaN (0x7ff) count as
        // zero did.
        let e = match biased {
            0 | 0x7ff => emin,
            b => (b - 1023).max(emin),
        };
        pow2(e - m)
    }
    /// Variance of rounding a value near `y` to this type (round to nearest: uniform in ±ulp/2).
    pub fn round_var(self, y: f64) -> f64 {
        let u = self.ulp(y);
        u * u / 12.0
    }
    /// The largest variance of rounding a value of magnitude |y| to this type, wherever in its binade
    /// it sits (at the binade's bottom, where the spacing relative to the value is largest: 2^-m):
    /// for values rounded at a scale the trace does not show.
    pub fn worst_round_var(self, y: f64) -> f64 {
        let (m, _) = self.format();
        let u = y.abs() * pow2(-m);
        (u * u / 12.0).max(self.round_var(y))
    }
    /// Round to this type (to nearest even).
    pub fn round(self, y: f64) -> f64 {
        match self {
            Store::Bf16 => half::bf16::from_f64(y).to_f64(),
            Store::Fp16 => half::f16::from_f64(y).to_f64(),
            Store::F32 => y as f32 as f64,
            Store::F64 => y,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Store::Bf16 => "bf16",
            Store::Fp16 => "fp16",
            Store::F32 => "f32",
            Store::F64 => "f64",
        }
    }
}

/// 2^k, exactly: f64's subnormals from their one bit, 0 below 2⁻¹⁰⁷⁴. (It was `2f64.powi(k)` below
/// 2⁻¹⁰²²: a call per zero of an f64-stored check (`round_var(0)`), 3 % of a GLM-5 run, and at run
/// time 0 below 2⁻¹⁰²³ (1 / 2⁻ᵏ overflows), where folded at compile time the subnormal; `round_var`
/// is 0 either way, for u² underflows.)
fn pow2(k: i32) -> f64 {
    match k {
        -1022.. => f64::from_bits(((k + 1023) as u64) << 52),
        -1074.. => f64::from_bits(1 << (k + 1074)),
        _ => 0.0,
    }
}

impl From<crate::precision::Dtype> for Store {
    fn from(d: crate::precision::Dtype) -> Store {
        match d {
            crate::precision::Dtype::Bf16 => Store::Bf16,
            crate::precision::Dtype::F16 => Store::Fp16,
            crate::precision::Dtype::F32 => Store::F32,
        }
    }
}

/// Variance of an f32 sum of `n` terms with `sum_sq` = Σ tᵢ² and result `total`, accumulated in one
/// running sum (a GEMM microkernel's or an MMA's accumulator walks the k dimension in order): the
/// random part of the partial sums (~n·Σt²/2) and their common part (~n·total²/3), each partial sum
/// rounded once per addition, plus each product's rounding. Doubled for tensor-core accumulation,
/// whose internal order and precision we do not model. (Lane-parallel sums, as the mirror's `dot`,
/// have less: this bound is conservative for them.)
pub fn acc_var(n: usize, sum_sq: f64, total: f64) -> f64 {
    let n = n as f64;
    2.0 * F32_OP * (sum_sq * (1.0 + n / 2.0) + n * total * total / 3.0)
}

/// Laurent–Massart: with probability ≥ 1 − e^{−x}, χ²_d / d ≤ 1 + 2√(x/d) + 2x/d.
pub fn chi2_bound(dof: f64, x: f64) -> f64 {
    let d = dof.max(1.0);
    1.0 + 2.0 * (x / d).sqrt() + 2.0 * x / d
}

/// Effective degrees of freedom of a sum of independent terms with variances σᵢ²: (Σσ²)²/Σσ⁴.
fn dof(vars: impl Iterator<Item = f64>) -> f64 {
    let (s, s2) = vars.fold((0.0, 0.0), |(a, b), v| (a + v, b + v * v));
    if s2 > 0.0 {
        s * s / s2
    } else {
        1.0
    }
}

/// The stage-local verdict of one check, as reported (`CheckResult::local`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalResult {
    pub pass: bool,
    /// The storage type inferred from the optimized values.
    pub store: Store,
    /// rel-L2 of the optimized stage against fp64 from its own inputs (with the truncation bias).
    pub rel_l2: f64,
    /// The rel-L2 the noise model predicts for it.
    pub predicted_rel_l2: f64,
    /// Error energy ÷ predicted, over the whole check; and its bound.
    pub energy: f64,
    pub energy_bound: f64,
    /// The worst row's (last axis) energy ÷ its prediction; its bound; where.
    pub row_energy: f64,
    pub row_bound: f64,
    pub row_at: Option<super::Position>,
    /// The worst element's |error| in predicted σ; its bound; where.
    pub max_sigmas: f64,
    pub sigma_bound: f64,
    pub max_sigmas_at: Option<super::Position>,
    /// How close to failing: the largest statistic ÷ its bound (≥ 1 fails; ∞ for non-finite).
    pub ratio: f64,
    pub reasons: Vec<String>,
    /// Where the path's scores come from a truncating tensor-core accumulator: the fitted κ (mean loss
    /// per k-step in u of the partial sum, within [0, KAPPA_MAX]) whose bias was taken out before judging.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncation: Option<f64>,
}

/// What the noise model predicts for one check, besides fp64's values.
pub struct Prediction<'a> {
    /// The variance predicted before the output's own rounding (per element).
    pub hidden: &'a [f64],
    /// A copy of values already in their type: nothing is added for the output's rounding.
    pub exact: bool,
    /// The last axis' length (a row).
    pub row: usize,
    /// Per row: the hidden variance its elements share and its number of sources (`LocalStage::coherent`).
    pub coherent: Option<&'a [(f64, f64)]>,
    /// Per element: the bias a tensor-core accumulator that truncates toward zero after each 16-wide
    /// k-step puts into the scores, carried to this stage, at κ = 1 (`local/`). Fitted over the check
    /// with κ ∈ [0, KAPPA_MAX] and taken out before judging: one-signed and bounded, so it explains only
    /// what truncation can (on the H200 it was 58 % of a GLM-5 split_lse's error energy; its fit leaves
    /// the CPU mirror's round-to-nearest noise: `bench/probes/split_lse.py`).
    pub truncation: Option<&'a [f64]>,
    /// The stage's storage type by the backend's contract (`LocalStage::store`); `None`: inferred.
    pub store: Option<Store>,
}

/// Judge one check: `opt` the optimized values, `local` fp64 from the optimized inputs, `pred` the noise
/// model's prediction for them. `pos` decodes a flat index for messages.
pub fn judge(
    opt: &[f64],
    local: &[f64],
    pred: &Prediction,
    pos: &dyn Fn(usize) -> super::Position,
) -> LocalResult {
    let store = pred.store.unwrap_or_else(|| Store::infer(opt));
    let nf = super::metrics::nonfinite(local, opt);
    let r = Residuals::new(opt, local, pred, store);
    let (p_all, n) = (r.p_all, opt.len());
    // A floor for elements whose own σ is tiny (a value near 0): 5 % of the check's RMS σ.
    let floor = 0.0025 * p_all / r.n_fin.max(1) as f64;
    let x = (1.0 / ALPHA).ln();
    let mut reasons = Vec::new();
    if nf.mismatches > 0 {
        let at = nf.first_mismatches.first().map(|&i| pos(i));
        reasons.push(format!(
            "{} non-finite mismatches against fp64 from the stage's own inputs{}",
            nf.mismatches,
            at.map(|p| format!(", first at {p}")).unwrap_or_default()
        ));
    }
    let row = pred.row.max(1);
    let row_dof = r.row_dof(row, pred.coherent);
    // Whole check.
    let energy_bound = K * chi2_bound(whole_dof(&row_dof), x);
    let energy = if p_all > 0.0 {
        r.e_all / p_all
    } else if r.e_all > 0.0 {
        f64::INFINITY
    } else {
        0.0
    };
    let r_all = ratio_of(r.e_all, p_all, energy_bound);
    if r_all > 1.0 {
        reasons.push(match p_all > 0.0 {
            true => {
                format!("error energy {energy:.2}× the predicted noise (bound {energy_bound:.2}×)")
            }
            false => "differs from an exact copy of its input".to_string(),
        });
    }
    // Rows of the last axis.
    let w = r.worst_row(row, &row_dof, x);
    if w.ratio > 1.0 && r_all <= 1.0 && p_all > 0.0 {
        reasons.push(format!(
            "one row's error energy {:.2}× its predicted noise (bound {:.2}×) at {}",
            w.energy,
            w.bound,
            w.at.map(pos).map(|p| p.to_string()).unwrap_or_default()
        ));
    }
    // Elements.
    let sigma_bound = (K * 2.0 * (x + (r.n_fin.max(1) as f64).ln())).sqrt();
    let (max_sig, max_i) = r.worst_element(floor);
    let r_elem = max_sig / sigma_bound;
    if r_elem > 1.0 && r_all <= 1.0 && w.ratio <= 1.0 && p_all > 0.0 {
        let i = max_i.expect("an element");
        reasons.push(format!(
            "an element {max_sig:.1}σ from fp64 of its own inputs (bound {sigma_bound:.1}σ) at {} (local {:.6e}, opt {:.6e})",
            pos(i),
            local[i],
            opt[i]
        ));
    }
    let ratio = if nf.mismatches > 0 {
        f64::INFINITY
    } else {
        r_all.max(w.ratio).max(r_elem)
    };
    let l2 = |f: &dyn Fn(usize) -> f64| (0..n).filter(|&i| r.fin(i)).map(f).sum::<f64>();
    let ref_sq = l2(&|i| local[i] * local[i]);
    let rel = |x: f64| {
        if ref_sq > 0.0 {
            (x / ref_sq).sqrt()
        } else {
            x.sqrt()
        }
    };
    let json_num = |v: f64| v.min(f64::MAX); // JSON has no infinity
    LocalResult {
        pass: reasons.is_empty(),
        store,
        rel_l2: rel(r.raw_all),
        predicted_rel_l2: rel(p_all),
        energy: json_num(energy),
        energy_bound,
        row_energy: json_num(w.energy),
        row_bound: w.bound,
        row_at: w.at.map(pos),
        max_sigmas: json_num(max_sig),
        sigma_bound,
        max_sigmas_at: max_i.map(pos),
        ratio: json_num(ratio),
        reasons,
        truncation: r.kappa,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_is_inferred_from_values() {
        assert_eq!(Store::infer(&[1.0, 0.5, -3.0]), Store::Bf16);
        assert_eq!(Store::infer(&[1.0 + 2f64.powi(-10)]), Store::Fp16);
        assert_eq!(
            Store::infer(&[0.1f32 as f64, f64::NEG_INFINITY]),
            Store::F32
        );
        assert_eq!(Store::infer(&[0.1]), Store::F64);
        assert_eq!(Store::Bf16.ulp(1.5), 2f64.powi(-7));
        assert_eq!(Store::Fp16.ulp(1e-9), 2f64.powi(-24));
        // floor(log2) exactly, at and just below powers of two, on both sides of zero.
        let below = f64::from_bits(2f64.to_bits() - 1);
        assert_eq!(Store::Bf16.ulp(below), 2f64.powi(-7));
        assert_eq!(Store::Bf16.ulp(-2.0), 2f64.powi(-6));
        assert_eq!(Store::F32.ulp(f64::NAN), Store::F32.ulp(0.0));
        assert_eq!(Store::F64.ulp(0.0), 2f64.powi(-1074));
        assert_eq!(Store::F64.ulp(5e-324), 2f64.powi(-1074));
    }

    /// [`pow2`] is 2^k to the bit, subnormals included (each twice the one below), 0 below them; the
    /// rounding variances at and below 2⁻¹⁰²² are 0 (u² underflows).
    #[test]
    fn pow2_is_exact() {
        assert_eq!(pow2(-1074), 5e-324);
        assert_eq!(pow2(0), 1.0);
        assert_eq!(pow2(1023), f64::MAX / (2.0 - f64::EPSILON));
        for k in -1074..1023 {
            assert_eq!(pow2(k + 1), 2.0 * pow2(k), "{k}");
        }
        assert_eq!(pow2(-1075), 0.0);
        for y in [0.0, 5e-324, 1e-310, f64::MIN_POSITIVE] {
            assert_eq!(Store::F64.round_var(y), 0.0, "{y}");
        }
    }

    fn plain(hidden: &[f64], exact: bool) -> Prediction<'_> {
        Prediction {
            hidden,
            exact,
            row: 64,
            coherent: None,
            truncation: None,
            store: None,
        }
    }

    /// An f32 contract holds values rounded to bf16 to f32's noise: inferred, the same values pass as
    /// a bf16 tensor (the split LSE of #35's `split_lse_bf16`).
    #[test]
    fn a_storage_contract_overrides_the_inferred_type() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let local: Vec<f64> = (0..512).map(|_| rng.random_range(2.0..9.0)).collect();
        let opt: Vec<f64> = local
            .iter()
            .map(|&v| half::bf16::from_f64(v).to_f64())
            .collect();
        let zero = vec![0.0; local.len()];
        assert!(judge(&opt, &local, &plain(&zero, false), &pos).pass);
        let f32_contract = Prediction {
            store: Some(Store::F32),
            ..plain(&zero, false)
        };
        assert!(!judge(&opt, &local, &f32_contract, &pos).pass);
        // Values that are f32 pass the f32 contract.
        let f32s: Vec<f64> = local.iter().map(|&v| v as f32 as f64).collect();
        assert!(judge(&f32s, &local, &f32_contract, &pos).pass);
    }

    fn pos(i: usize) -> super::super::Position {
        super::super::Position {
            coords: vec![("i".into(), i)],
        }
    }

    /// Rounding noise as predicted passes; the same values with a 3× larger error fail; an exact copy
    /// with one changed value fails; NaN fails.
    #[test]
    fn judge_separates_noise_from_errors() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let local: Vec<f64> = (0..4096).map(|_| rng.random_range(-2.0..2.0)).collect();
        let opt: Vec<f64> = local
            .iter()
            .map(|&v| half::bf16::from_f64(v).to_f64())
            .collect();
        let zero = vec![0.0; local.len()];
        let clean = judge(&opt, &local, &plain(&zero, false), &pos);
        assert!(clean.pass, "{:?}", clean.reasons);
        assert!((clean.energy - 1.0).abs() < 0.1, "{}", clean.energy);
        let worse: Vec<f64> = opt
            .iter()
            .zip(&local)
            .map(|(&o, &l)| l + 3.0 * (o - l))
            .map(|v| half::bf16::from_f64(v).to_f64())
            .collect();
        assert!(!judge(&worse, &local, &plain(&zero, false), &pos).pass);
        let mut copy = opt.clone();
        copy[5] += 2f64.powi(-6);
        assert!(!judge(&copy, &opt, &plain(&zero, true), &pos).pass);
        assert!(judge(&opt, &opt, &plain(&zero, true), &pos).pass);
        let mut nan = opt.clone();
        nan[9] = f64::NAN;
        let r = judge(&nan, &local, &plain(&zero, false), &pos);
        assert!(
            !r.pass && r.ratio == f64::MAX,
            "NaN must fail: {:?}",
            r.reasons
        );
    }

    /// A truncation bias along its direction is taken out up to κ = KAPPA_MAX; the same bias of the
    /// other sign, or larger than truncation can make, is not.
    #[test]
    fn truncation_bias_is_fitted_within_its_range() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let n = 4096;
        let local: Vec<f64> = (0..n).map(|_| rng.random_range(4.0..8.0)).collect();
        let var = vec![(1e-6f64).powi(2); n];
        // κ = 1 moves each element by −u·10·value: ~−2.4e-6 to −4.8e-6, several σ.
        let b: Vec<f64> = local.iter().map(|&v| -U32 * 10.0 * v).collect();
        let noisy = |k: f64, rng: &mut rand::rngs::StdRng| -> Vec<f64> {
            (0..n)
                .map(|i| local[i] + k * b[i] + 1e-6 * rng.random_range(-1.7..1.7))
                .map(|v| (v as f32) as f64)
                .collect()
        };
        fn pred<'a>(var: &'a [f64], t: Option<&'a [f64]>) -> Prediction<'a> {
            Prediction {
                hidden: var,
                exact: false,
                row: 64,
                coherent: None,
                truncation: t,
                store: None,
            }
        }
        let biased = noisy(0.6, &mut rng);
        assert!(!judge(&biased, &local, &pred(&var, None), &pos).pass);
        let r = judge(&biased, &local, &pred(&var, Some(&b)), &pos);
        assert!(r.pass, "{:?}", r.reasons);
        assert!(
            (r.truncation.unwrap() - 0.6).abs() < 0.05,
            "{:?}",
            r.truncation
        );
        for k in [-0.6, 3.0 * KAPPA_MAX] {
            let r = judge(&noisy(k, &mut rng), &local, &pred(&var, Some(&b)), &pos);
            assert!(!r.pass, "κ = {k} passed: {:?}", r.truncation);
        }
    }
}
