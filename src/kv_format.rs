//! The MLA latent cache's byte formats as serving engines store them: one token's row `[latent (Lkv) |
//! k_pe (R)]` encoded to bytes and decoded back to the values a kernel reads, for the formats of
//! docs/cache-formats.md (layouts, scale rules and their sources):
//!
//! - `auto`: the run's dtype (bf16/fp16/f32), as before this module: the row stored as computed;
//! - `fp8`: e4m3 over the whole row with one f32 scale per layer (vLLM `fp8`, FlashMLA dense fp8,
//!   TRITON_MLA fp8);
//! - `fp8_ds_mla`: 656 B, 512 e4m3 + 4 f32 scales (one per 128) + 64 bf16 rope (DeepSeek-V3.2, FlashMLA
//!   sparse); `fp8_ds_mla_nope`: the same ABI for a NoPE model, the rope bytes reserved;
//! - `fp8_v41`: FlashMLA V4.1, 528 B, 512 e4m3 (rope included) + 16 ue8m0 scales (one per 32);
//! - `fp4_v41`: FlashMLA V4.1, 288 B, 256 B of e2m1 pairs + 32 e4m3 scales (one per 16).
//!
//! Each quantized value is `round(x / s)` in its element type (saturating, nearest, ties to even) and
//! reads back as `q · s` in f32. Scales follow the rule documented per format, from the row (or, for
//! `fp8`, the layer's rows: a calibrated `k_scale`). [`Codec::bound`] is the format's rounding bound per
//! element: what the judge allows `cache_rows` to differ from the rows the path stored.
//!
//! Planted bugs of a cache writer or reader (`crate::faults`: `kv_scale_twice`, `kv_scale_inverted`,
//! `kv_rope_quantized`, `kv_scale_wrong_group`, `kv_saturate_240`) live here, each at the one line it
//! changes.

use crate::faults::{Active, Fault};
use half::bf16;

/// The largest finite float8 e4m3fn value (OCP / `cuda_fp8.hpp`).
pub const E4M3_MAX: f32 = 448.0;
/// The largest finite e4m3fnuz value (AMD's fp8): a writer saturating there instead of at 448 is a
/// fault (`kv_saturate_240`).
pub const E4M3_FNUZ_MAX: f32 = 240.0;
/// The largest e2m1 value.
pub const E2M1_MAX: f32 = 6.0;
/// FlashMLA's floor on a tile's `amax / 448` (tests/quant.py), so that an all-zero tile has a scale.
const SCALE_FLOOR: f32 = 1e-4;

/// How the optimized path stores its latent cache (`run --kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, clap::ValueEnum)]
pub enum KvFormat {
    /// The run's dtype (bf16, fp16 or f32): the rows as computed.
    #[default]
    Auto,
    /// e4m3 over the whole row, one f32 scale per layer (vLLM `fp8` / `fp8_e4m3`).
    #[value(name = "fp8", alias = "fp8_e4m3")]
    Fp8,
    /// 656 B/token: 512 e4m3, 4 f32 scales (per 128), 64 bf16 rope.
    #[value(name = "fp8_ds_mla")]
    Fp8DsMla,
    /// 656 B/token for a NoPE model: 512 e4m3, 4 f32 scales, 128 reserved bytes.
    #[value(name = "fp8_ds_mla_nope")]
    Fp8DsMlaNope,
    /// FlashMLA V4.1 fp8, 528 B/token: 512 e4m3 (rope included), 16 ue8m0 scales (per 32).
    #[value(name = "fp8_v41")]
    Fp8V41,
    /// FlashMLA V4.1 fp4, 288 B/token: 512 e2m1 (2 per byte), 32 e4m3 scales (per 16).
    #[value(name = "fp4_v41")]
    Fp4V41,
}

