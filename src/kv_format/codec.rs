//! One layer's cache codec: a row `[latent | k_pe]` to the format's bytes (`Codec::encode`) and back to
//! the values a kernel reads (`Codec::decode`), with the planted bugs of a writer and a reader.

use super::e4m3::*;
use super::KvFormat;
use crate::faults::{Active, Fault};
use half::bf16;

/// FlashMLA's floor on a tile's `amax / 448` (tests/quant.py), so that an all-zero tile has a scale.
const SCALE_FLOOR: f32 = 1e-4;

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
    pub(super) fn scales(&self, row: &[f32]) -> Vec<f32> {
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
    pub(super) fn group_of(&self, i: usize) -> usize {
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

    /// Encode one row as a write launch over several requests' rows does: `first_request` whether the
    /// row is one of the launch's first request (a launch of one request: every row). As `encode`,
    /// except under `kv_scale_unwritten` a later request's row keeps the scale bytes `out` held (a
    /// slot never written: 0xff, a NaN scale in every format).
    pub fn encode_in_launch(&self, row: &[f32], out: &mut [u8], first_request: bool) {
        // Fault: the launch's scale stores guarded as if it held one request.
        let keep = match self.faults.on(Fault::KvScaleUnwritten) && !first_request {
            true => self.format.scale_bytes(),
            false => None,
        };
        let before = keep.clone().map(|r| out[r].to_vec());
        self.encode(row, out);
        if let (Some(r), Some(b)) = (keep, before) {
            out[r].copy_from_slice(&b);
        }
    }

    /// Decode one row's bytes into the values a kernel reads (`width()` of them), each `q · s` in f32.
    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.width());
        let fx = self.faults;
        let scales = self.read_scales(bytes);
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

    /// The scales a row's bytes hold, one per group (`fp8`: the layer's).
    fn read_scales(&self, bytes: &[u8]) -> Vec<f32> {
        match self.format {
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
        }
    }

    /// Each column of a row's bytes before its scale: (the stored element's value q, the scale s of
    /// its group), `None` where the format applies no scale (the ds_mla formats' bf16 rope). `decode`
    /// without faults reads q·s (or q) of these; lint predicts from them what a reader of another
    /// scale convention reads.
    pub fn columns(&self, bytes: &[u8]) -> Vec<(f32, Option<f32>)> {
        let scales = self.read_scales(bytes);
        let q = self.format.quantized(self.lkv, self.r);
        (0..self.width())
            .map(|i| match (self.format, i < q) {
                (KvFormat::Fp4V41, _) => {
                    let c = (bytes[i / 2] >> (4 * (i % 2))) & 0xf;
                    (e2m1_value(c), Some(scales[self.group_of(i)]))
                }
                (_, true) => (e4m3_value(bytes[i]), Some(scales[self.group_of(i)])),
                (_, false) => {
                    let j = i - q;
                    let b = [bytes[528 + 2 * j], bytes[529 + 2 * j]];
                    (bf16::from_le_bytes(b).to_f32(), None)
                }
            })
            .collect()
    }

    /// Encode and decode one row: what a reader gets back for it.
    pub fn round_trip(&self, row: &[f32]) -> Vec<f32> {
        let mut bytes = vec![0u8; self.bytes()];
        let mut out = vec![0f32; self.width()];
        self.encode(row, &mut bytes);
        self.decode(&bytes, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::sample_row as row;
    use super::*;

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

    /// `columns` is what `decode` multiplies, for every format.
    #[test]
    fn columns_are_what_decode_reads() {
        for (f, lkv, r) in [
            (KvFormat::Fp8, 256, 32),
            (KvFormat::Fp8DsMla, 512, 64),
            (KvFormat::Fp8DsMlaNope, 512, 0),
            (KvFormat::Fp8V41, 448, 64),
            (KvFormat::Fp4V41, 448, 64),
        ] {
            let x = row(lkv + r, 7);
            let c = Codec::new(f, lkv, r).with_tensor_scale(super::tensor_scale(&x));
            let mut b = vec![0u8; c.bytes()];
            c.encode(&x, &mut b);
            let mut d = vec![0f32; lkv + r];
            c.decode(&b, &mut d);
            for (i, (q, s)) in c.columns(&b).into_iter().enumerate() {
                assert_eq!(
                    s.map_or(q, |s| q * s).to_bits(),
                    d[i].to_bits(),
                    "{f} [{i}]"
                );
            }
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
