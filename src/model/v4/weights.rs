//! DeepSeek-V4's two ropes as `RopeConfig`s and one layer's attention weights, loaded shape-checked.

use super::{LayerKind, V4Config};
use crate::error::Result;
use crate::gguf::GgufFile;

/// Which of V4's two ropes a layer (or its compressor and indexer) uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Rope {
    /// `rope.freq_base`, no scaling: window-only layers.
    Main,
    /// `compress_rope_freq_base` with the file's YaRN (cos/sin × 1): CSA/HCA layers.
    Compress,
}

impl V4Config {
    pub fn rope_of(&self, kind: LayerKind) -> V4Rope {
        match kind {
            LayerKind::Window => V4Rope::Main,
            _ => V4Rope::Compress,
        }
    }
    /// The rope as a `RopeConfig` (interleaved pairs over `rope_dim`; YaRN's magnitude cancelled, as
    /// transformers' `attention_factor` 1.0 and llama.cpp's `dsv4_rope_attn_factor`).
    pub fn rope_config(&self, which: V4Rope) -> crate::model::RopeConfig {
        let yarn = match which {
            V4Rope::Main => None,
            V4Rope::Compress => self.yarn.as_ref().map(|y| crate::model::Yarn {
                factor: y.factor,
                original_context: y.original_context,
                mscale_all_dim: 0.0,
                log_multiplier_raw: 0.0,
                beta_fast: y.beta_fast,
                beta_slow: y.beta_slow,
                ext_factor: 1.0,
            }),
        };
        crate::model::RopeConfig {
            dim: self.rope_dim,
            base: match which {
                V4Rope::Main => self.rope_base,
                V4Rope::Compress => self.compress_rope_base,
            },
            pairing: crate::model::RopePairing::Norm,
            yarn,
            freq_factors_short: None,
            freq_factors_long: None,
            attn_factor: 1.0,
        }
    }
}

/// A compressor's weights, torch orientation: `kv`, `gate` `[coff·d, E]`, `ape` `[ratio, coff·d]`,
/// `norm` `[d]`.
#[derive(Debug, Clone)]
pub struct CompressorWeights {
    pub kv: ndarray::Array2<f64>,
    pub gate: ndarray::Array2<f64>,
    pub ape: ndarray::Array2<f64>,
    pub norm: Vec<f64>,
}

/// One V4 layer's attention weights in f64, torch orientation (`[out, in]`).
#[derive(Debug, Clone)]
pub struct V4Weights {
    pub attn_norm: Vec<f64>,
    pub q_a: ndarray::Array2<f64>,
    pub q_a_norm: Vec<f64>,
    pub q_b: ndarray::Array2<f64>,
    pub kv: ndarray::Array2<f64>,
    pub kv_norm: Vec<f64>,
    pub sinks: Vec<f64>,
    /// `[G·o_lora, H·D/G]`: group g's rows are `g·o_lora ..`.
    pub o_a: ndarray::Array2<f64>,
    pub o_b: ndarray::Array2<f64>,
    pub compressor: Option<CompressorWeights>,
    /// CSA only: the indexer's compressor (at its head dim), `q_b` `[Hi·Di, q_lora]`, `proj` `[Hi, E]`.
    pub indexer: Option<(
        CompressorWeights,
        ndarray::Array2<f64>,
        ndarray::Array2<f64>,
    )>,
}

impl V4Weights {
    /// Layer `layer`'s attention tensors, each shape-checked against `attention_tensors`.
    pub fn load(f: &GgufFile, c: &V4Config, layer: usize) -> Result<V4Weights> {
        let specs = c.attention_tensors(layer);
        let get = |suffix: &str| -> Result<(Vec<f64>, Vec<usize>)> {
            let name = format!("blk.{layer}.{suffix}.weight");
            let ne = &specs
                .iter()
                .find(|(n, _)| *n == name)
                .expect("a V4 tensor")
                .1;
            let v = crate::model::weights::load_checked(f, &name, ne, "DeepSeek-V4 attention")?;
            Ok((v.into_iter().map(f64::from).collect(), ne.clone()))
        };
        let vec = |s: &str| get(s).map(|(v, _)| v);
        let mat = |s: &str| -> Result<ndarray::Array2<f64>> {
            let (v, ne) = get(s)?;
            Ok(ndarray::Array2::from_shape_vec((ne[1], ne[0]), v).expect("shape checked"))
        };
        let comp = |p: &str| -> Result<CompressorWeights> {
            Ok(CompressorWeights {
                kv: mat(&format!("{p}_kv"))?,
                gate: mat(&format!("{p}_gate"))?,
                ape: mat(&format!("{p}_ape"))?,
                norm: vec(&format!("{p}_norm"))?,
            })
        };
        let kind = c.kind(layer);
        Ok(V4Weights {
            attn_norm: vec("attn_norm")?,
            q_a: mat("attn_q_a")?,
            q_a_norm: vec("attn_q_a_norm")?,
            q_b: mat("attn_q_b")?,
            kv: mat("attn_kv")?,
            kv_norm: vec("attn_kv_a_norm")?,
            sinks: vec("attn_sinks")?,
            o_a: mat("attn_output_a")?,
            o_b: mat("attn_output_b")?,
            compressor: (kind != LayerKind::Window)
                .then(|| comp("attn_compressor"))
                .transpose()?,
            indexer: (kind == LayerKind::Csa)
                .then(|| -> Result<_> {
                    Ok((
                        comp("indexer_compressor")?,
                        mat("indexer.attn_q_b")?,
                        mat("indexer.proj")?,
                    ))
                })
                .transpose()?,
        })
    }
}
