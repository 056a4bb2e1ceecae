//! Rope and RMSNorm: the pairing, the base, the scaling keys (YaRN's context, β and mscale) and eps.
//! One function per check, called in the order the findings are reported.

use super::meta::Meta;
use super::{EPS_RANGE, MSCALE_ALL_DIM_MAX};
use crate::error::quote;
use crate::lint::{num, Findings};
use crate::model::config::{Arch, RopePairing, Yarn};

/// The rope scaling keys, each read once (a key of the wrong type is reported at its read).
struct Scaling {
    ty: Option<String>,
    factor: Option<f64>,
    factor_key: String,
    orig: Option<u64>,
    ctx: Option<u64>,
    raw_mul: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
}

/// Rope pairing, base, YaRN and other scaling keys.
pub(super) fn rope_and_scaling(m: &Meta, arch: Arch, out: &mut Findings) {
    pairing(m, arch, out);
    freq_base(m, arch, out);
    let s = scaling(m, out);
    scaling_type(m, arch, &s, out);
    if s.ty.as_deref() != Some("yarn") {
        return;
    }
    let fa = s.factor.unwrap_or(1.0);
    if fa.is_nan() || fa <= 1.0 {
        out.warning(
            &s.factor_key,
            s.factor.map(num).unwrap_or("absent".into()),
            "above 1",
            "YaRN with a factor of 1 or less extends nothing: llama.cpp and mla-diff apply no scaling",
        );
        return;
    }
    yarn_context(m, &s, fa, out);
    yarn_betas(m, &s, out);
    yarn_log_multiplier(m, &s, fa, out);
}

/// The pairing (no key: the architecture's), M-RoPE sections and LongRoPE factor tensors.
fn pairing(m: &Meta, arch: Arch, out: &mut Findings) {
    let pairing = arch.rope_pairing();
    out.note(
        "rope_pairing",
        match pairing {
            RopePairing::Norm => "NORM: pairs (x[2i], x[2i+1])".to_string(),
            RopePairing::Neox => "NEOX: pairs (x[i], x[i+rope/2])".to_string(),
        },
        format!(
            "GGUF has no key for it: llama.cpp (llama_model_rope_type) and mla-diff derive it from the architecture {}; a kernel pairing the other way computes another model (faults rope_neox / rope_norm)",
            m.arch
        ),
    );
    if m.k.rope_sections.present {
        out.warning(
            &m.key("rope.dimension_sections"),
            m.k.rope_sections.shown.clone().unwrap_or_default(),
            "absent: MLA rope has no sections",
            format!(
                "M-RoPE sections on an MLA model: llama.cpp's M-RoPE kernel pairs NEOX-style only, and its GLM converter permutes q/k to suit it; the {} weights may then be permuted for a pairing the architecture does not use",
                m.arch
            ),
        );
    }
    let has_factors = [
        "rope_factors_short.weight",
        "rope_factors_long.weight",
        "rope_freqs.weight",
    ]
    .iter()
    .any(|n| m.f.tensor(n).is_some());
    match (arch == Arch::Minicpm3, has_factors) {
        (true, false) => out.warning(
            "rope_factors_long.weight",
            "absent",
            "rope_factors_long.weight and rope_factors_short.weight",
            "MiniCPM3 is a LongRoPE model: its converter writes the per-frequency factors; without them the rope is plain",
        ),
        (false, true) => out.warning(
            "rope_factors",
            "rope frequency factor tensors on a NORM architecture",
            "none (only MiniCPM3 carries LongRoPE factors)",
            "the reference divides each pair's frequency by them; no DeepSeek/GLM converter writes them",
        ),
        _ => {}
    }
}

fn freq_base(m: &Meta, arch: Arch, out: &mut Findings) {
    match m.get(&m.k.rope_freq_base, out) {
        Some(b) if !(b.is_finite() && b > 1.0) => out.error(
            &m.key("rope.freq_base"),
            num(b),
            "a finite base above 1",
            "the rope angle is pos·base^(−2i/rope): a base of 1 or less does not rotate or diverges",
        ),
        None if !m.k.rope_freq_base.present && !matches!(arch, Arch::Minicpm3 | Arch::Glm5Next) => out.warning(
            &m.key("rope.freq_base"),
            "absent",
            "present (10000 DeepSeek, 50000 Kimi-K2, 1e6 GLM)",
            "llama.cpp and mla-diff then use 10000; a GLM model at 10000 instead of 1e6 is 0.11 rel-L2 off (conventions.md)",
        ),
        _ => {}
    }
}

