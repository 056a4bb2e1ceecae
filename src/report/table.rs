//! The compact terminal table: one row per layer, one column per check, each cell the worst
//! metric ÷ tolerance (≥ 1 fails). Colour only on a terminal and never under NO_COLOR.

use super::Report;
use std::fmt::Write;

/// Short column headers, so that all checks fit in ~120 columns.
fn short(check: &str) -> String {
    let (stage, phase) = match check.split_once('[') {
        Some((s, p)) => (s, if p.starts_with('p') { ".p" } else { ".d" }),
        None => (check, ""),
    };
    let s = match stage {
        "attn_in" => "in",
        "q_nope" => "qnope",
        "q_pe" => "qpe",
        "kv_latent" => "latnt",
        "k_pe" => "kpe",
        "cache_rows" => "cache",
        "q_absorbed" => "qabs",
        "split_out" => "splO",
        "split_lse" => "splL",
        "attn_latent" => "attL",
        "lse" => "lse",
        "attn_heads" => "heads",
        "attn_out" => "out",
        other => other,
    };
    format!("{s}{phase}")
}

pub struct Style {
    pub color: bool,
}

impl Style {
    /// Colour when stdout is a terminal and NO_COLOR is unset (https://no-color.org).
    pub fn detect() -> Style {
        use std::io::IsTerminal;
        Style {
            color: std::io::stdout().is_terminal()
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        }
    }
    fn paint(&self, s: &str, code: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
    fn red(&self, s: &str) -> String {
        self.paint(s, "31;1")
    }
    fn green(&self, s: &str) -> String {
        self.paint(s, "32")
    }
}

fn cell(ratio: f64) -> String {
    if ratio.is_infinite() {
        "NaN!".into()
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
        "schedule: prompt {} in chunks of {}, {} decode steps x {} tokens, page {}, {} splits   cells: worst metric / tolerance (>= 1 fails)",
        sc.prompt_len, sc.chunk, sc.decode_steps, sc.q_len, sc.page_size, sc.num_splits
    )
    .ok();
    for n in &r.run.notices {
        writeln!(s, "{}", style.red(&format!("NOTICE: {n}"))).ok();
    }
    for m in &r.modes {
        let Some(first) = m.layers.first() else {
            continue;
        };
        writeln!(s, "\n[{} mode]", m.mode).ok();
        let mut head = format!("{:>5} {:>4} ", "layer", "");
        for c in &first.checks {
            write!(head, " {:>7}", short(&c.check)).ok();
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
            for c in &l.checks {
                let txt = format!("{:>7}", cell(c.ratio()));
                row.push(' ');
                row.push_str(&if c.pass { txt } else { style.red(&txt) });
            }
            if let Some(d) = l.drift {
                write!(row, " {d:>8.1e}").ok();
            }
            writeln!(s, "{row}").ok();
        }
    }
    writeln!(s).ok();
    let msg = if r.verdict.pass {
        style.green(&r.verdict.message)
    } else {
        style.red(&r.verdict.message)
    };
    writeln!(s, "{msg}").ok();
    if let Some(b) = &r.baseline {
        let msg = if b.pass {
            style.green(&b.message)
        } else {
            style.red(&b.message)
        };
        writeln!(s, "{msg}").ok();
        for reg in b.regressions.iter().take(10) {
            writeln!(s, "  {reg}").ok();
        }
    }
    s
}
