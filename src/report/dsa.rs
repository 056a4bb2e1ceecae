//! The report's `dsa` section: a DSA file past top_k, the selection checks (computed by `crate::run::dsa`).

use crate::compare::selection::SelectionResult;

/// `Report::dsa`: the selection checks of a run on a DSA file past top_k (docs/dsa.md). The stage checks
/// of the modes ran over the reference's selection; this section is what the selections add.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DsaResult {
    pub top_k: usize,
    /// How the optimized side's indexer computed (its precision).
    pub indexer: String,
    pub pass: bool,
    pub first_layer: Option<usize>,
    pub message: String,
    pub layers: Vec<DsaLayerResult>,
}

/// One layer's selection check.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DsaLayerResult {
    pub layer: usize,
    /// Queries whose reference selection drops a visible key.
    pub sparse_queries: usize,
    /// A layer without indexer tensors (GLM-5.2 "shared"): the full layer whose selections it reuses.
    pub shared_from: Option<usize>,
    /// The optimized indexer's sets against the reference's, tie-aware (`None` on a shared layer).
    pub selection: Option<SelectionResult>,
    /// rel-L2 of `attn_out`: the optimized path over its own selection vs fp64 over that selection.
    /// `None`: not finite (JSON has no NaN; the stage checks fail then).
    pub own_path_error: Option<f64>,
    /// The first failing stage check of the optimized path over its own selection (`None`: all pass).
    pub own_path_first_failing: Option<String>,
    /// rel-L2 of `attn_out`: fp64 over the optimized selection vs fp64 over the reference's
    /// (informational: a near-tie flip may move the output a lot).
    pub selection_effect: Option<f64>,
    pub pass: bool,
}

impl DsaLayerResult {
    /// Why the layer fails (empty when it passes).
    pub fn failure(&self) -> String {
        let mut why = Vec::new();
        if let Some(s) = self.selection.as_ref().filter(|s| !s.pass) {
            why.push(s.summary());
        }
        if let Some(c) = &self.own_path_first_failing {
            why.push(format!(
                "over its own selection the optimized path diverges from fp64 at {c} (attn_out rel-L2 {})",
                num(self.own_path_error)
            ));
        }
        why.join("; ")
    }
    /// One line for the table and Markdown.
    pub fn line(&self) -> String {
        let sel = match (&self.selection, self.shared_from) {
            (Some(s), _) => s.summary(),
            (None, Some(l)) => format!("selection shared from layer {l}"),
            (None, None) => "selection shared".into(),
        };
        format!(
            "layer {} {}: {sel}; own-selection attn_out {}{}; selection effect {}",
            self.layer,
            if self.pass { "PASS" } else { "FAIL" },
            num(self.own_path_error),
            match &self.own_path_first_failing {
                Some(c) => format!(" (FAIL at {c})"),
                None => String::new(),
            },
            num(self.selection_effect)
        )
    }
}

fn num(x: Option<f64>) -> String {
    x.map_or("non-finite".into(), |v| format!("{v:.2e}"))
}
