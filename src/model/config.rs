//! `MlaConfig`: the attention hyper-parameters of an MLA model, read from GGUF metadata.
//!
//! The conventions (key names, the converter's ×0.1 on `yarn_log_multiplier`, rope pairing per
//! architecture, `*_mla` vs legacy head sizes) follow llama.cpp; docs/conventions.md
//! lists them with sources.

use crate::error::{quote, Error, Result};
use crate::gguf::{GgufFile, Value};
use serde::Serialize;

/// The GGUF architectures whose attention is MLA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arch {
    /// DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash.
    Deepseek2,
    /// GLM-5 (runs the deepseek2 dense-MLA graph; the DSA indexer is ignored).
    GlmDsa,
    Deepseek32,
    Mistral4,
    /// NEOX rope, unsplit kv_b, LongRoPE factors.
    Minicpm3,
    /// No q-LoRA, unsplit kv_b.
    Plm,
    /// GLM-5's NoPE successor (transformers `glm5_next`, llama.cpp `glm5-next`): MLA without rope
    /// (`rope.dimension_count` 0), a DSA indexer with k-pool compression, and linear-attention (KDA) layers
    /// between the MLA layers (`head_count_kv` is a per-layer array, 0 on a linear layer; `HybridLayout`).
    Glm5Next,
}

impl Arch {
    pub const ALL: [(&'static str, Arch); 7] = [
        ("deepseek2", Arch::Deepseek2),
        ("glm-dsa", Arch::GlmDsa),
        ("deepseek32", Arch::Deepseek32),
        ("mistral4", Arch::Mistral4),
        ("minicpm3", Arch::Minicpm3),
        ("plm", Arch::Plm),
        ("glm5-next", Arch::Glm5Next),
    ];
    pub fn from_gguf(name: &str) -> Option<Arch> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|&(_, a)| a)
    }
    pub fn gguf_name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, a)| *a == self)
            .map(|(n, _)| *n)
            .unwrap()
    }
    /// llama.cpp `llama_model_rope_type`: every MLA arch is NORM except MiniCPM3 (NEOX).
    pub fn rope_pairing(self) -> RopePairing {
        match self {
            Arch::Minicpm3 => RopePairing::Neox,
            _ => RopePairing::Norm,
        }
    }
}

/// Which elements a rotation pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopePairing {
    /// Consecutive pairs `(x[2i], x[2i+1])` ("interleaved", ggml mode 0).
    Norm,
    /// Pairs offset by half the rotary dim `(x[i], x[i+R/2])` (ggml mode 2).
    Neox,
}

/// YaRN context extension, as llama.cpp applies it.
#[derive(Debug, Clone, Serialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_context: u64,
    /// `mscale_all_dim`: the file's `yarn_log_multiplier` divided by the converter's 0.1.
    pub mscale_all_dim: f64,
    /// The raw `yarn_log_multiplier` as stored in the file.
    pub log_multiplier_raw: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Mix between interpolated and extrapolated frequencies (llama.cpp: 1.0 for YaRN).
    pub ext_factor: f64,
}

