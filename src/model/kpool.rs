//! glm5-next's k-pool DSA indexer (transformers 5.24.0 `Glm5NextTextIndexer`; llama.cpp's converter
//! `conversion/glm.py` `Glm5NextModel` and its graph `src/models/glm5-next.cpp`): GLM-5's indexer without
//! rope, whose keys are pooled `kpool` tokens at a time before the top-k.
//!
//! Keys: GLM-5's three (`indexer.head_count`, `.key_length`, `.top_k`) plus `indexer.kpool`,
//! `indexer.kpool_select_tail` and `indexer.types`. Tensors of a "full" layer: GLM-5's five
//! (`model::indexer::tensor_names`) plus, written by the converter as they are (no transpose) and forced
//! to F32 (`tensor_force_quant`: "indexer_compressor_"), `blk.N.indexer_compressor_gate.weight` (HF
//! `index_kpool_compress_gate`, torch `[Di, E]`, ne `{E, Di}`) and `blk.N.indexer_compressor_ape.weight`
//! (HF `index_kpool_compress_ape`, torch `[kpool, Di]`, ne `{Di, kpool}`) — the shapes llama.cpp's
//! loader creates them with (`{n_embd, n_embd_indexer}`, `{n_embd_indexer, kpool}`). A "shared" layer
//! has none of the seven and reuses the previous full layer's selection.

use super::config::{Arch, MlaConfig, RopePairing};
use super::indexer::{IndexerConfig, IndexerWeights};
use super::keys::MlaKeys;
use super::weights::load_checked;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use ndarray::Array2;
use serde::Serialize;

/// glm5-next's DSA indexer additions, as llama.cpp's converter writes them (conversion/glm.py
/// `Glm5NextModel`; gguf-py constants `Keys.Attention.Indexer.KPOOL`, `KPOOL_SELECT_TAIL`, `TYPES`), from
/// transformers' `Glm5NextConfig` (`index_kpool` 16, `index_kpool_always_select_tail` True,
/// `indexer_types`): keys are pooled `kpool` tokens at a time before top-k; a "shared" layer reuses the
/// previous "full" layer's top-k.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KpoolConfig {
    /// `{arch}.attention.indexer.kpool`: tokens per pooled key.
    pub kpool: usize,
    /// `{arch}.attention.indexer.kpool_select_tail`: the visible tail past the last full pool is always
    /// selected (the converter's default: true).
    pub select_tail: bool,
    /// `{arch}.attention.indexer.types` (true = "full", false = "shared"), one per block; `None` where the
    /// converter wrote none (the HF config had no `indexer_types`).
    pub full: Option<Vec<bool>>,
}

impl KpoolConfig {
    /// `Ok(None)` for every architecture but glm5-next, and for a glm5-next file without the kpool key.
    pub fn from_gguf(f: &GgufFile, cfg: &MlaConfig) -> Result<Option<KpoolConfig>> {
        if cfg.arch != Arch::Glm5Next {
            return Ok(None);
        }
        let k = MlaKeys::read(f, cfg.arch.gguf_name());
        let bad = |key: &str, shown: &Option<String>, what: &str| {
            Error::format(
                f.path.display(),
                format!(
                    "{key} is {}, expected {what}",
                    shown.as_deref().unwrap_or_default()
                ),
            )
        };
        let r = &k.indexer_kpool;
        if !r.present {
            return Ok(None);
        }
        let kpool = match r.value {
            Some(n) if n > 0 && n < 1 << 20 => n as usize,
            _ => return Err(bad(&r.key, &r.shown, "a positive integer")),
        };
        let r = &k.indexer_kpool_select_tail;
        let select_tail = match (r.present, r.value) {
            (false, _) => true,
            (true, Some(b)) => b,
            (true, None) => return Err(bad(&r.key, &r.shown, "a bool")),
        };
        let full = match (&k.indexer_types.value, &k.indexer_types.bad_type) {
            (Some(v), _) => Some(v.clone()),
            (None, Some(d)) => return Err(d.error(f)),
            (None, None) => None,
        };
        Ok(Some(KpoolConfig {
            kpool,
            select_tail,
            full,
        }))
    }

    /// The layers that reuse the previous full layer's top-k, among `layers`.
    pub fn shared_layers(&self, layers: &[usize]) -> Vec<usize> {
        match &self.full {
            None => Vec::new(),
            Some(full) => layers
                .iter()
                .copied()
                .filter(|&l| full.get(l) == Some(&false))
                .collect(),
        }
    }
}

/// The k-pool tensors' names of a layer: `[gate, ape]`.
pub fn tensor_names(layer: usize) -> [String; 2] {
    [
        "indexer_compressor_gate.weight",
        "indexer_compressor_ape.weight",
    ]
    .map(|n| format!("blk.{layer}.{n}"))
}

