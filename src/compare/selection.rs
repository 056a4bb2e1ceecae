//! Comparing DSA selections: the optimized path's top-k index sets against the reference's, tie-aware.
//!
//! Per query `t` with reference scores `s` (fp64, over the visible keys `0..=t`) and the reference's
//! selection of `k` keys: let `s_k` be the k-th largest score and `s_k1` the (k+1)-th (−inf when every
//! key is selected). A key the optimized path selects but the reference does not is *within the noise
//! margin* when `s_k − s_j ≤ margin_t`; a key the reference selects but the optimized path drops, when
//! `s_j − s_k1 ≤ margin_t`. `margin_t = MARGIN_ROUNDINGS · u · scale_t`, with `u` the storage dtype's unit
//! roundoff and `scale_t` the magnitude the query's score errors scale with
//! (`reference::indexer::error_scale`): a near-tie may flip at the engine's precision (axolotl PR
//! #3832), a key beyond it may not. A different count of keys is a failure by itself (a
//! top-k boundary bug can hide inside the margin otherwise). NaN scores never pass.

use crate::reference::sparse::Selection;
use ndarray::Array2;
use serde::{Deserialize, Serialize};

/// Roundings of the score's storage a flip may be blamed on: q and k stored (2), their rope (2), the
/// per-head logit and weights (2), the sum over heads (2). The mirror's measured error on the glm-5-dsa
/// golden's file stays below half of it (`tests/it/dsa.rs`: bf16 0.50 u, fp16 0.54 u, f32 2.06 u).
pub const MARGIN_ROUNDINGS: f64 = 8.0;

/// One selected key outside the margin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Miss {
    pub query: usize,
    /// The key token.
    pub key: usize,
    /// `true`: selected by the optimized path only; `false`: dropped by it.
    pub extra: bool,
    /// Distance to the reference's threshold (`s_k − s_j` or `s_j − s_k1`), absolute.
    pub gap: f64,
    pub margin: f64,
}

/// The verdict on one layer's selections.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectionResult {
    pub queries: usize,
    /// Queries whose reference selection drops a visible key (where DSA differs from dense).
    pub sparse_queries: usize,
    /// `|opt ∩ ref| / |ref|`, worst query and mean.
    pub recall_min: f64,
    pub recall_mean: f64,
    /// Keys in the symmetric differences, in all queries.
    pub differing: usize,
    /// Of those, within the noise margin.
    pub within_margin: usize,
    /// Queries whose key count differs from the reference's.
    pub count_mismatch: usize,
    /// The largest gap outside the margin (by `gap / margin`).
    pub worst: Option<Miss>,
    pub pass: bool,
}

