//! The two fp64 references agree to f64 rounding on every synthetic family, and their split partials
//! recombine to the full attention; a layout misread in one of them shows up.

use crate::common;
use common::*;
use mla_diff::model::synthetic::Family;
use mla_diff::reference::{absorbed, front, mha, softmax_in_place};
use mla_diff::trace::{Stage, StageTensor};
use ndarray::{s, Array, Dimension};

fn st<D: Dimension>(s: Stage, a: &Array<f64, D>) -> StageTensor {
    StageTensor::new(s, a.shape().to_vec(), a.iter().copied().collect())
}

fn rel(a: &StageTensor, b: &StageTensor) -> f64 {
    stage_error(a, b).rel_l2
}

#[test]
fn a_and_b_agree_on_every_family() {
    for fam in Family::ALL {
        let c = Case::new(fam, busy_schedule(), 5);
        let t = c.sched.total_tokens();
        let f = front::front(&c.cfg, &c.w, &c.rope, c.x.view());
        let a = mha::attention(&c.cfg, &c.w, &f);
        let (_, b) = absorbed::attention(&c.cfg, &c.w, &f, 0..t);
        for (stage, x, y) in [
            (Stage::Lse, st(Stage::Lse, &a.lse), st(Stage::Lse, &b.lse)),
            (
                Stage::AttnHeads,
                st(Stage::AttnHeads, &a.heads),
                st(Stage::AttnHeads, &b.heads),
            ),
            (
                Stage::AttnOut,
                st(Stage::AttnOut, &a.out),
                st(Stage::AttnOut, &b.out),
            ),
        ] {
            let e = rel(&x, &y);
            println!("{} {stage}: A vs B rel-L2 {e:.2e}", fam.name());
            assert!(e <= 1e-12, "{}: {stage} A vs B rel-L2 {e:e}", fam.name());
        }
    }
}

/// Merging the exact split partials by lse gives the full latent attention and lse of the decode tokens.
#[test]
fn split_partials_recombine() {
    for (fam, sched) in [
        (Family::DeepseekV3, small_schedule()),
        (Family::Minicpm3, busy_schedule()),
    ] {
        let must_have_empty = sched.prompt_len < 10;
        let c = Case::new(fam, sched, 6);
        let tr = c.reference();
        let (so, sl) = (
            tr.get(Stage::SplitOut).unwrap(),
            tr.get(Stage::SplitLse).unwrap(),
        );
        let (d, h, ns, lkv) = (so.shape[0], so.shape[1], so.shape[2], so.shape[3]);
        let mut empty = 0;
        let mut lat = vec![0.0; d * h * lkv];
        let mut lse = vec![0.0; d * h];
        for i in 0..d * h {
            let l = &sl.data[i * ns..(i + 1) * ns];
            empty += l.iter().filter(|v| **v == f64::NEG_INFINITY).count();
            let mut wts = l.to_vec();
            lse[i] = softmax_in_place(&mut wts);
            for (k, wk) in wts.iter().enumerate() {
                for j in 0..lkv {
                    lat[i * lkv + j] += wk * so.data[(i * ns + k) * lkv + j];
                }
            }
        }
        assert!(
            !must_have_empty || empty > 0,
            "the schedule should leave some splits empty"
        );
        let full_lse = tr.get(Stage::Lse).unwrap();
        let p = c.sched.prompt_len * h;
        let lse_ref = StageTensor::new(Stage::Lse, vec![d, h], full_lse.data[p..].to_vec());
        let e1 = rel(&StageTensor::new(Stage::Lse, vec![d, h], lse), &lse_ref);
        let e2 = rel(
            &StageTensor::new(Stage::AttnLatent, vec![d, h, lkv], lat),
            tr.get(Stage::AttnLatent).unwrap(),
        );
        assert!(
            e1 <= 1e-12 && e2 <= 1e-12,
            "{}: lse {e1:e}, latent {e2:e}",
            fam.name()
        );
    }
}

/// Negative control: B reading `attn_k_b` in its file orientation (`[H, Lkv, P]` memory taken as
/// `[H, P, Lkv]`) disagrees with A far beyond the 1e-12 bound.
#[test]
fn a_vs_b_catches_a_k_b_misread() {
    let c = Case::new(Family::DeepseekV3, busy_schedule(), 7);
    let t = c.sched.total_tokens();
    let f = front::front(&c.cfg, &c.w, &c.rope, c.x.view());
    let a = mha::attention(&c.cfg, &c.w, &f);
    let mut bad = c.w.clone();
    let file_order: Vec<f32> =
        c.w.w_uk
            .view()
            .permuted_axes([0, 2, 1])
            .iter()
            .copied()
            .collect();
    bad.w_uk = Array::from_shape_vec(c.w.w_uk.raw_dim(), file_order).unwrap();
    let (_, b) = absorbed::attention(&c.cfg, &bad, &f, 0..t);
    let e = rel(&st(Stage::AttnOut, &a.out), &st(Stage::AttnOut, &b.out));
    assert!(e > 1e-2, "misread W_UK went unnoticed: rel-L2 {e:e}");
    // The first token attends only to itself: its output does not depend on W_UK at all.
    let e0 = (&a.out.slice(s![0, ..]) - &b.out.slice(s![0, ..]))
        .mapv(f64::abs)
        .sum();
    assert!(e0 < 1e-9);
}
