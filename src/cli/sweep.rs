//! `mla-diff sweep`: runs over sequence lengths around the kernel's boundaries (or over split counts),
//! the smallest failing length and its bisection; the same report formats as `run`.

use super::run::{BackendArgs, FormatArgs, ScheduleArgs, TolArgs};
use mla_diff::error::{Error, EXIT_DIVERGENCE, EXIT_PASS};
use mla_diff::faults::{FaultSet, Injection};
use mla_diff::gguf::GgufFile;
use mla_diff::model::MlaConfig;
use mla_diff::precision::Dtype;
use mla_diff::report::outputs::{Outputs, ReportOptions};
use mla_diff::run::plan::check_dense_beyond_top_k;
use mla_diff::sweep::{self, lengths, LengthPlan, SweepOptions};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The MLA GGUF file.
    file: PathBuf,
    /// Layers, as for `run`; the first layer by default, to keep the many runs fast.
    #[arg(long, default_value = "0")]
    layers: String,
    /// Storage precision of the optimized path (accumulation is f32).
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// Lengths (total tokens: prompt + decode steps × q-len) to run besides the boundaries: a comma list
    /// of N, A..B (half-open) or A..=B, a range optionally with :STEP (every STEP-th from A). Their span
    /// is the sweep's range; default: from the decode tokens (prompt 0) to where every boundary has been
    /// crossed twice.
    #[arg(long, value_name = "A..B[:STEP],…")]
    lengths: Option<String>,
    /// Run only the --lengths, without the boundary lengths inside their range.
    #[arg(long, requires = "lengths")]
    no_boundaries: bool,
    /// Extra key-tile sizes to put boundaries around (on the prompt and on the keys per decode split),
    /// for a kernel whose tiles mla-diff cannot see (an external --runner's).
    #[arg(long, value_delimiter = ',', value_name = "KEYS,…")]
    tiles: Vec<usize>,
    /// Split invariance instead of lengths: run the schedule with each of these split-KV counts, each
    /// against fp64, and compare the decode outputs of each count with the first count's within the
    /// checks' tolerances.
    #[arg(long, value_delimiter = ',', value_name = "S,…", conflicts_with_all = ["lengths", "tiles"])]
    splits: Option<Vec<usize>>,
    /// Seed of the random layer inputs (captured inputs cannot follow the lengths).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run a DSA model on lengths beyond its indexer's top_k (as for `run`).
    #[arg(long)]
    allow_dense_beyond_topk: bool,
    /// Plant a bug from the catalogue, repeatable: NAME or NAME@layer=L (`mla-diff selftest --list`).
    #[arg(long = "inject", value_name = "NAME[@layer=L]")]
    inject: Vec<String>,
    #[command(flatten)]
    schedule: ScheduleArgs,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    tol: TolArgs,
    #[command(flatten)]
    report: FormatArgs,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let faults = FaultSet(
        a.inject
            .iter()
            .map(|s| Injection::parse(s))
            .collect::<Result<_, _>>()?,
    );
    let user = match &a.lengths {
        Some(s) => {
            let (ls, r) = lengths::parse_lengths(s)?;
            Some((s.clone(), ls, r))
        }
        None => None,
    };
    let formats = a.report.formats();
    // Checked before the runs, as `run`'s: the sweep writes no plot, baseline or dumps.
    let outputs = Outputs::check(&ReportOptions {
        formats: formats.clone(),
        ..ReportOptions::default()
    })?;
    let file = GgufFile::open(&a.file)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let sched = a.schedule.overrides().schedule()?;
    let layers = mla_diff::run::parse_layers(&a.layers, cfg.n_layer)?;
    faults.check_layers(cfg.n_layer, &layers)?;
    let (tolerances, tolerance_source) = a.tol.overrides().table(a.dtype)?;
    // The DSA check at the longest schedule the sweep runs, when it is known now (a default length
    // range is known after the first run: the library checks its end then).
    let longest = match (&a.splits, &user) {
        (None, Some((_, _, r))) => lengths::schedule_at(&sched, *r.end())?,
        _ => sched.clone(),
    };
    check_dense_beyond_top_k(&file, &cfg, &longest, a.allow_dense_beyond_topk)?;
    let opts = SweepOptions {
        layers,
        seed: a.seed,
        sched: sched.clone(),
        dtype: a.dtype,
        tolerances,
        tolerance_source,
        faults,
        progress: !a.report.quiet,
        allow_dense_beyond_topk: a.allow_dense_beyond_topk,
    };
    let (mut backend, info) = a.backend.spec().open(a.dtype, None)?;
    let started = std::time::Instant::now();
    let rep = match &a.splits {
        Some(counts) => sweep::splits::sweep_splits(&file, backend.as_mut(), &info, &opts, counts)?,
        None => {
            let plan = LengthPlan {
                user,
                boundaries: !a.no_boundaries,
                extra_tiles: a.tiles.clone(),
            };
            sweep::sweep_lengths(&file, backend.as_mut(), &info, &opts, &plan)?
        }
    };
    outputs.write_document(&rep, &formats)?;
    if !a.report.quiet {
        let runs = rep
            .lengths
            .as_ref()
            .map(|l| l.points.len())
            .or(rep.splits.as_ref().map(|s| s.runs.len()))
            .unwrap_or(0);
        eprintln!(
            "mla-diff: {runs} run(s) in {:.2} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(if rep.pass() {
        EXIT_PASS
    } else {
        EXIT_DIVERGENCE
    })
}
