//! NaN-poisoned cache slots (spare pages, unwritten rows of the last page) never reach any output of
//! the mirror; and a read of one of them would (so the finiteness check can fail).

use crate::common;
use common::*;
use mla_diff::backend::cpu::cache::PagedCache;
use mla_diff::backend::cpu::decode::split_partial;
use mla_diff::model::synthetic::Family;
use mla_diff::precision::Dtype;
use mla_diff::schedule::Schedule;

fn poisoned_schedules() -> Vec<Schedule> {
    vec![
        busy_schedule(),
        small_schedule(),
        Schedule {
            page_size: 7,
            spare_pages: 5,
            num_splits: 3,
            ..busy_schedule()
        },
        Schedule {
            page_size: 1,
            spare_pages: 4,
            ..small_schedule()
        },
        Schedule {
            page_size: 64,
            spare_pages: 2,
            num_splits: 1,
            chunk: 90,
            ..busy_schedule()
        },
    ]
}

/// Every schedule here leaves poisoned rows in the pool: spare pages and a partly filled last page.
#[test]
fn schedules_leave_poison_in_the_pool() {
    for s in poisoned_schedules() {
        let t = s.total_tokens();
        let mut cache = PagedCache::new(&s, 3);
        for tt in 0..t {
            cache.write(tt, &[1.0, 2.0], &[3.0]);
        }
        let nan_rows = cache
            .pool
            .chunks(3)
            .filter(|r| r.iter().all(|v| v.is_nan()))
            .count();
        let spare_rows = s.spare_pages * s.page_size;
        let tail_rows = s.pages_needed() * s.page_size - t;
        assert_eq!(nan_rows, spare_rows + tail_rows, "{s:?}");
        assert!(spare_rows > 0);
        assert!(
            tail_rows > 0 || s.page_size == 1,
            "{s:?}: the last page should be partly filled"
        );
    }
}

#[test]
fn poison_never_reaches_outputs() {
    for s in poisoned_schedules() {
        for (fam, dt) in [
            (Family::DeepseekV3, Dtype::Bf16),
            (Family::Minicpm3, Dtype::F16),
            (Family::DeepseekV2Lite, Dtype::F32),
        ] {
            let c = Case::new(fam, s.clone(), 51);
            let m = c.mirror(dt);
            if let Err(e) = all_finite(&m) {
                panic!("{} {}: {e} (schedule {s:?})", fam.name(), dt.name());
            }
        }
    }
}

/// Negative control: a split that reads one key past the sequence, or a row through a wrong page,
/// returns NaN.
#[test]
fn reading_a_poisoned_row_shows() {
    let c = Case::new(Family::DeepseekV3, busy_schedule(), 52);
    let s = &c.sched;
    let t = s.total_tokens();
    let (lkv, r) = (c.cfg.kv_lora_rank, c.cfg.qk_rope);
    let mut cache = PagedCache::new(s, lkv + r);
    for tt in 0..t {
        let lat: Vec<f32> = (0..lkv).map(|i| ((i + tt) % 7) as f32 / 7.0).collect();
        let pe: Vec<f32> = (0..r).map(|i| ((i * tt) % 5) as f32 / 5.0).collect();
        cache.write(tt, &lat, &pe);
    }
    let qa: Vec<f32> = (0..lkv).map(|i| (i % 3) as f32 - 1.0).collect();
    let qp: Vec<f32> = (0..r).map(|i| (i % 2) as f32).collect();
    let ok = split_partial(&c.cfg, &cache, &qa, &qp, 0..t, Dtype::Bf16);
    assert!(ok.lse.is_finite() && ok.out.iter().all(|v| v.is_finite()));
    let past = split_partial(&c.cfg, &cache, &qa, &qp, 0..t + 1, Dtype::Bf16);
    assert!(past.lse.is_nan() && past.out.iter().all(|v| v.is_nan()));
    // Point the last logical page at a spare page: its rows are poison.
    let spare = (0..s.pool_pages())
        .find(|p| !cache.table.contains(p))
        .unwrap();
    *cache.table.last_mut().unwrap() = spare;
    let wrong = split_partial(&c.cfg, &cache, &qa, &qp, 0..t, Dtype::Bf16);
    assert!(wrong.out.iter().all(|v| v.is_nan()));
}
