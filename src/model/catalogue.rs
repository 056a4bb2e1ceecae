//! The model catalogue: one table of the real models whose attention shapes the tool knows, used by the
//! fixture writer (`mla-diff fixture --preset`), the synthetic layers (`model::synthetic`, `mla-diff bench
//! reference --preset`), the selftest's fixtures and the GPU validation cases.
//!
//! Each entry states the model as its Hugging Face config and llama.cpp's converter state it. Where an
//! entry is not the published model (the tiny test model), it says so.

use super::config::{Arch, RopePairing};

/// glm5-next's k-pool size (`index_kpool`, transformers 5.24.0 `Glm5NextTextConfig` default).
pub const GLM5_NEXT_KPOOL: u32 = 16;

/// glm5-next's default layer layout (`Glm5NextTextConfig.__post_init__`): layer `l` is MLA
/// ("indexed_attention") where `l % 4 == 3`, linear attention (KDA) elsewhere.
pub fn glm5_next_is_mla(l: usize) -> bool {
    l % 4 == 3
}

/// A model of the catalogue (the `--preset` values). The variant names appear in the fixture files'
/// `general.description` (Debug formatting): renaming one changes the shipped fixtures' bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    DeepseekV3,
    DeepseekV2Lite,
    KimiK2,
    KimiK25,
    Glm47Flash,
    Glm5,
    DeepseekV32,
    Minicpm3,
    Glm5Next,
    Tiny,
}

/// YaRN as the HF config states it (before the converter's ×0.1 on `mscale_all_dim`).
#[derive(Debug, Clone, PartialEq)]
pub struct YarnSpec {
    pub factor: f32,
    pub original_context: u32,
    /// A Python float in the HF config: f64, so 0.1·0.707 rounds to f32 exactly as the converter's does.
    pub mscale_all_dim: Option<f64>,
    pub beta_fast: Option<f32>,
    pub beta_slow: Option<f32>,
}

/// The DSA indexer of GLM-5 and DeepSeek-V3.2 (keys and `blk.N.indexer.*` tensors; docs/dsa.md). Its
/// rope pairing is the architecture's (`IndexerConfig::rope_for`: interleaved for `glm-dsa`, NeoX for
/// `deepseek32`), so the entry does not state it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Indexer {
    pub heads: u32,
    pub key_length: u32,
    pub top_k: u32,
}

/// One model's attention, as its HF config and the GGUF converter state it.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub preset: Preset,
    /// The `--preset` value.
    pub name: &'static str,
    /// The model's own name (`general.name` of a fixture).
    pub model_name: &'static str,
    /// The GGUF architecture the converter writes.
    pub arch: Arch,
    /// Trunk layers (without NextN/MTP blocks).
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// `None`: no q-LoRA (a plain `attn_q`).
    pub q_lora: Option<usize>,
    pub kv_lora: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    /// The rope pair layout (llama.cpp derives it from the architecture; a test checks they agree).
    pub rope: RopePairing,
    /// `None`: the converter writes no `rope.freq_base` (MiniCPM3; llama.cpp then uses 10000).
    pub rope_base: Option<f64>,
    pub yarn: Option<YarnSpec>,
    /// LongRoPE frequency factors (`rope_factors_long`/`_short` tensors).
    pub longrope: bool,
    pub rms_eps: f64,
    pub context_length: u32,
    /// The converter writes one unsplit `attn_kv_b` (MiniCPM3 always; DeepSeek files before llama.cpp
    /// PR #12801 too, which the fixture writer can also produce).
    pub unsplit_kv_b: bool,
    pub indexer: Option<Indexer>,
    /// A note for `--help`, where the entry needs one beyond its dims.
    pub note: &'static str,
}

/// DeepSeek's YaRN: factor 40 over 4096 positions, β 32/1.
const DEEPSEEK_YARN: YarnSpec = YarnSpec {
    factor: 40.0,
    original_context: 4096,
    mscale_all_dim: Some(1.0),
    beta_fast: Some(32.0),
    beta_slow: Some(1.0),
};

/// Kimi-K2 (Kimi-K2-Instruct: YaRN ×32 to 131072), the base of Kimi-K2.5's entry.
const KIMI_K2: Entry = Entry {
    preset: Preset::KimiK2,
    name: "kimi-k2",
    model_name: "Kimi-K2",
    arch: Arch::Deepseek2,
    layers: 61,
    hidden: 7168,
    heads: 64,
    q_lora: Some(1536),
    kv_lora: 512,
    qk_nope: 128,
    qk_rope: 64,
    v_head: 128,
    rope: RopePairing::Norm,
    rope_base: Some(50000.0),
    yarn: Some(YarnSpec {
        factor: 32.0,
        beta_fast: Some(1.0),
        ..DEEPSEEK_YARN
    }),
    longrope: false,
    rms_eps: 1e-6,
    context_length: 131072,
    unsplit_kv_b: false,
    indexer: None,
    note: "",
};