impl Yarn {
    /// `0.1·m·ln(s) + 1` for s > 1 (HF `yarn_get_mscale`).
    pub fn get_mscale(scale: f64, m: f64) -> f64 {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    }
    /// The per-dimension ramp bounds (ggml `ggml_rope_yarn_corr_dims`).
    pub fn corr_dims(&self, n_rot: usize, base: f64) -> [f64; 2] {
        let corr = |n: f64| {
            n_rot as f64 * (self.original_context as f64 / (n * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let start = corr(self.beta_fast).floor().max(0.0);
        let end = corr(self.beta_slow).ceil().min(n_rot as f64 - 1.0);
        [start, end]
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct RopeConfig {
    /// Rotary dims per head (= qk_rope).
    pub dim: usize,
    pub base: f64,
    pub pairing: RopePairing,
    pub yarn: Option<Yarn>,
    /// LongRoPE per-frequency divisors: the name of the global tensor holding them, if any
    /// (`rope_factors_short.weight` / `rope_factors_long.weight`).
    pub freq_factors_short: Option<String>,
    pub freq_factors_long: Option<String>,
    /// Magnitude multiplier applied to cos/sin (`yarn_scales`: 1 for DeepSeek YaRN, HF's
    /// mscale/mscale_all_dim ratio; get_mscale(factor, 1) for YaRN without a log multiplier).
    pub attn_factor: f64,
}

/// Everything about a model's attention that the reference and the kernels need.
#[derive(Debug, Clone, Serialize)]
pub struct MlaConfig {
    pub arch: Arch,
    /// Trunk layers: `block_count` minus the appended NextN/MTP blocks (`nextn_predict_layers`).
    pub n_layer: usize,
    pub hidden: usize,
    pub n_head: usize,
    /// `head_count_kv` as stored (1 for new-style MLA files, n_head for legacy/MiniCPM3).
    pub n_head_kv: usize,
    /// `None`: no q-LoRA, `q = attn_q · x`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
    /// True when the head sizes came from the `*_mla` keys (new-style file).
    pub mla_keys: bool,
    pub rope: RopeConfig,
    /// eps of every RMSNorm (`layer_norm_rms_epsilon`; llama.cpp and vLLM use it for all of them).
    pub rms_eps: f64,
    /// eps of the two inner norms, q_a_norm and kv_a_norm. The file has one eps, so this is `rms_eps`, as
    /// llama.cpp reads it; transformers and the original remote code (DeepSeek-V2, MiniCPM3) build those
    /// two norms with their class default 1e-6 instead, which differs where `rms_eps` is not 1e-6 (GLM,
    /// MiniCPM3: 1e-5). The golden test sets it to 1e-6 to reproduce transformers exactly.
    pub lora_norm_eps: f64,
    /// `mscale` of the softmax: `get_mscale(factor, mscale_all_dim)` with YaRN and a log multiplier, else 1
    /// (times `rope.scaling.attn_factor`); see `yarn_scales`.
    pub mscale: f64,
    /// The softmax scale: `mscale² / sqrt(qk_nope + qk_rope)`.
    pub softmax_scale: f64,
    pub vocab_size: Option<usize>,
}

/// The layer layout of a hybrid file: llama.cpp's glm5-next converter (conversion/glm.py
/// `Glm5NextModel.set_gguf_parameters`) writes `head_count_kv` as one entry per block, 0 where the HF
/// `layer_types` entry is `linear_attention` (KDA) and 1 on an MLA (`indexed_attention`) layer; the
/// appended NextN/MTP blocks get 1. mla-diff checks the MLA layers and skips the linear ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HybridLayout {
    /// Trunk layers with MLA attention.
    pub mla_layers: Vec<usize>,
    /// Trunk layers with linear attention (not MLA: skipped).
    pub linear_layers: Vec<usize>,
    /// The MLA layers' head_count_kv (1).
    pub n_head_kv: usize,
}

impl HybridLayout {
    /// `Ok(None)` where `head_count_kv` is absent or a single number (every other MLA file).
    pub fn from_gguf(f: &GgufFile) -> Result<Option<HybridLayout>> {
        let Some(a) = f.architecture() else {
            return Ok(None);
        };
        let k = format!("{a}.attention.head_count_kv");
        let Some(Value::Array(arr)) = f.get(&k) else {
            return Ok(None);
        };
        let bad = |msg: String| Error::Unsupported(format!("{}: {k} {msg}", f.path.display()));
        let block_count = req_u64(f, a, "block_count")?;
        let nextn = opt_u64(f, a, "nextn_predict_layers")?.unwrap_or(0);
        if arr.len() != block_count {
            return Err(bad(format!(
                "has {} entries; block_count is {block_count} (the converter writes one per block)",
                arr.len()
            )));
        }
        let n_layer = block_count.saturating_sub(nextn);
        let (mut mla_layers, mut linear_layers, mut kv) = (Vec::new(), Vec::new(), None);
        for (l, v) in arr.iter().take(n_layer).enumerate() {
            match v.as_u64() {
                Some(0) => linear_layers.push(l),
                Some(n) => {
                    if kv.is_some_and(|k| k != n) {
                        return Err(bad(format!(
                            "mixes {} and {n} on MLA layers; one latent head (1) expected",
                            kv.unwrap()
                        )));
                    }
                    kv = Some(n);
                    mla_layers.push(l);
                }
                None => {
                    return Err(bad(format!(
                        "entry {l} is {}, expected an unsigned integer",
                        v.display_short()
                    )))
                }
            }
        }
        let Some(n_head_kv) = kv else {
            return Err(bad(
                "is 0 on every trunk layer: no MLA layer to check (all linear attention)".into(),
            ));
        };
        Ok(Some(HybridLayout {
            mla_layers,
            linear_layers,
            n_head_kv: n_head_kv as usize,
        }))
    }

    /// The message `inspect`/`lint`/`run` give for the layers they skip.
    pub fn skip_message(&self) -> Option<String> {
        (!self.linear_layers.is_empty()).then(|| {
            format!(
                "layers {} are linear attention (head_count_kv 0), not MLA: skipped (mla-diff checks the MLA layers {})",
                ranges(&self.linear_layers),
                ranges(&self.mla_layers)
            )
        })
    }
}

/// `[0,1,2,4]` → "0-2,4".
pub fn ranges(v: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if j == i {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The one line for a file whose architecture is not MLA; DeepSeek-V4's names what reads it.
pub fn not_mla(f: &GgufFile, name: &str) -> Error {
    if name == crate::model::v4::ARCH {
        return crate::model::v4::not_built(f);
    }
    let known: Vec<&str> = Arch::ALL.iter().map(|(n, _)| *n).collect();
    Error::Unsupported(format!(
        "{}: architecture {} does not use Multi-head Latent Attention (MLA architectures: {})",
        f.path.display(),
        quote(name),
        known.join(", ")
    ))
}

fn key<'a>(f: &'a GgufFile, arch: &str, k: &str) -> Option<&'a Value> {
    f.get(&format!("{arch}.{k}"))
}

fn req_u64(f: &GgufFile, arch: &str, k: &str) -> Result<usize> {
    let full = format!("{arch}.{k}");
    match f.get(&full) {
        None => Err(Error::Unsupported(format!(
            "{}: required metadata key {full} is missing",
            f.path.display()
        ))),
        Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: metadata key {full} should be an unsigned integer, found {}",
                f.path.display(),
                v.display_short()
            ))
        }),
    }
}

