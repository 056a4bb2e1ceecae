//! Synthetic in-memory models: an `MlaConfig` with a family's attention conventions and seeded random
//! `LayerWeights`, for tests and benchmarks that need no GGUF file.
//!
//! Each model of the catalogue (`super::catalogue`) keeps its real per-head dims, latent rank, rope
//! pairing and rope scaling (so every code path of that model runs); hidden size, head count and q-LoRA
//! rank are reduced unless `full` dims are asked for.

use super::catalogue::Preset;
use super::config::{yarn_scales, MlaConfig, RopeConfig, Yarn};
use super::rope_factors::RopeFactors;
use super::weights::{KvBLayout, LayerWeights, QProj};
use ndarray::{Array1, Array2, Array3};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

/// The synthetic layers' handle: a row of the model catalogue (`--preset` of `mla-diff bench reference`).
pub type Family = Preset;

/// The sizes of a synthetic layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub hidden: usize,
    pub n_head: usize,
    pub q_lora: Option<usize>,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
}

impl Preset {
    /// The real model's dims.
    pub fn full_dims(self) -> Dims {
        let e = self.entry();
        Dims {
            hidden: e.hidden,
            n_head: e.heads,
            q_lora: e.q_lora,
            kv_lora: e.kv_lora,
            nope: e.qk_nope,
            rope: e.qk_rope,
            v: e.v_head,
        }
    }

    /// Test-sized dims: the model's per-head dims and latent rank, a small hidden size and q-LoRA rank,
    /// few heads (GLM-5 keeps its 64 heads: head count is one of its differences).
    pub fn test_dims(self) -> Dims {
        let full = self.full_dims();
        let (hidden, n_head) = match self {
            Preset::Glm5 => (256, 64),
            _ => (256, 4),
        };
        Dims {
            hidden,
            n_head,
            q_lora: full.q_lora.map(|_| 96),
            ..full
        }
    }

    /// A config with this model's conventions (architecture, rope, scaling, eps) and the given dims.
    pub fn config(self, d: Dims) -> MlaConfig {
        let e = self.entry();
        let yarn = e.yarn.as_ref().map(|y| {
            let mscale_all_dim = y.mscale_all_dim.unwrap_or(0.0);
            Yarn {
                factor: y.factor as f64,
                original_context: y.original_context as u64,
                mscale_all_dim,
                log_multiplier_raw: 0.1 * mscale_all_dim,
                beta_fast: y.beta_fast.unwrap_or(32.0) as f64,
                beta_slow: y.beta_slow.unwrap_or(1.0) as f64,
                ext_factor: 1.0,
            }
        });
        let arch = e.arch;
        // llama.cpp's default when the file has no rope.freq_base.
        let base = e.rope_base.unwrap_or(10000.0);
        // Same chain as MlaConfig::from_gguf.
        let (attn_factor, mscale) = yarn_scales(arch, yarn.as_ref(), 1.0);
        let qk = d.nope + d.rope;
        MlaConfig {
            arch,
            n_layer: 1,
            hidden: d.hidden,
            n_head: d.n_head,
            n_head_kv: 1,
            q_lora_rank: d.q_lora,
            kv_lora_rank: d.kv_lora,
            qk_nope: d.nope,
            qk_rope: d.rope,
            v_head_dim: d.v,
            mla_keys: true,
            rope: RopeConfig {
                dim: d.rope,
                base,
                pairing: e.rope,
                yarn,
                freq_factors_short: e.longrope.then(|| "rope_factors_short.weight".into()),
                freq_factors_long: e.longrope.then(|| "rope_factors_long.weight".into()),
                attn_factor,
            },
            rms_eps: e.rms_eps,
            lora_norm_eps: e.rms_eps,
            mscale,
            softmax_scale: mscale * mscale / (qk as f64).sqrt(),
            vocab_size: None,
        }
    }

    pub fn test_config(self) -> MlaConfig {
        self.config(self.test_dims())
    }
}

fn normal(rng: &mut StdRng, std: f64) -> f32 {
    let z: f64 = StandardNormal.sample(rng);
    (z * std) as f32
}

fn matrix(rng: &mut StdRng, rows: usize, cols: usize) -> Array2<f32> {
    // 1/sqrt(fan_in): unit-scale outputs for unit-scale inputs, as a trained layer roughly keeps them.
    let std = 1.0 / (cols as f64).sqrt();
    Array2::from_shape_simple_fn((rows, cols), || normal(rng, std))
}

fn norm_weight(rng: &mut StdRng, n: usize) -> Array1<f32> {
    Array1::from_shape_simple_fn(n, || 1.0 + normal(rng, 0.25))
}

/// Seeded random weights for one layer of `cfg`.
pub fn weights(cfg: &MlaConfig, seed: u64) -> LayerWeights {
    let mut rng = StdRng::seed_from_u64(seed);
    let (e, h, lkv, r) = (cfg.hidden, cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope);
    let (p, dk, dv) = (cfg.qk_nope, cfg.qk_head_dim(), cfg.v_head_dim);
    let attn_norm = norm_weight(&mut rng, e);
    let q = match cfg.q_lora_rank {
        Some(lq) => QProj::Lora {
            a: matrix(&mut rng, lq, e),
            a_norm: norm_weight(&mut rng, lq),
            b: matrix(&mut rng, h * dk, lq),
        },
        None => QProj::Plain {
            q: matrix(&mut rng, h * dk, e),
        },
    };
    let kv_a = matrix(&mut rng, lkv + r, e);
    let kv_a_norm = norm_weight(&mut rng, lkv);
    let std = 1.0 / (lkv as f64).sqrt();
    let w_uk = Array3::from_shape_simple_fn((h, p, lkv), || normal(&mut rng, std));
    let w_uv = Array3::from_shape_simple_fn((h, dv, lkv), || normal(&mut rng, std));
    let o = matrix(&mut rng, e, h * dv);
    LayerWeights {
        layer: 0,
        attn_norm,
        q,
        kv_a,
        kv_a_norm,
        w_uk,
        w_uv,
        o,
        kv_b_layout: KvBLayout::Split,
        stored: Default::default(),
        rounded: None,
        id: Default::default(),
    }
}

/// Seeded LongRoPE factors when the config names factor tensors (MiniCPM3): short factors near 1, long
/// factors growing with the pair index, as real LongRoPE factors do.
pub fn rope_factors(cfg: &MlaConfig, seed: u64) -> Option<RopeFactors> {
    cfg.rope.freq_factors_short.as_ref()?;
    let mut rng = StdRng::seed_from_u64(seed);
    let half = cfg.qk_rope / 2;
    let short = (0..half).map(|_| 1.0 + rng.random::<f32>() * 0.1).collect();
    let long = (0..half)
        .map(|i| 1.0 + 30.0 * (i as f32 / half as f32).powi(2) + rng.random::<f32>())
        .collect();
    Some(RopeFactors {
        short: Some(short),
        long: Some(long),
        original_context: 32768,
    })
}
