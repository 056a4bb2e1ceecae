//! The mirror's online softmax and lse merge against exact f64 softmax; empty and poisoned parts; bad
//! layer inputs are errors, not panics.

use crate::common;
use approx::{assert_abs_diff_eq, assert_relative_eq};
use common::*;
use mla_diff::backend::cpu::flash::{attend, merge, Partial, TILE};
use mla_diff::backend::cpu::CpuMirror;
use mla_diff::backend::Backend;
use mla_diff::error::Error;
use mla_diff::model::synthetic::Family;
use mla_diff::precision::Dtype;

fn keys(n: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let s = (0..n)
        .map(|j| ((j * 37 % 101) as f32 / 10.0) - 5.0)
        .collect();
    let v = (0..n)
        .map(|j| {
            (0..4)
                .map(|d| ((j * 13 + d * 7) % 17) as f32 - 8.0)
                .collect()
        })
        .collect();
    (s, v)
}

fn exact(s: &[f32], v: &[Vec<f32>]) -> (Vec<f64>, f64) {
    let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let e: Vec<f64> = s.iter().map(|&x| (x as f64 - m).exp()).collect();
    let l: f64 = e.iter().sum();
    let out = (0..4)
        .map(|d| e.iter().zip(v).map(|(p, r)| p * r[d] as f64).sum::<f64>() / l)
        .collect();
    (out, m + l.ln())
}

/// Softmax is shift-invariant, and an exp taken without the running maximum subtracted overflows at
/// scores the goldens and the synthetic families never reach (their scores are small): scores near
/// ±1000 and masked keys, for the reference's softmax (against closed-form values) and the mirror's
/// tiled online softmax (against the exact softmax of the same scores).
#[test]
fn softmax_survives_large_scores() {
    let mut p = [1000.0, 999.0, f64::NEG_INFINITY, -1000.0];
    let lse = mla_diff::reference::softmax_in_place(&mut p);
    let z = 1.0 + (-1f64).exp() + (-2000f64).exp();
    let want = [1.0 / z, (-1f64).exp() / z, 0.0, (-2000f64).exp() / z];
    for (a, b) in p.iter().zip(&want) {
        assert_relative_eq!(*a, *b, epsilon = 0.0, max_relative = 4.0 * f64::EPSILON);
    }
    assert_relative_eq!(
        lse,
        1000.0 + z.ln(),
        epsilon = 0.0,
        max_relative = 4.0 * f64::EPSILON
    );

    let n = 2 * TILE + 3;
    let (s, v) = keys(n);
    let s: Vec<f32> = s.iter().map(|x| x + 1000.0).collect();
    let (out, lse) = exact(&s, &v);
    let p = attend(0..n, 4, Dtype::F32, |j| s[j], |j| &v[j]);
    for (a, b) in p.out.iter().zip(&out) {
        assert_relative_eq!(*a as f64, *b, epsilon = 1e-5, max_relative = 1e-5);
    }
    // An f32 log-sum-exp near 1000 is rounded by up to u·1000.
    assert_abs_diff_eq!(
        p.lse as f64,
        lse,
        epsilon = 1e-5 + 1000.0 * f32::EPSILON as f64
    );
}

#[test]
fn tiled_online_softmax_is_exact_softmax() {
    let n = 3 * TILE + 5;
    let (s, v) = keys(n);
    let p = attend(0..n, 4, Dtype::F32, |j| s[j], |j| &v[j]);
    let (out, lse) = exact(&s, &v);
    assert_abs_diff_eq!(p.lse as f64, lse, epsilon = 1e-5);
    for (a, b) in p.out.iter().zip(&out) {
        assert_relative_eq!(*a as f64, *b, epsilon = 1e-5, max_relative = 1e-5);
    }
    // Split at an odd place and merged by lse: the same attention.
    let a = attend(0..70, 4, Dtype::F32, |j| s[j], |j| &v[j]);
    let b = attend(70..n, 4, Dtype::F32, |j| s[j], |j| &v[j]);
    let m = merge(&[a.clone(), b]);
    assert_abs_diff_eq!(m.lse, p.lse, epsilon = 1e-5);
    for (x, y) in m.out.iter().zip(&p.out) {
        assert_relative_eq!(x, y, epsilon = 1e-5, max_relative = 1e-5);
    }
    // An empty part (lse −inf) has weight 0: the other part comes back unchanged.
    let e = attend(5..5, 4, Dtype::F32, |j| s[j], |j| &v[j]);
    assert_eq!(e, Partial::empty(4));
    assert_eq!(merge(&[e.clone(), a.clone()]), a);
    // A NaN part, or an empty context reported with lse +inf (FA2's convention, vLLM #15492), poisons.
    let nan = Partial {
        out: vec![f32::NAN; 4],
        lse: f32::NAN,
    };
    assert!(merge(&[a.clone(), nan]).out.iter().all(|x| x.is_nan()));
    let plus_inf = Partial {
        out: vec![0.0; 4],
        lse: f32::INFINITY,
    };
    assert!(merge(&[plus_inf, a]).out.iter().all(|x| x.is_nan()));
}

#[test]
fn bad_inputs_are_errors() {
    let c = Case::new(Family::DeepseekV2Lite, small_schedule(), 61);
    let mut m = CpuMirror::new(Dtype::Bf16);
    let short = c.x.slice(ndarray::s![1.., ..]).to_owned();
    let e = m.run_layer(&c.ctx(), &short).unwrap_err();
    assert!(matches!(e, Error::Usage(_)), "{e}");
    let e = mla_diff::reference::run_layer(&c.cfg, &c.w, &c.rope, &short, &c.sched).unwrap_err();
    assert!(matches!(e, Error::Usage(_)), "{e}");
    let mut x = c.x.clone();
    x[[2, 3]] = f64::NAN;
    // A NaN in the input is not rejected: it flows through, as in an engine (free-running mode relies on it).
    let t = m.run_layer(&c.ctx(), &x).unwrap();
    let out = t.get(mla_diff::trace::Stage::AttnOut).unwrap();
    assert!(out.data.iter().any(|v| v.is_nan()));
    let mut w = c.w.clone();
    w.w_uv = w.w_uv.slice(ndarray::s![.., 1.., ..]).to_owned();
    assert!(matches!(
        m.run_layer(
            &mla_diff::backend::LayerCtx {
                weights: &w,
                ..c.ctx()
            },
            &c.x
        ),
        Err(Error::Tensor(_))
    ));
    let other = Case::new(Family::DeepseekV2Lite, busy_schedule(), 61);
    let e = mla_diff::reference::run_layer(&c.cfg, &c.w, &other.rope, &c.x, &c.sched);
    assert!(e.is_ok(), "tables covering more positions are fine");
    let mut sched = c.sched.clone();
    sched.num_splits = 0;
    assert!(matches!(
        m.run_layer(
            &mla_diff::backend::LayerCtx {
                sched: &sched,
                ..c.ctx()
            },
            &c.x
        ),
        Err(Error::Usage(_))
    ));
}
