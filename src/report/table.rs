//! The compact terminal table: one row per layer, one column per check, each cell the worst
//! metric ÷ tolerance (≥ 1 fails). Colour only on a terminal and never under NO_COLOR.

use super::{Gate, Report};
use std::fmt::Write;

/// Short column headers, so that all checks fit in ~120 columns (`--tol` accepts them too).
fn short(check: &str) -> String {
    if let Some(base) = check.strip_suffix(crate::compare::AT_RUNNER) {
        return format!("{}@r", short(base));
    }
    let v4 = match check {
        "compressed" => Some("comp"),
        "index_scores" => Some("iscores"),
        "topk_indices" => Some("topk"),
        "attn_derot" => Some("derot"),
        _ => None,
    };
    crate::compare::Check::parse(check)
        .map(|c| crate::compare::checks::short_check_name(&c))
        .or(v4.map(String::from))
        .unwrap_or_else(|| check.to_string())
}

pub struct Style {
    pub color: bool,
}

/// `--color`: `auto` colours when the table's stream is a terminal and NO_COLOR is unset
/// (https://no-color.org).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ColorChoice {
    Auto,
    Always,
    Never,
}

impl Style {
    /// `to_terminal`: whether the stream the table goes to is a terminal.
    pub fn new(choice: ColorChoice, to_terminal: bool) -> Style {
        Style {
            color: match choice {
                ColorChoice::Always => true,
                ColorChoice::Never => false,
                ColorChoice::Auto => {
                    to_terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
                }
            },
        }
    }
    /// Colour when stdout is a terminal and NO_COLOR is unset.
    pub fn detect() -> Style {
        use std::io::IsTerminal;
        Style::new(ColorChoice::Auto, std::io::stdout().is_terminal())
    }
    fn paint(&self, s: &str, code: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
    pub fn red(&self, s: &str) -> String {
        self.paint(s, "31;1")
    }
    pub fn green(&self, s: &str) -> String {
        self.paint(s, "32")
    }
}

/// A cell's number; the caller marks failing cells with `!` so that logs without colour show them.
fn cell(ratio: f64) -> String {
    if ratio.is_infinite() {
        "NaN".into()
    } else if ratio >= 100.0 {
        format!("{:.0e}", ratio)
    } else if ratio >= 10.0 {
        format!("{ratio:.0}")
    } else {
        format!("{ratio:.2}")
    }
}

pub fn render(r: &Report, style: &Style) -> String {
    let mut s = String::new();
    let sc = &r.run.schedule;
    writeln!(
        s,
        "mla-diff {}  {} ({})  backend {}  dtype {}",
        r.tool.version, r.file.path, r.file.architecture, r.environment.backend, r.run.dtype
    )
    .ok();
    writeln!(
        s,
        "schedule: prompt {} in chunks of {}, {} decode steps x {} tokens, page {}, {} splits   cells: worst metric / tolerance (>= 1 fails, marked !)",
        sc.prompt_len, sc.chunk, sc.decode_steps, sc.q_len, sc.page_size, sc.num_splits
    )
    .ok();
    if let Some(l) = super::split_line(r) {
        writeln!(s, "{l}").ok();
    }
    for n in &r.run.notices {
        writeln!(s, "{}", style.red(&format!("NOTICE: {n}"))).ok();
    }
    for m in &r.modes {
        mode_table(&mut s, r, m, style);
    }
    if let Some(d) = &r.dsa {
        writeln!(
            s,
            "\n[DSA selections: the modes above attend over the reference's; here each side's own]"
        )
        .ok();
        for l in &d.layers {
            let line = l.line();
            writeln!(s, "{}", if l.pass { line } else { style.red(&line) }).ok();
        }
    }
    if let Some(c) = &r.coverage {
        writeln!(s).ok();
        s.push_str(&coverage_lines(c, style));
    }
    writeln!(s).ok();
    s.push_str(&verdict_line(r, style));
    for g in r.gates() {
        gate_lines(&mut s, g, style);
    }
    s
}

/// One mode's layer × check table (cells: worst metric ÷ tolerance), then the checks not provided.
fn mode_table(s: &mut String, r: &Report, m: &super::ModeResult, style: &Style) {
    if m.layers.is_empty() {
        return;
    }
    let cols = m.columns();
    let note = if r.decisive_mode() == Some(m.mode.as_str()) {
        ""
    } else {
        ", informational: drift does not decide the verdict"
    };
    writeln!(s, "\n[{} mode{note}]", m.mode).ok();
    let mut head = format!("{:>5} {:>4} ", "layer", "");
    for c in &cols {
        write!(head, "{:>7} ", short(c)).ok();
    }
    if m.mode == "free" {
        write!(head, " {:>8}", "drift").ok();
    }
    writeln!(s, "{head}").ok();
    for l in &m.layers {
        let verdict = if l.pass {
            style.green("PASS")
        } else {
            style.red("FAIL")
        };
        let mut row = format!("{:>5} {} ", l.layer, verdict);
        for col in &cols {
            let Some(c) = super::ModeResult::cell(l, col) else {
                row.push_str(&format!("{:>7} ", "-"));
                continue;
            };
            let mark = if c.pass { ' ' } else { '!' };
            let txt = format!("{:>7}{mark}", cell(c.ratio()));
            row.push_str(&if c.pass { txt } else { style.red(&txt) });
        }
        if let Some(d) = l.drift {
            write!(row, " {d:>8.1e}").ok();
        }
        writeln!(s, "{row}").ok();
    }
    let missing = m.not_provided();
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(|(c, _)| c.as_str()).collect();
        writeln!(
            s,
            "not provided by the backend (not compared): {}",
            names.join(", ")
        )
        .ok();
    }
}

