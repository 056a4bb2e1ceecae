//! What a command that writes a verdict report is asked to write (`run`, `replay`; `sweep` takes the
//! formats), as plain options, and the writing: the table on the terminal, then the report files,
//! every path checked before the (possibly long) run.

use super::baseline::Identity;
use super::output::Target;
use super::table::ColorChoice;
use super::Report;
use crate::error::{Error, Result};
use std::path::PathBuf;

/// The report formats and the terminal output.
#[derive(Debug, Clone)]
pub struct Formats {
    /// The JSON report; `-` is stdout for every format (one of them at most; the table then goes to
    /// stderr).
    pub json: Option<PathBuf>,
    pub junit: Option<PathBuf>,
    pub markdown: Option<PathBuf>,
    pub color: ColorChoice,
    /// Only the verdict line (and errors): no table, progress or notes.
    pub quiet: bool,
}

impl Default for Formats {
    fn default() -> Formats {
        Formats {
            json: None,
            junit: None,
            markdown: None,
            color: ColorChoice::Auto,
            quiet: false,
        }
    }
}

/// The reports, the `.npy` dumps and the baseline gate of a run.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    pub formats: Formats,
    /// The SVG heat map of error over layer × stage.
    pub plot: Option<PathBuf>,
    /// Dump both sides' stage tensors as .npy into this directory.
    pub dump_dir: Option<PathBuf>,
    /// Which layers to dump: `first` (first diverging), `all`, or a layer list.
    pub dump_layers: String,
    /// Fail when any metric is worse than this earlier report by more than `baseline_factor`.
    pub baseline: Option<PathBuf>,
    pub baseline_factor: f64,
    /// Compare against a baseline of another run (refused otherwise); the report records each
    /// difference.
    pub allow_baseline_mismatch: bool,
    /// Write this run's report as the new baseline.
    pub write_baseline: Option<PathBuf>,
}

impl Default for ReportOptions {
    fn default() -> ReportOptions {
        ReportOptions {
            formats: Formats::default(),
            plot: None,
            dump_dir: None,
            dump_layers: "first".into(),
            baseline: None,
            baseline_factor: super::baseline::DEFAULT_FACTOR,
            allow_baseline_mismatch: false,
            write_baseline: None,
        }
    }
}

impl ReportOptions {
    /// The --baseline report and how it differs from this run; a report of another run is refused
    /// unless `allow_baseline_mismatch`.
    pub fn baseline(&self, planned: &Identity) -> Result<Option<(Report, Vec<String>)>> {
        let Some(p) = &self.baseline else {
            return Ok(None);
        };
        let b = Report::from_json_file(p)?;
        let diffs = planned.differences(&Identity::of(&b));
        if !diffs.is_empty() && !self.allow_baseline_mismatch {
            return Err(Error::Usage(format!(
                "--baseline {} is a report of another run: {} (--allow-baseline-mismatch compares anyway)",
                p.display(),
                diffs.join("; ")
            )));
        }
        Ok(Some((b, diffs)))
    }
}

/// Where the reports go, checked before the (possibly long) run.
pub struct Outputs {
    json: Option<Target>,
    junit: Option<Target>,
    markdown: Option<Target>,
    plot: Option<Target>,
    write_baseline: Option<Target>,
}

impl Outputs {
    pub fn check(a: &ReportOptions) -> Result<Outputs> {
        let targets = super::output::file_targets(&[
            ("--json", a.formats.json.as_deref()),
            ("--junit", a.formats.junit.as_deref()),
            ("--markdown", a.formats.markdown.as_deref()),
            ("--plot", a.plot.as_deref()),
            ("--write-baseline", a.write_baseline.as_deref()),
        ])?;
        let [json, junit, markdown, plot, write_baseline]: [Option<Target>; 5] =
            targets.try_into().expect("five outputs");
        if let Some(d) = &a.dump_dir {
            super::output::dir_target("--dump-dir", d)?;
        }
        Ok(Outputs {
            json,
            junit,
            markdown,
            plot,
            write_baseline,
        })
    }

    fn stdout_taken(&self) -> bool {
        [
            &self.json,
            &self.junit,
            &self.markdown,
            &self.plot,
            &self.write_baseline,
        ]
        .iter()
        .any(|t| **t == Some(Target::Stdout))
    }

    /// The table (or, quiet, the verdict line) on stdout unless a report took it, then the reports.
    pub fn write(&self, rep: &Report, a: &ReportOptions) -> Result<()> {
        print_terminal(
            a.formats.color,
            a.formats.quiet,
            self.stdout_taken(),
            |style, quiet| {
                if quiet {
                    super::table::verdict_line(rep, style)
                } else {
                    super::table::render(rep, style)
                }
            },
        );
        if let Some(t) = &self.json {
            t.write(&rep.to_json())?;
        }
        if let Some(t) = &self.write_baseline {
            let mut b = rep.clone();
            // A baseline is this run's measurements, not its comparison with an older one (nor its
            // determinism check).
            b.baseline = None;
            b.repeat = None;
            b.verdict = Report::overall_verdict(&b.modes);
            t.write(&b.to_json())?;
        }
        if let Some(t) = &self.junit {
            t.write(&super::junit::render(rep))?;
        }
        if let Some(t) = &self.markdown {
            t.write(&super::markdown::render(rep))?;
        }
        if let Some(t) = &self.plot {
            t.write(&super::svg::render(rep)?)?;
        }
        Ok(())
    }
}

/// The table (quiet: the verdict line, `render`'s second argument) on stdout, or on stderr when a
/// report file took stdout, styled for whichever of them it goes to (`run`, `replay` and `sweep`).
pub fn print_terminal(
    color: ColorChoice,
    quiet: bool,
    stdout_taken: bool,
    render: impl Fn(&super::table::Style, bool) -> String,
) {
    use std::io::IsTerminal;
    let to_terminal = if stdout_taken {
        std::io::stderr().is_terminal()
    } else {
        std::io::stdout().is_terminal()
    };
    let text = render(&super::table::Style::new(color, to_terminal), quiet);
    if stdout_taken {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
}