/// Compare `opt` with `reference` under the reference's fp64 `scores` (`[T, T]`, visible `j ≤ t`) and
/// per-query error scales.
pub fn compare(
    scores: &Array2<f64>,
    scale: &[f64],
    reference: &Selection,
    opt: &Selection,
    unit_roundoff: f64,
) -> SelectionResult {
    let t = reference.n_queries();
    let mut r = SelectionResult {
        queries: t,
        sparse_queries: reference.sparse_queries(),
        recall_min: 1.0,
        recall_mean: 0.0,
        differing: 0,
        within_margin: 0,
        count_mismatch: 0,
        worst: None,
        pass: true,
    };
    if opt.n_queries() != t || scale.len() != t {
        r.pass = false;
        r.count_mismatch = t.abs_diff(opt.n_queries());
        r.recall_min = 0.0;
        return r;
    }
    let mut worst_ratio = 0.0;
    for (q, &scale_q) in scale.iter().enumerate().take(t) {
        let (rk, ok) = (&reference.keys[q], &opt.keys[q]);
        let row: Vec<f64> = scores.row(q).iter().take(q + 1).copied().collect();
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let k = rk.len();
        let s_k = sorted
            .get(k.wrapping_sub(1))
            .copied()
            .unwrap_or(f64::INFINITY);
        let s_k1 = sorted.get(k).copied().unwrap_or(f64::NEG_INFINITY);
        let margin = MARGIN_ROUNDINGS * unit_roundoff * scale_q;
        let common = ok.iter().filter(|j| rk.binary_search(j).is_ok()).count();
        let recall = if k == 0 {
            1.0
        } else {
            common as f64 / k as f64
        };
        r.recall_min = r.recall_min.min(recall);
        r.recall_mean += recall / t as f64;
        if ok.len() != k {
            r.count_mismatch += 1;
            r.pass = false;
        }
        let extra = ok
            .iter()
            .filter(|j| rk.binary_search(j).is_err())
            .map(|&j| (j, true));
        let dropped = rk
            .iter()
            .filter(|j| ok.binary_search(j).is_err())
            .map(|&j| (j, false));
        for (j, is_extra) in extra.chain(dropped) {
            r.differing += 1;
            let s = row[j as usize];
            let gap = if is_extra { s_k - s } else { s - s_k1 };
            // NaN anywhere (score, margin) is outside: `gap <= margin` is false.
            if gap <= margin {
                r.within_margin += 1;
                continue;
            }
            r.pass = false;
            let ratio = if margin > 0.0 {
                gap / margin
            } else {
                f64::INFINITY
            };
            if r.worst.is_none() || ratio > worst_ratio || ratio.is_nan() {
                worst_ratio = ratio;
                r.worst = Some(Miss {
                    query: q,
                    key: j as usize,
                    extra: is_extra,
                    gap,
                    margin,
                });
            }
        }
    }
    r
}

impl SelectionResult {
    /// One line for reports and test output.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "selection {}: recall min {:.4} mean {:.4}, {} differing keys ({} within the noise margin), {} count mismatches, {}/{} sparse queries",
            if self.pass { "PASS" } else { "FAIL" },
            self.recall_min,
            self.recall_mean,
            self.differing,
            self.within_margin,
            self.count_mismatch,
            self.sparse_queries,
            self.queries
        );
        if let Some(m) = &self.worst {
            s += &format!(
                "; worst: query {} key {} {} the reference's selection, score gap {:.3e} > margin {:.3e}",
                m.query,
                m.key,
                if m.extra { "selected outside" } else { "dropped from" },
                m.gap,
                m.margin
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores() -> Array2<f64> {
        // Query 3 sees keys 0..=3 with scores 4, 3, 2.9999, 1.
        let mut s = Array2::zeros((4, 4));
        s.row_mut(3)
            .assign(&ndarray::arr1(&[4.0, 3.0, 2.9999, 1.0]));
        s
    }

    fn sel(last: Vec<u32>) -> Selection {
        Selection::new(2, vec![vec![0], vec![0, 1], vec![0, 1], last])
    }

    #[test]
    fn a_near_tie_passes_and_a_far_key_fails_with_its_gap() {
        let (s, r) = (scores(), sel(vec![0, 1]));
        assert!(compare(&s, &[4.0; 4], &r, &r, 2f64.powi(-8)).pass);
        let tie = compare(&s, &[4.0; 4], &r, &sel(vec![0, 2]), 2f64.powi(-8));
        assert!(tie.pass && tie.within_margin == 2, "{}", tie.summary());
        let far = compare(&s, &[4.0; 4], &r, &sel(vec![0, 3]), 2f64.powi(-8));
        assert!(!far.pass);
        let m = far.worst.unwrap();
        assert_eq!((m.query, m.key, m.extra), (3, 3, true));
        assert!((m.gap - 2.0).abs() < 1e-12);
    }

    #[test]
    fn one_key_short_fails_even_inside_the_margin() {
        let r = compare(&scores(), &[4.0; 4], &sel(vec![0, 1]), &sel(vec![0]), 1.0);
        assert!(!r.pass && r.count_mismatch == 1, "{}", r.summary());
    }

    #[test]
    fn nan_scores_never_pass() {
        let mut s = scores();
        s[[3, 2]] = f64::NAN;
        assert!(
            !compare(
                &s,
                &[4.0; 4],
                &sel(vec![0, 1]),
                &sel(vec![0, 2]),
                2f64.powi(-8)
            )
            .pass
        );
    }
}
