//! Rope tables against hand-computed ggml values, pairings, and the relative-position property that any
//! correct rotation has (an error in the rotation formula or a pairing mix-up inside one table breaks it).

use crate::common;
use approx::{abs_diff_eq, assert_abs_diff_eq, assert_relative_eq, relative_eq};
use common::*;
use mla_diff::model::synthetic::{self, Family};
use mla_diff::model::RopePairing;
use mla_diff::rope::{pair, theta, RopeTables};
use mla_diff::trace::Stage;

#[test]
fn yarn_ramp_for_deepseek_v3() {
    let cfg = Family::DeepseekV3.test_config();
    let y = cfg.rope.yarn.as_ref().unwrap();
    // 64·ln(4096/(2π·32))/(2·ln 1e4) = 10.47 → floor 10; with beta_slow 1: 22.51 → ceil 23.
    assert_eq!(y.corr_dims(64, 10000.0), [10.0, 23.0]);
    let p = 1000.0;
    let extrap = |i: usize| p * 10000f64.powf(-2.0 * i as f64 / 64.0);
    for i in 0..=10 {
        assert!(
            relative_eq!(
                theta(&cfg.rope, None, p, i),
                extrap(i),
                epsilon = 0.0,
                max_relative = 1e-12
            ),
            "pair {i}"
        );
    }
    for i in 23..32 {
        let want = extrap(i) / 40.0;
        assert!(
            relative_eq!(
                theta(&cfg.rope, None, p, i),
                want,
                epsilon = 0.0,
                max_relative = 1e-12
            ),
            "pair {i}"
        );
    }
    // Pair 16: ramp 1 − (16−10)/13.
    let mix = 1.0 - 6.0 / 13.0;
    let want = extrap(16) / 40.0 * (1.0 - mix) + extrap(16) * mix;
    assert_relative_eq!(
        theta(&cfg.rope, None, p, 16),
        want,
        epsilon = 0.0,
        max_relative = 1e-12
    );
}

#[test]
fn plain_rope_and_longrope_factors() {
    let cfg = Family::Glm5.test_config();
    let t = RopeTables::new(&cfg.rope, None, 7, 3).unwrap();
    let th = 8.0 * 1e6f64.powf(-2.0 * 5.0 / 64.0);
    assert_abs_diff_eq!(t.cos[[1, 5]], th.cos(), epsilon = 1e-15);
    assert_abs_diff_eq!(t.sin[[1, 5]], th.sin(), epsilon = 1e-15);

    let cfg = Family::Minicpm3.test_config();
    let f = synthetic::rope_factors(&cfg, 3).unwrap();
    let (short, long) = (f.short.clone().unwrap(), f.long.clone().unwrap());
    assert_eq!(f.choose(f.original_context), Some(short.as_slice()));
    assert_eq!(f.choose(f.original_context + 1), Some(long.as_slice()));
    let i = 9;
    let want = 100.0 * 10000f64.powf(-2.0 * i as f64 / 32.0) / long[i] as f64;
    assert_abs_diff_eq!(
        theta(&cfg.rope, Some(&long), 100.0, i),
        want,
        epsilon = 1e-12
    );
    assert!(RopeTables::new(&cfg.rope, Some(&long[1..]), 0, 1).is_err());
}

#[test]
fn pairings() {
    assert_eq!(pair(RopePairing::Norm, 64, 3), (6, 7));
    assert_eq!(pair(RopePairing::Neox, 64, 3), (3, 35));
    assert_eq!(
        Family::Minicpm3.test_config().rope.pairing,
        RopePairing::Neox
    );
    assert_eq!(
        Family::DeepseekV3.test_config().rope.pairing,
        RopePairing::Norm
    );
}

/// `rot(p, q)·rot(p', k)` depends only on `p − p'`, and rotation keeps the norm (attn_factor 1).
#[test]
fn rotation_is_relative() {
    for fam in Family::ALL {
        let cfg = fam.test_config();
        let f = synthetic::rope_factors(&cfg, 1);
        let ff = f.as_ref().and_then(|f| f.choose(5000));
        let t = RopeTables::new(&cfg.rope, ff, 0, 5000).unwrap();
        let r = cfg.qk_rope;
        let q: Vec<f64> = (0..r).map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0).collect();
        let k: Vec<f64> = (0..r).map(|i| ((i * 17 % 13) as f64 - 6.0) / 4.0).collect();
        let score = |pq: usize, pk: usize| {
            let (mut a, mut b) = (q.clone(), k.clone());
            t.rotate(pq, &mut a);
            t.rotate(pk, &mut b);
            let (na, nq) = (
                a.iter().map(|v| v * v).sum::<f64>(),
                q.iter().map(|v| v * v).sum(),
            );
            assert!(
                abs_diff_eq!(na, nq, epsilon = 1e-9),
                "{}: rotation changed the norm",
                fam.name()
            );
            a.iter().zip(&b).map(|(x, y)| x * y).sum::<f64>()
        };
        for (pq, pk, d) in [(10, 3, 4000), (100, 100, 4321), (57, 0, 1234)] {
            let (s0, s1) = (score(pq, pk), score(pq + d, pk + d));
            assert!(
                relative_eq!(s0, s1, epsilon = 1e-9, max_relative = 1e-9),
                "{}: {s0} vs {s1}",
                fam.name()
            );
        }
    }
}

/// The whole reference only sees relative positions: shifting every position moves q_pe/k_pe but leaves
/// lse and the layer output unchanged (to f64 rounding of the angles).
#[test]
fn reference_is_shift_invariant() {
    for fam in [Family::DeepseekV3, Family::Minicpm3] {
        let c0 = Case::new(fam, small_schedule(), 9);
        let mut sched = small_schedule();
        sched.pos_offset = 3000;
        let c1 = Case::new(fam, sched, 9);
        let (a, b) = (c0.reference(), c1.reference());
        for s in [Stage::Lse, Stage::AttnOut, Stage::SplitLse] {
            let e = stage_error(b.get(s).unwrap(), a.get(s).unwrap()).rel_l2;
            assert!(
                e < 1e-10,
                "{}: {s} moved by {e:e} under a position shift",
                fam.name()
            );
        }
        let e = stage_error(b.get(Stage::QPe).unwrap(), a.get(Stage::QPe).unwrap()).rel_l2;
        assert!(e > 0.1, "q_pe should change with absolute position");
    }
}