fn opt_u64(f: &GgufFile, arch: &str, k: &str) -> Result<Option<usize>> {
    match key(f, arch, k) {
        None => Ok(None),
        Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: metadata key {arch}.{k} should be an unsigned integer, found {}",
                f.path.display(),
                v.display_short()
            ))
        }),
    }
}

fn opt_f64(f: &GgufFile, arch: &str, k: &str) -> Result<Option<f64>> {
    match key(f, arch, k) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: metadata key {arch}.{k} should be a number, found {}",
                f.path.display(),
                v.display_short()
            ))
        }),
    }
}

/// (cos/sin magnitude, softmax mscale) for a rope config, as transformers' DeepSeek-V3 / V2 / GLM-MoE-DSA
/// define them (`_compute_yarn_parameters`, `yarn_apply_mscale`), reconstructed from what the file keeps:
/// - YaRN with `mscale_all_dim` (m) ≠ 0: cos/sin × get_mscale(f, mscale)/get_mscale(f, m), which is 1
///   because the file does not keep `mscale` and every released checkpoint has mscale = m (llama.cpp
///   assumes the same for `deepseek2`); softmax mscale get_mscale(f, m). llama.cpp computes the same.
/// - YaRN without it: cos/sin × get_mscale(f, 1) (HF's default attention_factor; llama.cpp agrees), and
///   no softmax mscale (HF and vLLM: `yarn_apply_mscale` needs mscale_all_dim). llama.cpp's deepseek2
///   graph squares get_mscale(f, 1) into kq_scale here as well; we follow the model definition.
/// - No YaRN: 1 and 1.
///
/// `rope.scaling.attn_factor` (no MLA converter writes it) then multiplies the cos/sin magnitude, as in
/// llama.cpp (`cparams.yarn_attn_factor *= hparams.rope_attn_factor`); the deepseek2-family graphs also
/// square it into kq_scale (`attn_factor_org`), the minicpm3 and plm graphs do not.
pub fn yarn_scales(arch: Arch, yarn: Option<&Yarn>, rope_attn_factor: f64) -> (f64, f64) {
    let (attn, mscale) = match yarn {
        Some(y) if y.mscale_all_dim != 0.0 => (1.0, Yarn::get_mscale(y.factor, y.mscale_all_dim)),
        Some(y) => (Yarn::get_mscale(y.factor, 1.0), 1.0),
        None => (1.0, 1.0),
    };
    let folds_into_kq = !matches!(arch, Arch::Minicpm3 | Arch::Plm);
    let kq = if folds_into_kq { rope_attn_factor } else { 1.0 };
    (attn * rope_attn_factor, mscale * kq)
}

