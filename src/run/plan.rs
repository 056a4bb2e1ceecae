//! Run policy decided before a run starts, shared by `run` and the commands around it: the
//! kernel-aware default schedule (and the page a runner takes), the `--inject` a runner would make
//! meaningless, and a DSA file run dense past its indexer's top_k; [`options`] makes a run's
//! options from its request with all of them.

use crate::backend::runner::{declared_kernels, protocol, replaced_checks};
use crate::coverage::covering::{covering, for_runner, Limits};
use crate::error::{Error, Result};
use crate::faults::FaultSet;
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::schedule::{Schedule, Split};

/// The library's options for a run of `req` on `file`, every choice checked against the model (with
/// the notes a choice calls for on stderr); and `(schedule's page, page run)` when the page was moved
/// to one the runner takes (the runner backend's notice).
pub fn options(
    req: &super::request::Request,
    file: &GgufFile,
    cfg: &MlaConfig,
) -> Result<(super::RunOptions, Option<(usize, usize)>)> {
    let runner = req.backend.runner.as_deref();
    // The runner is asked to describe itself from here on (page choice, --inject): timed already.
    protocol::set_timeout(req.backend.runner_timeout);
    // The options given over the classic default, or, given none (and random inputs, which the
    // schedule is free to fit), the kernel-aware one with the page choice a runner made.
    let random = matches!(req.input, super::InputSpec::Random { .. });
    let chosen = !req.schedule.given() && random;
    let (mut sched, mut choice) = match chosen {
        false => (req.schedule.schedule()?, None),
        true => default_schedule(cfg, runner)?,
    };
    // A runner that does not take the schedule's page gets one it does (the report says so); the
    // default schedule chose its own already.
    if let (Some(cmd), None, None) = (runner, req.schedule.page_size, choice) {
        choice = Some(fit_runner_page(&mut sched, cmd)?);
    }
    let page_moved = choice.filter(|(want, page)| want != page);
    if let Some(cmd) = runner {
        refuse_inject_under_runner(&req.faults, cmd)?;
    }
    let (tolerances, tolerance_source) = req.tol.table(req.dtype)?;
    let dump = super::dump_of(&req.report, cfg.n_layer)?;
    let layers = super::parse_layers(&req.layers, cfg.n_layer)?;
    req.faults.check_layers(cfg.n_layer, &layers)?;
    // A file with an indexer runs the sparse model past top_k (`run::dsa`); only a DSA file without
    // one would run dense there.
    let sparse = super::dsa::sparse_for(file, cfg, &sched)?.is_some();
    if sparse && (req.shard.is_some() || req.gpus.is_some() || req.tp.is_some()) {
        return Err(Error::Usage(
            "--shard, --gpus and --tp do not run the DSA sparse model yet: use at most top_k tokens on this file, or run without them".into(),
        ));
    }
    if !sparse {
        check_dense_beyond_top_k(file, cfg, &sched, req.allow_dense_beyond_topk)?;
    }
    let mode = match (req.mode, &req.input) {
        (Some(m), _) => m,
        // Per-layer captures restart the reference at each layer, so free mode has no meaning there.
        (None, super::InputSpec::Npy(p)) if crate::input::npy_ndim(p)? == 3 => {
            eprintln!(
                "mla-diff: note: per-layer captures in {}: shadow mode only",
                p.display()
            );
            super::Mode::Shadow
        }
        (None, _) => super::Mode::Both,
    };
    let split = match chosen {
        true => split_for(req, file, cfg, &layers, &sched)?,
        false => None,
    };
    let opts = super::RunOptions {
        layers: Some(layers),
        input: req.input.clone(),
        sched,
        dtype: req.dtype,
        modes: mode.into(),
        tolerances,
        tolerance_source,
        dump,
        faults: req.faults.clone(),
        progress: !req.report.formats.quiet,
        repeat: req.repeat,
        indexer_keys: req.indexer_keys,
        split,
    };
    Ok((opts, page_moved))
}