fn scaling(m: &Meta, out: &mut Findings) -> Scaling {
    let k = m.k;
    let ty = m.get(&k.scaling_type, out);
    // llama.cpp reads the old `rope.scale_linear` key where `rope.scaling.factor` is absent.
    let (factor, factor_key) = match m.get(&k.scaling_factor, out) {
        Some(f) => (Some(f), &k.scaling_factor.key),
        None => (m.get(&k.scale_linear, out), &k.scale_linear.key),
    };
    Scaling {
        ty,
        factor,
        factor_key: factor_key.clone(),
        orig: m.get(&k.original_context, out),
        ctx: m.get(&k.context_length, out),
        raw_mul: m.get(&k.yarn_log_multiplier, out),
        beta_fast: m.get(&k.yarn_beta_fast, out),
        beta_slow: m.get(&k.yarn_beta_slow, out),
    }
}

/// The scaling type against the factor and the YaRN keys beside it.
fn scaling_type(m: &Meta, arch: Arch, s: &Scaling, out: &mut Findings) {
    let (ty, factor, factor_key) = (&s.ty, s.factor, &s.factor_key);
    let scaling_key = m.key("rope.scaling.type");
    match ty.as_deref() {
        Some("yarn") => {}
        Some("none") | None => {
            if let Some(fa) = factor.filter(|&fa| fa != 0.0 && fa != 1.0) {
                let how = if ty.is_none() {
                    "llama.cpp reads a factor without a scaling type as linear scaling (positions divided by it)"
                } else {
                    "with type none no engine applies it"
                };
                out.error(
                    factor_key,
                    format!("{} with {}", num(fa), ty.as_deref().map(|t| format!("type {t}")).unwrap_or("no rope.scaling.type".into())),
                    "rope.scaling.type yarn with it, or no factor",
                    format!("{how}; mla-diff's reference applies no scaling without type yarn, so the two compute different rope angles"),
                );
            }
            if let Some(k) = [&m.k.yarn_log_multiplier.key, &m.k.original_context.key]
                .into_iter()
                .zip([m.k.yarn_log_multiplier.present, m.k.original_context.present])
                .find_map(|(k, present)| present.then_some(k))
            {
                out.warning(
                    k,
                    "present without rope.scaling.type yarn",
                    "rope.scaling.type yarn",
                    "YaRN parameters without the YaRN type are ignored by llama.cpp and mla-diff",
                );
            }
        }
        Some("linear") => {
            if factor.is_some_and(|fa| fa > 1.0) {
                out.error(
                    &scaling_key,
                    "linear",
                    "yarn (or none)",
                    "no MLA model uses linear rope scaling; llama.cpp divides positions by the factor, mla-diff's reference does not model it",
                );
            }
        }
        Some("longrope") if arch == Arch::Minicpm3 => {}
        Some(other) => out.error(
            &scaling_key,
            quote(other),
            "yarn, none (or longrope for MiniCPM3)",
            "llama.cpp aborts on an unknown scaling type; mla-diff applies no scaling for anything but yarn",
        ),
    }
}

/// YaRN's original context: present, non-zero, below the whole context.
fn yarn_context(m: &Meta, s: &Scaling, fa: f64, out: &mut Findings) {
    match s.orig {
        None if !m.k.original_context.present => out.error(
            &m.key("rope.scaling.original_context_length"),
            "absent",
            "the original (pre-YaRN) context, e.g. 4096 for DeepSeek",
            format!(
                "YaRN's frequency ramp is computed over the original context; without the key llama.cpp falls back to context_length ({}) and mla-diff to 4096, so their rope angles differ",
                s.ctx.map(|c| c.to_string()).unwrap_or("absent".into())
            ),
        ),
        Some(0) => out.error(
            &m.key("rope.scaling.original_context_length"),
            "0",
            "the original context",
            "the YaRN ramp takes its log; 0 makes every correction dim infinite",
        ),
        Some(o) => {
            if let Some(c) = s.ctx.filter(|&c| o >= c) {
                out.warning(
                    &m.key("rope.scaling.original_context_length"),
                    o.to_string(),
                    format!("below context_length {c}"),
                    format!("YaRN factor {} extends the original context; an original context of the whole context extends nothing", num(fa)),
                );
            }
        }
        None => {}
    }
}

