//! FlashMLA's fp8 cache for sparse decode (`V32_FP8Sparse`, 656 bytes per token), as the values a kernel
//! reads: the 512 latent values in e4m3fn, 4 tiles of 128 columns each with a float32 scale, the 64 rope
//! values in bf16. The convention is FlashMLA's tests/quant.py (`quantize_k_cache`): a tile's scale is
//! amax/448 rounded up to a power of two (floor 1e-4), its values round(x/scale) to e4m3 (nearest, ties to
//! even), read back as value·scale. mla-diff applies it to the rows it sent a runner that declares
//! `kv_cache: fp8_v32` (runners/flashmla_fp8.py writes the bytes the same way), for the fp64 yardstick
//! over the cache the kernel reads. The bytes are `kv_format`'s `fp8_ds_mla` (same layout, same scale
//! rule), so the rows go through its `Codec`; the tests hold FlashMLA's convention written out on its
//! own and check the two agree.

/// The `kv_cache` name a runner's op declares for this format.
pub const FP8_V32: &str = "fp8_v32";

use crate::kv_format::{Codec, KvFormat};

/// One cache row `[latent (4·128) | rope]` as the kernel reads it from the fp8 cache (`fp8_ds_mla`'s
/// round trip): the latent through e4m3 with its tile's scale, the rope rounded to bf16. A row with a
/// non-finite value stays as it is (an unwritten slot: the runner writes NaN there).
pub fn dequantize_row(row: &[f64], lkv: usize) -> Vec<f64> {
    if row.iter().any(|v| !v.is_finite()) {
        return row.to_vec();
    }
    let f: Vec<f32> = row.iter().map(|&v| v as f32).collect();
    Codec::new(KvFormat::Fp8DsMla, lkv, row.len() - lkv)
        .round_trip(&f)
        .into_iter()
        .map(f64::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TILE: usize = 128;
    const E4M3_MAX: f32 = 448.0;

    /// Nearest float8 e4m3fn value of `y` (|y| ≤ 448; ties to even), through the `float8` crate
    /// (cuda_fp8.hpp's conversion, from the f64 itself); non-finite values pass unchanged.
    fn e4m3_round(y: f64) -> f64 {
        if !y.is_finite() {
            return y;
        }
        float8::F8E4M3::from_f64(y).to_f64()
    }

    /// A tile's scale from its values (bf16 values, as the runner holds them in float32): 2^⌈log2
    /// max(amax/448, 1e-4)⌉, the division in float32 as FlashMLA's quantizer does it.
    fn tile_scale(tile: &[f64]) -> f32 {
        let amax = tile.iter().fold(0f32, |m, &v| m.max((v as f32).abs()));
        let s = (amax / E4M3_MAX).max(1e-4f32);
        // ⌈log2 s⌉ exactly: s = m·2^e with m in [1, 2); an exact power of two is its own ceiling.
        let bits = s.to_bits();
        let e = ((bits >> 23) & 0xff) as i32 - 127;
        let e = if bits & 0x7f_ffff == 0 { e } else { e + 1 };
        2f32.powi(e)
    }

    /// One cache row `[latent (4·128) | rope]` as the kernel reads it from the fp8 cache: the latent through
    /// e4m3 with its tile's scale, the rope rounded to bf16. A row with a non-finite value stays as it is
    /// (an unwritten slot: the runner writes NaN there).
    fn reference_row(row: &[f64], lkv: usize) -> Vec<f64> {
        if row.iter().any(|v| !v.is_finite()) {
            return row.to_vec();
        }
        let mut out = Vec::with_capacity(row.len());
        for tile in row[..lkv].chunks(TILE) {
            let s = tile_scale(tile) as f64;
            out.extend(tile.iter().map(|&v| e4m3_round(v as f32 as f64 / s) * s));
        }
        out.extend(row[lkv..].iter().map(|&v| half::bf16::from_f64(v).to_f64()));
        out
    }

    #[test]
    fn e4m3_rounds_to_the_known_values() {
        // (input, nearest e4m3fn): the largest finite value, a normal and a subnormal, ties to even in
        // a normal binade (1.0625 between 1 and 1.125 → 1; 1.1875 → 1.25; 17 → 16; 19 → 20) and at
        // the subnormal floor (2⁻¹⁰ between 0 and 2⁻⁹ → 0), and a value in the top binade (step 32).
        for (x, want) in [
            (448.0, 448.0),
            (1.0, 1.0),
            (-1.75, -1.75),
            (2f64.powi(-9), 2f64.powi(-9)),
            (0.875 * 2f64.powi(-6), 0.875 * 2f64.powi(-6)),
            (1.0625, 1.0),
            (1.1875, 1.25),
            (17.0, 16.0),
            (19.0, 20.0),
            (2f64.powi(-10), 0.0),
            (3.0 * 2f64.powi(-11), 2f64.powi(-9)),
            (300.0, 288.0),
            (-0.3, -0.3125),
        ] {
            assert_eq!(e4m3_round(x), want, "e4m3({x})");
        }
    }

    #[test]
    fn a_tile_scale_is_amax_over_448_rounded_up_to_a_power_of_two() {
        assert_eq!(tile_scale(&[3.5, -1.0]), 2f32.powi(-7)); // 3.5/448 = 2⁻⁷ exactly
        assert_eq!(tile_scale(&[-3.0, 1.0]), 2f32.powi(-7)); // 3/448 = 0.0067 → 2⁻⁷
        assert_eq!(tile_scale(&[4.0]), 2f32.powi(-6));
        assert_eq!(tile_scale(&[0.0; 4]), 2f32.powi(-13)); // the 1e-4 floor → 2⁻¹³
    }

    #[test]
    fn a_dequantized_row_is_within_half_a_step_of_its_tile() {
        let row: Vec<f64> = (0..576)
            .map(|i| {
                half::bf16::from_f64(((i * 37 % 101) as f64 - 50.0) * 0.013 * (1 + i / 128) as f64)
                    .to_f64()
            })
            .collect();
        let d = reference_row(&row, 512);
        for (t, tile) in row[..512].chunks(128).enumerate() {
            let s = tile_scale(tile) as f64;
            for (k, &v) in tile.iter().enumerate() {
                let e = (d[t * 128 + k] - v).abs();
                // Half the spacing at v/s (≤ 2⁻⁴ of it, or 2⁻¹⁰ below the normal range), times s.
                let bound = (v.abs() / s * 2f64.powi(-4)).max(2f64.powi(-10)) * s;
                assert!(
                    e <= bound,
                    "tile {t} [{k}]: {v} → {} (bound {bound})",
                    d[t * 128 + k]
                );
            }
        }
        assert_eq!(&d[512..], &row[512..]);
        assert!(d != row, "the round trip changes a row of such values");
    }

    #[test]
    fn the_codec_reads_back_what_flashmlas_convention_does() {
        // fp8_v32 = kv_format's fp8_ds_mla: rows at many scales (zeros, the 1e-4 floor, subnormal
        // quotients, outliers, ties), bf16-valued as a runner holds them, the rope included.
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for k in 0..64 {
            let row: Vec<f64> = (0..576)
                .map(|i| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let u = (rng >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
                    let mag = 2f64.powi(k % 16 - 12 + i % 7);
                    let v = if k % 9 == 0 && i < 128 { 0.0 } else { u * mag };
                    half::bf16::from_f64(v).to_f64()
                })
                .collect();
            assert_eq!(
                dequantize_row(&row, 512),
                reference_row(&row, 512),
                "row {k}"
            );
        }
        let nan: Vec<f64> = vec![f64::NAN; 576];
        assert!(dequantize_row(&nan, 512).iter().all(|v| v.is_nan()));
    }
}
