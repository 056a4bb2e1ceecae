//! The format's rounding bound per element (`Codec::bound`): what the judge allows `cache_rows` to
//! differ from the rows the path stored.

use super::e4m3::{e2m1_half_step, e4m3_half_step};
use super::{Codec, KvFormat};
use crate::faults::Active;
use half::bf16;

impl Codec {
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
    use super::super::sample_row as row;
    use super::super::tensor_scale;
    use super::*;

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
}
