//! The verdict over all layers: the first failing layer and, inside it, the first failing check in
//! dataflow order, with the runner's culprit where its `@runner` twin tells.

use super::{LayerResult, AT_RUNNER};
use serde::{Deserialize, Serialize};

/// The verdict of one mode over all layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub pass: bool,
    pub first_layer: Option<usize>,
    pub first_check: Option<String>,
    /// Where the reason is known: the first failing check's reasons.
    pub reasons: Vec<String>,
    pub message: String,
}

/// Who is at fault when the first failing check is a runner's stage: its `@runner` twin (fp64 from the
/// runner's own inputs, judged by the same error model) fails with it — the runner's kernel — or
/// passes — upstream of the runner, in the path that fed it. Empty for every other check (and so for
/// every run without a runner).
fn culprit(l: &LayerResult, first: &str) -> String {
    if first.ends_with(AT_RUNNER) {
        return " — culprit: the runner's kernel (against fp64 from its own inputs)".into();
    }
    let twin = format!("{first}{AT_RUNNER}");
    match l.checks.iter().find(|c| c.check == twin) {
        Some(t) if !t.pass => format!(
            " — culprit: the runner's kernel ({twin} fails too, against fp64 from its own inputs)"
        ),
        Some(_) => format!(
            " — culprit: upstream of the runner ({twin} passes: it computed within the noise from what it was given)"
        ),
        None => String::new(),
    }
}

pub fn verdict(layers: &[LayerResult]) -> Verdict {
    match layers.iter().find(|l| !l.pass) {
        None => Verdict {
            pass: true,
            first_layer: None,
            first_check: None,
            reasons: vec![],
            message: format!("PASS: {} layer(s) within tolerance", layers.len()),
        },
        Some(l) => {
            let c = l
                .checks
                .iter()
                .find(|c| !c.pass)
                .expect("failing layer has a failing check");
            Verdict {
                pass: false,
                first_layer: Some(l.layer),
                first_check: Some(c.check.clone()),
                reasons: c.reasons.clone(),
                message: format!(
                    "DIVERGENCE: first at layer {}, stage {}: {}{}",
                    l.layer,
                    c.check,
                    c.reasons.join("; "),
                    culprit(l, &c.check)
                ),
            }
        }
    }
}
