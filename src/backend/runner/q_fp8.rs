//! q in float8 e4m3 for a decode kernel that reads it so (describe's `conventions.q_fp8`): FlashMLA's
//! dense fp8 decode (`fwd_kvcache_mla_fp8`) takes q and the cache both in e4m3, each with a one-element
//! descale. mla-diff quantizes q itself and sends it on that grid, with the scale as `meta.q_scale`:
//! the runner's division and cast back to e4m3 are then exact, so the `@runner` yardstick (fp64 over q
//! as sent and the cache as read) is over what the kernel reads, at the run's own bound. What the
//! quantization changes end to end is added to the cache's exact effect, which widens the end-to-end
//! decode checks as the cache's alone does.

use super::cache::latent_effects;
use super::decode::Entry;
use super::protocol::Fp8With;
use super::RunnerBackend;
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::LayerCtx;
use crate::kv_format::{e4m3_on_grid, pow2_ceil, tensor_scale, KvFormat};
use crate::trace::{CacheEffect, LayerTrace, Stage, StageSet, StageTensor};

/// A request's q on the e4m3 grid of one scale.
pub(super) struct QuantizedQ {
    pub q_abs: Vec<f64>,
    pub q_pe: Vec<f64>,
    pub scale: f32,
}

/// `q_abs` and `q_pe` (the decode rows) in e4m3 with one scale over both: a power of two, so that every
/// e4m3 value times it is exact in bf16 and fp16 (the values sent are the values quantized) and the
/// runner's division back is exact; the smallest one not below the `fp8` cache's calibration,
/// max(amax / 448, 1e-4).
pub(super) fn quantize(q_abs: &[f64], q_pe: &[f64]) -> QuantizedQ {
    let f: Vec<f32> = q_abs.iter().chain(q_pe).map(|&v| v as f32).collect();
    let s = pow2_ceil(tensor_scale(&f));
    let on_grid = |v: &[f64]| -> Vec<f64> { v.iter().map(|&x| e4m3_on_grid(x, s)).collect() };
    QuantizedQ {
        q_abs: on_grid(q_abs),
        q_pe: on_grid(q_pe),
        scale: s,
    }
}

impl RunnerBackend {
    /// Whether this run's decode requests carry q in e4m3: the runner declares it for the run's cache.
    pub(super) fn q_fp8(&self) -> bool {
        match self.desc.conventions.q_fp8 {
            Some(Fp8With::Fp8) => self.kv == KvFormat::Fp8,
            None => false,
        }
    }

    /// With q in e4m3, the split partials leave the stage-local view (`outside`, the inner path's, plus
    /// them): it recomputes them from the trace's q_absorbed and q_pe, q as computed, not the q the
    /// kernel read; their kernel's own error is `split_out@runner`'s, over q as sent, and the merged
    /// stages (attn_latent, lse) keep the view, which takes them from the stored partials.
    pub(super) fn q_fp8_outside(&self, outside: StageSet) -> StageSet {
        match self.q_fp8() {
            true => outside.with(Stage::SplitOut).with(Stage::SplitLse),
            false => outside,
        }
    }

    /// q's quantization effect on the decode: fp64 over the cache as read with q as sent (`quant`: out
    /// `[D, H, Lkv]`, lse `[D, H]`, the split partials `[D, H, S, Lkv]`, `[D, H, S]`) minus the same
    /// with q as computed (the entries `plain`), carried downstream and added to the cache's effect on
    /// each check.
    pub(super) fn q_effect(
        ctx: &LayerCtx,
        mw: &MirrorWeights,
        tr: &mut LayerTrace,
        plain: &[Entry],
        quant: [&[f64]; 4],
        rows: &[f64],
    ) {
        let (s_q, h) = (ctx.sched.q_len, ctx.cfg.n_head);
        let mut e = quant.map(<[f64]>::to_vec);
        let mut at = [0; 4];
        for entry in plain {
            let l = Self::local_entry(ctx, entry, s_q, rows);
            for (k, p) in [l.out, l.lse, l.sout, l.slse].into_iter().enumerate() {
                // An empty split's lse is −inf on both sides: no effect.
                for (x, p) in e[k][at[k]..].iter_mut().zip(&p) {
                    *x = if *x == *p { 0.0 } else { *x - p };
                }
                at[k] += p.len();
            }
        }
        let [e_lat, e_lse, e_sout, e_slse] = e;
        let prompt = ctx.sched.prompt_len;
        let d_n = plain.len() * s_q;
        let splits = e_slse.len() / (d_n * h).max(1);
        let mut fx = latent_effects(
            ctx,
            mw,
            (prompt..prompt + d_n, "decode"),
            e_lat,
            &e_lse,
            "q_fp8",
        );
        if splits > 0 {
            let lkv = ctx.cfg.kv_lora_rank;
            fx.extend(
                [
                    (Stage::SplitOut, vec![d_n, h, splits, lkv], e_sout),
                    (Stage::SplitLse, vec![d_n, h, splits], e_slse),
                ]
                .map(|(stage, shape, data)| CacheEffect {
                    check: stage.name().to_string(),
                    cache: "q_fp8",
                    effect: StageTensor::new(stage, shape, data),
                }),
            );
        }
        add_effects(&mut tr.cache_effect, fx);
    }
}

/// `fx` added to the effect of the same check and shape in `to` (the cache's: then the sum is the
/// cache's and q's together, as the kernel reads both), or pushed where there is none.
fn add_effects(to: &mut Vec<CacheEffect>, fx: Vec<CacheEffect>) {
    for e in fx {
        let same = |t: &&mut CacheEffect| t.check == e.check && t.effect.shape == e.effect.shape;
        match to.iter_mut().find(same) {
            Some(t) => {
                for (a, b) in t.effect.data.iter_mut().zip(&e.effect.data) {
                    *a += b;
                }
            }
            None => to.push(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scale is the power of two at or above amax / 448, every value sent is on its e4m3 grid and
    /// exact in bf16 and fp16 (so the runner's division and cast are exact), and a value off the grid
    /// moves by at most half a step.
    #[test]
    fn q_on_the_grid_of_a_power_of_two_scale() {
        let q_abs: Vec<f64> = (0..512).map(|i| ((i as f64) * 0.37).sin() * 3.3).collect();
        let q_pe: Vec<f64> = (0..64)
            .map(|i| ((i as f64) * 1.1).cos() * 7.9 + 1e-7)
            .collect();
        let q = quantize(&q_abs, &q_pe);
        let amax = q_abs.iter().chain(&q_pe).fold(0f64, |m, v| m.max(v.abs()));
        assert_eq!(q.scale, pow2_ceil((amax as f32) / 448.0));
        assert!(q.scale as f64 >= amax / 448.0 && (q.scale as f64) < 2.0 * amax / 448.0);
        let mut moved = 0;
        for (x, v) in q_abs.iter().chain(&q_pe).zip(q.q_abs.iter().chain(&q.q_pe)) {
            let y = v / q.scale as f64;
            assert_eq!(e4m3_on_grid(y, 1.0), y, "{v} off the grid");
            assert_eq!(
                half::bf16::from_f64(*v).to_f64(),
                *v,
                "{v} not exact in bf16"
            );
            assert_eq!(
                half::f16::from_f64(*v).to_f64(),
                *v,
                "{v} not exact in fp16"
            );
            let half_step = crate::kv_format::e4m3_half_step(x / q.scale as f64) * q.scale as f64;
            assert!((v - x).abs() <= half_step, "{x} -> {v}");
            moved += (v != x) as usize;
        }
        assert!(moved > 500, "quantizing changed only {moved} values");
    }
}
