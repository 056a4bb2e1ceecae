//! The keys as the loader read them (`model::keys`), reported as findings where they are read; the
//! tensors' votes on a dim.

use crate::gguf::GgufFile;
use crate::lint::Findings;
use crate::model::keys::{Diagnostic, MlaKeys, Read};
use crate::model::loader::Diagnosed;
use std::collections::{BTreeMap, BTreeSet};

/// The file, its keys as `MlaKeys` read them and the loader's diagnostics; a key of the wrong type is
/// reported where a check reads it, then absent.
pub(super) struct Meta<'a> {
    pub(super) f: &'a GgufFile,
    pub(super) arch: &'a str,
    pub(super) k: &'a MlaKeys,
    pub(super) d: &'a Diagnosed,
}

/// A diagnostic of the loader or the key reader as an error finding.
pub(super) fn report(d: &Diagnostic, out: &mut Findings) {
    out.error(&d.key, d.found.clone(), d.expected.clone(), d.why.clone());
}

impl Meta<'_> {
    pub(super) fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    /// The key's value; its type diagnostic, if any, becomes an error.
    pub(super) fn get<T: Clone>(&self, r: &Read<T>, out: &mut Findings) -> Option<T> {
        if let Some(d) = &r.bad_type {
            report(d, out);
        }
        r.value.clone()
    }
    /// A key the loader requires: absent is an error.
    pub(super) fn required(&self, r: &Read<u64>, out: &mut Findings) -> Option<u64> {
        if !r.present {
            report(&r.missing(), out);
            return None;
        }
        self.get(r, out)
    }
    /// The loader's diagnostic of `rule`, reported; whether it had one.
    pub(super) fn loader_rule(&self, rule: &str, out: &mut Findings) -> bool {
        self.d.rule(rule).map(|d| report(d, out)).is_some()
    }
    /// The loader's diagnostic of `rule` on `key`, reported; whether it had one.
    pub(super) fn loader_rule_on(&self, rule: &str, key: &str, out: &mut Findings) -> bool {
        self.d.rule_on(rule, key).map(|d| report(d, out)).is_some()
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
