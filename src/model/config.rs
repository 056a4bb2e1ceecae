//! `MlaConfig`: the attention hyper-parameters of an MLA model, read from GGUF metadata.
//!
//! The conventions (key names, the converter's ×0.1 on `yarn_log_multiplier`, rope pairing per
//! architecture, `*_mla` vs legacy head sizes) follow llama.cpp; docs/conventions.md
//! lists them with sources.

use super::keys::{Diagnostic, Diagnostics, MlaKeys};
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
        Self::from_keys(f, &MlaKeys::read(f, a)).map_err(|d| d.error(f))
    }

    /// As `from_gguf`, from the keys as read; a refusal is the diagnostic on `head_count_kv` (or on the
    /// `block_count` it is counted against).
    pub fn from_keys(
        f: &GgufFile,
        k: &MlaKeys,
    ) -> std::result::Result<Option<Self>, Box<Diagnostic>> {
        let Some(Value::Array(arr)) = &k.head_count_kv_raw else {
            return Ok(None);
        };
        let key = &k.head_count_kv.key;
        let bad = |msg: String| {
            Box::new(Diagnostic {
                key: key.clone(),
                found: format!("{}: {key} {msg}", f.path.display()),
                expected: "one entry per block: 0 (linear attention) or 1 (MLA)".into(),
                why: "llama.cpp's glm5-next converter writes head_count_kv per block".into(),
                message: format!("{key} {msg}"),
                rule: "hybrid",
                format: false,
            })
        };
        let mut d = Diagnostics::default();
        let (block_count, nextn) = (d.need(&k.block_count), d.opt(&k.nextn_predict_layers));
        if let Some(first) = d.0.into_iter().next() {
            return Err(Box::new(first));
        }
        let block_count = block_count.unwrap_or(0) as usize;
        let nextn = nextn.unwrap_or(0) as usize;
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

    /// The config of an MLA file; `Err` is the first thing the loader refuses (its key named), of all
    /// those `from_gguf_diagnosed` collects.
    pub fn from_gguf(f: &GgufFile) -> Result<MlaConfig> {
        let d = Self::from_gguf_diagnosed(f)?;
        match (d.cfg, d.diagnostics.error(f)) {
            (Some(c), _) => Ok(c),
            (None, Some(e)) => Err(e),
            (None, None) => Err(Error::Unsupported(format!(
                "{}: the loader refuses the file",
                f.path.display()
            ))),
        }
    }
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
