//! Dims: the required keys, the head-size keys, the tensors' votes, each layer's tensor shapes. One
//! function per check, called in the order the findings are reported (the report keeps that order).

use super::layout::glm5_next_layout;
use super::meta::{resolve, Meta, Votes};
use super::tensors::{rope_factor_tensors, tensors};
use super::DIM_LIMIT;
use crate::lint::{Findings, Severity};
use crate::model::config::Arch;
use crate::model::HybridLayout;

/// The dims as the metadata keys state them (before the tensors vote), read in the loader's order.
struct Keys {
    e: Option<u64>,
    h: Option<u64>,
    lkv: Option<u64>,
    r: Option<u64>,
    lq: Option<u64>,
    h_kv: Option<u64>,
    k_len: Option<u64>,
    v_len: Option<u64>,
    /// The per-head qk and v dims and the keys they come from (the `*_mla` pair or the plain ones).
    heads: HeadDims,
    hybrid: Option<HybridLayout>,
}

/// The per-head dims as the loader read them, and the keys they come from.
struct HeadDims {
    qk: Option<u64>,
    v: Option<u64>,
    mla: bool,
    qk_key: String,
    v_key: String,
}

/// The dims resolved against the tensors (theirs where they agree, else the keys').
struct Resolved {
    e: Option<u64>,
    h: Option<u64>,
    lkv: Option<u64>,
    r: Option<u64>,
    lq: Option<u64>,
    p: Option<u64>,
    dv: Option<u64>,
}

/// The first round of the tensors' votes (what needs no resolved dim).
#[derive(Default)]
struct TensorVotes {
    e: Votes,
    h: Votes,
    lq: Votes,
    lkv: Votes,
    p: Votes,
    dv: Votes,
}

fn layer_tensor(l: usize, role: &str) -> String {
    format!("blk.{l}.{role}.weight")
}

pub(super) fn dims(m: &Meta, arch: Arch, out: &mut Findings) {
    let n_layer = layer_count(m, out);
    let k = keys(m, arch, out);
    plausible(m, &k, out);
    let d = resolved(m, &k, n_layer, out);
    head_rules(m, &k, out);
    cache_row(m, arch, &k, &d, out);
    // Each layer's tensors against the resolved dims (implausible dims were reported above, and would
    // overflow the products).
    if let (Some(e), Some(h), Some(lkv), Some(p), Some(r), Some(dv)) =
        (d.e, d.h, d.lkv, d.p, d.r, d.dv)
    {
        if [e, h, lkv, p, r, dv, d.lq.unwrap_or(0)]
            .iter()
            .all(|&d| d <= DIM_LIMIT)
        {
            let skip = k.hybrid.map(|h| h.linear_layers).unwrap_or_default();
            tensors(m.f, n_layer, &skip, [e, h, lkv, p, r, dv], d.lq, out);
        }
    }
    rope_factor_tensors(m, d.r, out);
}

/// The trunk's layer count: block_count less the appended NextN/MTP blocks; 0 when the keys cannot
/// say (the layer loops then do not run).
fn layer_count(m: &Meta, out: &mut Findings) -> usize {
    let block_count = m.required(&m.k.block_count, out);
    let nextn = m.get(&m.k.nextn_predict_layers, out).unwrap_or(0);
    let n_layer = match block_count {
        Some(_) if m.loader_rule("no_trunk", out) => 0,
        Some(_) if m.loader_rule_on("zero", &m.k.block_count.key, out) => 0,
        Some(b) => (b - nextn) as usize,
        None => 0,
    };
    // Every layer has its own attention tensors: a count past the tensors is a corrupt header, and
    // must not drive a loop over layers.
    let n_layer = if m.loader_rule("layers_past_tensors", out) {
        0
    } else {
        n_layer
    };
    if nextn > 0 && n_layer > 0 {
        out.note(
            &m.key("nextn_predict_layers"),
            format!("{nextn}: layers 0..{n_layer} are the trunk"),
            "the appended NextN/MTP block is no layer of the model's forward (llama.cpp n_layer(), transformers); lint and run check the trunk",
        );
    }
    n_layer
}

/// The dim keys, each read once (a key of the wrong type is reported at its read).
fn keys(m: &Meta, arch: Arch, out: &mut Findings) -> Keys {
    let k = m.k;
    let e = m.required(&k.embedding_length, out);
    let h = m.required(&k.head_count, out);
    let lkv = m.required(&k.kv_lora_rank, out);
    let r = m.required(&k.rope_dim, out);
    let lq = m.get(&k.q_lora_rank, out).filter(|&r| r > 0);
    let hybrid = glm5_next_layout(m, arch, out);
    let h_kv = match &hybrid {
        Some(h) => Some(h.n_head_kv as u64),
        None => m.get(&k.head_count_kv, out),
    };
    m.get(&k.key_length_mla, out);
    m.get(&k.value_length_mla, out);
    let (k_len, v_len) = (m.get(&k.key_length, out), m.get(&k.value_length, out));
    let heads = head_dims(m, out);
    Keys {
        e,
        h,
        lkv,
        r,
        lq,
        h_kv,
        k_len,
        v_len,
        heads,
        hybrid,
    }
}

