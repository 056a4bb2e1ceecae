//! A tensor-parallel rank's share of a layer, and the gathering of the ranks' traces into the whole
//! layer's.
//!
//! Rank r of N serves heads `r·H/N .. (r+1)·H/N`: its rows of the query projection (q_b, or q without
//! LoRA), its heads of the kv_b decompression (`W_UK`, `W_UV`) and its `Dv` columns per head of o_proj,
//! so that its attn_out is the partial `o_proj[:, its heads] · attn_heads[its heads]`. The norms, kv_a
//! and rope are replicated. The cut is the one `crate::capsule::heads` makes of the file's bytes, taken
//! here of the dequantized values (the same numbers, with no block boundary to respect).

use crate::error::{Error, Result};
use crate::model::weights::QProj;
use crate::model::{LayerWeights, MlaConfig};
use crate::precision::Dtype;
use crate::trace::{LayerTrace, StageTensor};
use ndarray::{s, Array2};
use std::ops::Range;

/// The heads rank `rank` of `size` serves; `size` must divide the model's heads.
pub fn heads(cfg: &MlaConfig, size: usize, rank: usize) -> Range<usize> {
    let per = cfg.n_head / size;
    rank * per..(rank + 1) * per
}

/// Refuse a tensor-parallel size that does not split the heads evenly (engines refuse it too).
pub fn check_size(cfg: &MlaConfig, size: usize) -> Result<()> {
    if size == 0 || !cfg.n_head.is_multiple_of(size) {
        return Err(Error::Usage(format!(
            "--tp {size}: the model has {} attention heads, which {size} ranks cannot share evenly (use a divisor of {})",
            cfg.n_head, cfg.n_head
        )));
    }
    Ok(())
}

/// The config a rank's kernels see: its heads only.
pub fn rank_config(cfg: &MlaConfig, size: usize) -> MlaConfig {
    let mut c = cfg.clone();
    c.n_head = cfg.n_head / size;
    if c.n_head_kv == cfg.n_head {
        c.n_head_kv = c.n_head;
    }
    c
}

fn rows(a: &Array2<f32>, r: Range<usize>) -> Array2<f32> {
    a.slice(s![r, ..]).to_owned()
}

/// The weights rank `rank` of `size` holds.
pub fn rank_weights(cfg: &MlaConfig, w: &LayerWeights, size: usize, rank: usize) -> LayerWeights {
    let h = heads(cfg, size, rank);
    let dk = cfg.qk_head_dim();
    let dv = cfg.v_head_dim;
    let q_rows = h.start * dk..h.end * dk;
    LayerWeights {
        layer: w.layer,
        attn_norm: w.attn_norm.clone(),
        q: match &w.q {
            QProj::Lora { a, a_norm, b } => QProj::Lora {
                a: a.clone(),
                a_norm: a_norm.clone(),
                b: rows(b, q_rows),
            },
            QProj::Plain { q } => QProj::Plain { q: rows(q, q_rows) },
        },
        kv_a: w.kv_a.clone(),
        kv_a_norm: w.kv_a_norm.clone(),
        w_uk: w.w_uk.slice(s![h.clone(), .., ..]).to_owned(),
        w_uv: w.w_uv.slice(s![h.clone(), .., ..]).to_owned(),
        o: w.o.slice(s![.., h.start * dv..h.end * dv]).to_owned(),
        kv_b_layout: w.kv_b_layout,
        stored: Default::default(),
        rounded: w.rounded, // a slice of weights rounded in place is rounded
        id: Default::default(),
    }
}

/// The whole layer's trace from the ranks' (in rank order): per-head stages concatenated along their
/// head axis, replicated stages taken from rank 0, and attn_out the all-reduce of the partials — summed
/// in rank order with each partial sum stored in `dtype`, as a ring all-reduce of activations in the
/// model's dtype does (f32 accumulation of each pair, one rounding per hop).
pub fn gather(ranks: &[LayerTrace], dtype: Dtype) -> LayerTrace {
    let first = &ranks[0];
    let mut out = LayerTrace::new(first.layer);
    out.cache_format = first.cache_format;
    for t in &first.stages {
        let parts: Vec<&StageTensor> = ranks.iter().filter_map(|r| r.get(t.stage)).collect();
        if parts.len() != ranks.len() {
            continue;
        }
        let st = if t.stage == crate::trace::Stage::AttnOut {
            let mut acc = parts[0].data.clone();
            for p in &parts[1..] {
                for (a, &b) in acc.iter_mut().zip(&p.data) {
                    *a = dtype.round(*a as f32 + b as f32) as f64;
                }
            }
            StageTensor::new(t.stage, t.shape.clone(), acc)
        } else if t.stage.axes().get(1) == Some(&"head") {
            concat_heads(&parts)
        } else {
            t.clone()
        };
        out.push(st);
    }
    out
}

/// Tensors `[A, h, rest…]` concatenated along axis 1.
fn concat_heads(parts: &[&StageTensor]) -> StageTensor {
    let shape0 = &parts[0].shape;
    let outer = shape0[0];
    let mut shape = shape0.clone();
    shape[1] = parts.iter().map(|p| p.shape[1]).sum();
    let mut data = Vec::with_capacity(shape.iter().product());
    for a in 0..outer {
        for p in parts {
            let block: usize = p.shape[1..].iter().product();
            data.extend_from_slice(&p.data[a * block..(a + 1) * block]);
        }
    }
    StageTensor::new(parts[0].stage, shape, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::{self, Family};
    use crate::schedule::Schedule;

    /// The ranks' fp64 references gathered are the whole layer's reference (attn_out up to the
    /// summation order: 1e-12 relative).
    #[test]
    fn ranks_gathered_are_the_whole_layer() {
        let cfg = Family::DeepseekV3.test_config();
        let w = synthetic::weights(&cfg, 3);
        let sched = Schedule {
            prompt_len: 6,
            chunk: 4,
            decode_steps: 3,
            ..Schedule::default()
        };
        let f = synthetic::rope_factors(&cfg, 4);
        let rope =
            crate::rope::RopeTables::for_run(&cfg, f.as_ref(), 0, sched.total_tokens()).unwrap();
        let x = crate::input::random_hidden(cfg.hidden, sched.total_tokens(), 5);
        let whole = crate::reference::run_layer(&cfg, &w, &rope, &x, &sched).unwrap();
        let size = 2;
        check_size(&cfg, size).unwrap();
        let rc = rank_config(&cfg, size);
        let ranks: Vec<LayerTrace> = (0..size)
            .map(|r| {
                let wr = rank_weights(&cfg, &w, size, r);
                crate::reference::run_layer(&rc, &wr, &rope, &x, &sched).unwrap()
            })
            .collect();
        let g = gather(&ranks, Dtype::F32);
        for t in &whole.stages {
            let o = g.get(t.stage).unwrap();
            assert_eq!(o.shape, t.shape, "{}", t.stage);
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for (a, b) in o.data.iter().zip(&t.data) {
                if a.is_finite() || b.is_finite() {
                    num += (a - b) * (a - b);
                    den += b * b;
                }
            }
            // attn_out went through one f32 rounding per hop; everything else is exact.
            let tol = if t.stage == crate::trace::Stage::AttnOut {
                1e-6
            } else {
                1e-12
            };
            assert!((num / den.max(1e-300)).sqrt() < tol, "{}", t.stage);
        }
        assert!(check_size(&cfg, cfg.n_head + 1).is_err());
    }
}
