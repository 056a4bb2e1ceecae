//! One check's residuals against the noise model, and the statistics `judge` bounds: the whole
//! check's, its worst row's and its worst element's.

use super::{chi2_bound, dof, Prediction, Store, K, KAPPA_MAX};

/// An error energy `e` against its predicted noise `p`, as a fraction of its bound (∞ where nothing
/// may differ and something does).
pub(super) fn ratio_of(e: f64, p: f64, bound: f64) -> f64 {
    if p > 0.0 {
        e / p / bound
    } else if e > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

/// Degrees of freedom of the whole check from its rows' (variance, dof).
pub(super) fn whole_dof(row_dof: &[(f64, f64)]) -> f64 {
    let (sp, sd) = row_dof.iter().fold((0.0, 0.0), |(a, b), &(p, d)| {
        (a + p, b + p * p / d.max(1e-300))
    });
    if sd > 0.0 {
        sp * sp / sd
    } else {
        1.0
    }
}

/// The worst row of a check: its energy ratio to its bound, its energy ÷ prediction, the bound, and
/// its first element.
pub(super) struct WorstRow {
    pub ratio: f64,
    pub energy: f64,
    pub bound: f64,
    pub at: Option<usize>,
}

/// One check's residuals: each element's predicted variance and its error after the fitted truncation
/// bias, with totals over the elements finite on both sides (the only ones judged statistically).
pub(super) struct Residuals<'a> {
    opt: &'a [f64],
    local: &'a [f64],
    var: Vec<f64>,
    err: Vec<f64>,
    pub kappa: Option<f64>,
    /// Σ err², Σ var, the finite count, Σ (opt − local)² (before the bias is taken out).
    pub e_all: f64,
    pub p_all: f64,
    pub n_fin: usize,
    pub raw_all: f64,
}

impl<'a> Residuals<'a> {
    pub fn new(opt: &'a [f64], local: &'a [f64], pred: &Prediction, store: Store) -> Residuals<'a> {
        let (hidden, exact) = (pred.hidden, pred.exact);
        let var: Vec<f64> = opt
            .iter()
            .zip(hidden)
            .map(|(&y, &h)| if exact { h } else { h + store.round_var(y) })
            .collect();
        let fin = |i: usize| local[i].is_finite() && opt[i].is_finite();
        let n = opt.len();
        // The truncation bias, fitted by inverse-variance least squares within its physical range.
        let kappa = pred.truncation.map(|b| {
            let (mut num, mut den) = (0.0, 0.0);
            for i in (0..n).filter(|&i| fin(i) && var[i] > 0.0) {
                num += (opt[i] - local[i]) * b[i] / var[i];
                den += b[i] * b[i] / var[i];
            }
            if den > 0.0 {
                (num / den).clamp(0.0, KAPPA_MAX)
            } else {
                0.0
            }
        });
        let err: Vec<f64> = match (kappa, pred.truncation) {
            (Some(k), Some(b)) => (0..n).map(|i| opt[i] - local[i] - k * b[i]).collect(),
            _ => (0..n).map(|i| opt[i] - local[i]).collect(),
        };
        let (mut e_all, mut p_all, mut n_fin, mut raw_all) = (0.0, 0.0, 0usize, 0.0);
        for i in (0..n).filter(|&i| fin(i)) {
            let e = err[i];
            e_all += e * e;
            // A product, not `powi(2)` (a call per element here; the same bits: `1·(d·d)`).
            let d = opt[i] - local[i];
            raw_all += d * d;
            p_all += var[i];
            n_fin += 1;
        }
        Residuals {
            opt,
            local,
            var,
            err,
            kappa,
            e_all,
            p_all,
            n_fin,
            raw_all,
        }
    }

    pub fn fin(&self, i: usize) -> bool {
        self.local[i].is_finite() && self.opt[i].is_finite()
    }

    /// Per row (last axis): its predicted variance and degrees of freedom: its elements', or fewer
    /// where they share sources (Satterthwaite: a shared part C with n sources, the rest with the
    /// elements' dof).
    pub fn row_dof(&self, row: usize, coherent: Option<&[(f64, f64)]>) -> Vec<(f64, f64)> {
        let var = &self.var;
        (0..self.opt.len() / row)
            .map(|r| {
                let idx = (r * row..(r + 1) * row).filter(|&i| self.fin(i));
                let p: f64 = idx.clone().map(|i| var[i]).sum();
                let d_el = dof(idx.map(|i| var[i]));
                let d = match coherent.and_then(|c| c.get(r)) {
                    Some(&(c, n_src)) if c > 0.0 && p > 0.0 => {
                        let c = c.min(p);
                        p * p / (c * c / n_src.max(1.0) + (p - c) * (p - c) / d_el)
                    }
                    _ => d_el,
                };
                (p, d)
            })
            .collect()
    }

    /// The row whose error energy is largest against its bound (a union bound over the rows).
    pub fn worst_row(&self, row: usize, row_dof: &[(f64, f64)], x: f64) -> WorstRow {
        let rows = self.opt.len() / row;
        let row_x = x + (rows.max(1) as f64).ln();
        let mut w = WorstRow {
            ratio: 0.0,
            energy: 0.0,
            bound: 0.0,
            at: None,
        };
        for (r, &(_, row_d)) in row_dof.iter().enumerate() {
            let idx = (r * row..(r + 1) * row).filter(|&i| self.fin(i));
            let (e, p) = idx.fold((0.0, 0.0), |(e, p), i| {
                (e + self.err[i] * self.err[i], p + self.var[i])
            });
            let b = K * chi2_bound(row_d, row_x);
            let q = ratio_of(e, p, b);
            if q > w.ratio {
                w = WorstRow {
                    ratio: q,
                    energy: if p > 0.0 { e / p } else { f64::INFINITY },
                    bound: b,
                    at: Some(r * row),
                };
            }
        }
        w
    }

    /// The element farthest from fp64 in its own predicted σ (with `floor` added to its variance).
    pub fn worst_element(&self, floor: f64) -> (f64, Option<usize>) {
        let (mut max_sig, mut max_i) = (0.0, None);
        for i in (0..self.opt.len()).filter(|&i| self.fin(i)) {
            let s = (self.var[i] + floor).sqrt();
            let z = if s > 0.0 {
                self.err[i].abs() / s
            } else if self.err[i] != 0.0 {
                f64::INFINITY
            } else {
                0.0
            };
            if z > max_sig {
                max_sig = z;
                max_i = Some(i);
            }
        }
        (max_sig, max_i)
    }
}