/// A gate's lines below the verdict line (a failing gate's message is already part of it: a passing
/// one's is printed here), then where it failed.
fn gate_lines(s: &mut String, g: Gate, style: &Style) {
    match g {
        Gate::Baseline(b) => {
            if b.pass {
                writeln!(s, "{}", style.green(&b.message)).ok();
            }
            for reg in b.regressions.iter().take(10) {
                writeln!(s, "  {reg}").ok();
            }
            if !b.across.is_empty() {
                writeln!(s, "  compared across: {}", b.across.join("; ")).ok();
            }
        }
        Gate::Repeat(r) => {
            if r.pass {
                writeln!(s, "{}", style.green(&format!("repeat: {}", r.message))).ok();
            }
            for line in repeat_lines(r).iter().take(10) {
                writeln!(s, "  {line}").ok();
            }
        }
        // A runner's batch and input checks: every check that did not pass, and the reported
        // batch-invariance figures.
        Gate::RunnerChecks(rc) => {
            if rc.pass {
                writeln!(s, "{}", style.green(&rc.message)).ok();
            }
            for line in runner_check_lines(rc).iter().take(12) {
                writeln!(s, "  {line}").ok();
            }
        }
        // --tp: each rank against its own fp64 slice.
        Gate::Tp(t) => {
            for rk in t.ranks.iter().map(|rk| rk.line(t.size)) {
                writeln!(s, "  {rk}").ok();
            }
        }
        // Drawn after the modes, whose attention its selection decides.
        Gate::Dsa(_) => {}
    }
}

/// The runner checks worth a line: failures first, then the reported (no-verdict) figures.
pub fn runner_check_lines(rc: &crate::backend::runner::checks::RunnerChecks) -> Vec<String> {
    use crate::backend::runner::checks::Status;
    [Status::Fail, Status::Report]
        .iter()
        .flat_map(|st| {
            rc.checks
                .iter()
                .filter(move |c| c.status == *st)
                .map(|c| c.line())
        })
        .collect()
}

/// One line per stage that changed between identical runs (`--repeat`).
pub fn repeat_lines(r: &super::repeat::RepeatResult) -> Vec<String> {
    r.layers
        .iter()
        .flat_map(|l| l.differing.iter().map(move |d| repeat_line(l.layer, d)))
        .collect()
}

/// A stage that changed between identical runs: where first, and by how much.
pub fn repeat_line(layer: usize, d: &super::repeat::RepeatDiff) -> String {
    format!(
        "layer {layer} {}: run {} differs from run 1 in {}",
        d.stage,
        d.run,
        d.where_first()
    )
}

/// The coverage section: per phase the kernel and its class counts, then the warnings.
fn coverage_lines(c: &crate::coverage::Coverage, style: &Style) -> String {
    let mut s = String::new();
    for (i, k) in c.kernels.iter().enumerate() {
        writeln!(
            s,
            "{:<10}{} {}: {}",
            if i == 0 { "coverage:" } else { "" },
            k.phase.name(),
            k.describe(),
            c.summary(k.phase)
        )
        .ok();
    }
    if let Some(d) = &c.dsa {
        writeln!(s, "{:<10}{}", "", d.line()).ok();
    }
    if let Some(v) = &c.variants {
        writeln!(s, "{:<10}{}", "", v.line()).ok();
    }
    for w in &c.warnings {
        writeln!(s, "{}", style.red(&format!("WARNING: {w}"))).ok();
    }
    s
}

/// The overall verdict, one line (all that `-q` prints).
pub fn verdict_line(r: &Report, style: &Style) -> String {
    verdict_text(r.pass(), &r.verdict.message, style)
}

/// A verdict line, green or red (a run's, a sweep's).
pub fn verdict_text(pass: bool, message: &str, style: &Style) -> String {
    let msg = if pass {
        style.green(message)
    } else {
        style.red(message)
    };
    format!("{msg}\n")
}
