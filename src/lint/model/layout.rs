//! glm5-next's hybrid layer layout and the DSA indexer keys.

use super::meta::Meta;
use crate::lint::Findings;
use crate::model::config::Arch;

/// glm5-next's hybrid layout (`head_count_kv` per block, 0 on a linear-attention layer; llama.cpp's
/// conversion/glm.py `Glm5NextModel`) and its k-pool indexer keys. `None` for every other file.
pub(super) fn glm5_next_layout(
    m: &Meta,
    arch: Arch,
    out: &mut Findings,
) -> Option<crate::model::HybridLayout> {
    let key = m.key("attention.head_count_kv");
    let h = match crate::model::HybridLayout::from_keys(m.f, m.k) {
        Ok(Some(h)) => h,
        Ok(None) => return None,
        Err(d) => {
            out.error(
                &key,
                d.error(m.f).to_string(),
                "one entry per block: 0 (linear attention) or 1 (MLA)",
                "llama.cpp's glm5-next converter writes head_count_kv per block",
            );
            return Some(crate::model::HybridLayout {
                mla_layers: vec![],
                linear_layers: vec![],
                n_head_kv: 1,
            });
        }
    };
    if arch != Arch::Glm5Next {
        out.warning(&key, "a per-layer array", format!("one number for {}", m.arch), "only glm5-next writes head_count_kv per layer; mla-diff reads it as glm5-next's layout");
    }
    out.note(
        &key,
        format!("MLA layers {}", crate::model::config::ranges(&h.mla_layers)),
        h.skip_message()
            .unwrap_or_else(|| "every trunk layer is MLA".into()),
    );
    if arch == Arch::Glm5Next {
        let ik = |k: &str| m.key(&format!("attention.indexer.{k}"));
        match m.get(&m.k.indexer_kpool, out) {
            Some(0) => out.error(
                &ik("kpool"),
                "0",
                "at least 1",
                "the k-pool pools `kpool` keys into one before the indexer's top-k",
            ),
            Some(k) => {
                let tail = m.k.indexer_kpool_select_tail.value.unwrap_or(true);
                out.note(&ik("kpool"), format!("{k}, select tail {tail}"), "glm5-next's DSA indexer scores pools of `kpool` keys (gated softmax pooling with a per-slot APE), expands the chosen pools back to tokens and always selects the visible tail; past top_k `run` attends over the fp64 k-pool selection where the file has the k-pool tensors and checks the optimized k-pool indexer against it, tie-aware on pools; it refuses a file without them unless --allow-dense-beyond-topk");
                super::kpool::kpool_tensors(m, &h.mla_layers, k, out);
            }
            None => out.warning(
                &ik("kpool"),
                "absent",
                "present (16: transformers Glm5NextTextConfig.index_kpool)",
                "llama.cpp's glm5-next converter always writes it",
            ),
        }
        let types = &m.k.indexer_types;
        match &types.value {
            Some(full) => {
                let shared: Vec<usize> = h
                    .mla_layers
                    .iter()
                    .copied()
                    .filter(|&l| full.get(l) == Some(&false))
                    .collect();
                out.note(&ik("types"), if shared.is_empty() { "every MLA layer full".to_string() } else { format!("shared on layers {}", crate::model::config::ranges(&shared)) }, "a shared layer reuses the previous full layer's top-k (transformers indexer_types)");
            }
            None => {
                if let Some(d) = &types.bad_type {
                    super::meta::report(d, out);
                }
            }
        }
    }
    Some(h)
}

/// The DSA indexer of glm-dsa / deepseek32 files.
pub(super) fn dsa(m: &Meta, arch: Arch, out: &mut Findings) {
    if !matches!(arch, Arch::GlmDsa | Arch::Deepseek32) {
        return;
    }
    match m.get(&m.k.indexer_top_k, out) {
        Some(k) => out.note(
            &m.key("attention.indexer.top_k"),
            k.to_string(),
            format!("dense MLA (what mla-diff and llama.cpp before PR #25407 compute) equals the model's DSA only while a query sees at most {k} keys; past it `run` checks the sparse model (indexer + attention over the selection, docs/dsa.md) where the file has the `blk.N.indexer.*` tensors, and refuses a file without them unless --allow-dense-beyond-topk"),
        ),
        None if !m.k.indexer_top_k.present => out.warning(
            &m.key("attention.indexer.top_k"),
            "absent",
            "the lightning indexer's top_k (2048 for GLM-5)",
            "a DSA model attends to its top_k keys only; without the key nothing says where dense attention stops being the model",
        ),
        _ => {}
    }
}
