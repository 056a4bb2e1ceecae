//! The file side of `lint`: the metadata against the file's own tensors, against the conventions the
//! loader and the reference follow (docs/conventions.md, `MlaConfig::from_gguf`), and against the
//! catalogue of known models (`model::catalogue`).
//!
//! The keys are the loader's reads (`model::keys::MlaKeys`, through `MlaConfig::from_gguf_diagnosed`):
//! a key of the wrong type, a required key absent and the loader's rules on the keys alone (no trunk,
//! more layers than tensors, one of the `*_mla` pair, glm5-next's layout, zero dims, the 2^20 bound,
//! the rope dims) are its diagnostics, each a finding naming its key where the check that reads it
//! runs (`Meta::loader_rule`, `Meta::loader_rule_on`); what stays here is lint's own: the keys against
//! the file's tensors (the legacy cache-row check among them: it takes the tensors' kv_lora and rope),
//! the conventions, the catalogue. A file the loader refuses never lints clean.
//!
//! One file per concern: `meta` (the keys as read, the tensors' votes), `dims` (keys against tensor
//! shapes), `tensors` (each layer's shapes), `rope` (pairing, scaling, eps), `layout` (glm5-next's
//! hybrid layers, the DSA indexer; `kpool` its k-pool tensors), `catalogue` (the softmax scale notes, the known models).

mod catalogue;
mod dims;
mod kpool;
mod layout;
mod meta;
mod rope;
mod tensors;
mod v4;

use super::{Findings, Severity};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use meta::Meta;

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
const DIM_LIMIT: u64 = crate::model::loader::DIM_LIMIT as u64;

/// The file side of the lint. `Err` only when the file is no MLA model at all (exit 2, as `run`).
pub fn lint(f: &GgufFile, out: &mut Findings) -> Result<Facts> {
    if f.architecture() == Some(crate::model::v4::ARCH) {
        v4::lint(f, out);
        return Ok(Facts { cfg: None });
    }
    // No architecture, or one that is not MLA: the loader's error (exit 2).
    let d = MlaConfig::from_gguf_diagnosed(f)?;
    let m = Meta {
        f,
        arch: &d.keys.arch,
        k: &d.keys,
        d: &d,
    };
    dims::dims(&m, d.arch, out);
    rope::rope_and_scaling(&m, d.arch, out);
    rope::norms(&m, out);
    layout::dsa(&m, d.arch, out);
    let cfg = d.cfg.clone();
    // Never lint clean a file the loader refuses: its reason is the finding when no other check
    // explained it.
    if let (None, Some(e)) = (&cfg, d.diagnostics.error(f)) {
        if out.count(Severity::Error) == 0 {
            out.error(
                "loader",
                e.to_string(),
                "a file MlaConfig::from_gguf accepts",
                "the loader refuses the file, so no run reaches its layers",
            );
        }
    }
    if let Some(c) = &cfg {
        catalogue::scale_notes(c, out);
        catalogue::catalogue(&m, c, out);
    }
    Ok(Facts { cfg })
}
