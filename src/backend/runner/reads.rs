//! How a declared decode kernel reads a quantized cache besides as the format decodes it (describe's
//! conventions, docs/runners.md): `cache_dequant: "dtype"`, the dequantized rows rounded to the run's
//! dtype before the dots and P·V (vLLM's Triton decode over the `fp8` cache); `p_fp8`, P rounded to
//! e4m3 before P·V (FlashMLA's dense fp8 decode). Each is a precision of the kernel's own that a
//! judge over the rows as decoded, or over P in the attention type, would call a bug: the first is
//! known exactly, so the `@runner` yardstick reads the rows so rounded; the second depends on the
//! kernel's running max, so the stage-local view carries it as a rounding (`Judging::decode_p_e4m3`).

use super::decode::Entry;
use super::local;
use super::protocol::{CacheDequant, Fp8With};
use super::RunnerBackend;
use crate::backend::LayerCtx;
use crate::kv_format::{p_e4m3_half_step, KvFormat};
use crate::precision::Dtype;

impl RunnerBackend {
    /// Whether the decode reads the cache rows rounded to the run's dtype: declared, over a quantized
    /// cache (in the dtype's own rows the rounding is the identity).
    pub(super) fn cache_in_dtype(&self) -> bool {
        self.desc.conventions.cache_dequant == Some(CacheDequant::Dtype) && !self.kv.is_auto()
    }

    /// Whether the decode rounds P to e4m3: declared for the run's cache.
    pub(super) fn p_e4m3(&self) -> bool {
        match self.desc.conventions.p_fp8 {
            Some(Fp8With::Fp8) => self.kv == KvFormat::Fp8,
            None => false,
        }
    }

    /// The decode's cache rows (`Codec::decode` of the bytes sent) as the kernel attends over them:
    /// with `cache_in_dtype`, each value rounded to `dt` (an unwritten row's NaN stays NaN).
    pub(super) fn rows_as_read(&self, rows: Vec<f64>, dt: Dtype) -> Vec<f64> {
        match self.cache_in_dtype() {
            true => rows
                .into_iter()
                .map(|v| dt.round(v as f32) as f64)
                .collect(),
            false => rows,
        }
    }
}

/// The most P's e4m3 rounding (`conventions.p_fp8`) can move each decode output of `entries`, as
/// `RunnerBackend::local_entry` orders them: out `[s_q, H, Lkv]` and the split partials `[s_q, H, S,
/// Lkv]` per entry, Σ_j half_step(p_j)·|v_j| / Σ_j p_j over the keys each sees, P against the
/// range's max (a split's rounding against its own max, merged, is within the row's: p·e^(m−m_k) is
/// rounded, and scaled back by e^(m_k−m)). What the batch checks allow besides the storage bound.
pub(super) fn p_e4m3_bounds(
    ctx: &LayerCtx,
    entries: &[Entry],
    s_q: usize,
    rows: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    use rayon::prelude::*;
    let (cfg, sched) = (ctx.cfg, ctx.sched);
    let (h, lkv, r, scale) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope, cfg.softmax_scale);
    let w = lkv + r;
    let (mut out, mut sout) = (Vec::new(), Vec::new());
    for e in entries {
        let n = e.keys.len();
        let key = |j: usize| e.keys[j].expect("a real entry's keys are rows");
        let ranges = sched.split_ranges(n);
        let per: Vec<(Vec<f64>, Vec<f64>)> = (0..s_q * h)
            .into_par_iter()
            .map(|d| {
                let visible = (n + d / h + 1).saturating_sub(s_q);
                let (qa, qp) = (
                    &e.q_nope[d * lkv..(d + 1) * lkv],
                    &e.q_pe[d * r..(d + 1) * r],
                );
                let s: Vec<f64> = (0..visible)
                    .map(|j| {
                        let k = &rows[key(j) * w..(key(j) + 1) * w];
                        (local::dot(qa, &k[..lkv]) + local::dot(qp, &k[lkv..])) * scale
                    })
                    .collect();
                let bound = |keys: std::ops::Range<usize>| -> Vec<f64> {
                    let mut b = vec![0.0; lkv];
                    let m = s[keys.clone()]
                        .iter()
                        .fold(f64::NEG_INFINITY, |a, &x| a.max(x));
                    let mut l = 0.0;
                    for j in keys {
                        let p = (s[j] - m).exp();
                        l += p;
                        let hs = p_e4m3_half_step(p);
                        let v = &rows[key(j) * w..key(j) * w + lkv];
                        b.iter_mut().zip(v).for_each(|(x, &y)| *x += hs * y.abs());
                    }
                    if l > 0.0 {
                        b.iter_mut().for_each(|x| *x /= l);
                    }
                    b
                };
                let split: Vec<f64> = ranges
                    .iter()
                    .flat_map(|kr| bound(kr.start.min(visible)..kr.end.min(visible)))
                    .collect();
                (bound(0..visible), split)
            })
            .collect();
        for (o, so) in per {
            out.extend(o);
            sout.extend(so);
        }
    }
    (out, sout)
}

#[cfg(test)]
mod tests {
    use crate::kv_format::p_e4m3_half_step;

    /// P against a running max no larger than the row's (P' = p·r, r ≥ 1, P' ≤ 1) rounded to e4m3
    /// (cuda_fp8.hpp's conversion, the `float8` crate) and scaled back moves by at most the half step
    /// of p, over every binade a P reaches, the subnormals and the flush to 0 included; and the bound
    /// is reached (it is not loose by a factor).
    #[test]
    fn the_half_step_bounds_p_rounded_against_any_running_max() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut tight = 0.0f64;
        for _ in 0..200_000 {
            let p = 2f64.powf(-16.0 * next());
            let r = match next() < 0.3 {
                true => 1.0,
                false => 2f64.powf(16.0 * next()).min(1.0 / p),
            };
            let pr = p * r;
            let err = (float8::F8E4M3::from_f64(pr).to_f64() - pr).abs() / r;
            let b = p_e4m3_half_step(p);
            assert!(err <= b * (1.0 + 1e-12), "p {p} r {r}: {err} > {b}");
            tight = tight.max(err / b);
        }
        assert!(tight > 0.99, "the bound is never reached: {tight}");
    }
}
