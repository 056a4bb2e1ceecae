//! Changing only the serving schedule changes the mirror's outputs only at the rounding level of its
//! dtype: page size, block-table order and spare pages not at all (addressing only), the number of
//! splits only the decode tokens, the chunk size only the prefill tokens.

use crate::common;
use common::*;
use mla_diff::model::synthetic::Family;
use mla_diff::precision::Dtype;
use mla_diff::schedule::Schedule;
use mla_diff::trace::{LayerTrace, Stage, StageTensor};

/// Rows `[r0, r1)` of the token axis of a stage (decode-only stages index decode tokens).
fn rows(t: &StageTensor, r: std::ops::Range<usize>) -> StageTensor {
    let per: usize = t.shape[1..].iter().product();
    let mut shape = t.shape.clone();
    shape[0] = r.len();
    StageTensor::new(t.stage, shape, t.data[r.start * per..r.end * per].to_vec())
}

fn run(fam: Family, sched: Schedule, dt: Dtype) -> (LayerTrace, Schedule) {
    let c = Case::new(fam, sched.clone(), 41);
    (c.mirror(dt), sched)
}

const PER_TOKEN: [Stage; 4] = [
    Stage::Lse,
    Stage::AttnHeads,
    Stage::AttnOut,
    Stage::CacheRows,
];
const FRONT: [Stage; 5] = [
    Stage::AttnIn,
    Stage::QNope,
    Stage::QPe,
    Stage::KvLatent,
    Stage::KPe,
];
const DECODE: [Stage; 4] = [
    Stage::QAbsorbed,
    Stage::SplitOut,
    Stage::SplitLse,
    Stage::AttnLatent,
];

fn bitwise(a: &LayerTrace, b: &LayerTrace, stages: &[Stage], what: &str) {
    for &s in stages {
        let (x, y) = (a.get(s).unwrap(), b.get(s).unwrap());
        assert_eq!(x.shape, y.shape, "{what}: {s} shape");
        let same = x
            .data
            .iter()
            .zip(&y.data)
            .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{what}: {s} changed");
    }
}

/// Bound on the difference between two runs of `t` tokens that round differently in a few places: the
/// stores a schedule can move (prefill: both partial outputs and the merged one; decode: the combined
/// output) plus what they feed (W_UV and o_proj stores), n = 5 per run, independent between the runs:
/// `sqrt(2n)·u`. In f32 nothing is stored at lower precision; there the reordered f32 sums over up to
/// `t` keys dominate, `sqrt(t)·u_f32` each.
fn invariance_bound(dt: Dtype, t: usize) -> f64 {
    10f64.sqrt() * unit_roundoff(dt).max((t as f64).sqrt() * unit_roundoff(Dtype::F32))
}

fn close(a: &StageTensor, b: &StageTensor, dt: Dtype, t: usize, what: &str) {
    let e = stage_error(a, b);
    let bound = invariance_bound(dt, t);
    println!(
        "{what} {}: rel-L2 {:.2e} max {:.2e} (bound {bound:.2e})",
        a.stage, e.rel_l2, e.max_abs
    );
    assert!(
        e.rel_l2 <= bound,
        "{what}: {} differs by {:e} > {bound:e}",
        a.stage,
        e.rel_l2
    );
}

#[test]
fn paging_changes_nothing() {
    for dt in [Dtype::Bf16, Dtype::F32] {
        for fam in [Family::DeepseekV3, Family::Minicpm3] {
            let (base, _) = run(fam, busy_schedule(), dt);
            for (page_size, shuffle_seed, spare_pages) in [
                (1, Some(3), 0),
                (7, None, 9),
                (64, Some(1), 1),
                (16, Some(99), 3),
            ] {
                let s = Schedule {
                    page_size,
                    shuffle_seed,
                    spare_pages,
                    ..busy_schedule()
                };
                let (m, _) = run(fam, s, dt);
                let what = format!(
                    "{} {} page {page_size} seed {shuffle_seed:?}",
                    fam.name(),
                    dt.name()
                );
                bitwise(&m, &base, &Stage::ALL, &what);
            }
        }
    }
}

#[test]
fn splits_change_decode_at_rounding_level() {
    for dt in [Dtype::Bf16, Dtype::F32] {
        for fam in [Family::DeepseekV2Lite, Family::Minicpm3] {
            let (base, sched) = run(fam, busy_schedule(), dt);
            let p = sched.prompt_len;
            let t = sched.total_tokens();
            for num_splits in [1, 2, 8] {
                let (m, _) = run(
                    fam,
                    Schedule {
                        num_splits,
                        ..busy_schedule()
                    },
                    dt,
                );
                let what = format!("{} {} splits {num_splits}", fam.name(), dt.name());
                bitwise(&m, &base, &FRONT, &what);
                bitwise(&m, &base, &[Stage::QAbsorbed, Stage::CacheRows], &what);
                for s in [Stage::Lse, Stage::AttnHeads, Stage::AttnOut] {
                    let (x, y) = (m.get(s).unwrap(), base.get(s).unwrap());
                    assert_eq!(
                        rows(x, 0..p),
                        rows(y, 0..p),
                        "{what}: prefill rows of {s} changed"
                    );
                    close(&rows(x, p..t), &rows(y, p..t), dt, t, &what);
                }
                close(
                    m.get(Stage::AttnLatent).unwrap(),
                    base.get(Stage::AttnLatent).unwrap(),
                    dt,
                    t,
                    &what,
                );
            }
        }
    }
}

#[test]
fn chunking_changes_prefill_at_rounding_level() {
    // GLM-5 (64 heads) is the slow family: one variant in bf16 only.
    for (fam, dt, chunks) in [
        (Family::DeepseekV3, Dtype::Bf16, &[17, 64, 90][..]),
        (Family::DeepseekV3, Dtype::F32, &[17, 64, 90][..]),
        (Family::Glm5, Dtype::Bf16, &[17][..]),
    ] {
        let (base, sched) = run(fam, busy_schedule(), dt);
        let p = sched.prompt_len;
        let t = sched.total_tokens();
        for &chunk in chunks {
            let (m, _) = run(
                fam,
                Schedule {
                    chunk,
                    ..busy_schedule()
                },
                dt,
            );
            let what = format!("{} {} chunk {chunk}", fam.name(), dt.name());
            bitwise(&m, &base, &FRONT, &what);
            bitwise(&m, &base, &DECODE, &what);
            bitwise(&m, &base, &[Stage::CacheRows], &what);
            for s in PER_TOKEN.iter().copied().filter(|&s| s != Stage::CacheRows) {
                let (x, y) = (m.get(s).unwrap(), base.get(s).unwrap());
                assert_eq!(
                    rows(x, p..t),
                    rows(y, p..t),
                    "{what}: decode rows of {s} changed"
                );
                close(&rows(x, 0..p), &rows(y, 0..p), dt, t, &what);
            }
        }
    }
}