/// Every model, in `Preset` order.
pub const CATALOGUE: [Entry; 10] = [
    Entry {
        preset: Preset::DeepseekV3,
        name: "deepseek-v3",
        model_name: "DeepSeek-V3",
        arch: Arch::Deepseek2,
        layers: 61,
        hidden: 7168,
        heads: 128,
        q_lora: Some(1536),
        kv_lora: 512,
        qk_nope: 128,
        qk_rope: 64,
        v_head: 128,
        rope: RopePairing::Norm,
        rope_base: Some(10000.0),
        yarn: Some(DEEPSEEK_YARN),
        longrope: false,
        rms_eps: 1e-6,
        context_length: 163840,
        unsplit_kv_b: false,
        indexer: None,
        note: "",
    },
    Entry {
        preset: Preset::DeepseekV2Lite,
        name: "deepseek-v2-lite",
        model_name: "DeepSeek-V2-Lite",
        arch: Arch::Deepseek2,
        layers: 27,
        hidden: 2048,
        heads: 16,
        q_lora: None,
        kv_lora: 512,
        qk_nope: 128,
        qk_rope: 64,
        v_head: 128,
        rope: RopePairing::Norm,
        rope_base: Some(10000.0),
        yarn: Some(YarnSpec {
            mscale_all_dim: Some(0.707),
            ..DEEPSEEK_YARN
        }),
        longrope: false,
        rms_eps: 1e-6,
        context_length: 163840,
        unsplit_kv_b: false,
        indexer: None,
        note: "",
    },
    KIMI_K2,
    // Kimi-K2.5's text model. llama.cpp's converter takes `KimiK25ForConditionalGeneration` into
    // `DeepseekV2Model` (conversion/deepseek.py; conversion/__init__.py maps it to "deepseek"): arch
    // `deepseek2`, the text_config's keys exactly as for Kimi-K2 (its vision tower goes to the mmproj
    // file, `KimiK25Model(MmprojModel)` in conversion/kimivl.py). transformers 5.24.0's `Kimi_K25Config`
    // holds a `deepseek_v3` text_config (a "kimi_k2" model_type is renamed to it) and runs it through
    // DeepSeek-V3's attention unchanged. The text_config is Kimi-K2's 64 heads, 7168 hidden, q-LoRA 1536,
    // kv 512, qk 128/64, v 128, rope_theta 50000, vocabulary 163840 (same tokenizer, `tokpre` "kimi-k2"),
    // with the 256K context of the K2 releases after July 2025 (Kimi-K2-Instruct-0905: YaRN factor 64
    // over 4096, β 1/1, mscale = mscale_all_dim = 1, max_position_embeddings 262144): the only attention
    // difference from `kimi-k2` (YaRN ×32, 131072), and it moves the softmax scale (mscale 1.4159 vs
    // 1.3466). The released config.json was not available here; rms_norm_eps is Kimi-K2's.
    Entry {
        preset: Preset::KimiK25,
        name: "kimi-k2.5",
        model_name: "Kimi-K2.5",
        yarn: Some(YarnSpec {
            factor: 64.0,
            beta_fast: Some(1.0),
            ..DEEPSEEK_YARN
        }),
        context_length: 262144,
        note: "Kimi-K2.5's text model (DeepSeek-V3's deepseek2, 64 heads, YaRN x64 to 256K; also Kimi-K2-0905)",
        ..KIMI_K2
    },
    // rope_theta for GLM-4.7-Flash / GLM-5 is not settled by the public configs we know; 1e6 is GLM-5.1's.
    Entry {
        preset: Preset::Glm47Flash,
        name: "glm-4.7-flash",
        model_name: "GLM-4.7-Flash",
        arch: Arch::Deepseek2,
        layers: 47,
        hidden: 2048,
        heads: 20,
        q_lora: Some(768),
        kv_lora: 512,
        qk_nope: 192,
        qk_rope: 64,
        v_head: 256,
        rope: RopePairing::Norm,
        rope_base: Some(1e6),
        yarn: None,
        longrope: false,
        rms_eps: 1e-5,
        context_length: 202752,
        unsplit_kv_b: false,
        indexer: None,
        note: "",
    },
    // The 78 trunk layers; the converter also appends the NextN/MTP block (block_count 79), which the
    // fixture does not write. It writes the DSA indexer's tensors (`blk.N.indexer.*`).
    Entry {
        preset: Preset::Glm5,
        name: "glm-5",
        model_name: "GLM-5",
        arch: Arch::GlmDsa,
        layers: 78,
        hidden: 6144,
        heads: 64,
        q_lora: Some(2048),
        kv_lora: 512,
        qk_nope: 192,
        qk_rope: 64,
        v_head: 256,
        rope: RopePairing::Norm,
        rope_base: Some(1e6),
        yarn: None,
        longrope: false,
        rms_eps: 1e-5,
        context_length: 202752,
        unsplit_kv_b: false,
        indexer: Some(Indexer {
            heads: 32,
            key_length: 128,
            top_k: 2048,
        }),
        note: "",
    },
    // DeepSeek-V3.2(-Exp), from its HF config.json (as copied into huggingface/transformers at
    // src/transformers/models/deepseek_v32/deepseek_files/config.json; DeepSeek's inference/
    // config_671B_v3.2.json agrees): hidden_size 7168, num_hidden_layers 61 (+ num_nextn_predict_layers
    // 1), num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512, qk 128/64, v 128, rope_theta
    // 10000, rope_scaling yarn factor 40 / original 4096 / beta 32, 1 / mscale = mscale_all_dim = 1.0 (V3's),
    // rms_norm_eps 1e-6, max_position_embeddings 163840, index_n_heads 64, index_head_dim 128,
    // index_topk 2048 (transformers 5.24's `DeepseekV32Config` defaults are the same). llama.cpp's
    // `DeepseekV32Model` converter writes arch `deepseek32`, the split attn_k_b/attn_v_b of DeepseekV2Model,
    // the indexer keys and `blk.N.indexer.*` tensors as for GLM-5, and appends the MTP block (block_count
    // 62, nextn_predict_layers 1), which the fixture does not write. The indexer's rope is NeoX
    // (transformers: "NON-interleaved (half-split)"; llama.cpp's deepseek32 graph: LLAMA_ROPE_TYPE_NEOX).
    Entry {
        preset: Preset::DeepseekV32,
        name: "deepseek-v3.2",
        model_name: "DeepSeek-V3.2",
        arch: Arch::Deepseek32,
        layers: 61,
        hidden: 7168,
        heads: 128,
        q_lora: Some(1536),
        kv_lora: 512,
        qk_nope: 128,
        qk_rope: 64,
        v_head: 128,
        rope: RopePairing::Norm,
        rope_base: Some(10000.0),
        yarn: Some(DEEPSEEK_YARN),
        longrope: false,
        rms_eps: 1e-6,
        context_length: 163840,
        unsplit_kv_b: false,
        indexer: Some(Indexer {
            heads: 64,
            key_length: 128,
            top_k: 2048,
        }),
        note: "",
    },
    Entry {
        preset: Preset::Minicpm3,
        name: "minicpm3",
        model_name: "MiniCPM3-4B",
        arch: Arch::Minicpm3,
        layers: 62,
        hidden: 2560,
        heads: 40,
        q_lora: Some(768),
        kv_lora: 256,
        qk_nope: 64,
        qk_rope: 32,
        v_head: 64,
        rope: RopePairing::Neox,
        rope_base: None,
        yarn: None,
        longrope: true,
        rms_eps: 1e-5,
        context_length: 32768,
        unsplit_kv_b: true,
        indexer: None,
        note: "",
    },
    // GLM-5's NoPE successor (GLM-5.3-Flash, the converter's example), from transformers 5.24.0's
    // `Glm5NextTextConfig` defaults (models/glm5_next/configuration_glm5_next.py; the released
    // config.json was not available here): hidden_size 4096, num_hidden_layers 45, num_attention_heads 64,
    // q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 0, qk_nope_head_dim 256, v_head_dim 256,
    // rms_norm_eps 1e-5, max_position_embeddings 1048576, index_n_heads 32, index_head_dim 128,
    // index_topk 2048, index_kpool 16, index_kpool_always_select_tail True; `layer_types` default: layer i
    // is MLA ("indexed_attention") where i % 4 == 3, linear attention (KDA) elsewhere (11 MLA layers of 45);
    // `indexer_types` default (index_topk_freq 1): every layer "full". llama.cpp's `Glm5NextModel`
    // converter (conversion/glm.py) writes arch `glm5-next`, `head_count_kv` as a per-block array (0 on a
    // linear layer), rope.dimension_count 0, key_length = kv_lora_rank (512: no rope part, no 576 pad),
    // key_length_mla 256, value_length_mla 256, the indexer keys plus `indexer.kpool` and
    // `indexer.kpool_select_tail`, and `indexer.types` when config.json has `indexer_types`. No rope, so
    // no freq_base. The fixture writes the MLA layers' attention tensors, the indexer tensors GLM-5
    // has (`blk.N.indexer.*`) and the k-pool's gate and APE (`indexer_compressor_{gate,ape}`, F32 as
    // the converter forces them), not the linear-attention or hyper-connection tensors;
    // past top_k `run` attends over the fp64 k-pool selection (`reference::kpool`, `run::dsa`).
    Entry {
        preset: Preset::Glm5Next,
        name: "glm5-next",
        model_name: "GLM-5.3-Flash",
        arch: Arch::Glm5Next,
        layers: 45,
        hidden: 4096,
        heads: 64,
        q_lora: Some(1536),
        kv_lora: 512,
        qk_nope: 256,
        qk_rope: 0,
        v_head: 256,
        rope: RopePairing::Norm,
        rope_base: None,
        yarn: None,
        longrope: false,
        rms_eps: 1e-5,
        context_length: 1048576,
        unsplit_kv_b: false,
        indexer: Some(Indexer {
            heads: 32,
            key_length: 128,
            top_k: 2048,
        }),
        note: "NoPE MLA (no rope), a hybrid: MLA on layers 3, 7, .., 43, linear attention elsewhere (skipped)",
    },
    Entry {
        preset: Preset::Tiny,
        name: "tiny",
        model_name: "tiny-mla",
        arch: Arch::Deepseek2,
        layers: 2,
        hidden: 256,
        heads: 4,
        q_lora: Some(64),
        kv_lora: 64,
        qk_nope: 32,
        qk_rope: 16,
        v_head: 32,
        rope: RopePairing::Norm,
        rope_base: Some(10000.0),
        yarn: Some(YarnSpec {
            factor: 4.0,
            original_context: 256,
            ..DEEPSEEK_YARN
        }),
        longrope: false,
        rms_eps: 1e-6,
        context_length: 1024,
        unsplit_kv_b: false,
        indexer: None,
        note: "Small DeepSeek-style dims with YaRN, for fast tests",
    },
];

