//! The report's `repeat` section (`run --repeat N`, computed by `crate::run::repeat`).

use crate::compare::Position;
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
