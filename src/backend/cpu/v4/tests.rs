//! The V4 mirror against the fp64 reference on the transformers golden's file, and its forward passes.

use super::V4Mirror;
use crate::faults::Active;
use crate::gguf::GgufFile;
use crate::model::v4::{V4Config, V4Weights};
use crate::precision::Dtype;
use crate::reference::v4::{run_layer_selecting, V4Layer};
use std::ops::Range;

fn golden() -> (GgufFile, V4Config) {
    let p =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden/deepseek-v4.gguf");
    let f = GgufFile::open(&p).unwrap();
    let c = V4Config::from_gguf(&f).unwrap();
    (f, c)
}

/// A prompt of 136 in chunks of 64 (past the window of 16 and HCA's 128), then 6 decode steps.
fn passes() -> Vec<Range<usize>> {
    let mut v = vec![0..64, 64..128, 128..136];
    v.extend((136..142).map(|t| t..t + 1));
    v
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let (mut n, mut d) = (0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        if x.is_finite() && y.is_finite() {
            n += (x - y) * (x - y);
            d += y * y;
        }
    }
    (n / d.max(f64::MIN_POSITIVE)).sqrt()
}

fn stages(l: &V4Layer) -> Vec<(crate::trace::V4Stage, Vec<usize>, Vec<f64>)> {
    l.stages()
}

/// In f32 the mirror is the reference up to f32 rounding at every stage of every layer kind (the
/// attention judged on the mirror's own selection, as `run` does); in bf16 within a few percent.
#[test]
fn mirror_follows_the_reference_at_every_stage() {
    let (f, c) = golden();
    let x = crate::input::random_hidden(c.hidden, 142, 3);
    for (dt, bound) in [(Dtype::F32, 2e-5), (Dtype::Bf16, 3e-2)] {
        for l in 0..3 {
            let w = V4Weights::load(&f, &c, l).unwrap();
            let o = V4Mirror::new(dt).run_layer(&c, &w, l, x.view(), &passes(), Active::NONE);
            let r = run_layer_selecting(&c, &w, l, x.view(), o.topk_indices.as_ref());
            let (rs, os) = (stages(&r), stages(&o));
            assert_eq!(rs.len(), os.len(), "layer {l}");
            for ((s, rsh, rv), (_, osh, ov)) in rs.iter().zip(&os) {
                assert_eq!(rsh, osh, "layer {l} {}", s.name());
                if *s == crate::trace::V4Stage::TopkIndices {
                    continue;
                }
                let e = rel(ov, rv);
                assert!(
                    e < bound,
                    "{} layer {l} {}: rel-L2 {e:.3e}",
                    dt.name(),
                    s.name()
                );
            }
        }
    }
}

/// The compressors carry their state across forward passes: one pass or a prompt in chunks and
/// decode steps give the same bits.
#[test]
fn forward_passes_do_not_change_a_bit() {
    let (f, c) = golden();
    let x = crate::input::random_hidden(c.hidden, 142, 5);
    for l in 1..3 {
        let w = V4Weights::load(&f, &c, l).unwrap();
        let m = V4Mirror::new(Dtype::Bf16);
        let one = m.run_layer(
            &c,
            &w,
            l,
            x.view(),
            std::slice::from_ref(&(0..142)),
            Active::NONE,
        );
        let many = m.run_layer(&c, &w, l, x.view(), &passes(), Active::NONE);
        for ((s, _, a), (_, _, b)) in stages(&one).iter().zip(&stages(&many)) {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "layer {l} {}", s.name());
        }
    }
}
