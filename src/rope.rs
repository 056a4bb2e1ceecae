//! Rotary position embedding tables, as ggml's `rope_yarn` computes them, in f64.
//!
//! For position `p` and pair `i` in `0..R/2`:
//! - `theta_extrap = p · base^(−2i/R) / freq_factor[i]` (LongRoPE factors when given);
//! - with YaRN (`ext_factor ≠ 0`): `theta_interp = theta_extrap / factor`,
//!   `ramp_mix = ext_factor · (1 − clamp((i − low) / max(0.001, high − low), 0, 1))` with
//!   `[low, high] = Yarn::corr_dims` (ggml passes `i0/2` for the even dim index `i0`, i.e. `i`),
//!   `theta = theta_interp · (1 − ramp_mix) + theta_extrap · ramp_mix`;
//!   YaRN with `ext_factor = 0` is plain interpolation, `theta = theta_interp`;
//! - `cos`/`sin` are scaled by `RopeConfig::attn_factor`, the net magnitude (llama.cpp divides its
//!   attention factor by the `1 + 0.1·ln(factor)` that the kernel multiplies in: `src/llama-context.cpp`
//!   in https://github.com/ggml-org/llama.cpp; docs/conventions.md).
//!
//! Pairing: NORM rotates `(x[2i], x[2i+1])`, NEOX rotates `(x[i], x[i+R/2])`;
//! `x0' = x0·cos − x1·sin`, `x1' = x0·sin + x1·cos`. The rotated vector keeps the file's element order.
//! Everything here is pure: the caller passes the frequency factors in (`RopeFactors::choose`).

use crate::error::{Error, Result};
use crate::model::{MlaConfig, RopeConfig, RopeFactors, RopePairing};
use ndarray::Array2;

/// ggml `rope_yarn_ramp`: 1 for the fast-rotating pairs below `low` (kept extrapolated), 0 above `high`
/// (fully interpolated), linear in between.
pub fn yarn_ramp(low: f64, high: f64, i: usize) -> f64 {
    let y = (i as f64 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// The unscaled (extrapolated) angle of pair `i` at position `pos`.
pub fn theta_extrap(rope: &RopeConfig, freq_factors: Option<&[f32]>, pos: f64, i: usize) -> f64 {
    let inv_freq = rope.base.powf(-2.0 * i as f64 / rope.dim as f64);
    let factor = freq_factors.map_or(1.0, |f| f[i] as f64);
    pos * inv_freq / factor
}

/// The final angle of pair `i` at position `pos`, with YaRN applied.
pub fn theta(rope: &RopeConfig, freq_factors: Option<&[f32]>, pos: f64, i: usize) -> f64 {
    let extrap = theta_extrap(rope, freq_factors, pos, i);
    match &rope.yarn {
        None => extrap,
        Some(y) => {
            let interp = extrap / y.factor;
            if y.ext_factor == 0.0 {
                return interp;
            }
            let [low, high] = y.corr_dims(rope.dim, rope.base);
            let mix = yarn_ramp(low, high, i) * y.ext_factor;
            interp * (1.0 - mix) + extrap * mix
        }
    }
}

/// The element indices that pair `i` rotates.
#[inline]
pub fn pair(pairing: RopePairing, dim: usize, i: usize) -> (usize, usize) {
    match pairing {
        RopePairing::Norm => (2 * i, 2 * i + 1),
        RopePairing::Neox => (i, i + dim / 2),
    }
}

/// cos/sin tables for a run of consecutive positions.
#[derive(Debug, Clone)]
pub struct RopeTables {
    pub dim: usize,
    pub pairing: RopePairing,
    /// Position of row 0.
    pub pos_start: usize,
    /// `[n_pos, dim/2]`, magnitude included.
    pub cos: Array2<f64>,
    pub sin: Array2<f64>,
}

impl RopeTables {
    /// Tables for positions `pos_start .. pos_start + n_pos`.
    pub fn new(
        rope: &RopeConfig,
        freq_factors: Option<&[f32]>,
        pos_start: usize,
        n_pos: usize,
    ) -> Result<RopeTables> {
        let half = rope.dim / 2;
        // dim 0 is NoPE MLA (glm5-next): empty tables, rotations that do nothing.
        if !rope.dim.is_multiple_of(2) {
            return Err(Error::Unsupported(format!(
                "rope dims {} must be even",
                rope.dim
            )));
        }
        if let Some(f) = freq_factors {
            if f.len() != half {
                return Err(Error::Tensor(format!(
                    "rope frequency factors have {} entries, expected rope dims / 2 = {half}",
                    f.len()
                )));
            }
        }
        let mut cos = Array2::zeros((n_pos, half));
        let mut sin = Array2::zeros((n_pos, half));
        for t in 0..n_pos {
            let pos = (pos_start + t) as f64;
            for i in 0..half {
                let th = theta(rope, freq_factors, pos, i);
                cos[[t, i]] = th.cos() * rope.attn_factor;
                sin[[t, i]] = th.sin() * rope.attn_factor;
            }
        }
        Ok(RopeTables {
            dim: rope.dim,
            pairing: rope.pairing,
            pos_start,
            cos,
            sin,
        })
    }

    /// Tables for every token of a run (`T` positions from `pos_offset`), with the LongRoPE factors that
    /// those positions select.
    pub fn for_run(
        cfg: &MlaConfig,
        factors: Option<&RopeFactors>,
        pos_offset: usize,
        n_tokens: usize,
    ) -> Result<RopeTables> {
        let ff = factors.and_then(|f| f.choose(pos_offset + n_tokens));
        RopeTables::new(&cfg.rope, ff, pos_offset, n_tokens)
    }

    pub fn n_pos(&self) -> usize {
        self.cos.nrows()
    }

    /// Rotate one head's rope part (`dim` values) of the token in table row `row`, in f64.
    pub fn rotate(&self, row: usize, x: &mut [f64]) {
        debug_assert_eq!(x.len(), self.dim);
        for i in 0..self.dim / 2 {
            let (a, b) = pair(self.pairing, self.dim, i);
            let (c, s) = (self.cos[[row, i]], self.sin[[row, i]]);
            let (x0, x1) = (x[a], x[b]);
            x[a] = x0 * c - x1 * s;
            x[b] = x0 * s + x1 * c;
        }
    }

    /// The tables as f32 `[n_pos · dim/2]` (cos, sin), as a kernel would receive them.
    pub fn to_f32(&self) -> (Vec<f32>, Vec<f32>) {
        (
            self.cos.iter().map(|&v| v as f32).collect(),
            self.sin.iter().map(|&v| v as f32).collect(),
        )
    }
}
