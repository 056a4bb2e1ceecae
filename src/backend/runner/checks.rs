//! The runner checks beyond the stage checks (issue #32, items 6–10; JSON `runner_checks`): the
//! serving-shaped batch against fp64 from its inputs, the real rows of a batch with and without padded
//! entries (bit for bit), a request alone against inside the batch, the inputs after every reply, and the
//! split partials of a kernel that chooses its own partition, by merge consistency.

use serde::{Deserialize, Serialize};

/// What a runner check concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    /// Measured and reported, no verdict (batch invariance of a runner that does not declare it).
    Report,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "fail",
            Status::Report => "report",
        }
    }
}

/// One runner check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunnerCheck {
    /// The layer; absent for a check over the whole run (inputs unchanged in every request).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub layer: Option<usize>,
    /// `serving_batch`, `variant_batch` (our own batches aimed at production variants), `padding`,
    /// `batch_invariance`, `input_mutation`, `merge_consistency`.
    pub check: String,
    pub status: Status,
    /// What was compared: an output (`attn_latent`), a request, an input tensor.
    pub what: String,
    /// The measured figure (rel-L2, or the largest difference relative to the output's rms), where
    /// there is one and it is finite.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub value: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub bound: Option<f64>,
    pub detail: String,
}

impl RunnerCheck {
    /// `layer L check what: status (detail)`, as every format prints it.
    pub fn line(&self) -> String {
        let at = self
            .layer
            .map(|l| format!("layer {l} "))
            .unwrap_or_default();
        format!(
            "{at}{} {}: {} ({})",
            self.check,
            self.what,
            self.status.name(),
            self.detail
        )
    }
}

/// The runner checks of a run (`Report::runner_checks`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunnerChecks {
    /// No check failed.
    pub pass: bool,
    pub checks: Vec<RunnerCheck>,
    pub message: String,
}

impl RunnerChecks {
    pub fn new(checks: Vec<RunnerCheck>) -> RunnerChecks {
        RunnerChecks::labelled("runner", checks)
    }

    /// The label the message was made with (`runner`, `batch`).
    fn label(&self) -> String {
        let w = self.message.split_whitespace().next().unwrap_or("runner");
        w.to_lowercase()
    }

    /// Only the checks of `layers` (and those of no layer): a shard's backend also runs the layers
    /// before its slice, for free mode's residual, and their checks are another shard's.
    pub fn of_layers(self, layers: &[usize]) -> RunnerChecks {
        let label = self.label();
        let checks = self
            .checks
            .into_iter()
            .filter(|c| c.layer.is_none_or(|l| layers.contains(&l)))
            .collect();
        RunnerChecks::labelled(&label, checks)
    }

    /// These checks followed by `more`'s (the shards of one run, in layer order).
    pub fn joined(self, more: impl IntoIterator<Item = RunnerChecks>) -> RunnerChecks {
        let label = self.label();
        let mut checks = self.checks;
        for m in more {
            checks.extend(m.checks);
        }
        RunnerChecks::labelled(&label, checks)
    }

    /// The checks of a run whose message names whose they are (`runner`; `batch` for our own path's
    /// serving batch).
    pub fn labelled(label: &str, checks: Vec<RunnerCheck>) -> RunnerChecks {
        let failed: Vec<&RunnerCheck> =
            checks.iter().filter(|c| c.status == Status::Fail).collect();
        let message = match failed.first() {
            None => format!(
                "{label} checks: {} passed, {} reported",
                checks.iter().filter(|c| c.status == Status::Pass).count(),
                checks.iter().filter(|c| c.status == Status::Report).count()
            ),
            Some(f) => format!(
                "{} CHECK FAILED: {} of {} (first: {})",
                label.to_uppercase(),
                failed.len(),
                checks.len(),
                f.line()
            ),
        };
        RunnerChecks {
            pass: failed.is_empty(),
            checks,
            message,
        }
    }
}

