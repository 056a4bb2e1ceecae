//! `mla-diff replay`: run a capsule written by `export` through the ordinary run pipeline and write the
//! same reports as `run`.

use super::run::{BackendArgs, ReportArgs, TolArgs};
use mla_diff::capsule::Capsule;
use mla_diff::error::Error;
use mla_diff::gguf::GgufFile;
use mla_diff::model::MlaConfig;
use mla_diff::run::execute::{execute, How, Job, Optimized, Prepared};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The capsule directory (`mla-diff export -o DIR`).
    dir: PathBuf,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    tol: TolArgs,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let (backend, report) = (a.backend.spec(), a.report.options());
    let cap = Capsule::open(&a.dir)?;
    let file = GgufFile::open(&cap.weights)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let m = &cap.manifest;
    let (tolerances, source) = a.tol.overrides().table(m.dtype)?;
    let dump = mla_diff::run::dump_of(&report, cfg.n_layer)?;
    let opts = cap.run_options(tolerances, source, dump, !report.formats.quiet);
    let ready = Prepared::check(&file, &cfg, &opts, &report)?;
    // Before the run: a capsule whose weights no longer give its reference would report on another
    // problem than the one it was exported for.
    cap.check_reference(&file, &cfg)?;
    if !report.formats.quiet {
        eprintln!(
            "mla-diff: capsule {}: layer {} of {}{}, {} tokens, {}; its reference matches its weights",
            a.dir.display(),
            m.layer,
            m.source.file,
            m.heads
                .map(|[x, y]| format!(" (heads {x}..{y})"))
                .unwrap_or_default(),
            m.schedule.total_tokens(),
            m.dtype.name()
        );
    }
    let job = Job {
        file: &file,
        cfg: &cfg,
        opts: &opts,
    };
    let path = Optimized::Open(&backend, None);
    execute(job, ready, path, &report, &cap.notices(), How::default())
}
