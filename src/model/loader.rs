//! `MlaConfig::from_gguf_diagnosed`: the MLA loader's rules over the keys as `MlaKeys` read them. Every
//! key it needs and every rule it holds records a `Diagnostic` (in the order below, which is the order
//! `from_gguf`'s single error has always come in) instead of returning on the first; `lint` reports
//! them as findings.

use super::config::{not_mla, yarn_scales, Arch, HybridLayout, MlaConfig, RopeConfig, Yarn};
use super::keys::{Diagnostics, MlaKeys};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// A file's config as the loader reads it, with every diagnostic of its keys.
#[derive(Debug, Clone)]
pub struct Diagnosed {
    pub arch: Arch,
    /// `None` when any diagnostic refuses the file.
    pub cfg: Option<MlaConfig>,
    pub keys: MlaKeys,
    /// In the loader's order: the first is `from_gguf`'s error.
    pub diagnostics: Diagnostics,
}

impl Diagnosed {
    /// The diagnostic of `rule` (`Diagnostic::rule`), if the loader recorded it.
    pub fn rule(&self, rule: &str) -> Option<&super::keys::Diagnostic> {
        self.diagnostics.0.iter().find(|d| d.rule == rule)
    }
}

/// The sanity bound on a dim: a header claiming absurd dims would otherwise drive huge allocations.
pub const DIM_LIMIT: usize = 1 << 20;

impl MlaConfig {
    /// The config and every diagnostic of an MLA file's keys. `Err` only when the file names no
    /// architecture or one that is not MLA (nothing to diagnose).
    pub fn from_gguf_diagnosed(f: &GgufFile) -> Result<Diagnosed> {
        let name = f.architecture().ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: general.architecture is missing",
                f.path.display()
            ))
        })?;
        let arch = Arch::from_gguf(name).ok_or_else(|| not_mla(f, name))?;
        let keys = MlaKeys::read(f, name);
        let mut d = Diagnostics::default();
        let cfg = from_keys(f, arch, &keys, &mut d).filter(|_| d.is_empty());
        Ok(Diagnosed {
            arch,
            cfg,
            keys,
            diagnostics: d,
        })
    }
}

/// The dims the rules below need, as the keys give them.
struct Dims {
    n_layer: usize,
    hidden: usize,
    n_head: usize,
    n_head_kv: usize,
    kv_lora_rank: usize,
    q_lora_rank: Option<usize>,
    qk_rope: usize,
    qk: usize,
    v_head_dim: usize,
    mla_keys: bool,
}

fn from_keys(f: &GgufFile, arch: Arch, k: &MlaKeys, d: &mut Diagnostics) -> Option<MlaConfig> {
    let n_layer = layer_count(f, k, d);
    let hidden = d.need(&k.embedding_length).map(|x| x as usize);
    let n_head = d.need(&k.head_count).map(|x| x as usize);
    let n_head_kv = match HybridLayout::from_keys(f, k) {
        // A per-layer head_count_kv (glm5-next): the MLA layers' value.
        Ok(Some(h)) => Some(h.n_head_kv),
        Ok(None) => d
            .opt(&k.head_count_kv)
            .map(|x| x as usize)
            .or(n_head)
            .or(Some(0)),
        Err(e) => {
            d.push(*e);
            None
        }
    };
    let kv_lora_rank = d.need(&k.kv_lora_rank).map(|x| x as usize);
    let q_lora_rank = d.opt(&k.q_lora_rank).filter(|&r| r > 0).map(|x| x as usize);
    let qk_rope = d.need(&k.rope_dim).map(|x| x as usize);
    let heads = head_dims(k, hidden, n_head, d);
    let (
        Some(n_layer),
        Some(hidden),
        Some(n_head),
        Some(n_head_kv),
        Some(kv_lora_rank),
        Some(qk_rope),
        Some((qk, v_head_dim, mla_keys)),
    ) = (
        n_layer,
        hidden,
        n_head,
        n_head_kv,
        kv_lora_rank,
        qk_rope,
        heads,
    )
    else {
        return None;
    };
    let dims = Dims {
        n_layer,
        hidden,
        n_head,
        n_head_kv,
        kv_lora_rank,
        q_lora_rank,
        qk_rope,
        qk,
        v_head_dim,
        mla_keys,
    };
    rules(arch, k, &dims, d);
    let rms_eps = d.opt(&k.rms_eps).unwrap_or(1e-6);
    let base = d.opt(&k.rope_freq_base).unwrap_or(10000.0);
    let yarn = yarn_of(k, d);
    let rope_attn_factor = d.opt(&k.scaling_attn_factor).unwrap_or(1.0);
    if !d.is_empty() {
        return None;
    }
    Some(config(f, arch, dims, rms_eps, base, yarn, rope_attn_factor))
}

