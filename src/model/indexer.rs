//! The DSA lightning indexer of GLM-5 (`glm-dsa`) and DeepSeek-V3.2 (`deepseek32`): its metadata keys
//! and per-layer tensors, as llama.cpp's converter writes them (docs/dsa.md).
//!
//! Keys: `{arch}.attention.indexer.head_count` (Hi), `.key_length` (Di), `.top_k`. Tensors, torch
//! orientation after reading (ggml `ne` reversed): `blk.N.indexer.attn_q_b` `[Hi·Di, Lq]` (from the
//! normed q-LoRA latent), `indexer.attn_k` `[Di, E]`, `indexer.k_norm.{weight,bias}` `[Di]` (a LayerNorm
//! with bias), `indexer.proj` `[Hi, E]` (the per-head weights). GLM-5.2 ships them on its "full" layers
//! only (llama.cpp PR #24770); a layer without them reuses the previous full layer's selection.

use super::config::{Arch, MlaConfig, RopePairing};
use super::keys::{MlaKeys, Read};
use super::weights::load_checked;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use ndarray::{Array1, Array2};
use serde::Serialize;

/// transformers' `k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)` (both GLM-5 and DeepSeek-V3.2);
/// the GGUF has no key for it.
pub const K_NORM_EPS: f64 = 1e-6;

/// The indexer's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct IndexerConfig {
    pub heads: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Rope dims at the head's start (the indexer puts rope first, MLA puts it last): the MLA's R.
    pub rope_dim: usize,
    /// Interleaved (NORM) for GLM-5 (transformers PR #46842, llama.cpp PR #25407), NeoX for DeepSeek-V3.2.
    pub rope: RopePairing,
}

impl IndexerConfig {
    /// The indexer's rope pairing for an architecture (`None`: not a DSA architecture).
    pub fn rope_for(arch: Arch) -> Option<RopePairing> {
        match arch {
            Arch::GlmDsa => Some(RopePairing::Norm),
            Arch::Deepseek32 => Some(RopePairing::Neox),
            _ => None,
        }
    }

    /// `Ok(None)` for a dense architecture, or a DSA file without indexer keys (then the run stays dense,
    /// with the notice `run::dense_beyond_top_k` gives). An indexer needs q-LoRA (it reads its latent).
    pub fn from_gguf(f: &GgufFile, cfg: &MlaConfig) -> Result<Option<IndexerConfig>> {
        let Some(rope) = Self::rope_for(cfg.arch) else {
            return Ok(None);
        };
        Self::read(f, cfg, rope)
    }

    /// The three keys, with the MLA's rope dims and `rope` as the pairing (glm5-next: no rope at all).
    pub(super) fn read(
        f: &GgufFile,
        cfg: &MlaConfig,
        rope: RopePairing,
    ) -> Result<Option<IndexerConfig>> {
        let keys = MlaKeys::read(f, cfg.arch.gguf_name());
        let get = |r: &Read<u64>| -> Result<Option<usize>> {
            match (r.present, r.value) {
                (false, _) => Ok(None),
                (true, Some(n)) if n > 0 && n < 1 << 24 => Ok(Some(n as usize)),
                _ => Err(Error::format(
                    f.path.display(),
                    format!(
                        "{} is {}, expected a positive integer",
                        r.key,
                        r.shown.clone().unwrap_or_default()
                    ),
                )),
            }
        };
        let (heads, head_dim, top_k) = (
            get(&keys.indexer_head_count)?,
            get(&keys.indexer_key_length)?,
            get(&keys.indexer_top_k)?,
        );
        let (Some(heads), Some(head_dim), Some(top_k)) = (heads, head_dim, top_k) else {
            return Ok(None);
        };
        if head_dim < cfg.qk_rope || head_dim % 2 != 0 {
            return Err(Error::format(
                f.path.display(),
                format!(
                    "{} is {head_dim}, smaller than the rope dims {} or odd",
                    keys.indexer_key_length.key, cfg.qk_rope
                ),
            ));
        }
        if cfg.q_lora_rank.is_none() {
            return Err(Error::format(
                f.path.display(),
                "a DSA indexer reads the q-LoRA latent, but the file has no q_lora_rank",
            ));
        }
        Ok(Some(IndexerConfig {
            heads,
            head_dim,
            top_k,
            rope_dim: cfg.qk_rope,
            rope,
        }))
    }
}

/// One layer's indexer tensors, torch orientation, exact f32 values of the file's contents.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    /// `[Hi·Di, Lq]`
    pub q_b: Array2<f32>,
    /// `[Di, E]`
    pub k: Array2<f32>,
    /// `[Di]`
    pub k_norm: Array1<f32>,
    /// `[Di]`
    pub k_norm_bias: Array1<f32>,
    /// `[Hi, E]`
    pub proj: Array2<f32>,
}

/// The tensor names of a layer's indexer.
pub fn tensor_names(layer: usize) -> [String; 5] {
    [
        "indexer.attn_q_b.weight",
        "indexer.attn_k.weight",
        "indexer.k_norm.weight",
        "indexer.k_norm.bias",
        "indexer.proj.weight",
    ]
    .map(|n| format!("blk.{layer}.{n}"))
}

impl IndexerWeights {
    /// `Ok(None)` when the layer has no indexer tensors at all (a GLM-5.2 "shared" layer); a partial set
    /// or a wrong shape is an error.
    pub fn load(
        f: &GgufFile,
        cfg: &MlaConfig,
        ic: &IndexerConfig,
        layer: usize,
    ) -> Result<Option<IndexerWeights>> {
        let names = tensor_names(layer);
        let present = names.iter().filter(|n| f.tensor(n).is_some()).count();
        if present == 0 {
            return Ok(None);
        }
        let (e, lq) = (cfg.hidden, cfg.q_lora_rank.unwrap_or(0));
        let (hi, di) = (ic.heads, ic.head_dim);
        let why = format!("layer {layer} DSA indexer");
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Array2<f32>> {
            let v = load_checked(f, name, &[cols, rows], &why)?;
            Ok(Array2::from_shape_vec((rows, cols), v).expect("shape checked"))
        };
        let vec = |name: &str| -> Result<Array1<f32>> {
            Ok(Array1::from(load_checked(f, name, &[di], &why)?))
        };
        Ok(Some(IndexerWeights {
            q_b: mat(&names[0], hi * di, lq)?,
            k: mat(&names[1], di, e)?,
            k_norm: vec(&names[2])?,
            k_norm_bias: vec(&names[3])?,
            proj: mat(&names[4], hi, e)?,
        }))
    }
}
