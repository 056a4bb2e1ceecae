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
//!
//! Files: `e4m3.rs` (the element types: e4m3, e2m1, ue8m0), `codec.rs` (a row to its bytes and back),
//! `bound.rs` (the rounding bound the judge allows).

use crate::faults::Fault;

mod bound;
mod codec;
mod e4m3;
pub use codec::{tensor_scale, Codec};
pub use e4m3::*;

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

    /// The bytes of a row that hold its scales (`None`: no scale in the row — `auto`, and `fp8`, whose
    /// scale is the layer's).
    pub fn scale_bytes(self) -> Option<std::ops::Range<usize>> {
        match self {
            KvFormat::Auto | KvFormat::Fp8 => None,
            KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope | KvFormat::Fp8V41 => Some(512..528),
            KvFormat::Fp4V41 => Some(256..288),
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
/// to formats of more than one scale per row; saturation to the e4m3-valued ones; an unwritten scale
/// to formats that keep their scales in the row.
pub fn fault_fits(f: Fault, format: KvFormat) -> bool {
    use KvFormat::*;
    match f {
        Fault::KvScaleTwice | Fault::KvScaleInverted => !format.is_auto(),
        Fault::KvRopeQuantized => format == Fp8DsMla,
        Fault::KvScaleWrongGroup => matches!(format, Fp8DsMla | Fp8DsMlaNope | Fp8V41 | Fp4V41),
        Fault::KvSaturate240 => matches!(format, Fp8 | Fp8DsMla | Fp8DsMlaNope | Fp8V41),
        Fault::KvScaleUnwritten => format.scale_bytes().is_some(),
        _ => true,
    }
}
#[cfg(test)]
/// Latent-like values with a few outlier columns, stored in bf16 (the tests' rows).
pub(crate) fn sample_row(w: usize, seed: u64) -> Vec<f32> {
    (0..w)
        .map(|i| {
            let x = (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
                * if i % 61 == 0 { 9.0 } else { 1.0 };
            half::bf16::from_f32(x).to_f32()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