/// The per-head dims as the loader read them (`loader::Heads`: the `*_mla` pair, else the plain keys
/// or hidden/heads); one of the pair without the other is the loader's `mla_pair`.
fn head_dims(m: &Meta, out: &mut Findings) -> HeadDims {
    let h = m.d.heads;
    let key = |mla: &str, plain: &str| m.key(if h.mla { mla } else { plain });
    if h.mla {
        // Both present but one of the wrong type was reported as such already.
        m.loader_rule("mla_pair", out);
    }
    HeadDims {
        qk: h.qk.map(|x| x as u64),
        v: h.v.map(|x| x as u64),
        mla: h.mla,
        qk_key: key("attention.key_length_mla", "attention.key_length"),
        v_key: key("attention.value_length_mla", "attention.value_length"),
    }
}

/// Zero and implausible dims: the loader's `zero` and `limit` rules, in the keys' order (a zero value
/// head is reported with the head rules).
fn plausible(m: &Meta, k: &Keys, out: &mut Findings) {
    for key in [
        m.key("embedding_length"),
        m.key("attention.head_count"),
        m.key("attention.kv_lora_rank"),
    ] {
        let _ = m.loader_rule_on("zero", &key, out) || m.loader_rule_on("limit", &key, out);
    }
    for key in [
        m.key("attention.q_lora_rank"),
        m.key("attention.head_count_kv"),
        m.key("rope.dimension_count"),
        k.heads.qk_key.clone(),
        k.heads.v_key.clone(),
    ] {
        m.loader_rule_on("limit", &key, out);
    }
}

/// The first round of votes, over every trunk layer: what each tensor's shape says of each dim.
fn first_votes(m: &Meta, n_layer: usize) -> TensorVotes {
    let ne = |l: usize, role: &str| m.f.tensor(&layer_tensor(l, role)).map(|t| t.ne.clone());
    let mut v = TensorVotes::default();
    for l in 0..n_layer {
        if let Some([x]) = ne(l, "attn_norm").as_deref() {
            v.e.add(*x, "attn_norm");
        }
        if let Some([x, y]) = ne(l, "attn_q_a").as_deref() {
            v.e.add(*x, "attn_q_a");
            v.lq.add(*y, "attn_q_a");
        }
        if let Some([x]) = ne(l, "attn_q_a_norm").as_deref() {
            v.lq.add(*x, "attn_q_a_norm");
        }
        if let Some([x, _]) = ne(l, "attn_q_b").as_deref() {
            v.lq.add(*x, "attn_q_b");
        }
        if let Some([x, _]) = ne(l, "attn_q").as_deref() {
            v.e.add(*x, "attn_q");
        }
        if let Some([x, _]) = ne(l, "attn_kv_a_mqa").as_deref() {
            v.e.add(*x, "attn_kv_a_mqa");
        }
        if let Some([x]) = ne(l, "attn_kv_a_norm").as_deref() {
            v.lkv.add(*x, "attn_kv_a_norm");
        }
        if let Some([x, _]) = ne(l, "attn_kv_b").as_deref() {
            v.lkv.add(*x, "attn_kv_b");
        }
        if let Some([p, lkv, h]) = ne(l, "attn_k_b").as_deref() {
            v.p.add(*p, "attn_k_b");
            v.lkv.add(*lkv, "attn_k_b");
            v.h.add(*h, "attn_k_b");
        }
        if let Some([lkv, dv, h]) = ne(l, "attn_v_b").as_deref() {
            v.lkv.add(*lkv, "attn_v_b");
            v.dv.add(*dv, "attn_v_b");
            v.h.add(*h, "attn_v_b");
        }
        if let Some([_, x]) = ne(l, "attn_output").as_deref() {
            v.e.add(*x, "attn_output");
        }
    }
    v
}