/// YaRN's β: positive, fast at least slow.
fn yarn_betas(m: &Meta, s: &Scaling, out: &mut Findings) {
    let (beta_fast, beta_slow) = (s.beta_fast, s.beta_slow);
    for (k, b) in [
        ("rope.scaling.yarn_beta_fast", beta_fast),
        ("rope.scaling.yarn_beta_slow", beta_slow),
    ] {
        if let Some(b) = b.filter(|b| !(b.is_finite() && *b > 0.0)) {
            out.error(&m.key(k), num(b), "positive", "the ramp's correction dims take log(original_context / (2π·β)): a β of 0 or less gives NaN angles");
        }
    }
    if let (Some(bf), Some(bs)) = (beta_fast, beta_slow) {
        if bf > 0.0 && bs > 0.0 && bf < bs {
            out.warning(
                &m.key("rope.scaling.yarn_beta_fast"),
                num(bf),
                format!("at least yarn_beta_slow {}", num(bs)),
                "β_fast bounds the ramp's start and β_slow its end; swapped, the ramp is empty (DeepSeek: 32 / 1)",
            );
        }
    }
}

/// YaRN's log multiplier (0.1·mscale_all_dim): absent, non-positive, or the HF value stored raw.
fn yarn_log_multiplier(m: &Meta, s: &Scaling, fa: f64, out: &mut Findings) {
    let raw_mul = s.raw_mul;
    match raw_mul {
        None | Some(0.0) => {
            let g = Yarn::get_mscale(fa, 1.0);
            out.warning(
                &m.key("rope.scaling.yarn_log_multiplier"),
                raw_mul.map(num).unwrap_or("absent".into()),
                "0.1·mscale_all_dim (0.1 for DeepSeek-V3 and Kimi-K2, 0.0707 for V2-Lite)",
                format!(
                    "YaRN without mscale_all_dim: transformers and vLLM scale cos/sin by get_mscale({}, 1) = {} and leave the softmax at 1/sqrt(qk); llama.cpp's deepseek2 graph also squares {} into kq_scale ({}× larger): the engines disagree, and a DeepSeek checkpoint converted without its mscale_all_dim loses the softmax's mscale² (fault yarn_mscale_missing)",
                    num(fa),
                    num(g),
                    num(g),
                    num(g * g)
                ),
            );
        }
        Some(x) if !(x.is_finite() && x > 0.0) => out.error(
            &m.key("rope.scaling.yarn_log_multiplier"),
            num(x),
            "positive (0.1·mscale_all_dim)",
            "mscale = 0.1·mscale_all_dim·ln(factor) + 1 would shrink or flip the softmax scale",
        ),
        Some(x) => {
            let mad = (x as f32 / 0.1f32) as f64;
            if mad > MSCALE_ALL_DIM_MAX {
                let wrong = Yarn::get_mscale(fa, mad);
                let right = Yarn::get_mscale(fa, x);
                out.error(
                    &m.key("rope.scaling.yarn_log_multiplier"),
                    num(x),
                    format!("0.1·mscale_all_dim = {} if {} is the HF mscale_all_dim", num(0.1 * x), num(x)),
                    format!(
                        "the converter stores 0.1·mscale_all_dim and llama.cpp divides by 0.1 again (TAG_DEEPSEEK2_YARN_LOG_MUL_FIX, PR #17945): {} reads as mscale_all_dim {} (released models: 1 or 0.707), an mscale² of {} instead of {}",
                        num(x),
                        num(mad),
                        num(wrong * wrong),
                        num(right * right)
                    ),
                );
            }
        }
    }
}

/// RMSNorm eps.
pub(super) fn norms(m: &Meta, out: &mut Findings) {
    let k = "attention.layer_norm_rms_epsilon";
    match m.get(&m.k.rms_eps, out) {
        None if !m.k.rms_eps.present => out.error(
            &m.key(k),
            "absent",
            "the model's RMSNorm eps (1e-6 DeepSeek/Kimi, 1e-5 GLM/MiniCPM3)",
            "llama.cpp refuses the file without it; mla-diff would assume 1e-6, which is wrong for GLM and MiniCPM3",
        ),
        Some(e) if !(e.is_finite() && e > 0.0) => out.error(
            &m.key(k),
            num(e),
            format!("in [{}, {}]", num(EPS_RANGE.0), num(EPS_RANGE.1)),
            "RMSNorm divides by sqrt(mean(x²) + eps): with eps 0 a zero row (padding, a cleared cache slot) gives 0/0 = NaN; a negative eps can take the root of a negative",
        ),
        Some(e) if !(EPS_RANGE.0..=EPS_RANGE.1).contains(&e) => out.warning(
            &m.key(k),
            num(e),
            format!("in [{}, {}]", num(EPS_RANGE.0), num(EPS_RANGE.1)),
            "every MLA model uses 1e-6 or 1e-5; an eps this far off changes the normalisation of small activations (a value stored in the wrong unit?)",
        ),
        _ => {}
    }
}
