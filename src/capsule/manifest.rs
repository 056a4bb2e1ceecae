//! `capsule.json`: what a capsule holds and how to replay it. Read back with every field checked, so that
//! a missing or malformed manifest, a file it names that is not there, or a newer layout is one clear
//! error (exit 2), never a panic.

use super::{CAPSULE_VERSION, MANIFEST};
use crate::error::{Error, Result};
use crate::precision::Dtype;
use crate::schedule::Schedule;
use serde::{Deserialize, Serialize};
use std::path::{Component, Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub capsule_version: u32,
    /// The mla-diff that wrote it.
    pub mla_diff_version: String,
    pub source: Source,
    /// The layer of the source model the capsule holds (as `blk.0` in `layer.gguf`).
    pub layer: usize,
    /// `[A, B]`: only query heads A..B (half-open) of the source were kept; `null`: all of them.
    pub heads: Option<[usize; 2]>,
    /// What a head slice means for the numbers (present when `heads` is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads_note: Option<String>,
    pub schedule: Schedule,
    /// Storage precision of the optimized path the capsule was exported for.
    pub dtype: Dtype,
    pub input: InputInfo,
    /// The capsule's `MlaConfig` (as `layer.gguf` gives it), for humans: replay reads the GGUF.
    pub config: serde_json::Value,
    pub conventions: Conventions,
    pub files: Files,
}

/// The model the layer was taken from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Source {
    /// Base name of the GGUF file (of its first shard for a split model).
    pub file: String,
    /// Bytes over all shards.
    pub size: u64,
    pub architecture: String,
    pub name: Option<String>,
    /// Trunk layers of the source model.
    pub n_layer: usize,
    pub n_head: usize,
}

/// Where `input.npy` came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputInfo {
    /// The run's input source (`{"kind": "random", "seed": 0}`, tokens, or a capture's path).
    pub source: serde_json::Value,
    /// Layers the input went through before layer `layer` (the reference's attention-only residual
    /// stream, as a run over those layers feeds layer `layer` in shadow mode); empty: the source itself.
    pub layers_before: Vec<usize>,
    /// `[T, hidden]`.
    pub shape: [usize; 2],
}

/// The layout facts a kernel author needs to read the reference (docs/runners.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Conventions {
    /// Log-sum-exps (`lse`, `split_lse`) are natural logs.
    pub lse_base: String,
    /// A cache row is the normed latent followed by the roped k_pe.
    pub cache_row: String,
    /// Cache rows no token wrote hold this.
    pub poison: String,
}

impl Default for Conventions {
    fn default() -> Self {
        Conventions {
            lse_base: "e".into(),
            cache_row: "[latent | k_pe]".into(),
            poison: "nan".into(),
        }
    }
}

/// The capsule's files, as paths relative to its directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Files {
    pub weights: String,
    pub input: String,
    pub readme: String,
    /// One per reference stage, in dataflow order.
    pub reference: Vec<StageFile>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageFile {
    pub stage: String,
    pub path: String,
    pub shape: Vec<usize>,
    /// Axis names, outermost first.
    pub axes: Vec<String>,
}

impl Manifest {
    /// The manifest text (pretty JSON, newline-terminated).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("manifest serialises");
        s.push('\n');
        s
    }

    /// Read and check `DIR/capsule.json`: its version, its fields, and that every file it names is a
    /// regular file inside DIR.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let shown = dir.display();
        let meta = std::fs::metadata(dir)
            .map_err(|e| Error::io(format!("cannot open capsule {shown}"), e))?;
        if !meta.is_dir() {
            return Err(Error::Usage(format!(
                "{shown} is not a capsule directory (mla-diff export -o DIR writes one)"
            )));
        }
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::io(
                format!("{shown} is not a capsule: cannot read its {MANIFEST}"),
                e,
            )
        })?;
        let at = path.display();
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Usage(format!("{at}: not JSON: {e}")))?;
        match v.get("capsule_version").map(|x| x.as_u64()) {
            Some(Some(n)) if n == CAPSULE_VERSION as u64 => {}
            Some(Some(n)) => {
                return Err(Error::Usage(format!(
                    "{at}: capsule_version {n}; this mla-diff reads version {CAPSULE_VERSION}"
                )))
            }
            _ => {
                return Err(Error::Usage(format!(
                    "{at}: not a capsule manifest (no integer capsule_version)"
                )))
            }
        }
        let m: Manifest = serde_json::from_value(v)
            .map_err(|e| Error::Usage(format!("{at}: malformed capsule manifest: {e}")))?;
        m.schedule
            .validate()
            .map_err(|e| Error::Usage(format!("{at}: {e}")))?;
        if let Some([a, b]) = m.heads {
            if a >= b || b > m.source.n_head {
                return Err(Error::Usage(format!(
                    "{at}: heads [{a}, {b}] is not a head range of a model with {} heads",
                    m.source.n_head
                )));
            }
        }
        for (what, rel) in m.named_files() {
            let p = resolve(dir, &rel).ok_or_else(|| {
                Error::Usage(format!(
                    "{at}: {what} path {rel:?} is not a plain relative path inside the capsule"
                ))
            })?;
            if !p.is_file() {
                return Err(Error::Usage(format!(
                    "capsule {shown} is incomplete: {what} {} is missing",
                    p.display()
                )));
            }
        }
        Ok(m)
    }

    /// Every file the manifest names, with what it is.
    fn named_files(&self) -> Vec<(String, String)> {
        let f = &self.files;
        let mut v = vec![
            ("the weights".to_string(), f.weights.clone()),
            ("the input".to_string(), f.input.clone()),
        ];
        v.extend(
            f.reference
                .iter()
                .map(|s| (format!("the reference of {}", s.stage), s.path.clone())),
        );
        v
    }

    /// A file of the capsule in `dir` (the manifest was checked by `read`).
    pub fn path(dir: &Path, rel: &str) -> Result<PathBuf> {
        resolve(dir, rel).ok_or_else(|| {
            Error::Usage(format!(
                "{rel:?} is not a plain relative path inside the capsule"
            ))
        })
    }
}

/// `dir/rel` when `rel` stays inside `dir`: relative, no `..`, not empty.
fn resolve(dir: &Path, rel: &str) -> Option<PathBuf> {
    let p = Path::new(rel);
    let plain = !rel.is_empty()
        && p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    plain.then(|| dir.join(p))
}

#[cfg(test)]
mod tests {
    use super::resolve;
    use std::path::Path;

    #[test]
    fn paths_stay_inside_the_capsule() {
        let d = Path::new("/c");
        assert_eq!(
            resolve(d, "reference/q_pe.npy").unwrap(),
            Path::new("/c/reference/q_pe.npy")
        );
        for bad in ["", "/etc/passwd", "../x.npy", "reference/../../x"] {
            assert!(resolve(d, bad).is_none(), "{bad}");
        }
    }
}