/// The k-pool indexer's hyper-parameters: GLM-5's indexer keys (no rope: glm5-next is NoPE) and the
/// k-pool's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KpoolIndexer {
    pub ic: IndexerConfig,
    pub kp: KpoolConfig,
}

impl KpoolIndexer {
    /// `Ok(None)` for every architecture but glm5-next, and for a glm5-next file without the indexer or
    /// k-pool keys. `top_k` must be a multiple of `kpool` (transformers' `validate_architecture`,
    /// llama.cpp's loader asserts it).
    pub fn from_gguf(f: &GgufFile, cfg: &MlaConfig) -> Result<Option<KpoolIndexer>> {
        let Some(kp) = KpoolConfig::from_gguf(f, cfg)? else {
            return Ok(None);
        };
        let Some(ic) = IndexerConfig::read(f, cfg, RopePairing::Norm)? else {
            return Ok(None);
        };
        if ic.top_k % kp.kpool != 0 {
            return Err(Error::format(
                f.path.display(),
                format!(
                    "indexer top_k {} is not a multiple of kpool {} (transformers Glm5NextConfig requires it; the pool top-k is top_k / kpool)",
                    ic.top_k, kp.kpool
                ),
            ));
        }
        Ok(Some(KpoolIndexer { ic, kp }))
    }

    /// Whether `layer` runs its own indexer (`indexer.types`; every layer without it).
    pub fn is_full(&self, layer: usize) -> bool {
        self.kp
            .full
            .as_ref()
            .is_none_or(|f| f.get(layer) != Some(&false))
    }

    /// The layer whose selection a shared `layer` reuses: the nearest full layer before it among
    /// `mla_layers` (transformers passes the previous layer's top-k on; `None`: no full layer before).
    pub fn source_of(&self, layer: usize, mla_layers: &[usize]) -> Option<usize> {
        mla_layers
            .iter()
            .copied()
            .filter(|&l| l < layer && self.is_full(l))
            .max()
    }
}

/// One full layer's k-pool tensors, torch orientation, exact f32 values of the file's contents.
#[derive(Debug, Clone)]
pub struct KpoolWeights {
    /// `[Di, E]`: the per-token gate scores are `attn_in · gateᵀ`.
    pub gate: Array2<f32>,
    /// `[kpool, Di]`: added to the gate scores by the token's slot in its pool.
    pub ape: Array2<f32>,
}

/// A full layer's whole indexer: GLM-5's tensors and the k-pool's.
#[derive(Debug, Clone)]
pub struct KpoolLayer {
    pub index: IndexerWeights,
    pub pool: KpoolWeights,
}

impl KpoolLayer {
    /// `Ok(None)` on a layer with none of the indexer's tensors (a shared layer); a partial set, a
    /// wrong shape, or a layer `indexer.types` calls full without them (or shared with them) is an error.
    pub fn load(
        f: &GgufFile,
        cfg: &MlaConfig,
        k: &KpoolIndexer,
        layer: usize,
    ) -> Result<Option<KpoolLayer>> {
        let names = tensor_names(layer);
        let pooled = names.iter().filter(|n| f.tensor(n).is_some()).count();
        let index = IndexerWeights::load(f, cfg, &k.ic, layer)?;
        let full = k.is_full(layer);
        let err = |m: String| {
            Err(Error::Tensor(format!(
                "{}: layer {layer} {m}",
                f.path.display()
            )))
        };
        let index = match (index, pooled, full) {
            (None, 0, false) => return Ok(None),
            (None, 0, true) => {
                return err("has no DSA indexer tensors, but indexer.types says it is a full layer (a full layer runs its own k-pool indexer)".into())
            }
            (Some(_), _, false) => {
                return err("has DSA indexer tensors, but indexer.types says it is shared (it reuses the previous full layer's top-k)".into())
            }
            (None, _, _) => {
                return err(format!("has the k-pool tensors ({}) but not the DSA indexer's (blk.{layer}.indexer.*)", names.join(", ")))
            }
            (Some(_), n, true) if n < 2 => {
                let missing: Vec<&str> = names.iter().filter(|n| f.tensor(n).is_none()).map(|s| s.as_str()).collect();
                return err(format!("has the DSA indexer tensors but not the k-pool's {} (glm5-next's indexer pools keys with them; llama.cpp's converter writes both)", missing.join(" and ")));
            }
            (Some(i), _, true) => i,
        };
        let (e, di, kpool) = (cfg.hidden, k.ic.head_dim, k.kp.kpool);
        let why = format!("layer {layer} k-pool indexer");
        let gate = load_checked(f, &names[0], &[e, di], &why)?;
        let ape = load_checked(f, &names[1], &[di, kpool], &why)?;
        Ok(Some(KpoolLayer {
            index,
            pool: KpoolWeights {
                gate: Array2::from_shape_vec((di, e), gate).expect("shape checked"),
                ape: Array2::from_shape_vec((kpool, di), ape).expect("shape checked"),
            },
        }))
    }
}
