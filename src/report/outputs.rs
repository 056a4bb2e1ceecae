//! What a command that writes a verdict report is asked to write (`run`, `replay`; `sweep` takes the
//! formats), as plain options, and the writing: the table on the terminal, then the report files,
//! every path checked before the (possibly long) run. One writing path for every verdict document
//! ([`Document`]: a run's `Report`, `sweep`'s report).

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

    /// The table (or, quiet, the verdict line) on stdout unless a report took it, then the reports:
    /// JSON, the baseline, JUnit, Markdown, the plot.
    pub fn write(&self, rep: &Report, a: &ReportOptions) -> Result<()> {
        self.write_with(rep, &a.formats, || {
            if let Some(t) = &self.write_baseline {
                let mut b = rep.clone();
                // A baseline is this run's measurements, not its comparison with an older one (nor its
                // determinism check).
                b.baseline = None;
                b.repeat = None;
                b.verdict = Report::overall_verdict(&b.modes);
                t.write(&b.to_json())?;
            }
            Ok(())
        })?;
        if let Some(t) = &self.plot {
            t.write(&super::svg::render(rep)?)?;
        }
        Ok(())
    }

    /// A document's table (or, quiet, its verdict line) on stdout unless a report took it, then its
    /// JSON, JUnit and Markdown: what `sweep` writes (its `Outputs` is checked with its formats only).
    pub fn write_document(&self, doc: &dyn Document, f: &Formats) -> Result<()> {
        self.write_with(doc, f, || Ok(()))
    }

    /// The one writing path of every verdict document: the terminal, the JSON, `after_json` (the
    /// baseline of a run), the JUnit, the Markdown.
    fn write_with(
        &self,
        doc: &dyn Document,
        f: &Formats,
        after_json: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        print_terminal(f.color, f.quiet, self.stdout_taken(), |style, quiet| {
            doc.terminal(style, quiet)
        });
        if let Some(t) = &self.json {
            t.write(&doc.json())?;
        }
        after_json()?;
        if let Some(t) = &self.junit {
            t.write(&doc.junit())?;
        }
        if let Some(t) = &self.markdown {
            t.write(&doc.markdown())?;
        }
        Ok(())
    }
}

/// A verdict document in every format [`Outputs`] writes: a run's [`Report`], a sweep's report.
pub trait Document {
    /// The terminal table, or (`quiet`) the verdict line alone.
    fn terminal(&self, style: &super::table::Style, quiet: bool) -> String;
    /// The versioned JSON document, pretty, with a final newline.
    fn json(&self) -> String;
    fn junit(&self) -> String;
    fn markdown(&self) -> String;
}

impl Document for Report {
    fn terminal(&self, style: &super::table::Style, quiet: bool) -> String {
        if quiet {
            super::table::verdict_line(self, style)
        } else {
            super::table::render(self, style)
        }
    }
    fn json(&self) -> String {
        self.to_json()
    }
    fn junit(&self) -> String {
        super::junit::render(self)
    }
    fn markdown(&self) -> String {
        super::markdown::render(self)
    }
}

/// A document as pretty JSON with a final newline (the run's and the sweep's reports).
pub fn pretty_json(doc: &impl serde::Serialize) -> String {
    let mut s = serde_json::to_string_pretty(doc).expect("report serialises");
    s.push('\n');
    s
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A document other than a run's report.
    struct Doc;

    impl Document for Doc {
        fn terminal(&self, _style: &super::super::table::Style, quiet: bool) -> String {
            format!("doc quiet={quiet}\n")
        }
        fn json(&self) -> String {
            pretty_json(&serde_json::json!({"doc": 1}))
        }
        fn junit(&self) -> String {
            "<junit/>".into()
        }
        fn markdown(&self) -> String {
            "# doc\n".into()
        }
    }

    /// `sweep`'s reports go through the one writing path of the run's: checked with the formats only
    /// (no plot, baseline or dumps), each format from the document.
    #[test]
    fn any_document_is_written_by_the_run_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        let formats = Formats {
            json: Some(p("r.json")),
            junit: Some(p("r.xml")),
            markdown: Some(p("r.md")),
            color: super::super::table::ColorChoice::Never,
            quiet: true,
        };
        let out = Outputs::check(&ReportOptions {
            formats: formats.clone(),
            ..ReportOptions::default()
        })
        .unwrap();
        out.write_document(&Doc, &formats).unwrap();
        let read = |n: &str| std::fs::read_to_string(p(n)).unwrap();
        assert_eq!(read("r.json"), "{\n  \"doc\": 1\n}\n");
        assert_eq!(read("r.xml"), "<junit/>");
        assert_eq!(read("r.md"), "# doc\n");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    }
}
