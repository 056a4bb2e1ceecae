//! A run split over two schedules (issue #39, [`crate::schedule::Split`]): the covering schedule on the
//! first selected layers, a cheaper one on the rest, in two passes over the file.
//!
//! Two passes because a layer's input is the residual stream after the earlier layers, and a stream has
//! its schedule's token count: the covering pass runs its layers from the run's input as a whole run
//! would; the rest pass starts from the streams over the covering layers recomputed at the rest's
//! schedule (the reference, and with free mode the optimized path: `shard::streams_before`, not
//! compared), so each of its layers gets exactly the input a whole run at that schedule gives it. The
//! two reports are joined as `merge` joins shards (`merge::join`: layers in order, verdicts recomputed),
//! the covering pass's coverage kept, and `run.split` says which layers ran which schedule.

use super::{RunOptions, Start};
use crate::backend::{Backend, BackendInfo};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::report::Report;
use crate::schedule::{Schedule, Split};

/// The run `opts` describes with its layers split as `split` says: the covering pass, then the rest's.
pub fn run(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &RunOptions,
    split: &Split,
) -> Result<Report> {
    let cfg = MlaConfig::from_gguf(file)?;
    let covering = pass(opts, split.covering_layers.clone(), opts.sched.clone());
    let first = super::run_from(file, backend, info, &covering, None)?;
    let mut rest = pass(opts, split.rest_layers.clone(), split.rest.clone());
    // Only the first diverging layer is dumped: none more when the covering pass dumped it.
    if matches!(&opts.dump, Some((_, super::DumpLayers::First))) && !first.dumps.is_empty() {
        rest.dump = None;
    }
    let all: Vec<usize> = split
        .covering_layers
        .iter()
        .chain(&split.rest_layers)
        .copied()
        .collect();
    let rest_rep = {
        let mut streams = pass(opts, all.clone(), split.rest.clone());
        streams.dump = None;
        let (h_ref, h_opt, carried) = super::shard::streams_before(
            file,
            &cfg,
            backend,
            &streams,
            &all,
            split.rest_layers[0],
        )?;
        let start = Start {
            layers: split.rest_layers.clone(),
            h_ref,
            h_opt,
            carried,
        };
        super::run_from(file, backend, info, &rest, Some(start))?
    };
    Ok(joined(first, rest_rep, split))
}

/// `opts` for one pass: its layers on `sched`, unsplit.
fn pass(opts: &RunOptions, layers: Vec<usize>, sched: Schedule) -> RunOptions {
    RunOptions {
        layers: Some(layers),
        input: opts.input.clone(),
        sched,
        dtype: opts.dtype,
        modes: opts.modes,
        tolerances: opts.tolerances.clone(),
        tolerance_source: opts.tolerance_source.clone(),
        dump: opts.dump.clone(),
        faults: opts.faults.clone(),
        progress: opts.progress,
        repeat: opts.repeat,
        indexer_keys: opts.indexer_keys,
        split: None,
    }
}

/// The two passes' reports as the run's: the covering pass's frame (schedule, coverage), every
/// layer's results in order, the rest's notices added, and `run.split`.
fn joined(first: Report, rest: Report, split: &Split) -> Report {
    let extra: Vec<String> = rest
        .run
        .notices
        .iter()
        .filter(|n| !first.run.notices.contains(n))
        .cloned()
        .collect();
    let dumps: Vec<_> = first.dumps.iter().chain(&rest.dumps).cloned().collect();
    let mut out = crate::merge::join(vec![first, rest]);
    out.run.notices.extend(extra);
    out.run.split = Some(split.clone());
    out.dumps = dumps;
    out
}
