//! Synthetic in-memory models: an `MlaConfig` with a family's attention conventions and seeded random
//! `LayerWeights`, for tests and benchmarks that need no GGUF file.
//!
//! Each family keeps its real per-head dims, latent rank, rope pairing and rope scaling (so every code
//! path of that family runs); hidden size, head count and q-LoRA rank are reduced unless `full` dims are
//! asked for.

use super::config::{Arch, MlaConfig, RopeConfig, Yarn};
use super::rope_factors::RopeFactors;
use super::weights::{KvBLayout, LayerWeights, QProj};
use ndarray::{Array1, Array2, Array3};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

/// The attention families the tool must handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Family {
    /// DeepSeek-V3/R1 (Kimi-K2 alike): q-LoRA, 128/64/128, YaRN ×40, mscale_all_dim 1.
    DeepseekV3,
    /// DeepSeek-V2-Lite: no q-LoRA, 128/64/128, YaRN ×40, mscale_all_dim 0.707.
    DeepseekV2Lite,
    /// GLM-5: 192/64/256, 64 heads, no YaRN.
    #[value(name = "glm-5")]
    Glm5,
    /// MiniCPM3: NEOX rope, 64/32/64, kv_lora 256, LongRoPE factors.
    Minicpm3,
}

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

impl Family {
    pub const ALL: [Family; 4] = [
        Family::DeepseekV3,
        Family::DeepseekV2Lite,
        Family::Glm5,
        Family::Minicpm3,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::DeepseekV3 => "deepseek-v3",
            Family::DeepseekV2Lite => "deepseek-v2-lite",
            Family::Glm5 => "glm-5",
            Family::Minicpm3 => "minicpm3",
        }
    }

    /// The real model's dims.
    pub fn full_dims(self) -> Dims {
        match self {
            Family::DeepseekV3 => Dims {
                hidden: 7168,
                n_head: 128,
                q_lora: Some(1536),
                kv_lora: 512,
                nope: 128,
                rope: 64,
                v: 128,
            },
            Family::DeepseekV2Lite => Dims {
                hidden: 2048,
                n_head: 16,
                q_lora: None,
                kv_lora: 512,
                nope: 128,
                rope: 64,
                v: 128,
            },
            Family::Glm5 => Dims {
                hidden: 6144,
                n_head: 64,
                q_lora: Some(2048),
                kv_lora: 512,
                nope: 192,
                rope: 64,
                v: 256,
            },
            Family::Minicpm3 => Dims {
                hidden: 2560,
                n_head: 40,
                q_lora: Some(768),
                kv_lora: 256,
                nope: 64,
                rope: 32,
                v: 64,
            },
        }
    }

    /// Test-sized dims: the family's per-head dims and latent rank, a small hidden size and q-LoRA rank,
    /// few heads (GLM-5 keeps its 64 heads: head count is one of its differences).
    pub fn test_dims(self) -> Dims {
        let full = self.full_dims();
        let (hidden, n_head) = match self {
            Family::Glm5 => (256, 64),
            _ => (256, 4),
        };
        Dims {
            hidden,
            n_head,
            q_lora: full.q_lora.map(|_| 96),
            ..full
        }
    }

    /// A config with this family's conventions and the given dims.
    pub fn config(self, d: Dims) -> MlaConfig {
        let yarn = |mscale_all_dim: f64| Yarn {
            factor: 40.0,
            original_context: 4096,
            mscale_all_dim,
            log_multiplier_raw: 0.1 * mscale_all_dim,
            beta_fast: 32.0,
            beta_slow: 1.0,
            ext_factor: 1.0,
        };
        let (arch, base, yarn, rms_eps, longrope) = match self {
            Family::DeepseekV3 => (Arch::Deepseek2, 10000.0, Some(yarn(1.0)), 1e-6, false),
            Family::DeepseekV2Lite => (Arch::Deepseek2, 10000.0, Some(yarn(0.707)), 1e-6, false),
            Family::Glm5 => (Arch::GlmDsa, 1e6, None, 1e-5, false),
            Family::Minicpm3 => (Arch::Minicpm3, 10000.0, None, 1e-5, true),
        };
        // Same chain as MlaConfig::from_gguf (llama.cpp deepseek2 graph).
        let mscale = match &yarn {
            Some(y) if y.mscale_all_dim != 0.0 => Yarn::get_mscale(y.factor, y.mscale_all_dim),
            Some(y) => Yarn::get_mscale(y.factor, 1.0),
            None => 1.0,
        };
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
                pairing: arch.rope_pairing(),
                yarn,
                freq_factors_short: longrope.then(|| "rope_factors_short.weight".into()),
                freq_factors_long: longrope.then(|| "rope_factors_long.weight".into()),
                attn_factor: 1.0,
            },
            rms_eps,
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
