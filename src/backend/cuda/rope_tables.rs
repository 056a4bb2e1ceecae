//! Rope cos/sin tables for the kernels: computed on the host in f64, uploaded as f32 `[token, R/2]`.
//!
//! Follows llama.cpp's `rope_yarn` (ggml-cpu): theta_extrap = pos · base^(-2i/R), YaRN mixes the
//! interpolated and extrapolated angles with the linear ramp over `corr_dims`; the magnitude is the
//! config's `attn_factor` (1 for DeepSeek YaRN, where llama.cpp cancels YaRN's mscale).
// TODO(merge): use crate::rope (branch `math`) once it is on main, so the mirror and the kernels share
// one table (and LongRoPE frequency factors).

use crate::model::MlaConfig;

/// `(cos, sin)` for positions `pos0..pos0+n`, each `[n, R/2]`.
pub fn rope_tables(cfg: &MlaConfig, pos0: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let r = cfg.qk_rope;
    let half = r / 2;
    let base = cfg.rope.base;
    let (freq_scale, ext, corr) = match &cfg.rope.yarn {
        Some(y) => (1.0 / y.factor, y.ext_factor, y.corr_dims(r, base)),
        None => (1.0, 0.0, [0.0, 0.0]),
    };
    let mag = cfg.rope.attn_factor;
    let mut c = Vec::with_capacity(n * half);
    let mut s = Vec::with_capacity(n * half);
    for t in 0..n {
        let p = (pos0 + t) as f64;
        for i in 0..half {
            let theta_extrap = p * base.powf(-2.0 * i as f64 / r as f64);
            let theta_interp = freq_scale * theta_extrap;
            let theta = if ext != 0.0 {
                let y = (i as f64 - corr[0]) / (corr[1] - corr[0]).max(0.001);
                let ramp = (1.0 - y.clamp(0.0, 1.0)) * ext;
                theta_interp * (1.0 - ramp) + theta_extrap * ramp
            } else {
                theta_interp
            };
            c.push((theta.cos() * mag) as f32);
            s.push((theta.sin() * mag) as f32);
        }
    }
    (c, s)
}
