//! Markdown for pull-request comments: the verdict, then a layer × check table of metric/tolerance.

use super::{Gate, Report};
use std::fmt::Write;

fn cell(ratio: f64) -> String {
    if ratio.is_infinite() {
        "❌ non-finite".into()
    } else if ratio >= 1.0 {
        format!("❌ {ratio:.2}")
    } else {
        format!("{ratio:.2}")
    }
}

/// A verdict document's heading (`what`: "mla-diff", "mla-diff sweep lengths") and its verdict in bold
/// (a run's and a sweep's Markdown).
pub fn heading(
    s: &mut String,
    what: &str,
    pass: bool,
    file: &super::FileInfo,
    backend_dtype: [&str; 2],
    message: &str,
) {
    let icon = if pass { "✅" } else { "❌" };
    let [backend, dtype] = backend_dtype;
    writeln!(
        s,
        "### {icon} {what}: `{}` ({}, {backend}, {dtype})\n",
        file.base_name(),
        file.architecture,
    )
    .ok();
    writeln!(s, "**{message}**\n").ok();
}

/// The notices, a quoted paragraph each.
pub fn notices(s: &mut String, notices: &[String]) {
    for n in notices {
        writeln!(s, "> ⚠️ **Notice:** {n}\n").ok();
    }
}

pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let run = [r.run.backend.as_str(), r.run.dtype.as_str()];
    heading(
        &mut s,
        "mla-diff",
        r.pass(),
        &r.file,
        run,
        &r.verdict.message,
    );
    for g in r.gates() {
        gate(&mut s, g);
    }
    notices(&mut s, &r.run.notices);
    for w in r.coverage.iter().flat_map(|c| &c.warnings) {
        writeln!(
            s,
            "> ⚠️ **Coverage:** {}\n",
            w.trim_start_matches("coverage: ")
        )
        .ok();
    }
    let sc = &r.run.schedule;
    writeln!(
        s,
        "Schedule: prompt {} (chunk {}), {} decode steps × {} tokens, page {}, {} splits. Cells: worst metric ÷ tolerance (≥ 1 fails).\n",
        sc.prompt_len, sc.chunk, sc.decode_steps, sc.q_len, sc.page_size, sc.num_splits
    )
    .ok();
    if let Some(l) = super::split_line(r) {
        writeln!(s, "Split: {l}.\n").ok();
    }
    for m in &r.modes {
        mode_table(&mut s, r, m);
    }
    if let Some(d) = &r.dsa {
        writeln!(
            s,
            "#### DSA selections\n\nThe modes above attend over the reference's selection; here the optimized indexer ({}) against it, and each side over the optimized selection. {}\n",
            d.indexer, d.message
        )
        .ok();
        for l in &d.layers {
            writeln!(s, "- {} {}", if l.pass { "✅" } else { "❌" }, l.line()).ok();
        }
        writeln!(s).ok();
    }
    if let Some(c) = &r.coverage {
        s.push_str(&coverage(c));
    }
    s
}

/// A gate's paragraph under the verdict: its message, then where it failed.
fn gate(s: &mut String, g: Gate) {
    match g {
        Gate::Baseline(b) => {
            writeln!(s, "Baseline: {}\n", b.message).ok();
            for reg in b.regressions.iter().take(10) {
                writeln!(s, "- {reg}").ok();
            }
            if !b.regressions.is_empty() {
                writeln!(s).ok();
            }
            if !b.across.is_empty() {
                writeln!(s, "Compared across differences: {}\n", b.across.join("; ")).ok();
            }
        }
        Gate::Repeat(rep) => {
            writeln!(s, "Repeat ({} runs): {}\n", rep.runs, rep.message).ok();
            let lines = super::table::repeat_lines(rep);
            for l in lines.iter().take(10) {
                writeln!(s, "- {l}").ok();
            }
            if !lines.is_empty() {
                writeln!(s).ok();
            }
        }
        Gate::RunnerChecks(rc) => {
            writeln!(s, "Runner checks: {}\n", rc.message).ok();
            writeln!(
                s,
                "| layer | check | what | status | detail |\n|---|---|---|---|---|"
            )
            .ok();
            for c in &rc.checks {
                writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    c.layer
                        .map(|l| l.to_string())
                        .unwrap_or_else(|| "all".into()),
                    c.check,
                    c.what,
                    c.status.name(),
                    c.detail.replace('|', "\\|")
                )
                .ok();
            }
            writeln!(s).ok();
        }
        Gate::Tp(t) => {
            writeln!(s, "Tensor parallel {}: {}\n", t.size, t.message).ok();
            for rk in &t.ranks {
                writeln!(s, "- {}", rk.line(t.size)).ok();
            }
            writeln!(s).ok();
        }
        // Its own section after the modes, whose attention its selection decides.
        Gate::Dsa(_) => {}
    }
}

/// One mode's layer × check table (cells: worst metric ÷ tolerance), then the checks not provided.
fn mode_table(s: &mut String, r: &Report, m: &super::ModeResult) {
    if m.layers.is_empty() {
        return;
    }
    let note = if r.decisive_mode() == Some(m.mode.as_str()) {
        ""
    } else {
        " (informational: drift; it does not decide the verdict)"
    };
    writeln!(s, "#### {} mode{note}\n", m.mode).ok();
    let names = m.columns();
    writeln!(
        s,
        "| layer | {} |{}",
        names.join(" | "),
        if m.mode == "free" { " drift |" } else { "" }
    )
    .ok();
    writeln!(
        s,
        "|---|{}{}",
        "---|".repeat(names.len()),
        if m.mode == "free" { "---|" } else { "" }
    )
    .ok();
    for l in &m.layers {
        let cells: Vec<String> = names
            .iter()
            .map(|n| super::ModeResult::cell(l, n).map_or("-".into(), |c| cell(c.ratio())))
            .collect();
        let drift = l.drift.map(|d| format!(" {d:.2e} |")).unwrap_or_default();
        writeln!(s, "| {} | {} |{drift}", l.layer, cells.join(" | ")).ok();
    }
    writeln!(s).ok();
    let missing = m.not_provided();
    if !missing.is_empty() {
        let names: Vec<String> = missing.iter().map(|(c, _)| format!("`{c}`")).collect();
        writeln!(
            s,
            "Not provided by the backend (not compared): {}\n",
            names.join(", ")
        )
        .ok();
    }
}

/// The coverage section: the kernel of each phase, then every class with its count.
fn coverage(c: &crate::coverage::Coverage) -> String {
    let mut s = String::from("#### Coverage\n\n");
    for k in &c.kernels {
        writeln!(s, "- {}: `{}`", k.phase.name(), k.describe()).ok();
    }
    if let Some(d) = &c.dsa {
        writeln!(s, "- {}", d.line()).ok();
    }
    if let Some(v) = &c.variants {
        writeln!(s, "- {}", v.line()).ok();
    }
    writeln!(s, "\n| phase | class | count |\n|---|---|---|").ok();
    for cl in &c.classes {
        let n = match cl.count {
            Some(0) => "❌ 0".to_string(),
            Some(n) => n.to_string(),
            None => "❔ unknown".to_string(),
        };
        writeln!(s, "| {} | {} | {n} |", cl.phase.name(), cl.what).ok();
    }
    writeln!(s).ok();
    s
}