/// The keys against the tensors' votes, in rounds: what needs a resolved dim (the rope from the
/// kv_a width less the latent, qk_nope from the q width over the heads) votes after it.
fn resolved(m: &Meta, k: &Keys, n_layer: usize, out: &mut Findings) -> Resolved {
    let ne = |l: usize, role: &str| m.f.tensor(&layer_tensor(l, role)).map(|t| t.ne.clone());
    let mut v = first_votes(m, n_layer);
    let e = resolve(k.e, &v.e, &m.key("embedding_length"), n_layer, out);
    let h = resolve(k.h, &v.h, &m.key("attention.head_count"), n_layer, out);
    let lkv = resolve(
        k.lkv,
        &v.lkv,
        &m.key("attention.kv_lora_rank"),
        n_layer,
        out,
    );
    // The second round: what needs the first round's dims.
    let mut r_v = Votes::default();
    for l in 0..n_layer {
        if let (Some([_, w]), Some(lkv)) = (ne(l, "attn_kv_a_mqa").as_deref(), lkv) {
            if *w > lkv {
                r_v.add(w - lkv, "attn_kv_a_mqa");
            }
        }
        if let (Some([hdv, _]), Some(h)) = (ne(l, "attn_output").as_deref(), h) {
            if h > 0 && hdv % h == 0 {
                v.dv.add(hdv / h, "attn_output");
            }
        }
    }
    let r = resolve(k.r, &r_v, &m.key("rope.dimension_count"), n_layer, out);
    let lq = q_lora(m, k.lq, &v.lq, n_layer, out);
    // p from the q projection too (legacy and MiniCPM3 files have no attn_k_b): heads·(p + r) wide.
    for l in 0..n_layer {
        for role in ["attn_q_b", "attn_q"] {
            if let (Some([_, w]), Some(h), Some(r)) = (ne(l, role).as_deref(), h, r) {
                if h > 0 && w % h == 0 && w / h > r {
                    v.p.add(
                        w / h - r,
                        if role == "attn_q" {
                            "attn_q"
                        } else {
                            "attn_q_b"
                        },
                    );
                }
            }
        }
    }
    let p = qk_nope(m, k, &v.p, r, out);
    let dv = v_head(m, &k.heads, &v.dv, out);
    Resolved {
        e,
        h,
        lkv,
        r,
        lq,
        p,
        dv,
    }
}

/// q-LoRA: the rank key against which projection the layers hold.
fn q_lora(
    m: &Meta,
    lq_meta: Option<u64>,
    lq_v: &Votes,
    n_layer: usize,
    out: &mut Findings,
) -> Option<u64> {
    let has_all = |role: &str| {
        n_layer > 0 && (0..n_layer).all(|l| m.f.tensor(&layer_tensor(l, role)).is_some())
    };
    match (lq_meta, lq_v.unanimous()) {
        (Some(q), None) if has_all("attn_q") && !has_all("attn_q_a") => {
            out.error(
                &m.key("attention.q_lora_rank"),
                q.to_string(),
                "absent or 0",
                "the layers hold a plain attn_q and no attn_q_a/attn_q_b: the loader looks for q-LoRA tensors that are not there",
            );
            None
        }
        (None, Some(v)) => {
            out.error(
                &m.key("attention.q_lora_rank"),
                "absent",
                v.to_string(),
                format!("the layers hold q-LoRA tensors ({}) of rank {v}: without the key the loader looks for a plain attn_q", lq_v.roles()),
            );
            Some(v)
        }
        _ => resolve(lq_meta, lq_v, &m.key("attention.q_lora_rank"), n_layer, out),
    }
}

/// qk_nope: the tensors' vote, else the qk key less the rope.
fn qk_nope(m: &Meta, k: &Keys, p_v: &Votes, r: Option<u64>, out: &mut Findings) -> Option<u64> {
    let (qk_meta, mla) = (k.heads.qk, k.heads.mla);
    let p_meta = match (qk_meta, r.or(k.r)) {
        (Some(qk), Some(r)) => qk.checked_sub(r),
        _ => None,
    };
    let qk_present = if mla {
        m.k.key_length_mla.present
    } else {
        m.k.key_length.present
    };
    let qk_found = |qk: Option<u64>| match (qk, mla) {
        (Some(v), _) if qk_present => v.to_string(),
        (Some(v), false) => format!("absent (hidden/heads = {v})"),
        _ => "absent".to_string(),
    };
    // The key holds qk_nope + rope: compare it with the tensors' qk_nope plus the resolved rope (a wrong
    // rope key was reported on its own; it does not make a right key_length_mla look wrong).
    match (p_v.unanimous(), qk_meta, r) {
        (Some(pt), Some(qk), Some(rr)) if pt.saturating_add(rr) != qk => {
            out.error(
                &k.heads.qk_key,
                qk_found(qk_meta),
                pt.saturating_add(rr).to_string(),
                format!(
                    "the per-head qk dim is qk_nope + rope: the tensors ({}) hold qk_nope {pt} and rope {rr}; the softmax scale 1/sqrt(qk) and every per-head stride follow from this key",
                    p_v.roles()
                ),
            );
            Some(pt)
        }
        (Some(pt), _, _) => Some(pt),
        (None, _, _) => p_meta,
    }
}

