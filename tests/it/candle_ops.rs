//! Our rope, RMSNorm and softmax against candle-nn's (`rope_i`, `rope`, `rms_norm`, `softmax_last_dim`):
//! an implementation of each op written by others, on random f32 data at real model sizes.
//!
//! The goldens (golden/) pin the fp64 reference's *whole attention* to transformers on tiny models (rope
//! dim 16, positions 0..23, activations of unit scale). These checks pin single ops where the goldens
//! cannot look:
//! - rope: the f32 cos/sin tables as kernels receive them (`RopeTables::to_f32`, `[n_pos, dim/2]`) are
//!   the layout the standard implementation reads, at rope dim 64 and positions near 160k. The reference
//!   never reads `to_f32`, so a transposed or misaligned kernel table passes every golden and every CPU
//!   test and shows only on a GPU.
//! - RMSNorm: rows whose mean square is the size of eps, where eps added outside the square root, or a
//!   sum where the mean belongs, changes the result by O(1); at the goldens' scales it is below their
//!   1e-6 tolerance.
//! - softmax: scores of ±1000 and masked (−inf) keys; an exp without the max subtracted overflows there
//!   and passes the goldens, whose scores are small.
//!
//! Tolerances are f32 rounding bounds, u = 2⁻²⁴ (derived at each check).

use approx::relative_eq;
use candle_core::{Device, Tensor};
use mla_diff::backend::cpu::ops;
use mla_diff::backend::Dtype;
use mla_diff::input::random_hidden;
use mla_diff::model::synthetic::Family;
use mla_diff::model::RopePairing;
use mla_diff::reference::{front, softmax_in_place};
use mla_diff::rope::RopeTables;
use ndarray::{Array1, Array2};

const U: f64 = f32::EPSILON as f64 / 2.0;

fn f32s(a: &Array2<f64>) -> Vec<f32> {
    a.iter().map(|&v| v as f32).collect()
}

/// Both pairings (NORM = candle's `rope_i`, NEOX = `rope`), YaRN magnitude and all, on `[1, H, T, 64]`.
#[test]
fn rope_matches_candle_nn_both_pairings() {
    let (heads, t, pos0) = (3, 9, 163_830);
    for fam in [Family::DeepseekV3, Family::Minicpm3] {
        let mut rope = fam.test_config().rope;
        rope.dim = 64;
        let half = rope.dim / 2;
        let tables = RopeTables::new(&rope, None, pos0, t).unwrap();
        let (cos, sin) = tables.to_f32();
        let x = f32s(&random_hidden(rope.dim, heads * t, 11)); // [H·T, 64] = [1, H, T, 64]

        let dev = Device::Cpu;
        let xs = Tensor::from_vec(x.clone(), (1, heads, t, rope.dim), &dev).unwrap();
        let c = Tensor::from_vec(cos.clone(), (t, half), &dev).unwrap();
        let s = Tensor::from_vec(sin.clone(), (t, half), &dev).unwrap();
        let theirs = match rope.pairing {
            RopePairing::Norm => candle_nn::rotary_emb::rope_i(&xs, &c, &s),
            RopePairing::Neox => candle_nn::rotary_emb::rope(&xs, &c, &s),
        }
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();

        for (r, (v, want)) in x.chunks(rope.dim).zip(theirs.chunks(rope.dim)).enumerate() {
            let tt = r % t;
            // The mirror's f32 rope with the kernel tables, and the reference's f64 rope with its own.
            let mut mirror = v.to_vec();
            let (cs, sn) = (&cos[tt * half..][..half], &sin[tt * half..][..half]);
            ops::rope(&mut mirror, cs, sn, rope.pairing, Dtype::F32);
            let mut reference: Vec<f64> = v.iter().map(|&a| a as f64).collect();
            tables.rotate(tt, &mut reference);
            for i in 0..half {
                let (a, b) = mla_diff::rope::pair(rope.pairing, rope.dim, i);
                // x0·c − x1·s in f32: two products and a sum, each rounded (≤ u of |x0·c| + |x1·s|
                // each side), plus the rounding of c and s to f32 on candle's side against the f64
                // reference: 4u·(|x0·c| + |x1·s|) covers either comparison.
                let scale = (v[a].abs() * cs[i].abs()
                    + v[b].abs() * sn[i].abs()
                    + v[a].abs() * sn[i].abs()
                    + v[b].abs() * cs[i].abs()) as f64;
                let bound = 4.0 * U * scale;
                for k in [a, b] {
                    let w = want[k] as f64;
                    let what = format!("{} row {r} elem {k}", fam.name());
                    assert!((mirror[k] as f64 - w).abs() <= bound, "mirror {what}");
                    assert!((reference[k] - w).abs() <= bound, "reference {what}");
                }
            }
        }
    }
}

