//! Typed access to the architecture's keys, and the tensors' votes on a dim.

use crate::gguf::{GgufFile, Value};
use crate::lint::Findings;
use std::collections::{BTreeMap, BTreeSet};

/// Typed access to the architecture's keys; a key of the wrong type is reported once, then absent.
pub(super) struct Meta<'a> {
    pub(super) f: &'a GgufFile,
    pub(super) arch: &'a str,
}

impl Meta<'_> {
    pub(super) fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    pub(super) fn raw(&self, k: &str) -> Option<&Value> {
        self.f.get(&self.key(k))
    }
    pub(super) fn present(&self, k: &str) -> bool {
        self.raw(k).is_some()
    }
    pub(super) fn typed<T>(
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
    pub(super) fn uint(&self, k: &str, out: &mut Findings) -> Option<u64> {
        self.typed(k, "an unsigned integer", |v| v.as_u64(), out)
    }
    pub(super) fn float(&self, k: &str, out: &mut Findings) -> Option<f64> {
        self.typed(k, "a number", |v| v.as_f64(), out)
    }
    pub(super) fn string(&self, k: &str, out: &mut Findings) -> Option<String> {
        self.typed(k, "a string", |v| v.as_str().map(str::to_string), out)
    }
    /// A key the loader requires: absent is an error.
    pub(super) fn required(&self, k: &str, out: &mut Findings) -> Option<u64> {
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
pub(super) struct Votes(BTreeMap<u64, BTreeSet<&'static str>>);

impl Votes {
    pub(super) fn add(&mut self, v: u64, role: &'static str) {
        self.0.entry(v).or_default().insert(role);
    }
    /// The value every tensor that determines the dim agrees on.
    pub(super) fn unanimous(&self) -> Option<u64> {
        (self.0.len() == 1).then(|| *self.0.keys().next().unwrap())
    }
    pub(super) fn roles(&self) -> String {
        let all: BTreeSet<&str> = self.0.values().flatten().copied().collect();
        all.into_iter().collect::<Vec<_>>().join(", ")
    }
}

pub(super) fn fmt_ne(ne: &[u64]) -> String {
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
pub(super) fn resolve(
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