/// v_head_dim: the tensors' vote against the value key.
fn v_head(m: &Meta, heads: &HeadDims, dv_v: &Votes, out: &mut Findings) -> Option<u64> {
    let (v_meta, mla) = (heads.v, heads.mla);
    match (dv_v.unanimous(), v_meta) {
        (Some(vt), Some(vm)) if vt != vm => {
            let present = if mla {
                m.k.value_length_mla.present
            } else {
                m.k.value_length.present
            };
            let found = if present {
                vm.to_string()
            } else {
                format!("absent (hidden/heads = {vm})")
            };
            out.error(
                &heads.v_key,
                found,
                vt.to_string(),
                format!(
                    "the tensors ({}) hold v_head_dim {vt}: a kernel that strides V or o_proj by {vm} misreads every head (fault head_stride_qk)",
                    dv_v.roles()
                ),
            );
            Some(vt)
        }
        (Some(vt), _) => Some(vt),
        (None, vm) => vm,
    }
}

/// The head-size rules on the metadata itself (what an engine reads): the loader's `rope_dims` (unless
/// the rope key is blamed already) and `zero` on the value head.
fn head_rules(m: &Meta, k: &Keys, out: &mut Findings) {
    let rope = m.key("rope.dimension_count");
    if !out.has(Severity::Error, &rope) {
        m.loader_rule_on("rope_dims", &rope, out);
    }
    m.loader_rule_on("zero", &k.heads.v_key, out);
}

/// The cache row by the resolved dims: a wrong kv_lora_rank key is reported once, above, and does
/// not make a right key_length look wrong.
fn cache_row(m: &Meta, arch: Arch, k: &Keys, d: &Resolved, out: &mut Findings) {
    if let (Some(lkv), Some(r), Some(qk)) = (d.lkv.or(k.lkv), d.r.or(k.r), k.heads.qk) {
        let row = lkv.saturating_add(r);
        if k.heads.mla {
            mqa_keys(m, k, lkv, row, out);
        } else {
            legacy_keys(m, arch, k, qk, row, out);
        }
    }
}

/// New-style files expose MLA as MQA: one KV head whose key is the cache row.
fn mqa_keys(m: &Meta, k: &Keys, lkv: u64, row: u64, out: &mut Findings) {
    for (r, found, want, why) in [
        (&m.k.key_length, k.k_len, row, format!("MLA as MQA: the key of the one KV head is the latent cache row [latent | k_pe] = kv_lora_rank + rope = {row}; llama.cpp sizes the cache rows from it")),
        (&m.k.value_length, k.v_len, lkv, format!("MLA as MQA: the value is the latent, kv_lora_rank = {lkv} wide; llama.cpp sizes the value view from it")),
        (&m.k.head_count_kv, k.h_kv, 1, "MLA as MQA: one latent row per token shared by every head; llama.cpp sizes the cache by head_count_kv × key_length".to_string()),
    ] {
        match found {
            Some(x) if x != want => out.error(&r.key, x.to_string(), want.to_string(), why),
            None if !r.present => out.warning(
                &r.key,
                "absent",
                want.to_string(),
                format!("the converter writes it; without it llama.cpp falls back to hidden/heads or head_count. {why}"),
            ),
            _ => {}
        }
    }
}

/// A legacy file (no `*_mla` keys): per-head keys, head_count_kv = head_count.
fn legacy_keys(m: &Meta, arch: Arch, k: &Keys, qk: u64, row: u64, out: &mut Findings) {
    if qk == row {
        out.error(
            &k.heads.qk_key,
            qk.to_string(),
            format!("qk_nope + rope, or the key_length_mla / value_length_mla pair (here key_length equals kv_lora_rank + rope = {row})"),
            "a new-style MLA file missing its *_mla keys (made for llama.cpp PR #11446?): the per-head dims cannot be told, and the loader refuses it",
        );
    }
    if let (Some(hk), Some(h)) = (k.h_kv, k.h) {
        if hk != h {
            out.warning(
                &m.key("attention.head_count_kv"),
                hk.to_string(),
                h.to_string(),
                "a legacy MLA file (no *_mla keys) stores head_count_kv = head_count, as the converter did before PR #12801; another value says the file is neither layout",
            );
        }
    }
    if k.v_len.is_none() && !m.k.value_length.present && arch != Arch::Minicpm3 {
        out.warning(
            &m.key("attention.value_length"),
            format!("absent (hidden/heads = {})", k.heads.v.map(|v| v.to_string()).unwrap_or("?".into())),
            "present",
            "only the MiniCPM3 converter leaves it out; llama.cpp and mla-diff then take hidden/heads as the value head dim",
        );
    }
}