impl KvFormat {
    pub const ALL: [KvFormat; 6] = [
        KvFormat::Auto,
        KvFormat::Fp8,
        KvFormat::Fp8DsMla,
        KvFormat::Fp8DsMlaNope,
        KvFormat::Fp8V41,
        KvFormat::Fp4V41,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KvFormat::Auto => "auto",
            KvFormat::Fp8 => "fp8",
            KvFormat::Fp8DsMla => "fp8_ds_mla",
            KvFormat::Fp8DsMlaNope => "fp8_ds_mla_nope",
            KvFormat::Fp8V41 => "fp8_v41",
            KvFormat::Fp4V41 => "fp4_v41",
        }
    }

    pub fn from_name(s: &str) -> Option<KvFormat> {
        match s {
            "fp8_e4m3" => Some(KvFormat::Fp8),
            _ => KvFormat::ALL.into_iter().find(|f| f.name() == s),
        }
    }

    /// Whether the cache holds the rows as computed (no codec).
    pub fn is_auto(self) -> bool {
        self == KvFormat::Auto
    }

    /// Whether a model of latent width `lkv` and rope width `r` fits the format; the error names the
    /// dims the format needs.
    pub fn fits(self, lkv: usize, r: usize) -> Result<(), String> {
        let need = match self {
            KvFormat::Auto | KvFormat::Fp8 => return Ok(()),
            KvFormat::Fp8DsMla if (lkv, r) == (512, 64) => return Ok(()),
            KvFormat::Fp8DsMla => "kv_lora_rank 512 and qk_rope 64 (512 e4m3 + 64 bf16 rope)",
            KvFormat::Fp8DsMlaNope if (lkv, r) == (512, 0) => return Ok(()),
            KvFormat::Fp8DsMlaNope => "kv_lora_rank 512 and no rope (qk_rope 0)",
            KvFormat::Fp8V41 | KvFormat::Fp4V41 if lkv + r == 512 => return Ok(()),
            KvFormat::Fp8V41 | KvFormat::Fp4V41 => {
                "kv_lora_rank + qk_rope = 512 (DeepSeek-V4's 448 + 64)"
            }
        };
        Err(format!(
            "--kv-cache-dtype {}: the format needs {need}; this model has kv_lora_rank {lkv}, qk_rope {r}",
            self.name()
        ))
    }

    /// Bytes per token for a row of `lkv + r` values (`auto`: in a dtype of `elem` bytes).
    pub fn bytes_per_token(self, lkv: usize, r: usize, elem: usize) -> usize {
        match self {
            KvFormat::Auto => (lkv + r) * elem,
            KvFormat::Fp8 => lkv + r,
            KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope => 656,
            KvFormat::Fp8V41 => 528,
            KvFormat::Fp4V41 => 288,
        }
    }

    /// The format's scale groups, as column ranges of the row (`None`: one scale per layer, `fp8`).
    fn group(self) -> Option<usize> {
        match self {
            KvFormat::Auto | KvFormat::Fp8 => None,
            KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope => Some(128),
            KvFormat::Fp8V41 => Some(32),
            KvFormat::Fp4V41 => Some(16),
        }
    }

    /// Columns quantized with a scale: the latent for the ds_mla formats (their rope stays bf16), the
    /// whole row for the others.
    fn quantized(self, lkv: usize, r: usize) -> usize {
        match self {
            KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope => lkv,
            _ => lkv + r,
        }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether a planted cache fault applies to a format (`Need::KvCache`): the scale faults to every
/// quantized format; the rope fault to the one that keeps its rope bf16 (`fp8_ds_mla`); the wrong group
/// to formats of more than one scale per row; saturation to the e4m3-valued ones.
pub fn fault_fits(f: Fault, format: KvFormat) -> bool {
    use KvFormat::*;
    match f {
        Fault::KvScaleTwice | Fault::KvScaleInverted => !format.is_auto(),
        Fault::KvRopeQuantized => format == Fp8DsMla,
        Fault::KvScaleWrongGroup => matches!(format, Fp8DsMla | Fp8DsMlaNope | Fp8V41 | Fp4V41),
        Fault::KvSaturate240 => matches!(format, Fp8 | Fp8DsMla | Fp8DsMlaNope | Fp8V41),
        _ => true,
    }
}

// ---- element types ----------------------------------------------------------------------------------

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

/// Half the spacing of e4m3 numbers at |y| (y already divided by its scale): 2^(e−4) in the binade
/// 2^e (normal, e ≥ −6), 2^−10 below it.
pub fn e4m3_half_step(y: f64) -> f64 {
    let a = y.abs().min(E4M3_MAX as f64);
    let e = if a > 0.0 { a.log2().floor() as i32 } else { -6 };
    2f64.powi(e.max(-6) - 4)
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
fn ue8m0_bits(s: f32) -> u8 {
    ((s.to_bits() >> 23) & 0xff) as u8
}

fn ue8m0_value(b: u8) -> f32 {
    f32::from_bits((b as u32) << 23)
}

// ---- the codec --------------------------------------------------------------------------------------

/// One layer's cache codec: the format, the model's widths, the layer's tensor scale (`fp8`) and the
/// planted bugs of its writer and reader.
#[derive(Debug, Clone, Copy)]
pub struct Codec {
    pub format: KvFormat,
    pub lkv: usize,
    pub r: usize,
    /// `fp8`: the layer's scale (`tensor_scale` of its rows); 1 for the other formats (unused).
    pub tensor_scale: f32,
    pub faults: Active,
}

/// The per-layer scale of `fp8` from the layer's rows: max(amax / 448, 1e-4), a calibrated `k_scale`
/// (llm-compressor's amax / fp8 max) taken over the run's own rows; non-finite values are skipped.
pub fn tensor_scale<'a>(rows: impl IntoIterator<Item = &'a f32>) -> f32 {
    let amax = rows
        .into_iter()
        .filter(|v| v.is_finite())
        .fold(0f32, |m, v| m.max(v.abs()));
    (amax / E4M3_MAX).max(SCALE_FLOOR)
}

impl Codec {
    pub fn new(format: KvFormat, lkv: usize, r: usize) -> Codec {
        Codec {
            format,
            lkv,
            r,
            tensor_scale: 1.0,
            faults: Active::NONE,
        }
    }

    pub fn with_tensor_scale(mut self, s: f32) -> Codec {
        self.tensor_scale = s;
        self
    }

    pub fn with_faults(mut self, fx: Active) -> Codec {
        self.faults = fx;
        self
    }

    pub fn width(&self) -> usize {
        self.lkv + self.r
    }

    pub fn bytes(&self) -> usize {
        self.format.bytes_per_token(self.lkv, self.r, 4)
    }

    /// The scale of each group of the quantized columns, from the row's values, by the format's rule.
    fn scales(&self, row: &[f32]) -> Vec<f32> {
        let q = self.format.quantized(self.lkv, self.r);
        let Some(g) = self.format.group() else {
            return vec![self.tensor_scale];
        };
        row[..q]
            .chunks(g)
            .map(|c| {
                let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
                match self.format {
                    // FlashMLA tests/quant.py: amax/448 rounded up to a power of two (DeepSeek-V3.2's
                    // pow2_fp32 scales); V4.1's ue8m0 scales are powers of two by type.
                    KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope | KvFormat::Fp8V41 => {
                        pow2_ceil((amax / E4M3_MAX).max(SCALE_FLOOR))
                    }
                    // NVFP4-style: amax/6 stored in e4m3 (nearest).
                    _ => e4m3_value(e4m3_bits(amax / E2M1_MAX)),
                }
            })
            .collect()
    }

    /// Column `i`'s scale index (within `scales`).
    fn group_of(&self, i: usize) -> usize {
        self.format.group().map_or(0, |g| i / g)
    }

    /// Encode one row `[latent | k_pe]` (finite values) into `out` (`bytes()` long).
    pub fn encode(&self, row: &[f32], out: &mut [u8]) {
        debug_assert_eq!(row.len(), self.width());
        debug_assert_eq!(out.len(), self.bytes());
        let fx = self.faults;
        let scales = self.scales(row);
        let q = self.format.quantized(self.lkv, self.r);
        // Fault: the writer saturates at e4m3fnuz's 240 (AMD's fp8) instead of e4m3fn's 448.
        let sat = match fx.on(Fault::KvSaturate240) {
            true => E4M3_FNUZ_MAX,
            false => E4M3_MAX,
        };
        let fp8 = |x: f32, s: f32| e4m3_bits((x / s).clamp(-sat, sat));
        match self.format {
            KvFormat::Auto => unreachable!("no codec for the run's dtype"),
            KvFormat::Fp8 | KvFormat::Fp8V41 => {
                for (i, &x) in row.iter().enumerate() {
                    out[i] = fp8(x, scales[self.group_of(i)]);
                }
                if self.format == KvFormat::Fp8V41 {
                    for (k, &s) in scales.iter().enumerate() {
                        out[512 + k] = ue8m0_bits(s);
                    }
                }
            }
            KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope => {
                for (i, &x) in row[..q].iter().enumerate() {
                    out[i] = fp8(x, scales[self.group_of(i)]);
                }
                for (k, &s) in scales.iter().enumerate() {
                    out[512 + 4 * k..516 + 4 * k].copy_from_slice(&s.to_le_bytes());
                }
                let tail = &mut out[528..656];
                tail.fill(0);
                for (i, &x) in row[q..].iter().enumerate() {
                    // Fault: the rope part quantized to e4m3 (with the last latent tile's scale, as a
                    // tile loop run on over the row's tail) before it is stored as bf16.
                    let x = match fx.on(Fault::KvRopeQuantized) {
                        true => {
                            let s = scales[scales.len() - 1];
                            e4m3_value(fp8(x, s)) * s
                        }
                        false => x,
                    };
                    tail[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
            }
            KvFormat::Fp4V41 => {
                out[..256].fill(0);
                for (i, &x) in row.iter().enumerate() {
                    let s = scales[self.group_of(i)];
                    let c = if s > 0.0 { e2m1_bits(x / s) } else { 0 };
                    out[i / 2] |= c << (4 * (i % 2));
                }
                for (k, &s) in scales.iter().enumerate() {
                    out[256 + k] = e4m3_bits(s);
                }
            }
        }
    }

    /// Decode one row's bytes into the values a kernel reads (`width()` of them), each `q · s` in f32.
    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.width());
        let fx = self.faults;
        let scales: Vec<f32> = match self.format {
            KvFormat::Auto => unreachable!("no codec for the run's dtype"),
            KvFormat::Fp8 => vec![self.tensor_scale],
            KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope => (0..4)
                .map(|k| {
                    let b: [u8; 4] = bytes[512 + 4 * k..516 + 4 * k].try_into().expect("4 bytes");
                    f32::from_le_bytes(b)
                })
                .collect(),
            KvFormat::Fp8V41 => bytes[512..528].iter().map(|&b| ue8m0_value(b)).collect(),
            KvFormat::Fp4V41 => bytes[256..288].iter().map(|&b| e4m3_value(b)).collect(),
        };
        let n = scales.len();
        let scale = |i: usize| {
            let g = self.group_of(i);
            // Fault: the reader takes the next group's scale (an off-by-one scale index).
            match fx.on(Fault::KvScaleWrongGroup) {
                true => scales[(g + 1) % n],
                false => scales[g],
            }
        };
        // Faults: the scale applied twice (q·s·s), or as a divisor (q/s).
        let apply =
            |q: f32, s: f32| match (fx.on(Fault::KvScaleTwice), fx.on(Fault::KvScaleInverted)) {
                (true, _) => q * s * s,
                (_, true) => q / s,
                _ => q * s,
            };
        let q = self.format.quantized(self.lkv, self.r);
        match self.format {
            KvFormat::Fp4V41 => {
                for (i, o) in out.iter_mut().enumerate() {
                    let c = (bytes[i / 2] >> (4 * (i % 2))) & 0xf;
                    *o = apply(e2m1_value(c), scale(i));
                }
            }
            _ => {
                for (i, o) in out[..q].iter_mut().enumerate() {
                    *o = apply(e4m3_value(bytes[i]), scale(i));
                }
                for (i, o) in out[q..].iter_mut().enumerate() {
                    let b = [bytes[528 + 2 * i], bytes[529 + 2 * i]];
                    *o = bf16::from_le_bytes(b).to_f32();
                }
            }
        }
    }

    /// Encode and decode one row: what a reader gets back for it.
    pub fn round_trip(&self, row: &[f32]) -> Vec<f32> {
        let mut bytes = vec![0u8; self.bytes()];
        let mut out = vec![0f32; self.width()];
        self.encode(row, &mut bytes);
        self.decode(&bytes, &mut out);
        out
    }

    /// The format's rounding bound per element of `row` (the values the path stored): half the element
    /// type's spacing at `x / s` times `s`, plus the f32 roundings of `x / s` and `q · s`; for the bf16 rope of
    /// the ds_mla formats, half a bf16 step (0 where the values are bf16 already). With the scales of
    /// the format's rule (no faults).
    pub fn bound(&self, row: &[f64]) -> Vec<f64> {
        let row32: Vec<f32> = row.iter().map(|&v| v as f32).collect();
        let scales = Codec {
            faults: Active::NONE,
            ..*self
        }
        .scales(&row32);
        let q = self.format.quantized(self.lkv, self.r);
        let u32_ = 2f64.powi(-24);
        row.iter()
            .enumerate()
            .map(|(i, &x)| {
                if i >= q {
                    let b = bf16::from_f64(x).to_f64();
                    return (b - x).abs();
                }
                let s = scales[self.group_of(i)] as f64;
                let half = match self.format {
                    KvFormat::Fp4V41 => e2m1_half_step(x / s),
                    _ => e4m3_half_step(x / s),
                };
                // The quotient x / s is rounded to f32 before its conversion, the product q · s after.
                half * s + 2.0 * x.abs() * u32_
            })
            .collect()
    }
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

    fn row(w: usize, seed: u64) -> Vec<f32> {
        // Latent-like values with a few outlier columns, stored in bf16.
        (0..w)
            .map(|i| {
                let x = (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
                    * if i % 61 == 0 { 9.0 } else { 1.0 };
                bf16::from_f32(x).to_f32()
            })
            .collect()
    }

    /// Each format fits the dims it names, and its byte count is the engine's.
    #[test]
    fn dims_and_bytes() {
        use KvFormat::*;
        assert!(Fp8DsMla.fits(512, 64).is_ok() && Fp8DsMla.fits(256, 32).is_err());
        assert!(Fp8DsMlaNope.fits(512, 0).is_ok() && Fp8DsMlaNope.fits(512, 64).is_err());
        assert!(Fp8V41.fits(448, 64).is_ok() && Fp8V41.fits(512, 64).is_err());
        assert!(Fp4V41.fits(448, 64).is_ok());
        assert!(Fp8.fits(256, 32).is_ok());
        let e = Fp8DsMla.fits(256, 32).unwrap_err();
        assert!(
            e.contains("kv_lora_rank 512") && e.contains("kv_lora_rank 256"),
            "{e}"
        );
        assert_eq!(Fp8.bytes_per_token(512, 64, 2), 576);
        assert_eq!(Fp8DsMla.bytes_per_token(512, 64, 2), 656);
        assert_eq!(Fp8V41.bytes_per_token(448, 64, 2), 528);
        assert_eq!(Fp4V41.bytes_per_token(448, 64, 2), 288);
        assert_eq!(Auto.bytes_per_token(512, 64, 2), 1152);
        for f in KvFormat::ALL {
            assert_eq!(KvFormat::from_name(f.name()), Some(f));
        }
        assert_eq!(KvFormat::from_name("fp8_e4m3"), Some(Fp8));
    }

    /// The byte layout of fp8_ds_mla: the scales at 512.. as f32 little-endian, powers of two; the rope
    /// at 528.. as bf16, unchanged; every value within its bound.
    #[test]
    fn ds_mla_layout_and_bound() {
        let r = row(576, 1);
        let c = Codec::new(KvFormat::Fp8DsMla, 512, 64);
        let mut b = vec![0u8; 656];
        c.encode(&r, &mut b);
        for k in 0..4 {
            let s = f32::from_le_bytes(b[512 + 4 * k..516 + 4 * k].try_into().unwrap());
            let amax = r[k * 128..(k + 1) * 128]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(s, pow2_ceil(amax / 448.0), "tile {k}");
        }
        let mut d = vec![0f32; 576];
        c.decode(&b, &mut d);
        assert_eq!(&d[512..], &r[512..], "the rope is bf16, unchanged");
        let r64: Vec<f64> = r.iter().map(|&v| v as f64).collect();
        for (i, (&x, bd)) in r64.iter().zip(c.bound(&r64)).enumerate() {
            assert!((d[i] as f64 - x).abs() <= bd, "[{i}] {x} → {}", d[i]);
        }
        assert!(d[..512] != r[..512]);
    }

    /// Every format round-trips within its bound (and not exactly), and the bound is not loose: some
    /// element uses more than a third of it.
    #[test]
    fn every_format_within_its_bound() {
        for (f, lkv, r) in [
            (KvFormat::Fp8, 512, 64),
            (KvFormat::Fp8, 256, 32),
            (KvFormat::Fp8DsMla, 512, 64),
            (KvFormat::Fp8DsMlaNope, 512, 0),
            (KvFormat::Fp8V41, 448, 64),
            (KvFormat::Fp4V41, 448, 64),
        ] {
            let x = row(lkv + r, 3);
            let c = Codec::new(f, lkv, r).with_tensor_scale(tensor_scale(&x));
            let d = c.round_trip(&x);
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let mut worst = 0f64;
            for (i, bd) in c.bound(&x64).into_iter().enumerate() {
                let e = (d[i] as f64 - x64[i]).abs();
                assert!(e <= bd, "{f} [{i}]: {} → {} (bound {bd})", x[i], d[i]);
                if bd > 0.0 {
                    worst = worst.max(e / bd);
                }
            }
            assert!(worst > 0.33, "{f}: worst error/bound {worst}");
        }
    }

    /// V4.1's layouts: fp8's 16 ue8m0 bytes at 512..528; fp4's codes two per byte (element 2k in the
    /// low nibble) and 32 e4m3 scales at 256..288.
    #[test]
    fn v41_layouts() {
        let x = row(512, 5);
        let c = Codec::new(KvFormat::Fp8V41, 448, 64);
        let mut b = vec![0u8; 528];
        c.encode(&x, &mut b);
        let amax0 = x[..32].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(ue8m0_value(b[512]), pow2_ceil(amax0 / 448.0));
        assert_eq!(b[0], e4m3_bits(x[0] / ue8m0_value(b[512])));
        let c = Codec::new(KvFormat::Fp4V41, 448, 64);
        let mut b = vec![0u8; 288];
        c.encode(&x, &mut b);
        let s0 = e4m3_value(b[256]);
        let amax0 = x[..16].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(s0, e4m3_value(e4m3_bits(amax0 / 6.0)));
        assert_eq!(b[0] & 0xf, e2m1_bits(x[0] / s0));
        assert_eq!(b[0] >> 4, e2m1_bits(x[1] / s0));
    }
}