/// The config from dims that passed every rule.
fn config(
    f: &GgufFile,
    arch: Arch,
    dims: Dims,
    rms_eps: f64,
    base: f64,
    yarn: Option<Yarn>,
    rope_attn_factor: f64,
) -> MlaConfig {
    let Dims {
        n_layer,
        hidden,
        n_head,
        n_head_kv,
        kv_lora_rank,
        q_lora_rank,
        qk_rope,
        qk,
        v_head_dim,
        mla_keys,
    } = dims;
    let (attn_factor, mscale) = yarn_scales(arch, yarn.as_ref(), rope_attn_factor);
    let softmax_scale = mscale * mscale / (qk as f64).sqrt();
    let has = |n: &str| f.tensor(n).is_some().then(|| n.to_string());
    let rope = RopeConfig {
        dim: qk_rope,
        base,
        pairing: arch.rope_pairing(),
        attn_factor,
        yarn,
        freq_factors_short: has("rope_factors_short.weight").or_else(|| has("rope_freqs.weight")),
        freq_factors_long: has("rope_factors_long.weight"),
    };
    let vocab_size = f
        .tensor("token_embd.weight")
        .map(|t| t.ne.get(1).copied().unwrap_or(1) as usize);
    MlaConfig {
        arch,
        n_layer,
        hidden,
        n_head,
        n_head_kv,
        q_lora_rank,
        kv_lora_rank,
        qk_nope: qk - qk_rope,
        qk_rope,
        v_head_dim,
        mla_keys,
        rope,
        rms_eps,
        lora_norm_eps: rms_eps,
        mscale,
        softmax_scale,
        vocab_size,
    }
}

