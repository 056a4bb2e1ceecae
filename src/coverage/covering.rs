//! The kernel-aware default schedule of `mla-diff run`: the cheapest schedule of a simple shape that
//! exercises every coverage class of every kernel a model's dims may run on, computed from those kernels'
//! tile geometries.
//!
//! The kernels it is made for (`targets`): the CPU mirror's, and the CUDA kernels the host predicts for the
//! model's dims (`tiles::choice`) on Hopper and on Ampere, in bf16, at 64 or more decode rows (the
//! rows the production decode kernels are made for), plus the scalar kernel of f32 runs.
//!
//! The shape, and why each part (with the DeepSeek-sized tiles: 64 keys, 64 decode rows, 128 prefill rows):
//! - a prompt of two chunks, the first one a chunk of `max(2·keys, rows) + 1` prefill tokens: its causal
//!   pass spans two full tiles and a tail and two row tiles; the second chunk (2 tokens) crosses the
//!   chunk boundary and merges a context of that many keys;
//! - pages of half the smallest decode tile, so that every decode tile crosses a page boundary;
//! - two splits, and decode steps of `q_len` queries (two steps, so that the second runs on a cache that
//!   already holds decode rows): a step's last query sees both splits whole
//!   (the first split holds two full tiles and a tail), and its first query stops before the second
//!   split, which is then empty for it. That is the one way to have both an empty split and a split of
//!   two tiles in one step: with `S` splits a split holds about `seq/S` keys, and a split is empty for a
//!   query only when the step has more queries than the last split has keys. The search finds the
//!   smallest such `q_len` (also covering q_len × heads > the decode row tile).
//!
//! Tested for every shipped fixture (`tests/it/coverage.rs`): every class of every target is exercised.

use super::count;
use crate::backend::cpu::mirror_kernels;
use crate::kernel_use::{Geometry, KernelUse, Phase};
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::schedule::Schedule;
use crate::tiles::choice::{self as plan, Caps};
use crate::tiles::Dims;

/// The CUDA dims of a model (page size and faults do not change the tile choice).
pub fn cuda_dims(cfg: &MlaConfig, dtype: Dtype) -> Dims {
    Dims::of_model(cfg, dtype)
}

/// The CUDA kernels the host predicts for `cfg` on `caps` in `dtype`, at `q_rows` decode rows.
pub fn cuda_kernels(cfg: &MlaConfig, dtype: Dtype, caps: &Caps, q_rows: usize) -> Vec<KernelUse> {
    let d = cuda_dims(cfg, dtype);
    let (pre, dec) = plan::layer_tiles(&d, q_rows, caps, false);
    vec![
        plan::kernel_use(Phase::Prefill, pre, None),
        plan::kernel_use(Phase::Decode, dec, None),
    ]
}

/// The kernels the default schedule must cover for `cfg`: the mirror's and the predicted CUDA ones.
pub fn targets(cfg: &MlaConfig) -> Vec<KernelUse> {
    let mut t = mirror_kernels();
    for caps in [plan::HOPPER, plan::AMPERE] {
        t.extend(cuda_kernels(cfg, Dtype::Bf16, &caps, 64));
    }
    t.extend(cuda_kernels(cfg, Dtype::F32, &plan::HOPPER, 64));
    t
}

/// Whether `s` exercises every class of every target.
pub fn covers(targets: &[KernelUse], heads: usize, s: &Schedule) -> bool {
    targets.iter().all(|k| {
        count(k.phase, k.geometry.as_ref(), heads, s, &[])
            .iter()
            .all(|(_, n)| n.is_some_and(|n| n > 0))
    })
}

/// Largest geometry field over the targets of a phase.
fn largest(targets: &[KernelUse], phase: Phase, f: impl Fn(&Geometry) -> usize) -> usize {
    targets
        .iter()
        .filter(|k| k.phase == phase)
        .filter_map(|k| k.geometry.as_ref())
        .map(f)
        .max()
        .unwrap_or(1)
}

/// The default schedule for `cfg` (see the module doc). Deterministic: a function of the model's dims.
pub fn covering(cfg: &MlaConfig) -> Schedule {
    covering_for(&targets(cfg), cfg.n_head)
}

