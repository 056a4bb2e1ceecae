//! The CPU mirror against the fp64 reference, stage by stage, on every synthetic family: in f32 it
//! agrees to f32 rounding (the algorithm, layouts and schedule handling are right); in bf16 and fp16
//! it stays within the expected rounding error (`common::tolerance`). Run with `--nocapture` for the
//! per-stage figures recorded in docs/tolerances.md.

use crate::common;
use common::*;
use mla_diff::model::synthetic::Family;
use mla_diff::precision::Dtype;

#[test]
fn f32_mirror_matches_reference() {
    for fam in Family::ALL {
        for sched in [busy_schedule(), small_schedule()] {
            let c = Case::new(fam, sched.clone(), 21);
            let (r, m) = (c.reference(), c.mirror(Dtype::F32));
            all_finite(&m).unwrap();
            for (s, e) in errors(&m, &r) {
                println!(
                    "f32 {} {s} {:?}: rel-L2 {:.2e} max abs {:.2e}",
                    fam.name(),
                    sched.prompt_len,
                    e.rel_l2,
                    e.max_abs
                );
                assert!(
                    e.rel_l2 <= 1e-5,
                    "{} {s}: f32 mirror vs reference rel-L2 {:e} (schedule {sched:?})",
                    fam.name(),
                    e.rel_l2
                );
            }
        }
    }
}

fn within_expected_error(dt: Dtype) {
    println!("| family | stage | rel-L2 | max abs | bound sqrt(n)·u |");
    println!("|---|---|---|---|---|");
    let mut failures = vec![];
    for fam in Family::ALL {
        let c = Case::new(fam, busy_schedule(), 21);
        let (r, m) = (c.reference(), c.mirror(dt));
        all_finite(&m).unwrap();
        let lora = c.cfg.q_lora_rank.is_some();
        for (s, e) in errors(&m, &r) {
            let tol = tolerance(s, lora, dt);
            println!(
                "| {} | {s} | {:.2e} | {:.2e} | {:.2e} |",
                fam.name(),
                e.rel_l2,
                e.max_abs,
                tol
            );
            if e.rel_l2.is_nan() || e.rel_l2 > tol {
                failures.push(format!(
                    "{} {s}: rel-L2 {:e} > {tol:e}",
                    fam.name(),
                    e.rel_l2
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mirror beyond its expected error:\n{}",
        dt.name(),
        failures.join("\n")
    );
}

#[test]
fn bf16_mirror_within_expected_error() {
    within_expected_error(Dtype::Bf16);
}

#[test]
fn fp16_mirror_within_expected_error() {
    within_expected_error(Dtype::F16);
}