impl MlaConfig {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope + self.qk_rope
    }
    /// Width of one latent cache row: `[latent | k_pe]`.
    pub fn cache_row(&self) -> usize {
        self.kv_lora_rank + self.qk_rope
    }

    pub fn from_gguf(f: &GgufFile) -> Result<MlaConfig> {
        let name = f.architecture().ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: general.architecture is missing",
                f.path.display()
            ))
        })?;
        let arch = Arch::from_gguf(name).ok_or_else(|| not_mla(f, name))?;
        let a = name;
        let n_layer = layer_count(f, a)?;
        let hidden = req_u64(f, a, "embedding_length")?;
        let n_head = req_u64(f, a, "attention.head_count")?;
        let n_head_kv = match HybridLayout::from_gguf(f)? {
            // A per-layer head_count_kv (glm5-next): the MLA layers' value.
            Some(h) => h.n_head_kv,
            None => opt_u64(f, a, "attention.head_count_kv")?.unwrap_or(n_head),
        };
        let kv_lora_rank = req_u64(f, a, "attention.kv_lora_rank")?;
        let q_lora_rank = opt_u64(f, a, "attention.q_lora_rank")?.filter(|&r| r > 0);
        let qk_rope = req_u64(f, a, "rope.dimension_count")?;
        let (qk, v_head_dim, mla_keys) = head_dims(f, a, hidden, n_head)?;
        let bad = |msg: String| Error::Unsupported(format!("{}: {msg}", f.path.display()));
        if n_layer == 0 || hidden == 0 || n_head == 0 || kv_lora_rank == 0 || v_head_dim == 0 {
            return Err(bad(format!(
                "zero-sized attention (block_count {n_layer}, embedding_length {hidden}, head_count {n_head}, kv_lora_rank {kv_lora_rank}, v_head_dim {v_head_dim})"
            )));
        }
        // glm5-next is NoPE MLA: its converter asserts qk_rope_head_dim == 0 and writes rope dims 0.
        let nope_ok = arch == Arch::Glm5Next && qk_rope == 0;
        if arch == Arch::Glm5Next && qk_rope != 0 {
            return Err(bad(format!(
                "rope.dimension_count is {qk_rope}, but glm5-next is NoPE MLA (transformers glm5_next: qk_rope_head_dim = 0; llama.cpp's converter asserts it)"
            )));
        }
        if !nope_ok && (qk_rope == 0 || qk_rope % 2 != 0 || qk <= qk_rope) {
            return Err(bad(format!(
                "rope dims {qk_rope} must be even and smaller than the qk head dim {qk}"
            )));
        }
        if !mla_keys && qk == kv_lora_rank + qk_rope {
            return Err(bad(format!(
                "key_length {qk} equals kv_lora_rank + rope ({kv_lora_rank}+{qk_rope}): a new-style MLA file that lacks the *_mla keys (made for llama.cpp PR #11446?); cannot tell the per-head dims"
            )));
        }
        // Sanity bound: a header claiming absurd dims would otherwise drive huge allocations later.
        let limit = 1usize << 20;
        for (what, v) in [
            ("embedding_length", hidden),
            ("head_count", n_head),
            ("kv_lora_rank", kv_lora_rank),
            ("key_length", qk),
            ("value_length", v_head_dim),
            ("head_count_kv", n_head_kv),
            ("q_lora_rank", q_lora_rank.unwrap_or(0)),
        ] {
            if v > limit {
                return Err(bad(format!("{what} = {v} is implausible (> {limit})")));
            }
        }
        let qk_nope = qk - qk_rope;
        let rms_eps = opt_f64(f, a, "attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
        let base = opt_f64(f, a, "rope.freq_base")?.unwrap_or(10000.0);

        let yarn = yarn_of(f, a)?;
        let rope_attn_factor = opt_f64(f, a, "rope.scaling.attn_factor")?.unwrap_or(1.0);
        let (attn_factor, mscale) = yarn_scales(arch, yarn.as_ref(), rope_attn_factor);
        let softmax_scale = mscale * mscale / (qk as f64).sqrt();
        let has = |n: &str| f.tensor(n).is_some().then(|| n.to_string());
        let rope = RopeConfig {
            dim: qk_rope,
            base,
            pairing: arch.rope_pairing(),
            attn_factor,
            yarn,
            freq_factors_short: has("rope_factors_short.weight")
                .or_else(|| has("rope_freqs.weight")),
            freq_factors_long: has("rope_factors_long.weight"),
        };
        let vocab_size = f
            .tensor("token_embd.weight")
            .map(|t| t.ne.get(1).copied().unwrap_or(1) as usize);
        Ok(MlaConfig {
            arch,
            n_layer,
            hidden,
            n_head,
            n_head_kv,
            q_lora_rank,
            kv_lora_rank,
            qk_nope,
            qk_rope,
            v_head_dim,
            mla_keys,
            rope,
            rms_eps,
            lora_norm_eps: rms_eps,
            mscale,
            softmax_scale,
            vocab_size,
        })
    }
}

