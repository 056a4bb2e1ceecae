//! The report's `tp` section: a tensor-parallel run's ranks, each against its own fp64 slice
//! (computed by `crate::tp`).

use crate::compare::{self, LayerResult, Verdict};
use serde::{Deserialize, Serialize};

/// The report's `tp` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TpResult {
    /// N: ranks sharing the heads.
    pub size: usize,
    /// The ranks whose optimized path ran (all of them).
    pub ranks_run: Vec<usize>,
    /// The rank the `--inject` faults were planted in, when only one (`--inject-rank`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub fault_rank: Option<usize>,
    /// Every rank that ran is within tolerance of its own fp64 reference.
    pub pass: bool,
    pub message: String,
    pub ranks: Vec<RankResult>,
}

/// One rank's own comparison: its trace against the fp64 reference of its slice (the deciding mode's
/// input: shadow's when it ran).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankResult {
    pub rank: usize,
    /// Its heads, `[start, end)` in the model's numbering.
    pub heads: [usize; 2],
    pub verdict: Verdict,
    pub layers: Vec<LayerResult>,
}

impl TpResult {
    /// The section from the ranks' layer results; its message names the first failing rank.
    /// `ranks`: each rank that ran, its heads and its layer results.
    pub fn new(
        size: usize,
        fault_rank: Option<usize>,
        ranks: Vec<(usize, [usize; 2], Vec<LayerResult>)>,
    ) -> TpResult {
        let ranks: Vec<RankResult> = ranks
            .into_iter()
            .map(|(rank, heads, layers)| RankResult {
                rank,
                heads,
                verdict: compare::verdict(&layers),
                layers,
            })
            .collect();
        let failing: Vec<&RankResult> = ranks.iter().filter(|r| !r.verdict.pass).collect();
        let message = match failing.first() {
            None => format!(
                "tensor parallel {}: rank(s) {} within tolerance of their own fp64 slices",
                size,
                super::layer_list(&ranks.iter().map(|r| r.rank).collect::<Vec<_>>())
            ),
            Some(r) => format!(
                "tensor parallel {}: rank {} (heads {}..{}) {}",
                size, r.rank, r.heads[0], r.heads[1], r.verdict.message
            ),
        };
        TpResult {
            size,
            ranks_run: ranks.iter().map(|r| r.rank).collect(),
            fault_rank,
            pass: failing.is_empty(),
            message,
            ranks,
        }
    }
}

impl RankResult {
    /// "rank 1 of 2 (heads 8..16): VERDICT": the line every format shows for a rank.
    pub fn line(&self, size: usize) -> String {
        format!(
            "tp rank {} of {size} (heads {}..{}): {}",
            self.rank, self.heads[0], self.heads[1], self.verdict.message
        )
    }
}
