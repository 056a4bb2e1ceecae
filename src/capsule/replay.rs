//! `mla-diff replay`: a capsule back through the ordinary run pipeline (`crate::run`), on its own
//! `layer.gguf` and `input.npy`, with its schedule and dtype, in shadow mode, after checking that its
//! weights still give the reference it carries.

use super::manifest::Manifest;
use super::REFERENCE_REL_L2;
use crate::compare::ToleranceTable;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::input::LayerInputs;
use crate::model::MlaConfig;
use crate::run::{DumpLayers, InputSpec, Modes, RunOptions};
use crate::trace::{Stage, StageTensor};
use std::path::{Path, PathBuf};

/// An opened capsule: its checked manifest and where its files are.
#[derive(Debug, Clone)]
pub struct Capsule {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub weights: PathBuf,
    pub input: PathBuf,
}

/// How far a recomputed reference stage is from the capsule's copy.
#[derive(Debug, Clone, PartialEq)]
pub struct StageMatch {
    pub stage: Stage,
    /// rel-L2 over the entries finite on both sides; infinite when the non-finite entries differ.
    pub rel_l2: f64,
}

impl Capsule {
    /// Open `dir` and check its manifest (see [`Manifest::read`]).
    pub fn open(dir: &Path) -> Result<Capsule> {
        let manifest = Manifest::read(dir)?;
        Ok(Capsule {
            weights: Manifest::path(dir, &manifest.files.weights)?,
            input: Manifest::path(dir, &manifest.files.input)?,
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// The run of a replay: the capsule's one layer (0) in shadow mode (its input is the reference's, so
    /// free mode would be the same run), on its schedule, dtype and input.
    pub fn run_options(
        &self,
        tolerances: ToleranceTable,
        tolerance_source: String,
        dump: Option<(PathBuf, DumpLayers)>,
        progress: bool,
    ) -> RunOptions {
        RunOptions {
            layers: Some(vec![0]),
            input: InputSpec::Npy(self.input.clone()),
            sched: self.manifest.schedule.clone(),
            dtype: self.manifest.dtype,
            modes: Modes {
                shadow: true,
                free: false,
            },
            tolerances,
            tolerance_source,
            dump,
            progress,
            ..RunOptions::default()
        }
    }

    /// What the reports say about a replay: which layer of which model it is, and a head cut.
    pub fn notices(&self) -> Vec<String> {
        let m = &self.manifest;
        let mut n = format!(
            "replay of a capsule: layer {} of {} (layer 0 here)",
            m.layer, m.source.file
        );
        if let Some(h) = &m.heads_note {
            n.push_str(&format!("; {h}"));
        }
        vec![n]
    }

    /// Recompute the fp64 reference from the capsule's weights and input, and check it against the
    /// capsule's `reference/*.npy`: every stage within rel-L2 `REFERENCE_REL_L2` (an exported capsule
    /// is bit-identical), or an input error naming the first stage that differs.
    pub fn check_reference(&self, file: &GgufFile, cfg: &MlaConfig) -> Result<Vec<StageMatch>> {
        let sched = &self.manifest.schedule;
        sched.check_memory(cfg)?;
        let x = match crate::input::load_npy(&self.input, cfg.hidden, sched.total_tokens())? {
            LayerInputs::Shared(x) => x,
            LayerInputs::PerLayer(_) | LayerInputs::Captured(_) => {
                return Err(Error::Usage(format!(
                    "{}: a capsule's input is one layer's [T, hidden], not [layers, T, hidden]",
                    self.input.display()
                )))
            }
        };
        let reference = super::export::reference_of(file, cfg, &x, sched)?;
        let mut out = Vec::new();
        for t in &reference.stages {
            let name = t.stage.name();
            let f = self
                .manifest
                .files
                .reference
                .iter()
                .find(|s| s.stage == name)
                .ok_or_else(|| {
                    Error::Usage(format!(
                        "capsule {} has no reference for stage {name} in its manifest",
                        self.dir.display()
                    ))
                })?;
            let path = Manifest::path(&self.dir, &f.path)?;
            let h = crate::input::npy::read_header(&path)?;
            let mismatch = |why: String| {
                Error::Usage(format!(
                    "capsule's reference does not match its weights: stage {name} {why} ({}); the capsule was changed after export, or its files are from different exports",
                    path.display()
                ))
            };
            if h.shape != t.shape {
                return Err(mismatch(format!(
                    "has shape {:?} in the capsule, {:?} recomputed",
                    h.shape, t.shape
                )));
            }
            let stored = crate::input::npy::read_data(&path, &h)?;
            // Logical (row-major) order, whichever order the file stores.
            let rel_l2 = rel_l2(t, stored.iter().copied());
            if rel_l2.is_nan() || rel_l2 > REFERENCE_REL_L2 {
                return Err(mismatch(format!(
                    "differs by rel-L2 {rel_l2:.3e} (at most {REFERENCE_REL_L2:e} is the same)"
                )));
            }
            out.push(StageMatch {
                stage: t.stage,
                rel_l2,
            });
        }
        Ok(out)
    }
}

/// rel-L2 of `stored` against the recomputed stage over the entries finite on both sides; infinite when
/// the non-finite entries (an empty split's −inf) are not the same on both sides.
fn rel_l2(t: &StageTensor, stored: impl Iterator<Item = f64>) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&r, s) in t.data.iter().zip(stored) {
        if !(r.is_finite() && s.is_finite()) {
            let same = (r.is_nan() && s.is_nan()) || r == s;
            if !same {
                return f64::INFINITY;
            }
            continue;
        }
        num += (r - s) * (r - s);
        den += r * r;
    }
    if num == 0.0 {
        0.0
    } else if den > 0.0 {
        (num / den).sqrt()
    } else {
        f64::INFINITY
    }
}