/// What a runner's `supports` leaves of the schedule's freedom (docs/runners.md).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    /// The most queries per decode step (`supports.max_q_len`).
    pub max_q_len: Option<usize>,
    /// The page the run gives it (`runner::protocol::page_for`, the one place a runner's page is
    /// chosen and the report told); `None`: the covering page.
    pub page: Option<usize>,
}

impl Limits {
    /// What a runner's `supports` leaves of the default schedule's freedom; the page is set by
    /// `protocol::page_for` from the page the schedule would take without it.
    pub fn of_runner(d: &crate::backend::runner::protocol::Describe) -> Limits {
        let decodes = d.ops.decode.is_some() || d.ops.sparse_decode.is_some();
        Limits {
            max_q_len: d.supports.max_q_len.filter(|_| decodes),
            page: None,
        }
    }
}

/// The default schedule of `run --runner` (issue #32): the covering schedule of our own kernels' targets
/// and of the tiles the runner declares (`describe` `geometry.key_tile` / `row_tile` per op), within
/// what its `supports` allows. What it then cannot reach (MTP steps past `max_q_len`, an empty split in a
/// step) the serving batch (`crate::batch`) reaches where it can, and the coverage section lists the rest.
pub fn for_runner(cfg: &MlaConfig, declared: &[KernelUse], limits: &Limits) -> Schedule {
    let mut t = targets(cfg);
    t.extend(declared.iter().cloned());
    covering_within(&t, cfg.n_head, limits)
}

/// The covering schedule of the shape above for these targets; if none of its `q_len`s covers them all
/// (tiles far larger than today's), the search's last candidate, which the coverage section then
/// reports as incomplete.
pub fn covering_for(targets: &[KernelUse], heads: usize) -> Schedule {
    covering_within(targets, heads, &Limits::default())
}

/// [`covering_for`] within `limits`: the page the runner's, `q_len` at most `max_q_len` (the search
/// stops there; the coverage section says what that misses).
pub fn covering_within(targets: &[KernelUse], heads: usize, limits: &Limits) -> Schedule {
    let keys_p = largest(targets, Phase::Prefill, |g| g.keys_per_tile);
    let rows_p = largest(targets, Phase::Prefill, |g| g.rows_per_cta);
    let keys_d = largest(targets, Phase::Decode, |g| g.keys_per_tile);
    let smallest_tile = targets
        .iter()
        .filter(|k| k.phase == Phase::Decode)
        .filter_map(|k| k.geometry.as_ref())
        .map(|g| g.keys_per_tile)
        .min()
        .unwrap_or(keys_d);
    let chunk = (2 * keys_p).max(rows_p) + 1;
    let mut s = Schedule {
        prompt_len: chunk + 2,
        chunk,
        // Two steps, not one: the cache grows between them, so a step's slots, positions and split
        // ranges are computed from a cache that already holds decode rows (per-step bugs show).
        decode_steps: 2,
        q_len: 1,
        page_size: limits.page.unwrap_or((smallest_tile / 2).max(1)),
        num_splits: 2,
        shuffle_seed: Schedule::default().shuffle_seed,
        spare_pages: Schedule::default().spare_pages,
        pos_offset: 0,
    };
    // q_len rises by one each time; the bound is far past what the shape needs (about the prompt).
    let bound =
        (4 * (s.prompt_len + 2 * keys_d)).min(limits.max_q_len.unwrap_or(usize::MAX).max(1));
    for q in 1..=bound {
        s.q_len = q;
        // The row after the sequence end inside an owned page: what a stray read must hit (NaN poison).
        if covers(targets, heads, &s) && !s.total_tokens().is_multiple_of(s.page_size) {
            break;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runners_limits_bound_the_covering_schedule() {
        let t = crate::backend::cpu::mirror_kernels();
        let free = covering_within(&t, 8, &Limits::default());
        assert_eq!(free, covering_for(&t, 8));
        assert!(free.q_len > 1 && free.page_size == 32);
        let capped = covering_within(
            &t,
            8,
            &Limits {
                max_q_len: Some(1),
                page: Some(64),
            },
        );
        assert_eq!((capped.q_len, capped.page_size), (1, 64));
        let p = covering_within(
            &t,
            8,
            &Limits {
                max_q_len: None,
                page: Some(16),
            },
        );
        assert_eq!(p.page_size, 16);
        assert_eq!(p.prompt_len, free.prompt_len);
    }
}
