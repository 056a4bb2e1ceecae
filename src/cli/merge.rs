//! `mla-diff merge`: the JSON reports of a run's shards (`run --shard i/n`) joined into the report the
//! whole run writes, and its JUnit and Markdown; the exit code is the merged verdict.

use mla_diff::error::{Error, EXIT_DIVERGENCE, EXIT_PASS};
use mla_diff::report::{self, Report};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The shards' JSON reports (`run --shard i/n --json FILE`), every shard once, in any order.
    #[arg(required = true, value_name = "REPORT.json")]
    reports: Vec<PathBuf>,
    /// Write the merged JSON report here (`-` for stdout).
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Write the merged JUnit XML here (`-` for stdout).
    #[arg(long)]
    junit: Option<PathBuf>,
    /// Write the merged Markdown summary here (`-` for stdout).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Colour the table: `auto` on a terminal unless NO_COLOR is set.
    #[arg(long, value_enum, default_value_t = report::table::ColorChoice::Auto)]
    color: report::table::ColorChoice,
    /// Print only the verdict line (and errors).
    #[arg(short, long)]
    quiet: bool,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let targets = report::output::file_targets(&[
        ("--output", a.output.as_deref()),
        ("--junit", a.junit.as_deref()),
        ("--markdown", a.markdown.as_deref()),
    ])?;
    let reports = a
        .reports
        .iter()
        .map(|p| Ok((p.clone(), Report::from_json_file(p)?)))
        .collect::<Result<Vec<_>, Error>>()?;
    let merged = mla_diff::merge::merge(reports)?;
    let stdout_taken = targets.contains(&Some(report::output::Target::Stdout));
    let to_terminal = {
        use std::io::IsTerminal;
        if stdout_taken {
            std::io::stderr().is_terminal()
        } else {
            std::io::stdout().is_terminal()
        }
    };
    let style = report::table::Style::new(a.color, to_terminal);
    let text = if a.quiet {
        report::table::verdict_line(&merged, &style)
    } else {
        report::table::render(&merged, &style)
    };
    if stdout_taken {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    let [json, junit, markdown]: [Option<report::output::Target>; 3] =
        targets.try_into().expect("three outputs");
    if let Some(t) = json {
        t.write(&merged.to_json())?;
    }
    if let Some(t) = junit {
        t.write(&report::junit::render(&merged))?;
    }
    if let Some(t) = markdown {
        t.write(&report::markdown::render(&merged))?;
    }
    Ok(if merged.pass() {
        EXIT_PASS
    } else {
        EXIT_DIVERGENCE
    })
}
