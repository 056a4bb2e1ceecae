//! The cache formats' element types: e4m3fn (through the `float8` crate), e2m1 (fp4, by hand) and
//! ue8m0 (a power-of-two scale byte), with half their spacing at a value (the rounding bound's unit).

/// The largest finite float8 e4m3fn value (OCP / `cuda_fp8.hpp`).
pub const E4M3_MAX: f32 = 448.0;
/// The largest finite e4m3fnuz value (AMD's fp8): a writer saturating there instead of at 448 is a
/// fault (`kv_saturate_240`).
pub const E4M3_FNUZ_MAX: f32 = 240.0;
/// The largest e2m1 value.
pub const E2M1_MAX: f32 = 6.0;

/// Nearest e4m3fn value of `y` (ties to even; beyond ±448 saturates to ±448, as `__NV_SATFINITE`;
/// NaN stays NaN), through the `float8` crate (cuda_fp8.hpp's conversion).
pub fn e4m3_round(y: f64) -> f64 {
    float8::F8E4M3::from_f64(y).to_f64()
}

pub fn e4m3_bits(y: f32) -> u8 {
    float8::F8E4M3::from_f32(y).to_bits()
}

pub fn e4m3_value(b: u8) -> f32 {
    float8::F8E4M3::from_bits(b).to_f32()
}

/// `x` on the e4m3 grid of the scale `s`: e4m3(x / s)·s, the division and product in f32 as a q_fp8
/// runner's cast does (`meta.q_scale`, a power of two: the product is exact).
pub fn e4m3_on_grid(x: f64, s: f32) -> f64 {
    f64::from(e4m3_value(e4m3_bits(x as f32 / s)) * s)
}

/// Half the spacing of e4m3 numbers at |y| (y already divided by its scale): 2^(e−4) in the binade
/// 2^e (normal, e ≥ −6), 2^−10 below it.
pub fn e4m3_half_step(y: f64) -> f64 {
    let a = y.abs().min(E4M3_MAX as f64);
    let e = if a > 0.0 { a.log2().floor() as i32 } else { -6 };
    2f64.powi(e.max(-6) - 4)
}

/// The most rounding P (≤ 1, against its row's max) to e4m3 moves it, a kernel rounding it against a
/// running max no larger (P' = p·r, r ≥ 1, scaled back by 1/r): half a step wherever P' sits, 2⁻⁴·p in
/// e4m3's normal range, else at most 2⁻¹⁰ (half the subnormal step) and at most p (flushed to 0).
/// FlashMLA's dense fp8 decode rounds P so (`conventions.p_fp8`).
pub fn p_e4m3_half_step(p: f64) -> f64 {
    let p = p.abs();
    (p * 2f64.powi(-4)).max(p.min(2f64.powi(-10)))
}

