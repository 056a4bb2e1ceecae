//! glm5-next's k-pool tensors: each full MLA layer's `indexer_compressor_gate` (ne `{hidden, Di}`) and
//! `indexer_compressor_ape` (ne `{Di, kpool}`), as llama.cpp's converter writes them (`model::kpool`).

use super::meta::{fmt_ne, Meta};
use crate::lint::Findings;
use std::collections::BTreeMap;

/// One finding per tensor role and problem (absent, or each wrong shape), naming the layers. A layer
/// has a k-pool when it has any of GLM-5's `blk.N.indexer.*` tensors (a shared layer has none).
pub(super) fn kpool_tensors(m: &Meta, mla_layers: &[usize], kpool: u64, out: &mut Findings) {
    let (Some(e), Some(di)) = (m.k.embedding_length.value, m.k.indexer_key_length.value) else {
        return;
    };
    let roles = [
        ("indexer_compressor_gate", vec![e, di], "{hidden, indexer.key_length}: torch [Di, E], the per-token gate scores attn_in·gateᵀ"),
        ("indexer_compressor_ape", vec![di, kpool], "{indexer.key_length, indexer.kpool}: torch [kpool, Di], one learned offset per slot of a pool"),
    ];
    let mut bad: BTreeMap<(usize, Option<Vec<u64>>), Vec<usize>> = BTreeMap::new();
    for &l in mla_layers {
        let indexed = crate::model::indexer::tensor_names(l)
            .iter()
            .any(|n| m.f.tensor(n).is_some());
        for (i, (role, ne, _)) in roles.iter().enumerate() {
            let found =
                m.f.tensor(&format!("blk.{l}.{role}.weight"))
                    .map(|t| t.ne.clone());
            if (indexed || found.is_some()) && found.as_ref() != Some(ne) {
                bad.entry((i, found)).or_default().push(l);
            }
        }
    }
    for ((i, found), layers) in bad {
        let (role, want, formula) = &roles[i];
        let which = format!(" on layers {}", crate::model::config::ranges(&layers));
        let check = format!("blk.N.{role}.weight");
        let (found, why) = match found {
            None => (
                format!("absent{which}"),
                "the layer has the DSA indexer's tensors; glm5-next's indexer pools its keys with the gate and APE, and the loader refuses the layer without them".to_string(),
            ),
            Some(ne) => (
                format!("ne {}{which}", fmt_ne(&ne)),
                format!("the metadata's dims make it {}; the loader refuses the layer", fmt_ne(want)),
            ),
        };
        out.error(&check, found, format!("ne {} {formula}", fmt_ne(want)), why);
    }
}
