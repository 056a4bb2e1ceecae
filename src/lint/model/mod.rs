//! The file side of `lint`: the metadata against the file's own tensors, against the conventions the
//! loader and the reference follow (docs/conventions.md, `MlaConfig::from_gguf`), and against the
//! catalogue of known models (`model::catalogue`).
//!
//! The checks read the metadata themselves, tolerating what the loader refuses, so that each problem
//! becomes a finding naming its key instead of the loader's first error; the loader is then asked
//! too, and a file it refuses never lints clean.
//!
//! One file per concern: `meta` (typed key access, the tensors' votes), `dims` (keys against tensor
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
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::config::Arch;
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
const DIM_LIMIT: u64 = 1 << 20;

/// The file side of the lint. `Err` only when the file is no MLA model at all (exit 2, as `run`).
pub fn lint(f: &GgufFile, out: &mut Findings) -> Result<Facts> {
    let arch_name = f.architecture().ok_or_else(|| {
        Error::Unsupported(format!(
            "{}: general.architecture is missing",
            f.path.display()
        ))
    })?;
    if arch_name == crate::model::v4::ARCH {
        v4::lint(f, out);
        return Ok(Facts { cfg: None });
    }
    let arch =
        Arch::from_gguf(arch_name).ok_or_else(|| crate::model::config::not_mla(f, arch_name))?;
    let m = Meta { f, arch: arch_name };
    dims::dims(&m, arch, out);
    rope::rope_and_scaling(&m, arch, out);
    rope::norms(&m, out);
    layout::dsa(&m, arch, out);
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
        catalogue::scale_notes(c, out);
        catalogue::catalogue(&m, c, out);
    }
    Ok(Facts { cfg })
}
