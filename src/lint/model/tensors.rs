//! Each layer's attention tensors against the resolved dims, and the rope factor tensors.

use super::meta::{fmt_ne, Meta};
use crate::gguf::GgufFile;
use crate::lint::Findings;
use std::collections::BTreeMap;

/// Each layer's attention tensors against the dims `[hidden, heads, kv_lora, qk_nope, rope, v]`; one
/// finding per tensor role and problem, naming the first layer and how many share it.
pub(super) fn tensors(
    f: &GgufFile,
    n_layer: usize,
    skip: &[usize],
    d: [u64; 6],
    lq: Option<u64>,
    out: &mut Findings,
) {
    let [e, h, lkv, p, r, dv] = d;
    // (role, found shape or None for absent) → layers; expected per role.
    let mut bad: BTreeMap<(&'static str, Option<Vec<u64>>), Vec<usize>> = BTreeMap::new();
    let mut expect: BTreeMap<&'static str, (Vec<u64>, String)> = BTreeMap::new();
    for l in (0..n_layer).filter(|l| !skip.contains(l)) {
        let mut want: Vec<(&'static str, Vec<u64>, String)> =
            vec![("attn_norm", vec![e], "{hidden}".into())];
        match lq {
            Some(q) => {
                want.push(("attn_q_a", vec![e, q], "{hidden, q_lora_rank}".into()));
                want.push(("attn_q_a_norm", vec![q], "{q_lora_rank}".into()));
                want.push((
                    "attn_q_b",
                    vec![q, h * (p + r)],
                    "{q_lora_rank, heads·(qk_nope + rope)}: each head [q_nope | q_pe]".into(),
                ));
            }
            None => want.push((
                "attn_q",
                vec![e, h * (p + r)],
                "{hidden, heads·(qk_nope + rope)}: each head [q_nope | q_pe]".into(),
            )),
        }
        want.push((
            "attn_kv_a_mqa",
            vec![e, lkv + r],
            "{hidden, kv_lora_rank + rope}: rows [latent | k_pe]".into(),
        ));
        want.push(("attn_kv_a_norm", vec![lkv], "{kv_lora_rank}".into()));
        if f.tensor(&format!("blk.{l}.attn_kv_b.weight")).is_some() {
            want.push((
                "attn_kv_b",
                vec![lkv, h * (p + dv)],
                "{kv_lora_rank, heads·(qk_nope + v_head_dim)}: each head [k_nope | v]".into(),
            ));
        } else {
            want.push((
                "attn_k_b",
                vec![p, lkv, h],
                "{qk_nope, kv_lora_rank, heads}: W_UK stored transposed (llama.cpp PR #12801)"
                    .into(),
            ));
            want.push((
                "attn_v_b",
                vec![lkv, dv, h],
                "{kv_lora_rank, v_head_dim, heads}".into(),
            ));
        }
        want.push((
            "attn_output",
            vec![h * dv, e],
            "{heads·v_head_dim, hidden}".into(),
        ));
        for (role, ne, formula) in want {
            let found = f
                .tensor(&format!("blk.{l}.{role}.weight"))
                .map(|t| t.ne.clone());
            if found.as_ref() != Some(&ne) {
                bad.entry((role, found)).or_default().push(l);
            }
            expect.entry(role).or_insert((ne, formula));
        }
    }
    for ((role, found), layers) in bad {
        let (want, formula) = &expect[role];
        let first = layers[0];
        let which = if layers.len() == n_layer && n_layer > 1 {
            " (every layer)".to_string()
        } else if layers.len() > 1 {
            let shown: Vec<String> = layers.iter().take(8).map(|l| l.to_string()).collect();
            let more = match layers.len() - shown.len() {
                0 => String::new(),
                n => format!(" and {n} more"),
            };
            format!(" (layers {}{more})", shown.join(", "))
        } else {
            String::new()
        };
        let check = format!("blk.{first}.{role}.weight");
        match found {
            None => out.error(
                &check,
                format!("absent{which}"),
                format!("ne {} {formula}", fmt_ne(want)),
                "the loader refuses the layer without it",
            ),
            Some(ne) => {
                let mut why = format!(
                    "the metadata's dims make it {}; the loader refuses the layer, and a kernel sized by the metadata would misread it",
                    fmt_ne(want)
                );
                if role == "attn_k_b" && ne == [lkv, p, h] && p != lkv {
                    why = format!("it looks untransposed: a writer or reader that skips the converter's transpose mixes the k_nope dims (fault k_b_untransposed); {why}");
                }
                if role == "attn_v_b" && ne == [p, lkv, h] {
                    why = format!("it has attn_k_b's shape: are attn_k_b and attn_v_b swapped (fault kv_b_swap)? {why}");
                }
                out.error(
                    &check,
                    format!("ne {}{which}", fmt_ne(&ne)),
                    format!("ne {} {formula}", fmt_ne(want)),
                    why,
                );
            }
        }
    }
}

/// LongRoPE / rope frequency factor tensors: `rope / 2` finite positive entries, and the context that
/// tells the long ones when to apply.
pub(super) fn rope_factor_tensors(m: &Meta, r: Option<u64>, out: &mut Findings) {
    let names = [
        "rope_factors_short.weight",
        "rope_factors_long.weight",
        "rope_freqs.weight",
    ];
    for n in names {
        let Some(t) = m.f.tensor(n) else { continue };
        let Some(r) = r else { continue };
        match crate::model::weights::load_freq_factors(m.f, n, (r / 2) as usize) {
            Err(_) => out.error(
                n,
                format!("ne {}", fmt_ne(&t.ne)),
                format!("ne {{{}}} (rope / 2)", r / 2),
                "one factor per rotated pair divides that pair's frequency; the loader refuses another length",
            ),
            Ok(v) => {
                if let Some(x) = v.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                    out.error(n, format!("a factor {x}"), "finite, positive factors", "each factor divides a rope frequency");
                }
            }
        }
    }
    if m.f.tensor("rope_factors_long.weight").is_some()
        && !m.k.original_context.present
        && !m.k.context_length.present
    {
        out.error(
            &m.key("context_length"),
            "absent (and no rope.scaling.original_context_length)",
            "the original context",
            "the long LongRoPE factors apply once positions pass the original context; without it nothing says when",
        );
    }
}