/// The real model of the catalogue a config states, if any: the same architecture, attention dims,
/// rope base, YaRN and RMSNorm eps (each at the f32 the file stores); hidden size and heads may differ
/// (fixtures and tests reduce them), a full-size match first. What `inspect` names.
pub fn known(c: &super::MlaConfig) -> Option<&'static Entry> {
    let same = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1e-30);
    let yarn = |e: &Entry| match (&e.yarn, &c.rope.yarn) {
        (None, None) => true,
        (Some(s), Some(y)) => {
            same(y.factor, s.factor as f64)
                && y.original_context == s.original_context as u64
                && same(y.mscale_all_dim, s.mscale_all_dim.unwrap_or(0.0))
                && same(y.beta_fast, s.beta_fast.unwrap_or(32.0) as f64)
                && same(y.beta_slow, s.beta_slow.unwrap_or(1.0) as f64)
        }
        _ => false,
    };
    CATALOGUE
        .iter()
        .filter(|e| {
            e.preset != Preset::Tiny
                && e.arch == c.arch
                && (e.kv_lora, e.qk_nope, e.qk_rope, e.v_head)
                    == (c.kv_lora_rank, c.qk_nope, c.qk_rope, c.v_head_dim)
                && same(c.rope.base, e.rope_base.unwrap_or(10000.0))
                && same(c.rms_eps, e.rms_eps as f32 as f64)
                && yarn(e)
        })
        .min_by_key(|e| {
            (
                e.hidden != c.hidden || e.heads != c.n_head,
                e.preset as usize,
            )
        })
}

