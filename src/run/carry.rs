//! Free mode's carried cache effect (issue #38). With a quantized latent cache (`--kv-cache-dtype`, or a
//! runner's own fp8 cache) a layer's end-to-end checks are widened by the cache's exact effect on that
//! layer (`trace::CacheEffect`: the layer with the format's cache minus with the dtype's, on the same
//! input). In free mode the optimized stream also carries every earlier layer's effect into the next
//! layer's input, where no check knew it: on deepseek-v3-yarn-q4_k in fp16 with `fp8_ds_mla`, layer 0's
//! attn_out effect (2.4e-2 on the decode rows) moves the residual by 5.4e-3, and layer 1's `attn_in`
//! then differed from the reference by 8.0e-3 against fp16's 1.8e-3 tolerance (bf16's is wide enough
//! to hide it; f32 failed the same way) — the format's drift, not a kernel's error.
//!
//! The carried effect `E` (the residual's deviation due to the cache; to first order each earlier
//! layer's attn_out effect, its own and the one it carried) is followed along the stream: the layer's
//! reference is run a second time, from `h_ref + E` over the same selection, and its difference from
//! the reference, stage by stage, is added to free mode's cache effects, which widen its checks as the
//! layer's own do (triangle inequality: the kernel's and the dtype's error stay the calibrated
//! tolerance's). Exact at the layer after the first quantized one (both runs of the first layer share
//! its input), first order beyond. Shadow mode (each layer from the reference's input) is unchanged.

use crate::compare::Check;
use crate::schedule::Schedule;
use crate::trace::{CacheEffect, LayerTrace, Stage};
use ndarray::Array2;

/// The reference's input moved by the carried effect; `None` when nothing is carried.
pub(super) fn moved_input(
    h_ref: &Array2<f64>,
    carried: Option<&Array2<f64>>,
) -> Option<Array2<f64>> {
    carried.map(|e| h_ref + e)
}

/// Free mode's trace `opt` with its cache effects widened by the carried one (`moved`, the reference
/// from [`moved_input`], minus `reference`, per stage and check); then `carried` advanced by the
/// layer's attn_out effect, its own and the carried one, each check's on its own rows.
pub(super) fn absorb(
    opt: &mut LayerTrace,
    reference: &LayerTrace,
    moved: Option<&LayerTrace>,
    sched: &Schedule,
    carried: &mut Option<Array2<f64>>,
) {
    let cache = opt
        .cache_effect
        .first()
        .map_or(opt.cache_format.name(), |e| e.cache);
    for m in moved.map_or(&[][..], |m| &m.stages[..]) {
        let Some(r) = reference.get(m.stage).filter(|r| r.shape == m.shape) else {
            continue;
        };
        for fx in CacheEffect::of(m, r, cache) {
            match opt.cache_effect.iter_mut().find(|e| e.check == fx.check) {
                Some(e) if e.effect.shape == fx.effect.shape => {
                    let own = e.effect.data.iter_mut();
                    own.zip(&fx.effect.data).for_each(|(a, b)| *a += b);
                }
                Some(_) => {}
                None => opt.cache_effect.push(fx),
            }
        }
    }
    let Some(step) = attn_out_effect(opt, sched) else {
        return;
    };
    match carried {
        Some(e) if e.shape() == step.shape() => *e += &step,
        Some(_) => {}
        None => *carried = Some(step),
    }
}

/// The layer's attn_out cache effect `[T, hidden]`, each check's effect on its own rows (a runner's
/// prefill and decode effects are computed apart); `None` without one.
fn attn_out_effect(opt: &LayerTrace, sched: &Schedule) -> Option<Array2<f64>> {
    let out = opt.get(Stage::AttnOut)?;
    let (t, hidden) = (out.shape[0], out.data.len() / out.shape[0].max(1));
    let mut step = Array2::<f64>::zeros((t, hidden));
    let mut any = false;
    for e in &opt.cache_effect {
        let Some(c) = Check::parse(&e.check).filter(|c| c.stage == Stage::AttnOut) else {
            continue;
        };
        if e.effect.data.len() != t * hidden {
            continue;
        }
        for row in c.rows(sched).filter(|&r| r < t) {
            let src = &e.effect.data[row * hidden..(row + 1) * hidden];
            step.row_mut(row)
                .iter_mut()
                .zip(src)
                .for_each(|(a, b)| *a = *b);
            any = true;
        }
    }
    any.then_some(step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::StageTensor;

    fn sched() -> Schedule {
        Schedule {
            prompt_len: 2,
            decode_steps: 1,
            q_len: 1,
            ..Schedule::default()
        }
    }

    fn trace(attn_in: f64, out: [f64; 6]) -> LayerTrace {
        let mut t = LayerTrace::new(1);
        t.push(StageTensor::new(
            Stage::AttnIn,
            vec![3, 1],
            vec![attn_in; 3],
        ));
        t.push(StageTensor::new(Stage::AttnOut, vec![3, 2], out.to_vec()));
        t
    }

    /// The carried effect widens a stage with no own effect (attn_in: a new entry), adds to the own
    /// effect of a stage that has one (attn_out's, per check), and advances `E` by attn_out's own plus
    /// carried effect, each check on its rows.
    #[test]
    fn the_carried_effect_widens_every_stage_and_moves_on() {
        let s = sched();
        let reference = trace(1.0, [0.0; 6]);
        let moved = trace(1.5, [1.0; 6]);
        let mut opt = trace(0.0, [0.0; 6]);
        let own = StageTensor::new(
            Stage::AttnOut,
            vec![3, 2],
            vec![0.0, 0.0, 0.0, 0.0, 2.0, 2.0],
        );
        opt.cache_effect = CacheEffect::of(
            &own,
            &StageTensor::new(Stage::AttnOut, vec![3, 2], vec![0.0; 6]),
            "fp8",
        );
        let mut carried = Some(Array2::from_elem((3, 2), 0.25));
        absorb(&mut opt, &reference, Some(&moved), &s, &mut carried);
        let get = |c: &str| {
            opt.cache_effect
                .iter()
                .find(|e| e.check == c)
                .map(|e| e.effect.data.clone())
        };
        assert_eq!(get("attn_in"), Some(vec![0.5; 3]));
        assert_eq!(
            get("attn_out[decode]"),
            Some(vec![1.0, 1.0, 1.0, 1.0, 3.0, 3.0])
        );
        let e = carried.unwrap();
        assert_eq!(e.as_slice().unwrap(), &[1.25, 1.25, 1.25, 1.25, 3.25, 3.25]);
        // Nothing carried and no own effect: nothing starts.
        let mut none = None;
        absorb(&mut trace(0.0, [0.0; 6]), &reference, None, &s, &mut none);
        assert!(none.is_none());
    }
}
