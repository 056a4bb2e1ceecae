//! The selection comparison's unit tests: near ties, far flips, NaN, the tails.

use super::*;

fn scores() -> Array2<f64> {
    // Query 3 sees keys 0..=3 with scores 4, 3, 2.9999, 1.
    let mut s = Array2::zeros((4, 4));
    s.row_mut(3)
        .assign(&ndarray::arr1(&[4.0, 3.0, 2.9999, 1.0]));
    s
}

/// One head of one dim, weight 1, q = 1: each key's k is its score; every value with a relative
/// rounding variance 2u².
fn noise(u: f64) -> ScoreNoise {
    let k = Array2::from_shape_vec((4, 1), vec![4.0, 3.0, 2.9999, 1.0]).unwrap();
    ScoreNoise {
        q: Array3::ones((4, 1, 1)),
        vq: Array3::from_elem((4, 1, 1), 2.0 * u * u),
        vk: k.mapv(|x| 2.0 * u * u * x * x),
        k,
        w: Array2::ones((4, 1)),
        vw: Array2::zeros((4, 1)),
    }
}

fn sel(last: Vec<u32>) -> Selection {
    Selection::new(2, vec![vec![0], vec![0, 1], vec![0, 1], last])
}

#[test]
fn a_near_tie_passes_and_a_far_key_fails_with_its_gap() {
    let (s, r, n) = (scores(), sel(vec![0, 1]), noise(2f64.powi(-8)));
    assert!(compare(&s, &n, &r, &r).pass);
    let tie = compare(&s, &n, &r, &sel(vec![0, 2]));
    assert!(tie.pass && tie.within_margin == 2, "{}", tie.summary());
    let far = compare(&s, &n, &r, &sel(vec![0, 3]));
    assert!(!far.pass);
    let m = far.worst.unwrap();
    assert_eq!((m.query, m.key, m.extra), (3, 3, true));
    assert!((m.gap - 2.0).abs() < 1e-12);
    // σ of s_1 − s_3 with q shared: u²·2·(q²(k₁−k₃)² + k₁² + k₃²) = 2u²·(4 + 9 + 1).
    let sigma = 2f64.powi(-8) * (2.0f64 * 14.0).sqrt();
    assert!(
        (m.margin / (MARGIN_SIGMAS * sigma) - 1.0).abs() < 1e-6,
        "{m:?}"
    );
}

#[test]
fn one_key_short_fails_even_inside_the_margin() {
    let r = compare(&scores(), &noise(1.0), &sel(vec![0, 1]), &sel(vec![0]));
    assert!(!r.pass && r.count_mismatch == 1, "{}", r.summary());
}

#[test]
fn nan_scores_never_pass() {
    let mut s = scores();
    s[[3, 2]] = f64::NAN;
    let n = noise(2f64.powi(-8));
    assert!(!compare(&s, &n, &sel(vec![0, 1]), &sel(vec![0, 2])).pass);
}

#[test]
fn tails_match_their_closed_forms() {
    assert!((upper_tail(0.0) - 0.5).abs() < 1e-7);
    assert!((upper_tail(3.0) / 1.349_898e-3 - 1.0).abs() < 1e-5);
    assert!((upper_tail(6.0) / 9.865_876e-10 - 1.0).abs() < 1e-5);
    assert_eq!(poisson_tail(0, 0.3), 1.0);
    assert!((poisson_tail(1, 0.3) - (1.0 - (-0.3f64).exp())).abs() < 1e-15);
    // P(N ≥ 3 | 0.25) = 1 − e^−λ (1 + λ + λ²/2).
    let l: f64 = 0.25;
    let want = 1.0 - (-l).exp() * (1.0 + l + l * l / 2.0);
    assert!((poisson_tail(3, l) / want - 1.0).abs() < 1e-9);
    assert_eq!(poisson_tail(2, 0.0), 0.0);
}

/// Many queries with a key flipped at 4 σ (within the per-key margin) fail the flip count; one passes.
#[test]
fn many_far_flips_fail_one_does_not() {
    // 8 queries of 40 keys, scores 40 − j (top 20 selected); σ of every difference 0.25, so the
    // 20th and 21st keys (1 apart) are 4 σ apart and nothing else is within 8 σ.
    let t = 40;
    let mut s = Array2::zeros((t, t));
    for q in 0..t {
        for j in 0..=q {
            s[[q, j]] = (t - j) as f64;
        }
    }
    let u = 0.25 / 2f64.sqrt();
    let n = ScoreNoise {
        q: Array3::ones((t, 1, 1)),
        vq: Array3::zeros((t, 1, 1)),
        k: Array2::from_shape_fn((t, 1), |(j, _)| (t - j) as f64),
        vk: Array2::from_elem((t, 1), u * u),
        w: Array2::ones((t, 1)),
        vw: Array2::zeros((t, 1)),
    };
    let keys = |swap: &dyn Fn(usize) -> bool| {
        (0..t)
            .map(|q| {
                let mut k: Vec<u32> = (0..=q as u32).take(20).collect();
                if q >= 20 && swap(q) {
                    k[19] = 20;
                }
                k
            })
            .collect()
    };
    let r = Selection::new(20, keys(&|_| false));
    let one = compare(&s, &n, &r, &Selection::new(20, keys(&|q| q == 30)));
    assert!(one.pass && one.far_flip_queries == 1, "{}", one.summary());
    let many = compare(&s, &n, &r, &Selection::new(20, keys(&|q| q >= 28)));
    assert!(many.worst.is_none(), "{}", many.summary());
    assert!(
        !many.pass && many.far_flip_queries == 12,
        "{}",
        many.summary()
    );
    assert!(many.far_flip_p < FLIP_P, "{}", many.summary());
}

/// A head whose logit ReLU cuts adds no noise to that key's score; fp8 keys widen σ by their
/// rounding, in the rotated basis.
#[test]
fn relu_cut_heads_are_silent_and_fp8_widens_the_noise() {
    let mut n = noise(2f64.powi(-8));
    let quiet = n.sigma(3, 0, None);
    n.q[[3, 0, 0]] = -1.0;
    assert!(n.sigma(3, 0, None) < 1e-6 * quiet);
    let o = IndexerOut {
        q: Array3::from_shape_fn((2, 2, 4), |(t, h, d)| 1.0 + (t + h + d) as f64 * 0.1),
        k: Array2::from_shape_fn((2, 4), |(t, d)| 1.0 - (t + d) as f64 * 0.2),
        k_lin: Array2::from_shape_fn((2, 4), |(t, d)| 2.0 - (t + d) as f64 * 0.3),
        k_gain: Array2::ones((2, 4)),
        weights: Array2::ones((2, 2)),
        weights_sq: Array2::ones((2, 2)),
        in_dims: (8, 4),
        scores: Array2::zeros((2, 2)),
        selection: Selection::dense(2, 2),
    };
    let bf = ScoreNoise::new(&o, Dtype::Bf16, KeyPrecision::Storage).sigma(1, 0, Some(1));
    let f8 = ScoreNoise::new(&o, Dtype::Bf16, KeyPrecision::Fp8).sigma(1, 0, Some(1));
    assert!(f8 > 2.0 * bf, "bf16 {bf:.3e} fp8 {f8:.3e}");
}