/// The rules on the dims: none zero, the rope dims, the *_mla keys' absence, the sanity bound.
fn rules(arch: Arch, k: &MlaKeys, m: &Dims, d: &mut Diagnostics) {
    let (qk, qk_rope, lkv) = (m.qk, m.qk_rope, m.kv_lora_rank);
    let zero = [
        (&k.block_count.key, m.n_layer),
        (&k.embedding_length.key, m.hidden),
        (&k.head_count.key, m.n_head),
        (&k.kv_lora_rank.key, lkv),
        (head_key(k, m.mla_keys, false), m.v_head_dim),
    ];
    if let Some((key, _)) = zero.iter().find(|(_, v)| *v == 0) {
        d.rule(
            "zero",
            key,
            "0",
            "at least 1",
            "zero-sized attention",
            format!(
                "zero-sized attention (block_count {}, embedding_length {}, head_count {}, kv_lora_rank {lkv}, v_head_dim {})",
                m.n_layer, m.hidden, m.n_head, m.v_head_dim
            ),
        );
    }
    // glm5-next is NoPE MLA: its converter asserts qk_rope_head_dim == 0 and writes rope dims 0.
    let nope_ok = arch == Arch::Glm5Next && qk_rope == 0;
    if arch == Arch::Glm5Next && qk_rope != 0 {
        d.rule(
            "glm5_next_rope",
            &k.rope_dim.key,
            qk_rope.to_string(),
            "0",
            "glm5-next is NoPE MLA",
            format!(
                "rope.dimension_count is {qk_rope}, but glm5-next is NoPE MLA (transformers glm5_next: qk_rope_head_dim = 0; llama.cpp's converter asserts it)"
            ),
        );
    }
    if !nope_ok && (qk_rope == 0 || qk_rope % 2 != 0 || qk <= qk_rope) {
        d.rule(
            "rope_dims",
            &k.rope_dim.key,
            qk_rope.to_string(),
            format!("even, at least 2 and below the qk head dim {qk}"),
            "rope rotates pairs of the last `rope` dims of each qk head; an odd count cannot pair, and a head of rope only has no q_nope",
            format!("rope dims {qk_rope} must be even and smaller than the qk head dim {qk}"),
        );
    }
    if !m.mla_keys && qk == lkv + qk_rope {
        d.rule(
            "missing_mla_keys",
            head_key(k, false, true),
            qk.to_string(),
            "qk_nope + rope, or the key_length_mla / value_length_mla pair",
            "a new-style MLA file missing its *_mla keys (made for llama.cpp PR #11446?)",
            format!(
                "key_length {qk} equals kv_lora_rank + rope ({lkv}+{qk_rope}): a new-style MLA file that lacks the *_mla keys (made for llama.cpp PR #11446?); cannot tell the per-head dims"
            ),
        );
    }
    for (what, key, v) in [
        ("embedding_length", &k.embedding_length.key, m.hidden),
        ("head_count", &k.head_count.key, m.n_head),
        ("kv_lora_rank", &k.kv_lora_rank.key, lkv),
        ("key_length", head_key(k, m.mla_keys, true), qk),
        ("value_length", head_key(k, m.mla_keys, false), m.v_head_dim),
        ("head_count_kv", &k.head_count_kv.key, m.n_head_kv),
        (
            "q_lora_rank",
            &k.q_lora_rank.key,
            m.q_lora_rank.unwrap_or(0),
        ),
    ] {
        if v > DIM_LIMIT {
            d.rule(
                "limit",
                key,
                v.to_string(),
                format!("at most {DIM_LIMIT}"),
                "implausible: the loader refuses it before allocating",
                format!("{what} = {v} is implausible (> {DIM_LIMIT})"),
            );
        }
    }
}

/// The key a per-head dim comes from: the `*_mla` pair or the plain keys.
fn head_key(k: &MlaKeys, mla: bool, qk: bool) -> &String {
    match (mla, qk) {
        (true, true) => &k.key_length_mla.key,
        (true, false) => &k.value_length_mla.key,
        (false, true) => &k.key_length.key,
        (false, false) => &k.value_length.key,
    }
}

/// The trunk's layer count: `block_count` less the NextN/MTP blocks, bounded by the tensor count.
fn layer_count(f: &GgufFile, k: &MlaKeys, d: &mut Diagnostics) -> Option<usize> {
    let block_count = d.need(&k.block_count)? as usize;
    // block_count also counts the NextN/MTP blocks the converter appends after the trunk (GLM-4.7-Flash,
    // GLM-5: nextn_predict_layers = 1); llama.cpp's n_layer() and the model's forward run the trunk only.
    let nextn = d.opt(&k.nextn_predict_layers).unwrap_or(0) as usize;
    if nextn > 0 && nextn >= block_count {
        d.rule(
            "no_trunk",
            &k.nextn_predict_layers.key,
            nextn.to_string(),
            format!("fewer than block_count {block_count}"),
            "the NextN/MTP blocks come after the trunk; none would be left",
            format!("nextn_predict_layers {nextn} leaves no trunk layers of block_count {block_count} (an MTP-only file?)"),
        );
        return None;
    }
    let n_layer = block_count - nextn;
    // Bound the layer count by what the file can hold before anything loops over layers: every
    // layer has its own attention tensors, so a file cannot have more layers than tensors.
    if n_layer > f.tensors.len() {
        d.rule(
            "layers_past_tensors",
            &k.block_count.key,
            block_count.to_string(),
            format!("at most the {} tensors the file has", f.tensors.len()),
            "every layer needs its own attention tensors",
            format!(
                "block_count {block_count} is impossible: the file has only {} tensors, and every layer needs its own attention tensors",
                f.tensors.len()
            ),
        );
        return None;
    }
    Some(n_layer)
}

