//! A shard's run (`run --shard i/n`, the slice [`crate::shard::Shard`] names).
//!
//! Layers are not independent: layer l's input is the residual stream after the earlier selected layers
//! (the reference's in shadow mode, each side's own in free mode). A shard therefore recomputes the
//! streams over the layers before its slice — the fp64 reference only when free mode is off, and the
//! optimized path too when it is on — without comparing or reporting them. That keeps a shard's results
//! identical to the whole run's, at a cost: shard i also pays for the reference of every earlier layer,
//! so the last shard carries about the whole reference. Per-layer captures (`--hidden` of
//! `[layers, T, hidden]`, shadow mode) give every layer its own input, and then a shard runs its own
//! layers only.

use super::{RunOptions, Start};
use crate::backend::{Backend, BackendInfo, RunTables};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::input::LayerInputs;
use crate::model::rope_factors::RopeFactors;
use crate::model::{LayerWeights, MlaConfig};
use crate::report::{Report, ShardInfo};
use crate::shard::Shard;

/// Shard `shard` of the run `opts` describes: its slice of the layers, started from the residual
/// streams the whole run has there.
pub fn run(
    file: &GgufFile,
    backend: &mut dyn Backend,
    info: &BackendInfo,
    opts: &RunOptions,
    shard: Shard,
) -> Result<Report> {
    let cfg = MlaConfig::from_gguf(file)?;
    opts.sched.validate()?;
    opts.sched.check_memory(&cfg)?;
    let all = match &opts.layers {
        Some(l) => l.clone(),
        None => (0..cfg.n_layer).collect(),
    };
    let mine = all[shard.range(all.len(), "layers")?].to_vec();
    let (h_ref, h_opt, carried) = streams_before(file, &cfg, backend, opts, &all, mine[0])?;
    let start = Start {
        layers: mine,
        h_ref,
        h_opt,
        carried,
    };
    let mut rep = super::run_from(file, backend, info, opts, Some(start))?;
    rep.run.shard = Some(ShardInfo {
        index: shard.index,
        count: shard.count,
        of: all,
    });
    Ok(rep)
}

/// The reference and optimized residual streams of the whole run just before layer `first`, computed
/// as `run::run` does (`h ← h + attn(h)` from the first layer's input), with the cache effect free
/// mode's stream carries (`run::carry`), without comparing anything.
pub(super) fn streams_before(
    file: &GgufFile,
    cfg: &MlaConfig,
    backend: &mut dyn Backend,
    opts: &RunOptions,
    all: &[usize],
    first: usize,
) -> Result<super::Streams> {
    let inputs = super::load_inputs(file, cfg, &opts.input, &opts.sched)?;
    if let LayerInputs::PerLayer(_) | LayerInputs::Captured(_) = inputs {
        // Each layer has its own captured input (free mode is refused with .npy ones by the run itself).
        let h = inputs.layer(first)?;
        return Ok((h.clone(), h, None));
    }
    let mut h_ref = inputs.layer(all[0])?;
    let mut h_opt = h_ref.clone();
    let mut carried = None;
    let before: Vec<usize> = all.iter().copied().take_while(|&l| l != first).collect();
    if before.is_empty() {
        return Ok((h_ref, h_opt, carried));
    }
    let factors = RopeFactors::load(file, cfg)?;
    let tables = RunTables::new(cfg, factors.as_ref(), &opts.sched)?;
    for l in before {
        let w = LayerWeights::load(file, cfg, l)?;
        let reference = crate::reference::run_layer(cfg, &w, &tables.rope, &h_ref, &opts.sched)?;
        if opts.modes.free {
            let ctx = tables.ctx(cfg, &w, &opts.sched, opts.faults.active(l));
            let mut opt = backend.run_layer(&ctx, &h_opt)?;
            let moved = super::carry::moved_input(&h_ref, carried.as_ref())
                .map(|x| crate::reference::run_layer(cfg, &w, &tables.rope, &x, &opts.sched))
                .transpose()?;
            super::carry::absorb(
                &mut opt,
                &reference,
                moved.as_ref(),
                &opts.sched,
                &mut carried,
            );
            h_opt = super::residual_after(&h_opt, &opt)?;
        }
        h_ref = super::residual_after(&h_ref, &reference)?;
    }
    Ok((h_ref, h_opt, carried))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_parse_and_refuse_nonsense() {
        assert_eq!(Shard::parse("0/4").unwrap(), Shard { index: 0, count: 4 });
        assert_eq!(
            Shard::parse(" 3 / 4").unwrap(),
            Shard { index: 3, count: 4 }
        );
        for bad in ["4/4", "1/0", "1", "a/2", "-1/2", "1/2/3"] {
            assert!(Shard::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn slices_are_balanced_contiguous_and_cover_everything_once() {
        for len in 1..40 {
            for count in 1..=len {
                let mut next = 0;
                for index in 0..count {
                    let r = Shard { index, count }.range(len, "x").unwrap();
                    assert_eq!(r.start, next, "len {len} count {count}");
                    let size = r.len();
                    assert!(size == len / count || size == len / count + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
            assert!(Shard {
                index: 0,
                count: len + 1
            }
            .range(len, "x")
            .is_err());
        }
    }
}
