//! The run's outputs: the table on the terminal and the report files.

use super::ReportArgs;
use mla_diff::error::Error;
use mla_diff::report::output::Target;
use mla_diff::report::{self, Report};

/// Where the reports go, checked before the (possibly long) run.
pub struct Outputs {
    json: Option<Target>,
    junit: Option<Target>,
    markdown: Option<Target>,
    plot: Option<Target>,
    write_baseline: Option<Target>,
}

impl Outputs {
    pub fn check(a: &ReportArgs) -> Result<Outputs, Error> {
        let targets = report::output::file_targets(&[
            ("--json", a.formats.json.as_deref()),
            ("--junit", a.formats.junit.as_deref()),
            ("--markdown", a.formats.markdown.as_deref()),
            ("--plot", a.plot.as_deref()),
            ("--write-baseline", a.write_baseline.as_deref()),
        ])?;
        let [json, junit, markdown, plot, write_baseline]: [Option<Target>; 5] =
            targets.try_into().expect("five outputs");
        if let Some(d) = &a.dump_dir {
            report::output::dir_target("--dump-dir", d)?;
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

    /// The table (or, with -q, the verdict line) on stdout unless a report took it, then the reports.
    pub fn write(&self, rep: &Report, a: &ReportArgs) -> Result<(), Error> {
        let stdout_taken = self.stdout_taken();
        let to_terminal = {
            use std::io::IsTerminal;
            if stdout_taken {
                std::io::stderr().is_terminal()
            } else {
                std::io::stdout().is_terminal()
            }
        };
        let style = report::table::Style::new(a.formats.color, to_terminal);
        let text = if a.formats.quiet {
            report::table::verdict_line(rep, &style)
        } else {
            report::table::render(rep, &style)
        };
        if stdout_taken {
            eprint!("{text}");
        } else {
            print!("{text}");
        }
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
            t.write(&report::junit::render(rep))?;
        }
        if let Some(t) = &self.markdown {
            t.write(&report::markdown::render(rep))?;
        }
        if let Some(t) = &self.plot {
            t.write(&report::svg::render(rep)?)?;
        }
        Ok(())
    }
}
