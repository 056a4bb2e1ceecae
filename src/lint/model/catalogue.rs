//! The softmax scale notes and the file against the catalogue of known models.

use super::meta::Meta;
use crate::lint::{num, Findings, Severity};
use crate::model::catalogue::{Preset, CATALOGUE};
use crate::model::MlaConfig;

/// The softmax scale and what the classic mistakes would make of it.
pub(super) fn scale_notes(c: &MlaConfig, out: &mut Findings) {
    let qk = c.qk_head_dim();
    let row = c.cache_row();
    let wrong = 1.0 / (row as f64).sqrt();
    let mut why = format!(
        "every kernel and runner must be given it (runner meta softmax_scale); 1/sqrt(kv_lora_rank + rope) = {row}^-0.5 = {}, the absorbed query's width and FlashMLA's default softmax_scale, is {}× smaller (fault scale_576)",
        num(wrong),
        num(c.softmax_scale / wrong)
    );
    if c.mscale != 1.0 {
        why.push_str(&format!(
            "; without the YaRN mscale² it would be {} (fault yarn_mscale_missing)",
            num(1.0 / (qk as f64).sqrt())
        ));
    }
    out.note(
        "softmax_scale",
        format!(
            "{} = mscale {}² / sqrt({} + {})",
            num(c.softmax_scale),
            num(c.mscale),
            c.qk_nope,
            c.qk_rope
        ),
        why,
    );
    out.note(
        "head_dims",
        format!(
            "heads {}, qk_nope {} + rope {} = {}, v_head_dim {}, kv_lora_rank {}, cache row {} = [latent {} | k_pe {}]",
            c.n_head, c.qk_nope, c.qk_rope, qk, c.v_head_dim, c.kv_lora_rank, row, c.kv_lora_rank, c.qk_rope
        ),
        if qk != c.v_head_dim {
            format!("K and V head dims differ ({qk} vs {}): a kernel that strides V or o_proj by the K head dim misreads every head (fault head_stride_qk)", c.v_head_dim)
        } else {
            "what the kernels are compiled for and the runner is asked for".to_string()
        },
    );
}

/// A catalogue entry's conventions as the file would state them, for comparison.
struct Conv {
    base: f64,
    /// (factor, original context, mscale_all_dim, β_fast, β_slow)
    yarn: Option<(f64, u64, f64, f64, f64)>,
    eps: f64,
}

fn file_conv(c: &MlaConfig) -> Conv {
    Conv {
        base: c.rope.base,
        yarn: c.rope.yarn.as_ref().map(|y| {
            (
                y.factor,
                y.original_context,
                y.mscale_all_dim,
                y.beta_fast,
                y.beta_slow,
            )
        }),
        eps: c.rms_eps,
    }
}

fn entry_conv(e: &crate::model::catalogue::Entry) -> Conv {
    Conv {
        base: e.rope_base.unwrap_or(10000.0),
        yarn: e.yarn.as_ref().map(|y| {
            (
                y.factor as f64,
                y.original_context as u64,
                y.mscale_all_dim.unwrap_or(0.0),
                y.beta_fast.unwrap_or(32.0) as f64,
                y.beta_slow.unwrap_or(1.0) as f64,
            )
        }),
        eps: e.rms_eps,
    }
}

/// The keys on which a file's conventions differ from an entry's: (key, found, expected).
fn conv_diffs(m: &Meta, file: &Conv, entry: &Conv) -> Vec<(String, String, String)> {
    // The file stores f32: compare at f32 precision (0.707 comes back as 0.70700002).
    let same =
        |a: f64, b: f64| (a as f32) == (b as f32) || (a - b).abs() <= 1e-6 * b.abs().max(1e-30);
    let mut d = Vec::new();
    if !same(file.base, entry.base) {
        d.push((m.key("rope.freq_base"), num(file.base), num(entry.base)));
    }
    match (&file.yarn, &entry.yarn) {
        (None, None) => {}
        (Some(a), Some(b)) => {
            for (k, x, y) in [
                ("rope.scaling.factor", a.0, b.0),
                (
                    "rope.scaling.original_context_length",
                    a.1 as f64,
                    b.1 as f64,
                ),
                ("rope.scaling.yarn_log_multiplier", 0.1 * a.2, 0.1 * b.2),
                ("rope.scaling.yarn_beta_fast", a.3, b.3),
                ("rope.scaling.yarn_beta_slow", a.4, b.4),
            ] {
                if !same(x, y) {
                    d.push((m.key(k), num(x), num(y)));
                }
            }
        }
        (a, b) => {
            let s = |y: &Option<(f64, u64, f64, f64, f64)>| match y {
                Some(y) => format!("yarn factor {} over {}", num(y.0), y.1),
                None => "no YaRN".to_string(),
            };
            d.push((m.key("rope.scaling.type"), s(a), s(b)));
        }
    }
    if !same(file.eps, entry.eps) {
        d.push((
            m.key("attention.layer_norm_rms_epsilon"),
            num(file.eps),
            num(entry.eps),
        ));
    }
    d
}

