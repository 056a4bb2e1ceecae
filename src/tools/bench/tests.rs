//! The bench's checks of a configuration: correctness within four roundoffs, fp16 bits read as fp16.

use super::*;

fn bits_of(v: &[f32], dt: Dtype) -> Vec<u16> {
    v.iter()
        .map(|&x| match dt {
            Dtype::F16 => half::f16::from_f32(x).to_bits(),
            _ => half::bf16::from_f32(x).to_bits(),
        })
        .collect()
}

#[test]
fn a_configuration_is_correct_only_finite_and_within_four_roundoffs() {
    for dt in [Dtype::Bf16, Dtype::F16] {
        let want: Vec<f32> = (0..256).map(|i| ((i as f32) * 0.37).sin()).collect();
        let w = bits_of(&want, dt);
        let same = Session::timed("x".into(), (1.0, 1.0), &w, &w, dt);
        assert!(same.correct && same.rel_l2_vs_scalar == 0.0);
        // 10 % off everywhere: far outside 4u of either type.
        let off: Vec<f32> = want.iter().map(|x| x * 1.1).collect();
        let t = Session::timed("x".into(), (1.0, 1.0), &bits_of(&off, dt), &w, dt);
        assert!(!t.correct, "{dt:?}: {}", t.rel_l2_vs_scalar);
        // One NaN: never correct, however close the rest.
        let mut nan = w.clone();
        nan[7] = bits_of(&[f32::NAN], dt)[0];
        let t = Session::timed("x".into(), (1.0, 1.0), &nan, &w, dt);
        assert!(!t.correct && t.non_finite == 1);
    }
}

#[test]
fn fp16_bits_are_read_as_fp16() {
    let h = half::f16::from_f32(1.5).to_bits();
    assert_eq!(bits_to_f64(h, Dtype::F16), 1.5);
    let b = half::bf16::from_f32(1.5).to_bits();
    assert_eq!(bits_to_f64(b, Dtype::Bf16), 1.5);
    assert_ne!(bits_to_f64(h, Dtype::Bf16), 1.5);
}
