//! `MlaConfig::from_gguf_diagnosed`: the MLA loader's rules over the keys as `MlaKeys` read them. Every
//! key it needs and every rule it holds records a `Diagnostic` (in the order below, which is the order
//! `from_gguf`'s single error has always come in) instead of returning on the first; `lint` reports
//! them as findings. A rule is evaluated on the keys it needs, whatever else is missing (`Seen`), so
//! lint evaluates none of them itself.

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
    /// The per-head dims as far as the keys give them (what the rules saw).
    pub heads: Heads,
    /// In the loader's order: the first is `from_gguf`'s error.
    pub diagnostics: Diagnostics,
}

impl Diagnosed {
    /// The diagnostic of `rule` (`Diagnostic::rule`), if the loader recorded it.
    pub fn rule(&self, rule: &str) -> Option<&super::keys::Diagnostic> {
        self.diagnostics.0.iter().find(|d| d.rule == rule)
    }
    /// The diagnostic of `rule` on `key` (a rule such as `zero` or `limit` refuses each key apart).
    pub fn rule_on(&self, rule: &str, key: &str) -> Option<&super::keys::Diagnostic> {
        self.diagnostics
            .0
            .iter()
            .find(|d| d.rule == rule && d.key == key)
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
        let (cfg, heads) = from_keys(f, arch, &keys, &mut d);
        let cfg = cfg.filter(|_| d.is_empty());
        Ok(Diagnosed {
            arch,
            cfg,
            keys,
            heads,
            diagnostics: d,
        })
    }
}

/// The dims the config is built from, as the keys give them.
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

/// The dims as far as the keys can be read, for the rules: each rule is evaluated on the keys it
/// needs, whatever else is missing, so `lint` reports every one of them from here.
struct Seen {
    n_layer: Option<usize>,
    hidden: Option<usize>,
    n_head: Option<usize>,
    /// `head_count_kv` as the file states it (glm5-next's layout or the key), without the fallback to
    /// `head_count`.
    head_count_kv: Option<usize>,
    kv_lora_rank: Option<usize>,
    q_lora_rank: Option<usize>,
    qk_rope: Option<usize>,
    heads: Heads,
}

/// The per-head dims by llama.cpp's rule: the `*_mla` pair, else the plain keys or hidden/heads. A
/// key of the wrong type reads as absent (its own diagnostic says so); `whole` is whether the config
/// can take them (no diagnostic on the way).
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub qk: Option<usize>,
    pub v: Option<usize>,
    /// From the `*_mla` pair (or one of it).
    pub mla: bool,
    pub whole: bool,
}