/// The file against the catalogue: a model whose attention dims it has, and the keys it differs in.
pub(super) fn catalogue(m: &Meta, c: &MlaConfig, out: &mut Findings) {
    let geo = |e: &crate::model::catalogue::Entry| {
        let mut d = Vec::new();
        if e.kv_lora != c.kv_lora_rank {
            d.push(("attention.kv_lora_rank", c.kv_lora_rank, e.kv_lora));
        }
        if e.qk_nope != c.qk_nope {
            let k = if c.mla_keys {
                "attention.key_length_mla"
            } else {
                "attention.key_length"
            };
            d.push((k, c.qk_head_dim(), e.qk_nope + c.qk_rope));
        }
        if e.qk_rope != c.qk_rope {
            d.push(("rope.dimension_count", c.qk_rope, e.qk_rope));
        }
        if e.v_head != c.v_head_dim {
            let k = if c.mla_keys {
                "attention.value_length_mla"
            } else {
                "attention.value_length"
            };
            d.push((k, c.v_head_dim, e.v_head));
        }
        d
    };
    let fc = file_conv(c);
    let full = |e: &crate::model::catalogue::Entry| e.hidden == c.hidden && e.heads == c.n_head;
    let dims = format!(
        "kv_lora_rank {}, qk {} + {}, v {}",
        c.kv_lora_rank, c.qk_nope, c.qk_rope, c.v_head_dim
    );
    // The same attention dims: the entry agreeing on most conventions (a full-size match first).
    let best = CATALOGUE
        .iter()
        .filter(|e| e.arch == c.arch && geo(e).is_empty())
        .map(|e| (conv_diffs(m, &fc, &entry_conv(e)), e))
        .min_by_key(|(d, e)| (d.len(), !full(e), e.preset as usize));
    if let Some((diffs, e)) = best {
        let size = if full(e) {
            "at full size".to_string()
        } else {
            format!("at other hidden/heads: {} / {}", c.hidden, c.n_head)
        };
        if diffs.is_empty() {
            out.note(
                "catalogue",
                format!("{} ({dims}, {size})", e.model_name),
                "its rope base, YaRN and eps agree with the catalogue entry too",
            );
        } else if diffs.len() <= 2 && e.preset != Preset::Tiny {
            // A key already in error is not repeated as a catalogue difference.
            let diffs: Vec<_> = diffs
                .into_iter()
                .filter(|d| !out.has(Severity::Error, &d.0))
                .collect();
            for (k, found, want) in diffs {
                out.warning(
                    &k,
                    found,
                    format!("{want}, as {}", e.model_name),
                    format!(
                        "the file has {}'s attention dims ({dims}) and agrees with it on the other rope, YaRN and eps keys; intended, or a conversion slip?",
                        e.model_name
                    ),
                );
            }
        } else {
            out.note(
                "catalogue",
                format!(
                    "{}'s attention dims ({dims}), but {} other keys differ",
                    e.model_name,
                    diffs.len()
                ),
                format!(
                    "another model of the same shape: {}",
                    diffs
                        .iter()
                        .map(|(k, f, w)| format!("{k} {f} (vs {w})"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
        return;
    }
    // One attention dim off a real model whose conventions the file shares in full.
    for e in CATALOGUE
        .iter()
        .filter(|e| e.arch == c.arch && e.preset != Preset::Tiny)
    {
        let g = geo(e);
        if g.len() == 1 && conv_diffs(m, &fc, &entry_conv(e)).is_empty() {
            let (k, found, want) = g[0];
            if out.has(Severity::Error, &m.key(k)) {
                return;
            }
            out.warning(
                &m.key(k),
                found.to_string(),
                format!("{want}, as {}", e.model_name),
                format!(
                    "every other attention dim, the rope base, YaRN and eps are {}'s; this one key differs",
                    e.model_name
                ),
            );
            return;
        }
    }
    no_known_model(m, &dims, out);
}

/// The note for a file of no catalogue model's attention dims.
fn no_known_model(m: &Meta, dims: &str, out: &mut Findings) {
    let names: Vec<&str> = CATALOGUE
        .iter()
        .filter(|e| e.preset != Preset::Tiny)
        .map(|e| e.model_name)
        .collect();
    out.note(
        "catalogue",
        format!("no known model ({dims}, {})", m.arch),
        format!(
            "the catalogue ({}) has no model of these dims; the checks above are the file's own consistency",
            names.join(", ")
        ),
    );
}