/// The default covering schedule `sched` on the first `req.covering_layers` of the selected MLA
/// `layers` and the classic schedule on the rest, in two passes (issue #39: `run/split.rs`), where
/// that is the same problem at a lower cost: a plain run on a backend (no runner, whose schedule is its
/// own; no `--tp` or `--write-capture`, whose records are per layer call; no `--shard` or `--gpus`,
/// whose slices are of one schedule) on a dense schedule (the DSA sparse model's section is not
/// joined) whose classic schedule has fewer tokens. `None`: every layer on `sched`.
fn split_for(
    req: &super::request::Request,
    file: &GgufFile,
    cfg: &MlaConfig,
    layers: &[usize],
    sched: &Schedule,
) -> Result<Option<Split>> {
    let plain = req.backend.runner.is_none()
        && req.tp.is_none()
        && req.write_capture.is_none()
        && req.shard.is_none()
        && req.gpus.is_none();
    if !plain {
        return Ok(None);
    }
    let hybrid = crate::model::HybridLayout::from_gguf(file)?;
    let mla = super::mla_layers(layers.to_vec(), hybrid.as_ref())?;
    let Some(split) = Split::of(&mla, req.covering_layers, sched, Schedule::default()) else {
        return Ok(None);
    };
    for s in [sched, &split.rest] {
        if super::dsa::sparse_for(file, cfg, s)?.is_some() {
            return Ok(None);
        }
    }
    Ok(Some(split))
}

/// The kernel-aware schedule that crosses every coverage class of the kernels this model's dims may
/// run on (docs/coverage.md); with a runner, also of the tiles it declares, within what its
/// `supports` allows (docs/runners.md), and the page choice it made: `(page the schedule wanted,
/// page taken)`.
pub fn default_schedule(
    cfg: &MlaConfig,
    runner: Option<&str>,
) -> Result<(Schedule, Option<(usize, usize)>)> {
    let mut choice = None;
    let s = match runner {
        Some(cmd) => {
            let d = protocol::describe(cmd)?;
            let (declared, mut limits) = (declared_kernels(&d), Limits::of_runner(&d));
            // The page the schedule wants, then the runner's (`page_for`: the one choice, and
            // the notice); the q_len search then runs at that page.
            let want = for_runner(cfg, &declared, &limits).page_size;
            let page = protocol::page_for(&d, want);
            (limits.page, choice) = (Some(page), Some((want, page)));
            for_runner(cfg, &declared, &limits)
        }
        None => covering(cfg),
    };
    s.validate()?;
    Ok((s, choice))
}

/// A runner that does not take the schedule's page gets one it does (the report says so):
/// `(page the schedule wanted, page taken)`.
pub fn fit_runner_page(sched: &mut Schedule, cmd: &str) -> Result<(usize, usize)> {
    let want = sched.page_size;
    sched.page_size = protocol::page_for(&protocol::describe(cmd)?, want);
    sched.validate()?;
    Ok((want, sched.page_size))
}

/// `--inject` of a fault whose first failing check is a stage the runner replaces: the bug would sit in
/// code the runner stands in for and change nothing, and a pass would read as a fault mla-diff missed,
/// so it is refused (docs/runners.md).
pub fn refuse_inject_under_runner(faults: &FaultSet, cmd: &str) -> Result<()> {
    if faults.is_empty() {
        return Ok(());
    }
    let d = protocol::describe(cmd)?;
    let replaced = replaced_checks(&d);
    for inj in &faults.0 {
        let info = inj.name.info();
        if replaced.contains(&info.expected) {
            return Err(Error::Usage(format!(
                "--inject {} plants its bug where it first shows, {}, which runner {} replaces: it would change nothing; inject a fault upstream of the runner (e.g. rope_neox) or run without --runner",
                info.name, info.expected, d.name
            )));
        }
    }
    Ok(())
}

/// A DSA model on a schedule beyond its indexer's top_k is refused unless allowed (then a note).
pub fn check_dense_beyond_top_k(
    file: &GgufFile,
    cfg: &MlaConfig,
    sched: &Schedule,
    allow: bool,
) -> Result<()> {
    if let Some(n) = super::dense_beyond_top_k(file, cfg, sched) {
        if !allow {
            return Err(Error::Usage(format!(
                "{n}. Pass --allow-dense-beyond-topk to run anyway, or use at most top_k tokens"
            )));
        }
        eprintln!("mla-diff: note: {n}");
    }
    Ok(())
}