/// Two outputs' values the same bit for bit (any two NaNs equal).
pub fn same_bits(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// How far `o` is from `r`: rel-L2 over the finite pairs, the largest elementwise excess over the
/// bound `atol·rms(r) + rtol·|r|` (≤ 1 passes), and the count of pairs that cannot pass (a NaN, or an
/// infinity on one side only). Pairs where `skip(i)` are don't-care.
pub struct Judged {
    pub rel_l2: f64,
    pub worst: f64,
    pub bad: usize,
}

pub fn judge(
    r: &[f64],
    o: &[f64],
    tol: &crate::tolerance::Tolerance,
    skip: impl Fn(usize) -> bool,
) -> Judged {
    judge_with(r, o, tol, skip, None)
}

/// [`judge`] with `extra[i]` allowed on element `i` besides the bound: an error the kernel declares
/// (P's e4m3 rounding, `reads::p_e4m3_bounds`), bounded per element.
pub fn judge_with(
    r: &[f64],
    o: &[f64],
    tol: &crate::tolerance::Tolerance,
    skip: impl Fn(usize) -> bool,
    extra: Option<&[f64]>,
) -> Judged {
    let (mut num, mut den, mut n, mut bad) = (0.0f64, 0.0f64, 0usize, 0usize);
    for (i, (&a, &b)) in r.iter().zip(o).enumerate() {
        if skip(i) {
            continue;
        }
        if a.is_infinite() && a == b {
            continue;
        }
        if !a.is_finite() || !b.is_finite() {
            bad += 1;
            continue;
        }
        num += (a - b) * (a - b);
        den += a * a;
        n += 1;
    }
    let rms = (den / n.max(1) as f64).sqrt();
    let mut worst = 0.0f64;
    for (i, (&a, &b)) in r.iter().zip(o).enumerate() {
        if skip(i) || !a.is_finite() || !b.is_finite() {
            continue;
        }
        let mut bound = tol.atol_rms * rms + tol.rtol * a.abs();
        if let Some(x) = extra {
            bound += x[i];
        }
        if bound > 0.0 {
            worst = worst.max((a - b).abs() / bound);
        } else if a != b {
            worst = f64::INFINITY;
        }
    }
    Judged {
        rel_l2: if den > 0.0 {
            (num / den).sqrt()
        } else if num > 0.0 {
            f64::INFINITY
        } else {
            0.0
        },
        worst,
        bad,
    }
}

/// `1.2e-3`: the report's figures.
pub(crate) fn e(v: f64) -> String {
    format!("{v:.1e}")
}

/// One check's record; `figures`: its value (finite only) and bound.
pub(crate) fn record(
    layer: usize,
    check: &str,
    status: Status,
    what: &str,
    figures: (Option<f64>, Option<f64>),
    detail: String,
) -> RunnerCheck {
    RunnerCheck {
        layer: Some(layer),
        check: check.into(),
        status,
        what: what.into(),
        value: figures.0.filter(|v| v.is_finite()),
        bound: figures.1,
        detail,
    }
}

/// Judge `o` against fp64 `r` (`ro`) at the `@runner` bound (`local::tolerance`) of a run in
/// `run_dtype` whose output came back in `dtype`, over `terms` products: the one error model of every
/// batch check, a runner's or our own path's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn against_fp64(
    run_dtype: &str,
    layer: usize,
    check: &str,
    what: &str,
    ro: (&[f64], &[f64]),
    dtype: &str,
    terms: usize,
    skip: impl Fn(usize) -> bool,
    scope: &str,
) -> RunnerCheck {
    against_fp64_with(
        run_dtype,
        (layer, check, what),
        ro,
        dtype,
        terms,
        skip,
        scope,
        None,
    )
}