/// The config when every dim is readable and every rule holds, and the per-head dims as read.
fn from_keys(
    f: &GgufFile,
    arch: Arch,
    k: &MlaKeys,
    d: &mut Diagnostics,
) -> (Option<MlaConfig>, Heads) {
    let n_layer = layer_count(f, k, d);
    let hidden = d.need(&k.embedding_length).map(|x| x as usize);
    let n_head = d.need(&k.head_count).map(|x| x as usize);
    let (n_head_kv, head_count_kv) = match HybridLayout::from_keys(f, k) {
        // A per-layer head_count_kv (glm5-next): the MLA layers' value.
        Ok(Some(h)) => (Some(h.n_head_kv), Some(h.n_head_kv)),
        Ok(None) => {
            let key = d.opt(&k.head_count_kv).map(|x| x as usize);
            (key.or(n_head).or(Some(0)), key)
        }
        Err(e) => {
            d.push(*e);
            (None, None)
        }
    };
    let kv_lora_rank = d.need(&k.kv_lora_rank).map(|x| x as usize);
    let q_lora_rank = d.opt(&k.q_lora_rank).filter(|&r| r > 0).map(|x| x as usize);
    let qk_rope = d.need(&k.rope_dim).map(|x| x as usize);
    let heads = head_dims(k, hidden, n_head, d);
    let seen = Seen {
        n_layer,
        hidden,
        n_head,
        head_count_kv,
        kv_lora_rank,
        q_lora_rank,
        qk_rope,
        heads,
    };
    rules(arch, k, &seen, d);
    let (
        Some(n_layer),
        Some(hidden),
        Some(n_head),
        Some(n_head_kv),
        Some(kv_lora_rank),
        Some(qk_rope),
        Heads {
            qk: Some(qk),
            v: Some(v_head_dim),
            mla: mla_keys,
            whole: true,
        },
    ) = (
        n_layer,
        hidden,
        n_head,
        n_head_kv,
        kv_lora_rank,
        qk_rope,
        seen.heads,
    )
    else {
        return (None, seen.heads);
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
    let rms_eps = d.opt(&k.rms_eps).unwrap_or(1e-6);
    let base = d.opt(&k.rope_freq_base).unwrap_or(10000.0);
    let yarn = yarn_of(k, d);
    let rope_attn_factor = d.opt(&k.scaling_attn_factor).unwrap_or(1.0);
    if !d.is_empty() {
        return (None, seen.heads);
    }
    let cfg = config(f, arch, dims, rms_eps, base, yarn, rope_attn_factor);
    (Some(cfg), seen.heads)
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

/// The rules on the dims, each evaluated on the keys it needs: none zero, the rope dims, the *_mla
/// keys' absence, the sanity bound. One diagnostic per key a rule refuses, in this order (the first
/// is `from_gguf`'s error, as when the rules ran only on complete dims).
fn rules(arch: Arch, k: &MlaKeys, m: &Seen, d: &mut Diagnostics) {
    zero(k, m, d);
    rope_rules(arch, k, m, d);
    let h = &m.heads;
    if let (false, Some(qk), Some(lkv), Some(qk_rope)) = (h.mla, h.qk, m.kv_lora_rank, m.qk_rope) {
        if qk == lkv + qk_rope {
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
    }
    limit(k, m, d);
}

/// `zero`: no dim that sizes the attention is 0 (`rope` and `head_count_kv` may be: glm5-next's NoPE,
/// its linear layers). One diagnostic per zero key; the message names every dim the keys give.
fn zero(k: &MlaKeys, m: &Seen, d: &mut Diagnostics) {
    let shown = |v: Option<usize>| v.map_or("?".to_string(), |v| v.to_string());
    let message = format!(
        "zero-sized attention (block_count {}, embedding_length {}, head_count {}, kv_lora_rank {}, v_head_dim {})",
        shown(m.n_layer),
        shown(m.hidden),
        shown(m.n_head),
        shown(m.kv_lora_rank),
        shown(m.heads.v)
    );
    for (key, v, why) in [
        (&k.block_count.key, m.n_layer, "a model without layers"),
        (&k.embedding_length.key, m.hidden, "zero-sized attention"),
        (&k.head_count.key, m.n_head, "zero-sized attention"),
        (&k.kv_lora_rank.key, m.kv_lora_rank, "zero-sized attention"),
        (
            head_key(k, m.heads.mla, false),
            m.heads.v,
            "zero-sized value heads",
        ),
    ] {
        if v == Some(0) {
            d.rule("zero", key, "0", "at least 1", why, message.clone());
        }
    }
}

/// `glm5_next_rope` and `rope_dims`: rope rotates pairs of the last `rope` dims of each qk head.
fn rope_rules(arch: Arch, k: &MlaKeys, m: &Seen, d: &mut Diagnostics) {
    let Some(qk_rope) = m.qk_rope else {
        return;
    };
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
    let Some(qk) = m.heads.qk else {
        return;
    };
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
}

/// `limit`: every dim the keys state within `DIM_LIMIT`.
fn limit(k: &MlaKeys, m: &Seen, d: &mut Diagnostics) {
    let h = &m.heads;
    for (what, key, v) in [
        ("embedding_length", &k.embedding_length.key, m.hidden),
        ("head_count", &k.head_count.key, m.n_head),
        ("kv_lora_rank", &k.kv_lora_rank.key, m.kv_lora_rank),
        ("key_length", head_key(k, h.mla, true), h.qk),
        ("value_length", head_key(k, h.mla, false), h.v),
        ("head_count_kv", &k.head_count_kv.key, m.head_count_kv),
        ("q_lora_rank", &k.q_lora_rank.key, m.q_lora_rank),
        ("rope.dimension_count", &k.rope_dim.key, m.qk_rope),
    ] {
        match v {
            Some(v) if v > DIM_LIMIT => d.rule(
                "limit",
                key,
                v.to_string(),
                format!("at most {DIM_LIMIT}"),
                "implausible: the loader refuses it before allocating",
                format!("{what} = {v} is implausible (> {DIM_LIMIT})"),
            ),
            _ => {}
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

/// The per-head dims: the `*_mla` pair, else the plain keys, each defaulting to hidden/heads.
fn head_dims(
    k: &MlaKeys,
    hidden: Option<usize>,
    n_head: Option<usize>,
    d: &mut Diagnostics,
) -> Heads {
    let k_mla = d.opt(&k.key_length_mla).map(|x| x as usize);
    let v_mla = d.opt(&k.value_length_mla).map(|x| x as usize);
    let pair = |whole| Heads {
        qk: k_mla,
        v: v_mla,
        mla: true,
        whole,
    };
    match (k.key_length_mla.present, k.value_length_mla.present) {
        // Both present: one of the wrong type was recorded at its read.
        (true, true) => pair(k_mla.is_some() && v_mla.is_some()),
        // llama.cpp defaults both head sizes to n_embd / n_head when the key is absent; the MiniCPM3
        // converter relies on that and writes no value_length (conversion/minicpm.py).
        (false, false) => {
            let default = match (hidden, n_head) {
                (Some(e), Some(h)) if h > 0 && e.is_multiple_of(h) => Some(e / h),
                _ => None,
            };
            let mut whole = true;
            let mut head = |r: &super::keys::Read<u64>| {
                let v = d.opt(r).map(|v| v as usize);
                if !r.present && default.is_none() {
                    d.need(r);
                }
                whole &= v.is_some() || !r.present && default.is_some();
                v.or(default)
            };
            let (qk, v) = (head(&k.key_length), head(&k.value_length));
            Heads {
                qk,
                v,
                mla: false,
                whole,
            }
        }
        (one, _) => {
            let one = if one {
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
            pair(false)
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