/// `(qk head dim, v head dim, whether from the *_mla keys)`.
fn head_dims(
    k: &MlaKeys,
    hidden: Option<usize>,
    n_head: Option<usize>,
    d: &mut Diagnostics,
) -> Option<(usize, usize, bool)> {
    let k_mla = d.opt(&k.key_length_mla);
    let v_mla = d.opt(&k.value_length_mla);
    match (k_mla, v_mla) {
        (Some(kl), Some(vl)) => Some((kl as usize, vl as usize, true)),
        // llama.cpp defaults both head sizes to n_embd / n_head when the key is absent; the MiniCPM3
        // converter relies on that and writes no value_length (conversion/minicpm.py).
        (None, None) if !k.key_length_mla.present && !k.value_length_mla.present => {
            let default = match (hidden, n_head) {
                (Some(e), Some(h)) if h > 0 && e.is_multiple_of(h) => Some(e / h),
                _ => None,
            };
            let mut head = |r: &super::keys::Read<u64>| match (d.opt(r), default) {
                (Some(v), _) => Some(v as usize),
                (None, Some(x)) if !r.present => Some(x),
                (None, _) if !r.present => d.need(r).map(|v| v as usize),
                (None, _) => None,
            };
            let qk = head(&k.key_length);
            let v = head(&k.value_length);
            Some((qk?, v?, false))
        }
        // Both present, one of the wrong type: recorded at its read.
        _ if k.key_length_mla.present == k.value_length_mla.present => None,
        _ => {
            let one = if k.key_length_mla.present {
                &k.key_length_mla.key
            } else {
                &k.value_length_mla.key
            };
            d.rule(
                "mla_pair",
                one,
                "present without its pair",
                "both attention.key_length_mla and attention.value_length_mla, or neither",
                "llama.cpp takes the per-head dims from the pair; with one of them the loader cannot tell the head dims",
                format!(
                    "only one of {}.attention.key_length_mla / value_length_mla is present (llama.cpp needs both or neither)",
                    k.arch
                ),
            );
            None
        }
    }
}

/// YaRN's parameters where the file scales rope by YaRN with a factor above 1.
fn yarn_of(k: &MlaKeys, d: &mut Diagnostics) -> Option<Yarn> {
    // A scaling type that is no string reads as none (lint reports it).
    let scaling = k.scaling_type.value.as_deref().unwrap_or("none");
    let factor = d.opt(&k.scaling_factor).unwrap_or(1.0);
    if !(scaling == "yarn" && factor > 1.0) {
        return None;
    }
    let raw = d.opt(&k.yarn_log_multiplier).unwrap_or(0.0);
    // TAG_DEEPSEEK2_YARN_LOG_MUL_FIX: the converter stores 0.1·mscale_all_dim; llama.cpp divides by 0.1.
    // In f32 as llama.cpp does (`rope_yarn_log_mul /= 0.1f`), so 0.1f gives exactly 1.
    let mscale_all_dim = (raw as f32 / 0.1f32) as f64;
    Some(Yarn {
        factor,
        original_context: d.opt(&k.original_context).unwrap_or(4096),
        mscale_all_dim,
        log_multiplier_raw: raw,
        beta_fast: d.opt(&k.yarn_beta_fast).unwrap_or(32.0),
        beta_slow: d.opt(&k.yarn_beta_slow).unwrap_or(1.0),
        ext_factor: d
            .opt(&k.yarn_ext_factor)
            .filter(|&e| e >= 0.0)
            .unwrap_or(1.0),
    })
}
