//! `lint` of a DeepSeek-V4 (`deepseek4`) file: its keys as `V4Config` reads them (the first key it
//! refuses is the error, named), every attention tensor against the shape llama.cpp's loader creates
//! it with, and notes on what the file says (layer kinds, the softmax scale, the catalogue).

use crate::gguf::GgufFile;
use crate::lint::{num, Findings};
use crate::model::catalogue::V4_CATALOGUE;
use crate::model::v4::{LayerKind, V4Config};

fn ne(v: &[usize]) -> String {
    let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("{{{}}}", s.join(", "))
}

pub(super) fn lint(f: &GgufFile, out: &mut Findings) {
    let c = match V4Config::read(f) {
        Ok(c) => c,
        Err(b) => {
            out.error(
                &b.key,
                b.found,
                b.expected,
                format!("{}; no V4 layer can be read without it", b.why),
            );
            return;
        }
    };
    for (name, found, want) in c.tensor_issues(f) {
        let found = match found {
            None => "absent".to_string(),
            Some(t) => ne(&t.iter().map(|&x| x as usize).collect::<Vec<_>>()),
        };
        out.error(
            &name,
            found,
            ne(&want),
            "llama.cpp's deepseek4 loader creates the tensor with this shape from the keys and refuses the file otherwise",
        );
    }
    let count = |k: LayerKind| c.kinds.iter().filter(|&&x| x == k).count();
    out.note(
        "layers",
        format!(
            "{} layers: {} window-only, {} CSA (ratio 4, indexer top_k {}), {} HCA (ratio 128); sliding window {}",
            c.n_layer,
            count(LayerKind::Window),
            count(LayerKind::Csa),
            c.indexer.top_k,
            count(LayerKind::Hca),
            c.sliding_window
        ),
        "each layer attends to its window and, on CSA/HCA layers, to entries pooled from closed windows of ratio tokens (docs/deepseek-v4.md)",
    );
    out.note(
        "softmax_scale",
        format!(
            "{} = 1 / sqrt(head_dim {})",
            num(c.softmax_scale),
            c.head_dim
        ),
        "on every layer kind, no mscale; the per-head sink logit is in the denominator only",
    );
    out.note(
        "head_dims",
        format!(
            "heads {} over one K = V head of {} = nope {} + rope {} (trailing, interleaved pairs); cache row {}",
            c.n_head,
            c.head_dim,
            c.nope_dim(),
            c.rope_dim,
            c.head_dim
        ),
        "not latent MLA: no kv_b to absorb; V carries rope, de-rotated after attention",
    );
    let dims = (
        c.n_head,
        c.head_dim,
        c.rope_dim,
        c.q_lora_rank,
        c.o_groups,
        c.o_lora_rank,
    );
    match V4_CATALOGUE.iter().find(|m| m.dims() == dims) {
        Some(m) => out.note(
            "catalogue",
            m.name.to_string(),
            "the attention dims of this known model",
        ),
        None => out.note(
            "catalogue",
            "no known V4 model".to_string(),
            format!(
                "heads, head_dim, rope, q_lora, o_groups, o_lora = {dims:?}; known: {}",
                V4_CATALOGUE
                    .iter()
                    .map(|m| format!("{} {:?}", m.name, m.dims()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    }
}
