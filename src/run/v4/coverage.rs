//! What a V4 run exercised, per phase (the prompt's chunks, the decode steps), in the coverage section
//! every renderer shows: the window edge, each compression kind's closed windows, CSA's top-k past its
//! entries, and windows closed in a later forward pass than their first token's (the compressors'
//! carried state, llama.cpp #26509's class). Counts are facts of the schedule and the layer kinds run.

use super::passes;
use crate::coverage::{ClassCount, Coverage};
use crate::kernel_use::{Family, KernelUse, Phase};
use crate::model::v4::{LayerKind, V4Config};
use crate::schedule::Schedule;
use std::ops::Range;

/// The pass holding token `t`.
fn pass_of(ps: &[Range<usize>], t: usize) -> usize {
    ps.iter().position(|r| r.contains(&t)).unwrap_or(usize::MAX)
}

/// Windows of `kind` closed by the tokens of `ts`: and of them those whose pooled tokens (CSA: the
/// previous window's too) were fed in an earlier pass than the closing token's.
fn closed(kind: LayerKind, ps: &[Range<usize>], ts: &[usize]) -> (u64, u64) {
    let m = kind.ratio();
    let (mut n, mut carried) = (0, 0);
    for &t in ts.iter().filter(|&&t| (t + 1) % m == 0) {
        n += 1;
        let w = (t + 1) / m - 1;
        let first = match kind {
            LayerKind::Csa => w.saturating_sub(1) * m,
            _ => w * m,
        };
        if pass_of(ps, first) != pass_of(ps, t) {
            carried += 1;
        }
    }
    (n, carried)
}

/// The coverage of a V4 run of `layers` on schedule `s`, on the kernel `(family, label)`.
pub fn coverage(
    c: &V4Config,
    layers: &[usize],
    s: &Schedule,
    (family, label): (Family, &str),
) -> Coverage {
    let ps = passes(s);
    let has = |k: LayerKind| layers.iter().any(|&l| c.kind(l) == k);
    let mut classes = Vec::new();
    let mut warnings = Vec::new();
    let mut kernels = Vec::new();
    let prompt: Vec<usize> = (0..s.prompt_len).collect();
    let decode: Vec<usize> = (s.prompt_len..s.total_tokens()).collect();
    for (phase, ts) in [(Phase::Prefill, prompt), (Phase::Decode, decode)] {
        if ts.is_empty() {
            warnings.push(format!(
                "coverage: no {} in this schedule: not exercised",
                match phase {
                    Phase::Prefill => "prompt",
                    Phase::Decode => "decode step",
                }
            ));
            continue;
        }
        let k = KernelUse {
            phase,
            family,
            label: label.into(),
            geometry: None,
            production: None,
        };
        let mut add = |id: &str, what: String, n: u64| {
            if n == 0 {
                let d = k.describe();
                warnings.push(format!(
                    "coverage: {} ({d}): not exercised: {what}",
                    phase.name()
                ));
            }
            classes.push(ClassCount {
                phase,
                class: id.into(),
                what,
                count: Some(n),
            });
        };
        let edge = ts.iter().filter(|&&t| t >= c.sliding_window).count() as u64;
        let what = format!(
            "a query whose window has dropped rows (position ≥ sliding_window {})",
            c.sliding_window
        );
        add("window_edge", what, edge);
        if has(LayerKind::Csa) {
            let (n, carried) = closed(LayerKind::Csa, &ps, &ts);
            add(
                "csa_group_edge",
                "a CSA compression window (4 tokens) closed".into(),
                n,
            );
            let what = "a CSA window closed in a later forward pass than its pooled tokens (the carried state)";
            add("csa_carried", what.into(), carried);
            let k = c.indexer.top_k;
            let past = ts.iter().filter(|&&t| (t + 1) / 4 > k).count() as u64;
            let what = format!("a CSA query with more entries than the indexer's top_k {k} (the selection matters)");
            add("csa_topk", what, past);
        }
        if has(LayerKind::Hca) {
            let (n, carried) = closed(LayerKind::Hca, &ps, &ts);
            add(
                "hca_group_edge",
                "an HCA compression window (128 tokens) closed".into(),
                n,
            );
            let what = "an HCA window closed in a later forward pass than its first token (the carried state)";
            add("hca_carried", what.into(), carried);
        }
        kernels.push(k);
    }
    for (k, name) in [
        (LayerKind::Csa, "CSA (ratio 4, the indexer)"),
        (LayerKind::Hca, "HCA (ratio 128)"),
    ] {
        if !has(k) {
            warnings.push(format!(
                "coverage: no {name} layer among the run's layers: not exercised"
            ));
        }
    }
    Coverage {
        kernels,
        classes,
        warnings,
        dsa: None,
        variants: None,
    }
}
