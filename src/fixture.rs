//! Synthetic MLA GGUF files in llama.cpp's exact conventions, with seeded random weights.
//!
//! Every weight is first generated in torch (HF) layout, then emitted the way the converter would:
//! `ne` = reversed torch shape, `kv_b_proj` split per head into `[k_nope | v]` with `k_b` transposed
//! (`attn_k_b` ne `{P, Lkv, H}`, `attn_v_b` ne `{Lkv, Dv, H}`) — or, for legacy files and MiniCPM3,
//! one unsplit `attn_kv_b`. Metadata keys and values follow `conversion/deepseek.py`, `glm.py` and
//! `minicpm.py` (see docs/conventions.md). Only attention tensors and `token_embd` are written:
//! no FFN/MoE, output or tokenizer, so the files are small and not runnable by llama.cpp itself.
//!
//! Values are a pure function of (seed, tensor name, row): each torch row has its own RNG stream, so
//! the bytes do not depend on chunking or thread count, and tests can regenerate any tensor on its own.

use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::model::Arch;

#[cfg(test)]
mod catalogue_tests;
mod metadata;
pub mod v4;
mod values;
mod write;

pub use values::{Source, TensorPlan};
pub use write::{write, Summary};

pub use crate::model::catalogue::{Preset, YarnSpec};

/// Everything that determines a fixture file.
#[derive(Debug, Clone)]
pub struct Spec {
    pub preset: Preset,
    pub model_name: &'static str,
    pub arch: Arch,
    pub layers: usize,
    pub hidden: usize,
    pub n_head: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
    /// `None`: the converter writes no `rope.freq_base` (MiniCPM3; llama.cpp then uses 10000).
    pub rope_base: Option<f32>,
    pub yarn: Option<YarnSpec>,
    pub rms_eps: f32,
    pub context_length: u32,
    pub vocab: usize,
    /// Pre-PR #12801 layout: unsplit `attn_kv_b`, MHA-style head sizes, no `*_mla` keys.
    pub legacy_kv_b: bool,
    /// DSA indexer keys (head_count, key_length, top_k) written by the GLM-5 converter.
    pub indexer: Option<(u32, u32, u32)>,
    /// glm5-next's k-pool size (`index_kpool`); `None` for every other architecture.
    pub kpool: Option<u32>,
    /// glm5-next's `layer_types`, one per layer: true for MLA ("indexed_attention"), false for linear
    /// attention (no MLA tensors, head_count_kv 0). `None`: the model's default layout
    /// (`catalogue::glm5_next_is_mla`), or every layer MLA on the other architectures.
    pub layer_types: Option<Vec<bool>>,
    /// glm5-next's `indexer_types` (`attention.indexer.types`): true for a layer running its own
    /// indexer ("full": indexer and k-pool tensors), false for one reusing the previous selection
    /// ("shared": none). `None`: every layer full.
    pub indexer_types: Option<Vec<bool>>,
    pub quant: GgmlType,
    pub seed: u64,
}

/// Command-line choices layered over a preset.
#[derive(Debug, Clone)]
pub struct Options {
    pub preset: Preset,
    pub layers: Option<usize>,
    pub quant: GgmlType,
    pub seed: u64,
    pub legacy_kv_b: bool,
    pub hidden: Option<usize>,
    pub heads: Option<usize>,
    /// `Some(0)` removes the q-LoRA (plain `attn_q`).
    pub q_lora_rank: Option<usize>,
    pub vocab: Option<usize>,
}

/// Rows of `token_embd` in a fixture unless `--vocab` says otherwise (not the real model's vocabulary).
const VOCAB: usize = 512;

impl Preset {
    /// The fixture of the model as the catalogue states it (BF16, seed 0).
    pub fn spec(self) -> Spec {
        let e = self.entry();
        Spec {
            preset: self,
            model_name: e.model_name,
            arch: e.arch,
            layers: e.layers,
            hidden: e.hidden,
            n_head: e.heads,
            q_lora_rank: e.q_lora,
            kv_lora_rank: e.kv_lora,
            qk_nope: e.qk_nope,
            qk_rope: e.qk_rope,
            v_head_dim: e.v_head,
            rope_base: e.rope_base.map(|b| b as f32),
            yarn: e.yarn.clone(),
            rms_eps: e.rms_eps as f32,
            context_length: e.context_length,
            vocab: VOCAB,
            legacy_kv_b: e.unsplit_kv_b,
            indexer: e.indexer.map(|i| (i.heads, i.key_length, i.top_k)),
            kpool: (e.arch == Arch::Glm5Next).then_some(crate::model::catalogue::GLM5_NEXT_KPOOL),
            layer_types: None,
            indexer_types: None,
            quant: GgmlType::from_name("BF16").unwrap(),
            seed: 0,
        }
    }
}

impl Spec {
    pub fn from_options(o: &Options) -> Result<Spec> {
        let mut s = o.preset.spec();
        if o.legacy_kv_b && s.arch == Arch::Minicpm3 {
            return Err(Error::Usage(
                "--legacy-kv-b: minicpm3 files always have an unsplit attn_kv_b already".into(),
            ));
        }
        s.legacy_kv_b |= o.legacy_kv_b;
        s.layers = o.layers.unwrap_or(s.layers);
        s.hidden = o.hidden.unwrap_or(s.hidden);
        s.n_head = o.heads.unwrap_or(s.n_head);
        if let Some(r) = o.q_lora_rank {
            s.q_lora_rank = (r > 0).then_some(r);
        }
        s.vocab = o.vocab.unwrap_or(s.vocab);
        s.quant = o.quant;
        s.seed = o.seed;
        for (what, v) in [
            ("--layers", s.layers),
            ("--hidden", s.hidden),
            ("--heads", s.n_head),
            ("--vocab", s.vocab),
        ] {
            if v == 0 || v > 1 << 20 {
                return Err(Error::Usage(format!("{what} {v} is out of range")));
            }
        }
        if !crate::gguf::write::can_quantize(s.quant) {
            return Err(Error::Usage(format!(
                "--quant {}: cannot produce this type (choose one of: {})",
                s.quant.name.to_lowercase(),
                quant_names().join(", ")
            )));
        }
        Ok(s)
    }

    /// Whether layer `l` is an MLA layer (glm5-next's linear-attention layers are not).
    pub fn is_mla(&self, l: usize) -> bool {
        match &self.layer_types {
            Some(t) => t.get(l).copied().unwrap_or(false),
            None => self.arch != Arch::Glm5Next || crate::model::catalogue::glm5_next_is_mla(l),
        }
    }

    /// Whether layer `l` runs its own indexer (glm5-next's "shared" layers reuse the previous one's).
    pub fn indexer_full(&self, l: usize) -> bool {
        self.indexer_types
            .as_ref()
            .is_none_or(|t| t.get(l).copied().unwrap_or(true))
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope + self.qk_rope
    }
    fn kv_b_rows(&self) -> usize {
        self.n_head * (self.qk_nope + self.v_head_dim)
    }
}

/// `--quant` values, lower case.
pub fn quant_names() -> Vec<String> {
    GgmlType::all()
        .iter()
        .filter(|t| crate::gguf::write::can_quantize(**t))
        .map(|t| t.name.to_lowercase())
        .collect()
}
