//! `manifest.json` of a capture (docs/captures.md, schema/capture.schema.json): read with every field
//! checked, so that a malformed manifest is one clear error (exit 2), never a panic.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Component, Path};

pub const FORMAT: &str = "mla-diff-capture";
/// The version written. 2 added `stage_dtypes`; a version-1 manifest (without it) reads unchanged.
pub const VERSION: u32 = 2;
/// The versions read.
pub const VERSIONS: std::ops::RangeInclusive<u32> = 1..=VERSION;
pub const MANIFEST: &str = "manifest.json";

/// The names a step file may hold (docs/captures.md, "Stages in a step file"), besides `NAME.rows`.
pub const NAMES: [&str; 15] = [
    "x",
    "attn_in",
    "q_nope",
    "q_pe",
    "kv_latent",
    "k_pe",
    "cache_rows",
    "kv_cache",
    "slot_mapping",
    "q_absorbed",
    "attn_latent",
    "lse",
    "attn_heads",
    "attn_out",
    "topk",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<Writer>,
    pub engine: Engine,
    pub model: ModelId,
    pub dtype: crate::precision::Dtype,
    /// Version 2: the storage type of each stage named, where it is not `dtype` (llama.cpp's f16
    /// cache rows next to its f32 projections). Stages not named are in `dtype`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub stage_dtypes: std::collections::BTreeMap<String, crate::precision::Dtype>,
    #[serde(default)]
    pub conventions: Conventions,
    #[serde(default)]
    pub tp: Tp,
    pub requests: Vec<Request>,
    pub steps: Vec<Step>,
    pub layers: Vec<LayerFile>,
    #[serde(default)]
    pub names: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Writer {
    pub name: String,
    pub version: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Engine {
    pub name: String,
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The GGUF file's identity (`GgufFile::header_sha256` and the file's name, size and architecture).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelId {
    pub file: String,
    pub size: u64,
    pub architecture: String,
    pub header_bytes: u64,
    pub header_sha256: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeOrder {
    /// The GGUF file's order (the project's canonical one).
    File,
    /// De-interleaved `[even…, odd…]`, as transformers' `apply_rotary_pos_emb_interleave` returns.
    Halves,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LseBase {
    #[serde(rename = "e")]
    E,
    #[serde(rename = "2")]
    Two,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conventions {
    #[serde(default = "file_order")]
    pub rope_order: RopeOrder,
    #[serde(default = "base_e")]
    pub lse_base: LseBase,
}

fn file_order() -> RopeOrder {
    RopeOrder::File
}
fn base_e() -> LseBase {
    LseBase::E
}

impl Default for Conventions {
    fn default() -> Self {
        Conventions {
            rope_order: RopeOrder::File,
            lse_base: LseBase::E,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tp {
    pub rank: usize,
    pub world_size: usize,
    #[serde(default)]
    pub heads: Option<[usize; 2]>,
}

impl Default for Tp {
    fn default() -> Self {
        Tp {
            rank: 0,
            world_size: 1,
            heads: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub id: u64,
    pub tokens: Vec<u64>,
    pub positions: Vec<u64>,
    pub prefill: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    Prefill,
    Decode,
    Mixed,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    pub step: u64,
    pub kind: StepKind,
    /// `[request_id, position]` per row; `None`: padding.
    pub rows: Vec<Option<[u64; 2]>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerFile {
    pub layer: usize,
    pub step: u64,
    pub file: String,
    pub stages: Vec<String>,
}

impl Manifest {
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("manifest serialises");
        s.push('\n');
        s
    }

    /// Read and check `DIR/manifest.json`.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let shown = dir.display();
        let bad = |m: String| Error::Usage(format!("capture {shown}: {m}"));
        let meta = std::fs::metadata(dir)
            .map_err(|e| Error::io(format!("cannot open capture {shown}"), e))?;
        if !meta.is_dir() {
            return Err(bad(
                "not a capture folder (docs/captures.md: a folder with manifest.json)".into(),
            ));
        }
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| bad(format!("cannot read {MANIFEST}: {e}")))?;
        // The format and version first, so that a newer capture says so rather than failing on a field.
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("{MANIFEST} is not JSON: {e}")))?;
        if v.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(bad(format!(
                "{MANIFEST} is not a capture manifest (format must be \"{FORMAT}\")"
            )));
        }
        match v.get("version").and_then(|f| f.as_u64()) {
            Some(n) if u32::try_from(n).is_ok_and(|n| VERSIONS.contains(&n)) => {}
            Some(n) => {
                return Err(bad(format!(
                    "format version {n}; this mla-diff reads versions {} to {VERSION}",
                    VERSIONS.start()
                )))
            }
            None => return Err(bad(format!("{MANIFEST} has no integer version"))),
        }
        let m: Manifest = serde_json::from_value(v).map_err(|e| bad(format!("{MANIFEST}: {e}")))?;
        m.check().map_err(bad)?;
        Ok(m)
    }

    /// The manifest's own consistency (everything that does not need the model or the files).
    fn check(&self) -> std::result::Result<(), String> {
        self.check_header()?;
        self.check_requests()?;
        let steps = self.check_steps()?;
        self.check_layers(&steps)?;
        self.check_stage_names()
    }

    /// The engine is named, the model identity is a SHA-256, the TP rank and heads are in range.
    fn check_header(&self) -> std::result::Result<(), String> {
        if self.engine.name.is_empty() {
            return Err("engine.name is empty".into());
        }
        if !(self.model.header_sha256.len() == 64
            && self
                .model
                .header_sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        {
            return Err("model.header_sha256 is not 64 lowercase hex digits".into());
        }
        let tp = self.tp;
        if tp.world_size == 0 || tp.rank >= tp.world_size {
            return Err(format!(
                "tp.rank {} outside tp.world_size {}",
                tp.rank, tp.world_size
            ));
        }
        if let Some([a, b]) = tp.heads {
            if a >= b {
                return Err(format!(
                    "tp.heads [{a}, {b}] is not a range [A, B) with A < B"
                ));
            }
        }
        Ok(())
    }

    /// At least one request; ids unique, each with as many positions as tokens, contiguous, and a
    /// prefill within them.
    fn check_requests(&self) -> std::result::Result<(), String> {
        if self.requests.is_empty() {
            return Err("no requests".into());
        }
        let mut ids = std::collections::BTreeSet::new();
        for r in &self.requests {
            if !ids.insert(r.id) {
                return Err(format!("request id {} appears twice", r.id));
            }
            if r.tokens.len() != r.positions.len() {
                return Err(format!(
                    "request {}: {} tokens but {} positions",
                    r.id,
                    r.tokens.len(),
                    r.positions.len()
                ));
            }
            if r.tokens.is_empty() {
                return Err(format!("request {} has no tokens", r.id));
            }
            if r.positions.windows(2).any(|w| w[1] != w[0] + 1) {
                return Err(format!(
                    "request {}: positions must be contiguous and increasing",
                    r.id
                ));
            }
            if r.prefill > r.tokens.len() {
                return Err(format!(
                    "request {}: prefill {} > its {} tokens",
                    r.id,
                    r.prefill,
                    r.tokens.len()
                ));
            }
        }
        Ok(())
    }

    /// Step numbers unique, each row a position of a listed request. Returns the step numbers.
    fn check_steps(&self) -> std::result::Result<std::collections::BTreeSet<u64>, String> {
        let mut steps = std::collections::BTreeSet::new();
        for s in &self.steps {
            if !steps.insert(s.step) {
                return Err(format!("step {} appears twice", s.step));
            }
            for row in s.rows.iter().flatten() {
                let Some(r) = self.requests.iter().find(|r| r.id == row[0]) else {
                    return Err(format!(
                        "step {}: a row names request {}, which is not in requests",
                        s.step, row[0]
                    ));
                };
                if !r.positions.contains(&row[1]) {
                    return Err(format!(
                        "step {}: request {} has no position {}",
                        s.step, row[0], row[1]
                    ));
                }
            }
        }
        Ok(steps)
    }

    /// Each layer file of a listed step, listed once, a relative path inside the folder, naming
    /// stages of the vocabulary.
    fn check_layers(
        &self,
        steps: &std::collections::BTreeSet<u64>,
    ) -> std::result::Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        for l in &self.layers {
            if !steps.contains(&l.step) {
                return Err(format!(
                    "layer {} names step {}, which is not in steps",
                    l.layer, l.step
                ));
            }
            if !seen.insert((l.layer, l.step)) {
                return Err(format!("layer {} step {} is listed twice", l.layer, l.step));
            }
            let p = Path::new(&l.file);
            if l.file.is_empty()
                || p.components()
                    .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
            {
                return Err(format!(
                    "layer {} step {}: file {:?} must be a relative path inside the folder",
                    l.layer, l.step, l.file
                ));
            }
            if let Some(s) = l.stages.iter().find(|s| !NAMES.contains(&s.as_str())) {
                return Err(format!(
                    "layer {} step {}: unknown stage {s:?} (stages: {})",
                    l.layer,
                    l.step,
                    NAMES.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// `stage_dtypes` (format version 2) and `names` name stages of the vocabulary; the cache has one
    /// type.
    fn check_stage_names(&self) -> std::result::Result<(), String> {
        if !self.stage_dtypes.is_empty() && self.version < 2 {
            return Err("stage_dtypes needs format version 2".into());
        }
        if let Some(k) = self
            .stage_dtypes
            .keys()
            .find(|k| !NAMES.contains(&k.as_str()) || matches!(k.as_str(), "slot_mapping" | "topk"))
        {
            return Err(format!(
                "stage_dtypes names {k:?}, which is not a stage with values (stages: {})",
                NAMES
                    .iter()
                    .filter(|n| !matches!(**n, "slot_mapping" | "topk"))
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if let (Some(a), Some(b)) = (
            self.stage_dtypes.get("cache_rows"),
            self.stage_dtypes.get("kv_cache"),
        ) {
            if a != b {
                return Err(format!(
                    "stage_dtypes gives cache_rows {} but kv_cache {}: one cache, one type",
                    a.name(),
                    b.name()
                ));
            }
        }
        if let Some((k, v)) = self
            .names
            .iter()
            .find(|(_, v)| !NAMES.contains(&v.as_str()))
        {
            return Err(format!("names[{k:?}] = {v:?} is not a stage"));
        }
        Ok(())
    }

    /// The storage types declared for the trace's stages (`stage_dtypes`; `kv_cache` is the cache
    /// rows'), for `LayerTrace::storage`.
    pub fn storage(&self) -> Vec<(crate::trace::Stage, crate::precision::Dtype)> {
        self.stage_dtypes
            .iter()
            .filter_map(|(k, &d)| {
                let name = if k == "kv_cache" { "cache_rows" } else { k };
                crate::trace::Stage::from_name(name).map(|s| (s, d))
            })
            .collect()
    }

    /// The model identity of `file`, as this manifest records one.
    pub fn identity_of(file: &crate::gguf::GgufFile) -> ModelId {
        let (header_bytes, header_sha256) = file.header_sha256();
        let first = &file.shards[0].path;
        ModelId {
            file: first
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            size: file.file_size,
            architecture: file.architecture().unwrap_or_default().to_string(),
            header_bytes,
            header_sha256,
        }
    }

    /// Refuse a capture of another file, naming the first field that differs (the digest last: it
    /// differs whenever anything else in the header does).
    pub fn check_identity(&self, file: &crate::gguf::GgufFile, dir: &Path) -> Result<()> {
        let ours = Self::identity_of(file);
        let theirs = &self.model;
        let diff = if theirs.architecture != ours.architecture {
            Some(format!(
                "architecture {:?}, FILE is {:?}",
                theirs.architecture, ours.architecture
            ))
        } else if theirs.size != ours.size {
            Some(format!(
                "size {} bytes, FILE has {}",
                theirs.size, ours.size
            ))
        } else if theirs.header_bytes != ours.header_bytes
            || theirs.header_sha256 != ours.header_sha256
        {
            Some(format!(
                "header sha256 {} ({} bytes), FILE's is {} ({} bytes)",
                theirs.header_sha256, theirs.header_bytes, ours.header_sha256, ours.header_bytes
            ))
        } else {
            None
        };
        match diff {
            None => Ok(()),
            Some(d) => Err(Error::Usage(format!(
                "capture {} was made from another file ({}): model {d}",
                dir.display(),
                theirs.file
            ))),
        }
    }
}
