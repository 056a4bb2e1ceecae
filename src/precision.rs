//! The optimized path's numerics, the ground floor's vocabulary: its storage type ([`Dtype`]), how a DSA
//! indexer stores its q and k ([`KeyPrecision`]) and how its kernels sum a
//! score ([`ScoreSum`]). Every floor above names them (the model's weights, the reference's products,
//! backends, the judge, reports), so this file imports nothing of ours.

use serde::{Deserialize, Serialize};

/// Storage precision of weights and activations on the optimized path (accumulation is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    #[value(name = "fp16", alias = "f16")]
    #[serde(rename = "fp16", alias = "f16")]
    F16,
    F32,
}

impl Dtype {
    /// Round an f32 to this storage type and back (round-to-nearest-even; f16 overflows to ±inf).
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
            Dtype::F16 => half::f16::from_f32(x).to_f32(),
            Dtype::F32 => x,
        }
    }
    /// [`Dtype::round`] over a slice, bit for bit, at memory speed: a layer's weights are hundreds of
    /// millions of values. bf16 by its bit pattern (round to nearest even on the upper half, NaNs kept
    /// quiet: what `half` does one value at a time, here branch-free so that it vectorizes); fp16 by
    /// `half`'s slice conversions (F16C where the CPU has it).
    pub fn round_slice(self, v: &mut [f32]) {
        match self {
            Dtype::Bf16 => v.iter_mut().for_each(|x| {
                let b = x.to_bits();
                let nearest = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
                let quiet = (b | 0x0040_0000) & 0xffff_0000;
                *x = f32::from_bits(if x.is_nan() { quiet } else { nearest });
            }),
            Dtype::F16 => {
                use half::slice::HalfFloatSliceExt;
                let mut h = [half::f16::ZERO; 256];
                for c in v.chunks_mut(256) {
                    let h = &mut h[..c.len()];
                    h.convert_from_f32_slice(c);
                    h.convert_to_f32_slice(c);
                }
            }
            Dtype::F32 => {}
        }
    }
    /// The spacing of the storage type's numbers just above 1 (2⁻⁸ bf16, 2⁻¹¹ fp16, 2⁻²⁴ f32 here:
    /// twice the unit roundoff).
    pub fn round_unit(self) -> f64 {
        match self {
            Dtype::Bf16 => 2f64.powi(-8),
            Dtype::F16 => 2f64.powi(-11),
            Dtype::F32 => 2f64.powi(-24),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
            Dtype::F32 => "f32",
        }
    }
}

/// How the indexer stores q and k (`--indexer-keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KeyPrecision {
    /// In the run's dtype (bf16 / fp16 / f32), like transformers' and llama.cpp's graphs.
    #[default]
    #[value(name = "storage")]
    Storage,
    /// Hadamard-rotated fp8 e4m3 with per-128 scales, like vLLM / DeepGEMM (`Di` a power of two).
    #[value(name = "fp8")]
    Fp8,
}

/// How a backend sums an attention score's dot product in f32 (`Judging::score_sum`): what the
/// stage-local view's model of that sum is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreSum {
    /// Unknown (external kernels): a sequential sum's noise (conservative for any order), and a
    /// truncation bias fitted in case they are tensor cores.
    Sequential,
    /// The CPU mirror's `ops::dot`: 8 lanes, round to nearest.
    Lanes8,
    /// This project's CUDA kernels: tensor-core MMAs in k-steps of 16 whose f32 accumulator truncates.
    TensorCore,
}

impl ScoreSum {
    /// Whether the sum may truncate toward zero (a one-signed bias the judge fits).
    pub fn truncates(self) -> bool {
        self != ScoreSum::Lanes8
    }
}

#[cfg(test)]
mod round_tests {
    use super::Dtype;
    use rand::{Rng, SeedableRng};

    /// `round_slice` is `round` bit for bit: random bit patterns (NaNs with payloads, subnormals,
    /// overflow to inf included), ties, and the edges of each format.
    #[test]
    fn round_slice_is_round() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut v: Vec<f32> = (0..200_000).map(|_| f32::from_bits(rng.random())).collect();
        v.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            1.0 + 2f32.powi(-11),
            65504.0,
            65520.0,
            -65520.0,
            2f32.powi(-25),
            2f32.powi(-24) * 1.5,
        ]);
        for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            let mut got = v.clone();
            dt.round_slice(&mut got);
            for (x, g) in v.iter().zip(&got) {
                assert_eq!(
                    dt.round(*x).to_bits(),
                    g.to_bits(),
                    "{dt:?} {x:e} ({:#x})",
                    x.to_bits()
                );
            }
        }
    }
}
