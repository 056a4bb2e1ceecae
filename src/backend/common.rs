//! What every optimized path derives from the model the same way, planted bugs included: the softmax
//! scale the attention kernels are given and the kv_b split. Not in `crate::model`, which describes the
//! model as it is: both carry faults of the serving path (`crate::faults`), and the CPU mirror and the
//! CUDA backend must agree on them bit for bit.

use crate::faults::{Active, Fault};
use crate::model::{LayerWeights, MlaConfig, RopePairing};
use crate::rope::RopeTables;
use ndarray::{s, Array3, Axis};

/// The rope width a DeepSeek MLA front assumes (`rope_on_nope`, `nope_pad_as_rope`: what a NoPE model's
/// path gets where that width is hard-coded).
pub const DEEPSEEK_ROPE: usize = 64;

/// Fault `rope_on_nope`, on a NoPE model (qk_rope 0) whose latent is at least that wide: the tables of
/// the rope a DeepSeek front applies anyway to the latent's last 64 columns (base 10000, NORM pairs),
/// for the run's positions (`t`'s); `None` without the fault or with rope.
pub fn nope_rope_tables(cfg: &MlaConfig, t: &RopeTables, fx: Active) -> Option<RopeTables> {
    if !fx.on(Fault::RopeOnNope) || cfg.qk_rope != 0 || cfg.kv_lora_rank < DEEPSEEK_ROPE {
        return None;
    }
    let spec = crate::model::RopeConfig {
        dim: DEEPSEEK_ROPE,
        base: 10000.0,
        pairing: RopePairing::Norm,
        yarn: None,
        freq_factors_short: None,
        freq_factors_long: None,
        attn_factor: 1.0,
    };
    RopeTables::new(&spec, None, t.pos_start, t.n_pos()).ok()
}

/// The softmax scale the attention kernels are given (faults: YaRN's mscale² missing, FlashMLA's
/// 1/sqrt(Lkv+R) default).
pub fn kernel_scale(cfg: &MlaConfig, fx: Active) -> f64 {
    if fx.on(Fault::Scale576) {
        1.0 / (cfg.cache_row() as f64).sqrt()
    } else if fx.on(Fault::YarnMscaleMissing) {
        cfg.softmax_scale / (cfg.mscale * cfg.mscale)
    } else {
        cfg.softmax_scale
    }
}

/// `(W_UK, W_UV)` read from each head's kv_b block `[W_UK[h]; W_UV[h]]` (P + Dv rows) with the split the
/// wrong way round: the first Dv rows taken as W_UV, the next P rows as W_UK.
pub fn kv_b_split_swapped(cfg: &MlaConfig, w: &LayerWeights) -> (Array3<f32>, Array3<f32>) {
    let (p, dv) = (cfg.qk_nope, cfg.v_head_dim);
    let mut uk = Array3::zeros(w.w_uk.raw_dim());
    let mut uv = Array3::zeros(w.w_uv.raw_dim());
    for h in 0..cfg.n_head {
        let block = ndarray::concatenate(
            Axis(0),
            &[w.w_uk.index_axis(Axis(0), h), w.w_uv.index_axis(Axis(0), h)],
        )
        .expect("same Lkv");
        uv.index_axis_mut(Axis(0), h)
            .assign(&block.slice(s![..dv, ..]));
        uk.index_axis_mut(Axis(0), h)
            .assign(&block.slice(s![dv..dv + p, ..]));
    }
    (uk, uv)
}