/// RMSNorm rows of unit scale and rows whose mean square is eps itself.
#[test]
fn rms_norm_matches_candle_nn() {
    let (n, rows, eps) = (512, 6, 1e-6);
    let mut x = random_hidden(n, rows, 12);
    for r in 3..rows {
        x.row_mut(r).mapv_inplace(|v| v * 1e-3); // mean square ≈ 1e-6 = eps
    }
    let x32 = x.mapv(|v| v as f32);
    let w = Array1::from_iter((0..n).map(|i| 0.5 + (i % 7) as f32 / 8.0));

    let dev = Device::Cpu;
    let xs = Tensor::from_vec(x32.iter().copied().collect::<Vec<_>>(), (rows, n), &dev).unwrap();
    let ws = Tensor::from_vec(w.to_vec(), n, &dev).unwrap();
    let theirs = candle_nn::ops::rms_norm(&xs, &ws, eps as f32).unwrap();
    let theirs = theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap();

    let mirror = ops::rms_norm(x32.view(), &w, eps, Dtype::F32);
    let reference = front::rms_norm(x32.mapv(f64::from).view(), &w, eps);
    // f32 sum of n squares: relative error ≤ n·u; the square root halves it; eps, the division, the
    // reciprocal and the two products add a few u. Each f32 side is within (n/2 + 6)·u of exact.
    let rel = (n as f64 / 2.0 + 6.0) * U;
    for ((&t, &m), &r) in theirs.iter().zip(mirror.iter()).zip(reference.iter()) {
        let t = t as f64;
        assert!(
            relative_eq!(r, t, epsilon = 0.0, max_relative = rel),
            "reference {r} vs {t}"
        );
        assert!(
            relative_eq!(m as f64, t, epsilon = 0.0, max_relative = 2.0 * rel),
            "mirror {m} vs {t}"
        );
    }
}

/// Softmax over 200 keys with scores up to ±1000 and a few masked keys (−inf).
#[test]
fn softmax_matches_candle_nn() {
    let (n, rows) = (200, 5);
    let mut s = random_hidden(n, rows, 13).mapv(|v| (v * 300.0) as f32);
    for r in 0..rows {
        s[[r, (7 * r) % n]] = f32::NEG_INFINITY;
        s[[r, (11 * r + 3) % n]] = 1000.0;
    }
    let dev = Device::Cpu;
    let ts = Tensor::from_vec(s.iter().copied().collect::<Vec<_>>(), (rows, n), &dev).unwrap();
    let theirs = candle_nn::ops::softmax_last_dim(&ts).unwrap();
    let theirs = theirs.to_vec2::<f32>().unwrap();
    for (r, want) in theirs.iter().enumerate() {
        let mut ours: Vec<f64> = s.row(r).iter().map(|&v| v as f64).collect();
        softmax_in_place(&mut ours);
        let m = s.row(r).iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        for (j, (&p, &q)) in ours.iter().zip(want).enumerate() {
            // candle: s − max rounded (≤ u·|s − max| absolute, so exp's relative error grows by that),
            // exp (≤ 2u), a sum of n terms (≤ n·u), a division (u); below f32's normal range, absolute.
            // A masked key: p = 0, so only the absolute term is left.
            let d = (s[[r, j]] as f64 - m).abs();
            let d = if d.is_finite() { d } else { 0.0 };
            let bound = p * (d + n as f64 + 4.0) * U + f32::MIN_POSITIVE as f64;
            assert!(
                p.is_finite() && (p - q as f64).abs() <= bound,
                "row {r} key {j}: {p} vs {q}"
            );
        }
    }
}