/// The trunk's layer count: `block_count` less the NextN/MTP blocks, bounded by the tensor count.
fn layer_count(f: &GgufFile, a: &str) -> Result<usize> {
    let block_count = req_u64(f, a, "block_count")?;
    // block_count also counts the NextN/MTP blocks the converter appends after the trunk (GLM-4.7-Flash,
    // GLM-5: nextn_predict_layers = 1); llama.cpp's n_layer() and the model's forward run the trunk only.
    let nextn = opt_u64(f, a, "nextn_predict_layers")?.unwrap_or(0);
    if nextn > 0 && nextn >= block_count {
        return Err(Error::Unsupported(format!(
            "{}: nextn_predict_layers {nextn} leaves no trunk layers of block_count {block_count} (an MTP-only file?)",
            f.path.display()
        )));
    }
    let n_layer = block_count - nextn;
    // Bound the layer count by what the file can hold before anything loops over layers: every
    // layer has its own attention tensors, so a file cannot have more layers than tensors.
    if n_layer > f.tensors.len() {
        return Err(Error::Unsupported(format!(
            "{}: block_count {block_count} is impossible: the file has only {} tensors, and every layer needs its own attention tensors",
            f.path.display(),
            f.tensors.len()
        )));
    }
    Ok(n_layer)
}

/// `(qk head dim, v head dim, whether from the *_mla keys)`.
fn head_dims(f: &GgufFile, a: &str, hidden: usize, n_head: usize) -> Result<(usize, usize, bool)> {
    let k_mla = opt_u64(f, a, "attention.key_length_mla")?;
    let v_mla = opt_u64(f, a, "attention.value_length_mla")?;
    Ok(match (k_mla, v_mla) {
        (Some(k), Some(v)) => (k, v, true),
        // llama.cpp defaults both head sizes to n_embd / n_head when the key is absent; the MiniCPM3
        // converter relies on that and writes no value_length (conversion/minicpm.py).
        (None, None) => {
            let default = (n_head > 0 && hidden.is_multiple_of(n_head)).then(|| hidden / n_head);
            let head = |k: &str| -> Result<usize> {
                match (opt_u64(f, a, k)?, default) {
                    (Some(v), _) => Ok(v),
                    (None, Some(d)) => Ok(d),
                    (None, None) => req_u64(f, a, k),
                }
            };
            (head("attention.key_length")?, head("attention.value_length")?, false)
        }
        _ => {
            return Err(Error::Unsupported(format!(
                "{}: only one of {a}.attention.key_length_mla / value_length_mla is present (llama.cpp needs both or neither)",
                f.path.display()
            )))
        }
    })
}

