//! The file side of `lint`: the metadata against the file's own tensors, against the conventions the
//! loader and the reference follow (docs/conventions.md, `MlaConfig::from_gguf`), and against the
//! catalogue of known models (`model::catalogue`).
//!
//! The checks read the metadata themselves, tolerating what the loader refuses, so that each problem
//! becomes a finding naming its key instead of the loader's first error; the loader is then asked
//! too, and a file it refuses never lints clean.

use super::{num, Findings, Severity};
use crate::error::{quote, Error, Result};
use crate::gguf::{GgufFile, Value};
use crate::model::catalogue::{Preset, CATALOGUE};
use crate::model::config::{Arch, RopePairing, Yarn};
use crate::model::MlaConfig;
use std::collections::{BTreeMap, BTreeSet};

/// What the other sides of the lint need from the file.
pub struct Facts {
    /// The config as the loader reads it; `None` when the loader refuses the file (the runner and
    /// kernel sides then have no dims to work from).
    pub cfg: Option<MlaConfig>,
}

/// Bounds of a plausible RMSNorm eps: every MLA model uses 1e-6 or 1e-5.
const EPS_RANGE: (f64, f64) = (1e-7, 1e-3);
/// The largest plausible `mscale_all_dim` (released models: 1.0 and 0.707); a value past it is most
/// likely the HF number stored without the converter's ×0.1.
const MSCALE_ALL_DIM_MAX: f64 = 2.0;
/// Dims above this are implausible (the loader's bound).
const DIM_LIMIT: u64 = 1 << 20;

/// Typed access to the architecture's keys; a key of the wrong type is reported once, then absent.
struct Meta<'a> {
    f: &'a GgufFile,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn raw(&self, k: &str) -> Option<&Value> {
        self.f.get(&self.key(k))
    }
    fn present(&self, k: &str) -> bool {
        self.raw(k).is_some()
    }
    fn typed<T>(
        &self,
        k: &str,
        what: &str,
        conv: impl Fn(&Value) -> Option<T>,
        out: &mut Findings,
    ) -> Option<T> {
        let v = self.raw(k)?;
        let r = conv(v);
        if r.is_none() {
            out.error(
                &self.key(k),
                v.display_short(),
                what,
                "llama.cpp and mla-diff read this key as that type and refuse the file otherwise",
            );
        }
        r
    }
    fn uint(&self, k: &str, out: &mut Findings) -> Option<u64> {
        self.typed(k, "an unsigned integer", |v| v.as_u64(), out)
    }
    fn float(&self, k: &str, out: &mut Findings) -> Option<f64> {
        self.typed(k, "a number", |v| v.as_f64(), out)
    }
    fn string(&self, k: &str, out: &mut Findings) -> Option<String> {
        self.typed(k, "a string", |v| v.as_str().map(str::to_string), out)
    }
    /// A key the loader requires: absent is an error.
    fn required(&self, k: &str, out: &mut Findings) -> Option<u64> {
        if !self.present(k) {
            out.error(
                &self.key(k),
                "absent",
                "present",
                "the loader (and llama.cpp) refuse an MLA file without it",
            );
            return None;
        }
        self.uint(k, out)
    }
}

