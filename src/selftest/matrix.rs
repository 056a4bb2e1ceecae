//! What the selftest shows: one outcome per run, its line, and the Markdown matrices.

use super::cases::Case;

/// What one run showed.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub case: Case,
    pub detected: bool,
    pub first_layer: Option<usize>,
    pub first_check: Option<String>,
    /// Worst metric ÷ tolerance of the first failing check (∞: non-finite values).
    pub margin: Option<f64>,
    /// The first failing check's reasons.
    pub reason: String,
    pub ok: bool,
    /// Why the case is not ok.
    pub problems: Vec<String>,
}

impl Outcome {
    /// The check the fault must be first detected at; `None` for clean runs and controls.
    pub fn expected(&self) -> Option<&'static str> {
        match self.case.lacking {
            Some(_) => None,
            None => self.case.fault.map(|f| f.info().expected),
        }
    }
    /// How the case names itself in the matrix.
    pub fn label(&self) -> String {
        match (self.case.fault, self.case.lacking) {
            (None, _) => "(clean)".into(),
            (Some(f), None) => format!("{f}@layer={}", self.case.target),
            (Some(f), Some(n)) => format!("{f}@layer={} without {}", self.case.target, n.name()),
        }
    }
    /// One line per case, test-backend-ops style.
    pub fn line(&self) -> String {
        let what = self.label();
        let found = match (&self.first_layer, &self.first_check) {
            (Some(l), Some(ch)) => format!(
                "detected at layer {l} {ch} ({})",
                margin_text(self.margin.unwrap_or(f64::NAN))
            ),
            _ => "no divergence".into(),
        };
        let expect = match self.expected() {
            Some(e) => format!(", expected layer {} {e}", self.case.target),
            None => ", expected no divergence".into(),
        };
        let mut s = format!(
            "  {what}: {}: {found}{expect}  {}",
            self.case.vars(),
            if self.ok { "OK" } else { "FAIL" }
        );
        for p in &self.problems {
            s.push_str(&format!("\n      {p}"));
        }
        s
    }
}

fn margin_text(m: f64) -> String {
    // f64::MAX: the stage-local view's figure for a non-finite value where fp64 is finite.
    if m.is_infinite() || m >= f64::MAX {
        "non-finite".into()
    } else if m >= 100.0 {
        format!("{m:.0e}× tol")
    } else {
        format!("{m:.1}× tol")
    }
}

/// All outcomes: clean runs first, then one per fault.
pub struct Summary {
    pub backend: String,
    pub outcomes: Vec<Outcome>,
    pub seconds: f64,
    /// Faults not run, with why (the DSA indexer faults on a backend without sparse attention).
    pub left_out: Vec<String>,
}

impl Summary {
    pub fn pass(&self) -> bool {
        !self.outcomes.is_empty() && self.outcomes.iter().all(|o| o.ok)
    }
    /// The matrix of clean runs and faults, as a Markdown table.
    pub fn matrix(&self) -> String {
        let head = [
            "fault",
            "fixture",
            "schedule",
            "detected",
            "first layer",
            "first stage",
            "expected",
            "margin",
            "ok",
        ];
        let rows = self.outcomes.iter().filter(|o| o.case.lacking.is_none());
        table(
            &head,
            rows.map(|o| {
                let c = &o.case;
                vec![
                    o.label(),
                    format!("{} {}", c.model.name(), c.dtype.name()),
                    c.params(),
                    yes_no(o.detected),
                    o.first_layer.map_or("-".into(), |l| l.to_string()),
                    o.first_check.clone().unwrap_or("-".into()),
                    match o.expected() {
                        Some(e) => format!("{} {e}", c.target),
                        None => "none".into(),
                    },
                    o.margin.map_or("-".into(), margin_text),
                    ok_text(o.ok),
                ]
            }),
        )
    }

    /// The controls (each fault on a run lacking one need: must stay undetected), as a Markdown table.
    pub fn controls_matrix(&self) -> String {
        let head = ["fault", "lacking", "fixture", "schedule", "detected", "ok"];
        let rows = self.outcomes.iter().filter(|o| o.case.lacking.is_some());
        table(
            &head,
            rows.map(|o| {
                let c = &o.case;
                vec![
                    format!("{}@layer={}", c.fault.map_or("-", |f| f.name()), c.target),
                    c.lacking.map_or("-", |n| n.name()).to_string(),
                    format!("{} {}", c.model.name(), c.dtype.name()),
                    c.params(),
                    match (&o.first_layer, &o.first_check) {
                        (Some(l), Some(ch)) => format!("yes (layer {l} {ch})"),
                        _ => "no".into(),
                    },
                    ok_text(o.ok),
                ]
            }),
        )
    }
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.into()
}

fn ok_text(b: bool) -> String {
    if b { "OK" } else { "FAIL" }.into()
}

/// A Markdown table with aligned columns.
fn table(head: &[&str], rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut rows: Vec<Vec<String>> = rows.collect();
    rows.insert(0, head.iter().map(|h| h.to_string()).collect());
    let widths: Vec<usize> = (0..head.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let line = |r: &[String]| {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, &w)| format!("{c:<w$}"))
            .collect();
        format!("| {} |\n", cells.join(" | "))
    };
    let mut s = line(&rows[0]);
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    s.push_str(&format!("|-{}-|\n", rule.join("-|-")));
    for r in &rows[1..] {
        s.push_str(&line(r));
    }
    s
}

#[cfg(test)]
mod tests {
    /// A non-finite value reads "non-finite", whichever view gave it: the end-to-end ratio (∞) or the
    /// stage-local one (f64::MAX, which printed "2e308× tol").
    #[test]
    fn non_finite_margins_say_so() {
        for m in [f64::INFINITY, f64::MAX] {
            assert_eq!(super::margin_text(m), "non-finite");
        }
        assert_eq!(super::margin_text(2.0), "2.0× tol");
        assert_eq!(super::margin_text(2e3), "2e3× tol");
    }
}