/// YaRN's parameters where the file scales rope by YaRN with a factor above 1.
fn yarn_of(f: &GgufFile, a: &str) -> Result<Option<Yarn>> {
    let scaling = key(f, a, "rope.scaling.type")
        .and_then(|v| v.as_str())
        .unwrap_or("none")
        .to_string();
    let factor = opt_f64(f, a, "rope.scaling.factor")?.unwrap_or(1.0);
    Ok(if scaling == "yarn" && factor > 1.0 {
        let raw = opt_f64(f, a, "rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0);
        // TAG_DEEPSEEK2_YARN_LOG_MUL_FIX: the converter stores 0.1·mscale_all_dim; llama.cpp divides by 0.1.
        // In f32 as llama.cpp does (`rope_yarn_log_mul /= 0.1f`), so 0.1f gives exactly 1.
        let mscale_all_dim = (raw as f32 / 0.1f32) as f64;
        Some(Yarn {
            factor,
            original_context: opt_u64(f, a, "rope.scaling.original_context_length")?.unwrap_or(4096)
                as u64,
            mscale_all_dim,
            log_multiplier_raw: raw,
            beta_fast: opt_f64(f, a, "rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
            beta_slow: opt_f64(f, a, "rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
            ext_factor: opt_f64(f, a, "rope.scaling.yarn_ext_factor")?
                .filter(|&e| e >= 0.0)
                .unwrap_or(1.0),
        })
    } else {
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(m: f64) -> Yarn {
        Yarn {
            factor: 40.0,
            original_context: 4096,
            mscale_all_dim: m,
            log_multiplier_raw: 0.1 * m,
            beta_fast: 32.0,
            beta_slow: 1.0,
            ext_factor: 1.0,
        }
    }

    /// The (cos/sin, softmax mscale) pairs derived in `yarn_scales`' doc from transformers and llama.cpp.
    #[test]
    fn yarn_scales_cases() {
        let g1 = 0.1 * 40f64.ln() + 1.0; // 1.36889
        let close = |(a, b): (f64, f64), (c, d): (f64, f64)| {
            assert!(
                (a - c).abs() < 1e-12 && (b - d).abs() < 1e-12,
                "({a}, {b}) vs ({c}, {d})"
            )
        };
        close(
            yarn_scales(Arch::Deepseek2, Some(&yarn(1.0)), 1.0),
            (1.0, g1),
        );
        let g707 = 0.1 * 0.707 * 40f64.ln() + 1.0;
        close(
            yarn_scales(Arch::Deepseek2, Some(&yarn(0.707)), 1.0),
            (1.0, g707),
        );
        close(
            yarn_scales(Arch::Deepseek2, Some(&yarn(0.0)), 1.0),
            (g1, 1.0),
        );
        close(yarn_scales(Arch::Deepseek2, None, 1.0), (1.0, 1.0));
        // rope.scaling.attn_factor: cos/sin always; kq_scale only in the deepseek2-family graphs.
        close(
            yarn_scales(Arch::Deepseek2, Some(&yarn(1.0)), 2.0),
            (2.0, 2.0 * g1),
        );
        close(yarn_scales(Arch::GlmDsa, None, 2.0), (2.0, 2.0));
        close(yarn_scales(Arch::Minicpm3, None, 2.0), (2.0, 1.0));
        close(yarn_scales(Arch::Plm, None, 2.0), (2.0, 1.0));
    }
}