/// Tensor-shape votes for one dim: value → the tensors that say so.
#[derive(Default)]
struct Votes(BTreeMap<u64, BTreeSet<&'static str>>);

impl Votes {
    fn add(&mut self, v: u64, role: &'static str) {
        self.0.entry(v).or_default().insert(role);
    }
    /// The value every tensor that determines the dim agrees on.
    fn unanimous(&self) -> Option<u64> {
        (self.0.len() == 1).then(|| *self.0.keys().next().unwrap())
    }
    fn roles(&self) -> String {
        let all: BTreeSet<&str> = self.0.values().flatten().copied().collect();
        all.into_iter().collect::<Vec<_>>().join(", ")
    }
}

fn fmt_ne(ne: &[u64]) -> String {
    format!(
        "{{{}}}",
        ne.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// A metadata dim against the tensors' unanimous vote: the resolved value (the tensors' when they
/// agree, else the key's) and, when they disagree with the key, an error on the key.
fn resolve(
    meta: Option<u64>,
    votes: &Votes,
    key: &str,
    n_layer: usize,
    out: &mut Findings,
) -> Option<u64> {
    match (votes.unanimous(), meta) {
        (Some(v), Some(m)) if v != m => {
            out.error(
                key,
                m.to_string(),
                v.to_string(),
                format!(
                    "the file's own tensors ({} of all {n_layer} layers) are shaped for {v}: the loader refuses the file at its first layer, and a kernel or engine sized by the key reads {m}-wide rows",
                    votes.roles()
                ),
            );
            Some(v)
        }
        (Some(v), _) => Some(v),
        (None, m) => m,
    }
}

/// The file side of the lint. `Err` only when the file is no MLA model at all (exit 2, as `run`).
pub fn lint(f: &GgufFile, out: &mut Findings) -> Result<Facts> {
    let arch_name = f.architecture().ok_or_else(|| {
        Error::Unsupported(format!(
            "{}: general.architecture is missing",
            f.path.display()
        ))
    })?;
    let arch = Arch::from_gguf(arch_name).ok_or_else(|| {
        let known: Vec<&str> = Arch::ALL.iter().map(|(n, _)| *n).collect();
        Error::Unsupported(format!(
            "{}: architecture {} does not use Multi-head Latent Attention (MLA architectures: {})",
            f.path.display(),
            quote(arch_name),
            known.join(", ")
        ))
    })?;
    let m = Meta { f, arch: arch_name };
    dims(&m, arch, out);
    rope_and_scaling(&m, arch, out);
    norms(&m, out);
    dsa(&m, arch, out);
    let cfg = match MlaConfig::from_gguf(f) {
        Ok(c) => Some(c),
        Err(e) => {
            // Never lint clean a file the loader refuses: its reason is the finding when no other
            // check explained it.
            if out.count(Severity::Error) == 0 {
                out.error(
                    "loader",
                    e.to_string(),
                    "a file MlaConfig::from_gguf accepts",
                    "the loader refuses the file, so no run reaches its layers",
                );
            }
            None
        }
    };
    if let Some(c) = &cfg {
        scale_notes(c, out);
        catalogue(&m, c, out);
    }
    Ok(Facts { cfg })
}

/// Dims: required keys, head-size keys, the tensors' votes, each layer's tensor shapes.
fn dims(m: &Meta, arch: Arch, out: &mut Findings) {
    let f = m.f;
    let block_count = m.required("block_count", out);
    let nextn = m.uint("nextn_predict_layers", out).unwrap_or(0);
    let n_layer = match block_count {
        Some(b) if nextn > 0 && nextn >= b => {
            out.error(
                &m.key("nextn_predict_layers"),
                nextn.to_string(),
                format!("fewer than block_count {b}"),
                "the NextN/MTP blocks come after the trunk; none would be left",
            );
            0
        }
        Some(0) => {
            out.error(
                &m.key("block_count"),
                "0",
                "at least 1",
                "a model without layers",
            );
            0
        }
        Some(b) => (b - nextn) as usize,
        None => 0,
    };
    // Every layer has its own attention tensors: a count past the tensors is a corrupt header, and
    // must not drive a loop over layers.
    let n_layer = if n_layer > f.tensors.len() {
        out.error(
            &m.key("block_count"),
            block_count.unwrap_or(0).to_string(),
            format!("at most the {} tensors the file has", f.tensors.len()),
            "every layer needs its own attention tensors",
        );
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

    let e_meta = m.required("embedding_length", out);
    let h_meta = m.required("attention.head_count", out);
    let lkv_meta = m.required("attention.kv_lora_rank", out);
    let r_meta = m.required("rope.dimension_count", out);
    let lq_meta = m.uint("attention.q_lora_rank", out).filter(|&r| r > 0);
    let hybrid = glm5_next_layout(m, arch, out);
    let h_kv = match &hybrid {
        Some(h) => Some(h.n_head_kv as u64),
        None => m.uint("attention.head_count_kv", out),
    };
    let (k_mla, v_mla) = (
        m.uint("attention.key_length_mla", out),
        m.uint("attention.value_length_mla", out),
    );
    let (k_len, v_len) = (
        m.uint("attention.key_length", out),
        m.uint("attention.value_length", out),
    );
    let default_head = match (e_meta, h_meta) {
        (Some(e), Some(h)) if h > 0 && e % h == 0 => Some(e / h),
        _ => None,
    };
    // (qk, v, mla keys, key names); the loader's rule.
    let (qk_meta, v_meta, mla, qk_key, v_key) = match (k_mla, v_mla) {
        (Some(k), Some(v)) => (
            Some(k),
            Some(v),
            true,
            m.key("attention.key_length_mla"),
            m.key("attention.value_length_mla"),
        ),
        (None, None)
            if !m.present("attention.key_length_mla")
                && !m.present("attention.value_length_mla") =>
        {
            (
                k_len.or(default_head),
                v_len.or(default_head),
                false,
                m.key("attention.key_length"),
                m.key("attention.value_length"),
            )
        }
        _ => {
            let (kp, vp) = (
                m.present("attention.key_length_mla"),
                m.present("attention.value_length_mla"),
            );
            let one = if kp {
                "key_length_mla"
            } else {
                "value_length_mla"
            };
            // Both present but one of the wrong type was reported as such already.
            if kp != vp {
                out.error(
                &m.key(&format!("attention.{one}")),
                "present without its pair",
                "both attention.key_length_mla and attention.value_length_mla, or neither",
                "llama.cpp takes the per-head dims from the pair; with one of them the loader cannot tell the head dims",
            );
            }
            (
                k_mla,
                v_mla,
                true,
                m.key("attention.key_length_mla"),
                m.key("attention.value_length_mla"),
            )
        }
    };

    // Zero and implausible dims, as the loader refuses them.
    for (k, v, zero_ok) in [
        (m.key("embedding_length"), e_meta, false),
        (m.key("attention.head_count"), h_meta, false),
        (m.key("attention.kv_lora_rank"), lkv_meta, false),
        (m.key("attention.q_lora_rank"), lq_meta, true),
        (m.key("attention.head_count_kv"), h_kv, true),
        (m.key("rope.dimension_count"), r_meta, true),
        (qk_key.clone(), qk_meta, true),
        (v_key.clone(), v_meta, true),
    ] {
        match v {
            Some(0) if !zero_ok => out.error(&k, "0", "at least 1", "zero-sized attention"),
            Some(x) if x > DIM_LIMIT => out.error(
                &k,
                x.to_string(),
                format!("at most {DIM_LIMIT}"),
                "implausible: the loader refuses it before allocating",
            ),
            _ => {}
        }
    }

    // Votes of the tensors, over every trunk layer.
    let name = |l: usize, role: &str| format!("blk.{l}.{role}.weight");
    let ne = |l: usize, role: &str| f.tensor(&name(l, role)).map(|t| t.ne.clone());
    let (mut e_v, mut h_v, mut lq_v) = (Votes::default(), Votes::default(), Votes::default());
    let (mut lkv_v, mut p_v, mut dv_v) = (Votes::default(), Votes::default(), Votes::default());
    let mut r_v = Votes::default();
    for l in 0..n_layer {
        if let Some([x]) = ne(l, "attn_norm").as_deref() {
            e_v.add(*x, "attn_norm");
        }
        if let Some([x, y]) = ne(l, "attn_q_a").as_deref() {
            e_v.add(*x, "attn_q_a");
            lq_v.add(*y, "attn_q_a");
        }
        if let Some([x]) = ne(l, "attn_q_a_norm").as_deref() {
            lq_v.add(*x, "attn_q_a_norm");
        }
        if let Some([x, _]) = ne(l, "attn_q_b").as_deref() {
            lq_v.add(*x, "attn_q_b");
        }
        if let Some([x, _]) = ne(l, "attn_q").as_deref() {
            e_v.add(*x, "attn_q");
        }
        if let Some([x, _]) = ne(l, "attn_kv_a_mqa").as_deref() {
            e_v.add(*x, "attn_kv_a_mqa");
        }
        if let Some([x]) = ne(l, "attn_kv_a_norm").as_deref() {
            lkv_v.add(*x, "attn_kv_a_norm");
        }
        if let Some([x, _]) = ne(l, "attn_kv_b").as_deref() {
            lkv_v.add(*x, "attn_kv_b");
        }
        if let Some([p, lkv, h]) = ne(l, "attn_k_b").as_deref() {
            p_v.add(*p, "attn_k_b");
            lkv_v.add(*lkv, "attn_k_b");
            h_v.add(*h, "attn_k_b");
        }
        if let Some([lkv, dv, h]) = ne(l, "attn_v_b").as_deref() {
            lkv_v.add(*lkv, "attn_v_b");
            dv_v.add(*dv, "attn_v_b");
            h_v.add(*h, "attn_v_b");
        }
        if let Some([_, x]) = ne(l, "attn_output").as_deref() {
            e_v.add(*x, "attn_output");
        }
    }
    let e = resolve(e_meta, &e_v, &m.key("embedding_length"), n_layer, out);
    let h = resolve(h_meta, &h_v, &m.key("attention.head_count"), n_layer, out);
    let lkv = resolve(
        lkv_meta,
        &lkv_v,
        &m.key("attention.kv_lora_rank"),
        n_layer,
        out,
    );
    // The second round: what needs the first round's dims.
    for l in 0..n_layer {
        if let (Some([_, w]), Some(lkv)) = (ne(l, "attn_kv_a_mqa").as_deref(), lkv) {
            if *w > lkv {
                r_v.add(w - lkv, "attn_kv_a_mqa");
            }
        }
        if let (Some([hdv, _]), Some(h)) = (ne(l, "attn_output").as_deref(), h) {
            if h > 0 && hdv % h == 0 {
                dv_v.add(hdv / h, "attn_output");
            }
        }
    }
    let r = resolve(r_meta, &r_v, &m.key("rope.dimension_count"), n_layer, out);
    // q-LoRA: the rank key against which projection the layers hold.
    let has_all =
        |role: &str| n_layer > 0 && (0..n_layer).all(|l| f.tensor(&name(l, role)).is_some());
    let lq = match (lq_meta, lq_v.unanimous()) {
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
        _ => resolve(
            lq_meta,
            &lq_v,
            &m.key("attention.q_lora_rank"),
            n_layer,
            out,
        ),
    };
    // p from the q projection too (legacy and MiniCPM3 files have no attn_k_b): heads·(p + r) wide.
    for l in 0..n_layer {
        for role in ["attn_q_b", "attn_q"] {
            if let (Some([_, w]), Some(h), Some(r)) = (ne(l, role).as_deref(), h, r) {
                if h > 0 && w % h == 0 && w / h > r {
                    p_v.add(
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
    let p_meta = match (qk_meta, r.or(r_meta)) {
        (Some(qk), Some(r)) => qk.checked_sub(r),
        _ => None,
    };
    let qk_found = |qk: Option<u64>| match (qk, mla) {
        (Some(v), _)
            if m.present(if mla {
                "attention.key_length_mla"
            } else {
                "attention.key_length"
            }) =>
        {
            v.to_string()
        }
        (Some(v), false) => format!("absent (hidden/heads = {v})"),
        _ => "absent".to_string(),
    };
    // The key holds qk_nope + rope: compare it with the tensors' qk_nope plus the resolved rope (a wrong
    // rope key was reported on its own; it does not make a right key_length_mla look wrong).
    let p = match (p_v.unanimous(), qk_meta, r) {
        (Some(pt), Some(qk), Some(rr)) if pt.saturating_add(rr) != qk => {
            out.error(
                &qk_key,
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
    };
    let dv = match (dv_v.unanimous(), v_meta) {
        (Some(vt), Some(vm)) if vt != vm => {
            let found = if m.present(if mla {
                "attention.value_length_mla"
            } else {
                "attention.value_length"
            }) {
                vm.to_string()
            } else {
                format!("absent (hidden/heads = {vm})")
            };
            out.error(
                &v_key,
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
    };

    // The head-size rules on the metadata itself (what an engine reads).
    if let (Some(r), Some(qk)) = (r_meta, qk_meta) {
        let nope = arch == Arch::Glm5Next && r == 0;
        if !nope
            && (r == 0 || r % 2 != 0 || r >= qk)
            && !out.has(Severity::Error, &m.key("rope.dimension_count"))
        {
            out.error(
                &m.key("rope.dimension_count"),
                r.to_string(),
                format!("even, at least 2 and below the qk head dim {qk}"),
                "rope rotates pairs of the last `rope` dims of each qk head; an odd count cannot pair, and a head of rope only has no q_nope",
            );
        }
    }
    if let Some(v) = v_meta {
        if v == 0 {
            out.error(&v_key, "0", "at least 1", "zero-sized value heads");
        }
    }
    // The cache row by the resolved dims: a wrong kv_lora_rank key is reported once, above, and does
    // not make a right key_length look wrong.
    if let (Some(lkv), Some(r), Some(qk)) = (lkv.or(lkv_meta), r.or(r_meta), qk_meta) {
        let row = lkv.saturating_add(r);
        if mla {
            // New-style files expose MLA as MQA: one KV head whose key is the cache row.
            for (k, found, want, why) in [
                ("attention.key_length", k_len, row, format!("MLA as MQA: the key of the one KV head is the latent cache row [latent | k_pe] = kv_lora_rank + rope = {row}; llama.cpp sizes the cache rows from it")),
                ("attention.value_length", v_len, lkv, format!("MLA as MQA: the value is the latent, kv_lora_rank = {lkv} wide; llama.cpp sizes the value view from it")),
                ("attention.head_count_kv", h_kv, 1, "MLA as MQA: one latent row per token shared by every head; llama.cpp sizes the cache by head_count_kv × key_length".to_string()),
            ] {
                match found {
                    Some(x) if x != want => out.error(&m.key(k), x.to_string(), want.to_string(), why),
                    None if !m.present(k) => out.warning(
                        &m.key(k),
                        "absent",
                        want.to_string(),
                        format!("the converter writes it; without it llama.cpp falls back to hidden/heads or head_count. {why}"),
                    ),
                    _ => {}
                }
            }
        } else {
            if qk == row {
                out.error(
                    &qk_key,
                    qk.to_string(),
                    format!("qk_nope + rope, or the key_length_mla / value_length_mla pair (here key_length equals kv_lora_rank + rope = {row})"),
                    "a new-style MLA file missing its *_mla keys (made for llama.cpp PR #11446?): the per-head dims cannot be told, and the loader refuses it",
                );
            }
            if let (Some(hk), Some(h)) = (h_kv, h_meta) {
                if hk != h {
                    out.warning(
                        &m.key("attention.head_count_kv"),
                        hk.to_string(),
                        h.to_string(),
                        "a legacy MLA file (no *_mla keys) stores head_count_kv = head_count, as the converter did before PR #12801; another value says the file is neither layout",
                    );
                }
            }
            if v_len.is_none() && !m.present("attention.value_length") && arch != Arch::Minicpm3 {
                out.warning(
                    &m.key("attention.value_length"),
                    format!("absent (hidden/heads = {})", v_meta.map(|v| v.to_string()).unwrap_or("?".into())),
                    "present",
                    "only the MiniCPM3 converter leaves it out; llama.cpp and mla-diff then take hidden/heads as the value head dim",
                );
            }
        }
    }

    // Each layer's tensors against the resolved dims (implausible dims were reported above, and would
    // overflow the products).
    if let (Some(e), Some(h), Some(lkv), Some(p), Some(r), Some(dv)) = (e, h, lkv, p, r, dv) {
        if [e, h, lkv, p, r, dv, lq.unwrap_or(0)]
            .iter()
            .all(|&d| d <= DIM_LIMIT)
        {
            let skip = hybrid.map(|h| h.linear_layers).unwrap_or_default();
            tensors(f, n_layer, &skip, [e, h, lkv, p, r, dv], lq, out);
        }
    }
    rope_factor_tensors(m, r, out);
}

/// Each layer's attention tensors against the dims `[hidden, heads, kv_lora, qk_nope, rope, v]`; one
/// finding per tensor role and problem, naming the first layer and how many share it.
fn tensors(
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
fn rope_factor_tensors(m: &Meta, r: Option<u64>, out: &mut Findings) {
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
        && !m.present("rope.scaling.original_context_length")
        && !m.present("context_length")
    {
        out.error(
            &m.key("context_length"),
            "absent (and no rope.scaling.original_context_length)",
            "the original context",
            "the long LongRoPE factors apply once positions pass the original context; without it nothing says when",
        );
    }
}

/// Rope pairing, base, YaRN and other scaling keys.
fn rope_and_scaling(m: &Meta, arch: Arch, out: &mut Findings) {
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
    if m.present("rope.dimension_sections") {
        out.warning(
            &m.key("rope.dimension_sections"),
            m.raw("rope.dimension_sections").map(|v| v.display_short()).unwrap_or_default(),
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

    match m.float("rope.freq_base", out) {
        Some(b) if !(b.is_finite() && b > 1.0) => out.error(
            &m.key("rope.freq_base"),
            num(b),
            "a finite base above 1",
            "the rope angle is pos·base^(−2i/rope): a base of 1 or less does not rotate or diverges",
        ),
        None if !m.present("rope.freq_base") && !matches!(arch, Arch::Minicpm3 | Arch::Glm5Next) => out.warning(
            &m.key("rope.freq_base"),
            "absent",
            "present (10000 DeepSeek, 50000 Kimi-K2, 1e6 GLM)",
            "llama.cpp and mla-diff then use 10000; a GLM model at 10000 instead of 1e6 is 0.11 rel-L2 off (conventions.md)",
        ),
        _ => {}
    }

    let ty = m.string("rope.scaling.type", out);
    // llama.cpp reads the old `rope.scale_linear` key where `rope.scaling.factor` is absent.
    let (factor, factor_name) = match m.float("rope.scaling.factor", out) {
        Some(f) => (Some(f), "rope.scaling.factor"),
        None => (m.float("rope.scale_linear", out), "rope.scale_linear"),
    };
    let orig = m.uint("rope.scaling.original_context_length", out);
    let ctx = m.uint("context_length", out);
    let raw_mul = m.float("rope.scaling.yarn_log_multiplier", out);
    let beta_fast = m.float("rope.scaling.yarn_beta_fast", out);
    let beta_slow = m.float("rope.scaling.yarn_beta_slow", out);
    let scaling_key = m.key("rope.scaling.type");
    let factor_key = m.key(factor_name);
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
                    &factor_key,
                    format!("{} with {}", num(fa), ty.as_deref().map(|t| format!("type {t}")).unwrap_or("no rope.scaling.type".into())),
                    "rope.scaling.type yarn with it, or no factor",
                    format!("{how}; mla-diff's reference applies no scaling without type yarn, so the two compute different rope angles"),
                );
            }
            if let Some(k) = ["rope.scaling.yarn_log_multiplier", "rope.scaling.original_context_length"]
                .into_iter()
                .find(|k| m.present(k))
            {
                out.warning(
                    &m.key(k),
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
    if ty.as_deref() != Some("yarn") {
        return;
    }
    let fa = factor.unwrap_or(1.0);
    if fa.is_nan() || fa <= 1.0 {
        out.warning(
            &factor_key,
            factor.map(num).unwrap_or("absent".into()),
            "above 1",
            "YaRN with a factor of 1 or less extends nothing: llama.cpp and mla-diff apply no scaling",
        );
        return;
    }
    match orig {
        None if !m.present("rope.scaling.original_context_length") => out.error(
            &m.key("rope.scaling.original_context_length"),
            "absent",
            "the original (pre-YaRN) context, e.g. 4096 for DeepSeek",
            format!(
                "YaRN's frequency ramp is computed over the original context; without the key llama.cpp falls back to context_length ({}) and mla-diff to 4096, so their rope angles differ",
                ctx.map(|c| c.to_string()).unwrap_or("absent".into())
            ),
        ),
        Some(0) => out.error(
            &m.key("rope.scaling.original_context_length"),
            "0",
            "the original context",
            "the YaRN ramp takes its log; 0 makes every correction dim infinite",
        ),
        Some(o) => {
            if let Some(c) = ctx.filter(|&c| o >= c) {
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
fn norms(m: &Meta, out: &mut Findings) {
    let k = "attention.layer_norm_rms_epsilon";
    match m.float(k, out) {
        None if !m.present(k) => out.error(
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

/// glm5-next's hybrid layout (`head_count_kv` per block, 0 on a linear-attention layer; llama.cpp's
/// conversion/glm.py `Glm5NextModel`) and its k-pool indexer keys. `None` for every other file.
fn glm5_next_layout(
    m: &Meta,
    arch: Arch,
    out: &mut Findings,
) -> Option<crate::model::HybridLayout> {
    let key = m.key("attention.head_count_kv");
    let h = match crate::model::HybridLayout::from_gguf(m.f) {
        Ok(Some(h)) => h,
        Ok(None) => return None,
        Err(e) => {
            out.error(
                &key,
                e.to_string(),
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
        match m.uint("attention.indexer.kpool", out) {
            Some(0) => out.error(
                &ik("kpool"),
                "0",
                "at least 1",
                "the k-pool pools `kpool` keys into one before the indexer's top-k",
            ),
            Some(k) => {
                let tail = m
                    .raw("attention.indexer.kpool_select_tail")
                    .and_then(|v| v.as_bool())
                    .unwrap_or(true);
                out.note(&ik("kpool"), format!("{k}, select tail {tail}"), "glm5-next's DSA indexer scores pools of `kpool` keys (gated softmax pooling with a per-slot APE), expands the chosen pools back to tokens and always selects the visible tail; mla-diff checks the MLA layers densely (no k-pool model yet)");
            }
            None => out.warning(
                &ik("kpool"),
                "absent",
                "present (16: transformers Glm5NextTextConfig.index_kpool)",
                "llama.cpp's glm5-next converter always writes it",
            ),
        }
        if let Some(v) = m.raw("attention.indexer.types") {
            match v {
                crate::gguf::Value::Array(a) => {
                    let full: Option<Vec<bool>> = a.iter().map(|v| v.as_bool()).collect();
                    match full {
                        Some(full) => {
                            let shared: Vec<usize> = h
                                .mla_layers
                                .iter()
                                .copied()
                                .filter(|&l| full.get(l) == Some(&false))
                                .collect();
                            out.note(&ik("types"), if shared.is_empty() { "every MLA layer full".to_string() } else { format!("shared on layers {}", crate::model::config::ranges(&shared)) }, "a shared layer reuses the previous full layer's top-k (transformers indexer_types)");
                        }
                        None => out.error(
                            &ik("types"),
                            v.display_short(),
                            "an array of bools (true = full)",
                            "llama.cpp's converter writes [t == \"full\" for t in indexer_types]",
                        ),
                    }
                }
                _ => out.error(
                    &ik("types"),
                    v.display_short(),
                    "an array of bools (true = full)",
                    "llama.cpp's converter writes [t == \"full\" for t in indexer_types]",
                ),
            }
        }
    }
    Some(h)
}

/// The DSA indexer of glm-dsa / deepseek32 files.
fn dsa(m: &Meta, arch: Arch, out: &mut Findings) {
    if !matches!(arch, Arch::GlmDsa | Arch::Deepseek32) {
        return;
    }
    match m.uint("attention.indexer.top_k", out) {
        Some(k) => out.note(
            &m.key("attention.indexer.top_k"),
            k.to_string(),
            format!("dense MLA (what mla-diff and llama.cpp before PR #25407 compute) equals the model's DSA only while a query sees at most {k} keys; past it `run` checks the sparse model (indexer + attention over the selection, docs/dsa.md) where the file has the `blk.N.indexer.*` tensors, and refuses a file without them unless --allow-dense-beyond-topk"),
        ),
        None if !m.present("attention.indexer.top_k") => out.warning(
            &m.key("attention.indexer.top_k"),
            "absent",
            "the lightning indexer's top_k (2048 for GLM-5)",
            "a DSA model attends to its top_k keys only; without the key nothing says where dense attention stops being the model",
        ),
        _ => {}
    }
}

/// The softmax scale and what the classic mistakes would make of it.
fn scale_notes(c: &MlaConfig, out: &mut Findings) {
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
fn catalogue(m: &Meta, c: &MlaConfig, out: &mut Findings) {
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
            "at full size"
        } else {
            "at reduced hidden/heads"
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
    out.note(
        "catalogue",
        format!("no known model ({dims}, {})", m.arch),
        "the catalogue (DeepSeek-V3, V2-Lite, Kimi-K2, GLM-4.7-Flash, GLM-5, MiniCPM3) has no model of these dims; the checks above are the file's own consistency",
    );
}