/// DeepSeek-V4 is a kind of its own (not latent MLA): its models' dims live with its config.
pub use super::v4::{V4Model, V4_CATALOGUE};

impl Preset {
    pub const ALL: [Preset; 10] = [
        Preset::DeepseekV3,
        Preset::DeepseekV2Lite,
        Preset::KimiK2,
        Preset::KimiK25,
        Preset::Glm47Flash,
        Preset::Glm5,
        Preset::DeepseekV32,
        Preset::Minicpm3,
        Preset::Glm5Next,
        Preset::Tiny,
    ];

    /// The model's row of the catalogue.
    pub fn entry(self) -> &'static Entry {
        &CATALOGUE[self as usize]
    }

    /// The `--preset` value.
    pub fn name(self) -> &'static str {
        self.entry().name
    }

    pub fn from_name(s: &str) -> Option<Preset> {
        Preset::ALL.into_iter().find(|p| p.name() == s)
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// By hand rather than derived, so that the names and help come from the table.
impl clap::ValueEnum for Preset {
    fn value_variants<'a>() -> &'a [Self] {
        &Preset::ALL
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let e = self.entry();
        let v = clap::builder::PossibleValue::new(e.name);
        Some(if e.note.is_empty() { v } else { v.help(e.note) })
    }
}