/// [`against_fp64`] with `extra[i]` allowed on element `i` besides the `@runner` bound (`judge_with`),
/// and the rel-L2 bound raised by ‖extra‖ / ‖r‖ (the triangle inequality).
#[allow(clippy::too_many_arguments)]
pub(crate) fn against_fp64_with(
    run_dtype: &str,
    (layer, check, what): (usize, &str, &str),
    ro: (&[f64], &[f64]),
    dtype: &str,
    terms: usize,
    skip: impl Fn(usize) -> bool,
    scope: &str,
    extra: Option<&[f64]>,
) -> RunnerCheck {
    let mut tol = super::local::tolerance(run_dtype, dtype, terms);
    let j = judge_with(ro.0, ro.1, &tol, &skip, extra);
    let mut also = String::new();
    if let Some(x) = extra {
        let norm = |v: &[f64]| -> f64 {
            let f = v
                .iter()
                .enumerate()
                .filter(|&(i, a)| !skip(i) && a.is_finite());
            f.map(|(_, a)| a * a).sum::<f64>().sqrt()
        };
        let (nx, nr) = (norm(x), norm(ro.0));
        if nr > 0.0 {
            tol.rel_l2 += nx / nr;
        }
        also = " with P's e4m3 rounding".into();
    }
    let pass = j.bad == 0 && j.rel_l2 <= tol.rel_l2 && j.worst <= 1.0;
    let detail = format!(
        "{scope}: rel-L2 {} (bound {}{also}), largest element {:.2} of its bound{}, returned in {dtype}",
        e(j.rel_l2),
        e(tol.rel_l2),
        j.worst,
        match j.bad {
            0 => String::new(),
            n => format!(", {n} NaN or one-sided infinite"),
        }
    );
    let status = if pass { Status::Pass } else { Status::Fail };
    record(
        layer,
        check,
        status,
        what,
        // NaN or one-sided infinite elements: no figure (the rel-L2 of the finite rest would
        // understate the failure).
        ((j.bad == 0).then_some(j.rel_l2), Some(tol.rel_l2)),
        detail,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judge_never_passes_nan_and_skips_dont_care() {
        let tol = crate::tolerance::Tolerance {
            rel_l2: 1e-3,
            atol_rms: 1e-2,
            rtol: 1e-3,
        };
        let r = [1.0, 2.0, f64::NEG_INFINITY, 3.0];
        let j = judge(&r, &[1.0, 2.0, f64::NEG_INFINITY, f64::NAN], &tol, |_| {
            false
        });
        assert_eq!(j.bad, 1);
        let j = judge(&r, &[1.0, 2.0, f64::NEG_INFINITY, f64::NAN], &tol, |i| {
            i == 3
        });
        assert_eq!((j.bad, j.rel_l2), (0, 0.0));
        let j = judge(&r, &[1.0, 2.5, f64::NEG_INFINITY, 3.0], &tol, |_| false);
        assert!(j.rel_l2 > 0.1 && j.worst > 1.0);
        let c = RunnerChecks::new(vec![RunnerCheck {
            layer: Some(0),
            check: "padding".into(),
            status: Status::Fail,
            what: "attn_latent".into(),
            value: None,
            bound: None,
            detail: "x".into(),
        }]);
        assert!(!c.pass && c.message.contains("layer 0 padding attn_latent: fail"));
    }

    #[test]
    fn a_check_failed_by_nan_has_no_figure() {
        let r = [1.0, 2.0, 3.0, 4.0];
        let go = |o: &[f64]| {
            against_fp64(
                "bf16",
                0,
                "serving_batch",
                "attn_latent",
                (&r, o),
                "bf16",
                8,
                |_| false,
                "b",
            )
        };
        let c = go(&[1.0, 2.0, f64::NAN, 4.0]);
        assert_eq!((c.status, c.value), (Status::Fail, None));
        assert!(c.detail.contains("1 NaN"), "{}", c.detail);
        let c = go(&r);
        assert_eq!((c.status, c.value), (Status::Pass, Some(0.0)));
    }
}