/// The e2m1 magnitudes by code (sign in bit 3).
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The e2m1 code of `y`: nearest magnitude, ties to the even code, saturating at ±6; NaN → 0 (e2m1
/// has none).
pub fn e2m1_bits(y: f32) -> u8 {
    let a = y.abs();
    if a.is_nan() {
        return 0;
    }
    let mut best = 0u8;
    for c in 1..8u8 {
        let (d, db) = (
            (E2M1[c as usize] - a).abs(),
            (E2M1[best as usize] - a).abs(),
        );
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    best | if y.is_sign_negative() { 8 } else { 0 }
}

pub fn e2m1_value(b: u8) -> f32 {
    let m = E2M1[(b & 7) as usize];
    if b & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Half the spacing of e2m1 numbers at |y|: 0.25 below 2, 0.5 in [2, 4), 1 from 4 on.
pub fn e2m1_half_step(y: f64) -> f64 {
    match y.abs() {
        a if a < 2.0 => 0.25,
        a if a < 4.0 => 0.5,
        _ => 1.0,
    }
}

/// 2^⌈log2 s⌉ exactly (s > 0 finite): an exact power of two is its own ceiling.
pub fn pow2_ceil(s: f32) -> f32 {
    let bits = s.to_bits();
    let e = ((bits >> 23) & 0xff) as i32 - 127;
    let e = if bits & 0x7f_ffff == 0 { e } else { e + 1 };
    2f32.powi(e)
}

/// A ue8m0 byte (an unsigned exponent, value 2^(b − 127)) of a power of two.
pub(super) fn ue8m0_bits(s: f32) -> u8 {
    ((s.to_bits() >> 23) & 0xff) as u8
}

pub(super) fn ue8m0_value(b: u8) -> f32 {
    f32::from_bits((b as u32) << 23)
}
#[cfg(test)]
mod tests {
    use super::*;

    /// Every e4m3fn code: decodes to the value its bits spell (sign, 4-bit exponent with bias 7, 3-bit
    /// mantissa; 0x7f/0xff NaN), and every finite value encodes back to its own code.
    #[test]
    fn e4m3_every_code() {
        for b in 0..=255u8 {
            let (s, e, m) = ((b >> 7) as i32, ((b >> 3) & 0xf) as i32, (b & 7) as f64);
            let v = e4m3_value(b);
            if b & 0x7f == 0x7f {
                assert!(v.is_nan(), "{b:#x}");
                continue;
            }
            let mag = match e {
                0 => m / 8.0 * 2f64.powi(-6),
                _ => (1.0 + m / 8.0) * 2f64.powi(e - 7),
            };
            let want = if s == 1 { -mag } else { mag };
            assert_eq!(v as f64, want, "{b:#x}");
            // −0 encodes as 0x80; every other value as its own code.
            assert_eq!(e4m3_bits(v), b, "{b:#x} = {v}");
        }
    }

    /// Between every two neighbouring positive e4m3 values: just below the midpoint rounds down, just
    /// above up, the midpoint to the even code; and the error is within `e4m3_half_step`.
    #[test]
    fn e4m3_rounds_to_nearest_even_everywhere() {
        let vals: Vec<f64> = (0..0x7fu8).map(|b| e4m3_value(b) as f64).collect();
        for (k, w) in vals.windows(2).enumerate() {
            let (a, b) = (w[0], w[1]);
            let mid = (a + b) / 2.0;
            let eps = (b - a) * 1e-3;
            assert_eq!(e4m3_round(mid - eps), a);
            assert_eq!(e4m3_round(mid + eps), b);
            let even = if k % 2 == 0 { a } else { b };
            assert_eq!(e4m3_round(mid), even, "tie between {a} and {b}");
            for y in [a, mid - eps, mid, mid + eps, b] {
                assert!((e4m3_round(y) - y).abs() <= e4m3_half_step(y), "{y}");
            }
        }
        assert_eq!(e4m3_round(1e6), 448.0, "saturates");
        assert_eq!(e4m3_round(-500.0), -448.0);
    }

    /// Every e2m1 code, its round trip, and nearest-even rounding at every midpoint.
    #[test]
    fn e2m1_every_code_and_midpoint() {
        for b in 0..16u8 {
            let v = e2m1_value(b);
            let want = if b == 8 { 0 } else { b }; // −0 → +0's code is fine either way
            assert_eq!(e2m1_bits(v) & if b == 8 { 7 } else { 15 }, want, "{b}");
        }
        // (midpoint, the even code's value)
        for (mid, want) in [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
        ] {
            assert_eq!(e2m1_value(e2m1_bits(mid)), want, "{mid}");
            assert_eq!(e2m1_value(e2m1_bits(-mid)), -want, "-{mid}");
            assert_eq!(e2m1_value(e2m1_bits(mid + 0.01)), {
                let up = E2M1.iter().copied().find(|&v| v > mid).unwrap();
                up
            });
        }
        assert_eq!(e2m1_value(e2m1_bits(100.0)), 6.0);
        for i in 0..=700 {
            let y = i as f64 / 100.0;
            let q = e2m1_value(e2m1_bits(y as f32)) as f64;
            assert!(
                (q - y).abs() <= e2m1_half_step(y) + 1e-9 || y > 6.0,
                "{y} → {q}"
            );
        }
    }

    #[test]
    fn pow2_and_ue8m0() {
        assert_eq!(pow2_ceil(3.5 / 448.0), 2f32.powi(-7));
        assert_eq!(pow2_ceil(3.0 / 448.0), 2f32.powi(-7));
        assert_eq!(pow2_ceil(1e-4), 2f32.powi(-13));
        for e in -30..30 {
            let s = 2f32.powi(e);
            assert_eq!(ue8m0_value(ue8m0_bits(s)), s);
        }
    }
}
