//! What a run is asked ([`Request`]): the command line's `run` options as plain values, which a Rust
//! user builds without clap (`Request::new(file)` is `mla-diff run FILE`).

use super::Mode;
use crate::backend::open::Spec;
use crate::faults::FaultSet;
use crate::precision::{Dtype, KeyPrecision};
use crate::report::outputs::{Formats, ReportOptions};
use crate::shard::Shard;
use crate::tp::TpSpec;
use std::ffi::OsString;
use std::path::PathBuf;

/// Everything a run is asked, as plain values (the command line's `run` options; `Request::new(file)`
/// is `mla-diff run FILE`).
#[derive(Debug, Clone)]
pub struct Request {
    pub file: PathBuf,
    /// `all`, `N`, `A..B`, `A..=B` or a comma list ([`super::parse_layers`]).
    pub layers: String,
    pub dtype: Dtype,
    /// `None`: both, or shadow for per-layer captured inputs.
    pub mode: Option<Mode>,
    /// Run a DSA file without indexer tensors past its top_k (dense attention, with a notice).
    pub allow_dense_beyond_topk: bool,
    pub indexer_keys: KeyPrecision,
    pub faults: FaultSet,
    /// Runs of the optimized path per layer, compared bit for bit (1: no repeat).
    pub repeat: usize,
    pub shard: Option<Shard>,
    /// Spread the layers over this host's GPUs, one worker process each (`crate::gpus`).
    pub gpus: Option<Spread>,
    pub tp: Option<TpSpec>,
    /// Capture folders (one per TP rank) that take the optimized path's place (`run --capture`).
    pub capture: Vec<PathBuf>,
    /// The capture's request, by its manifest id.
    pub capture_request: Option<u64>,
    /// Also write the optimized path's stages as a capture into this folder.
    pub write_capture: Option<PathBuf>,
    pub input: super::InputSpec,
    /// Laid over the classic default; none set (and random inputs): the kernel-aware schedule.
    pub schedule: crate::schedule::Overrides,
    /// With the kernel-aware schedule: how many of the first selected layers run it, the others the
    /// classic one (`crate::schedule::Split`); `usize::MAX`: every layer.
    pub covering_layers: usize,
    pub backend: Spec,
    pub tol: crate::compare::tolerance::Overrides,
    pub report: ReportOptions,
}

/// `--gpus`: the devices (`all`, a count or indices) and the command line each worker reruns with its
/// shard (`gpus::fan_out`).
#[derive(Debug, Clone)]
pub struct Spread {
    pub spec: String,
    pub args: Vec<OsString>,
}

impl Request {
    /// `mla-diff run FILE`: every default.
    pub fn new(file: PathBuf) -> Request {
        Request {
            file,
            layers: "all".into(),
            dtype: Dtype::Bf16,
            mode: None,
            allow_dense_beyond_topk: false,
            indexer_keys: KeyPrecision::default(),
            faults: FaultSet::default(),
            repeat: 1,
            shard: None,
            gpus: None,
            tp: None,
            capture: Vec::new(),
            capture_request: None,
            write_capture: None,
            input: super::InputSpec::Random { seed: 0 },
            schedule: Default::default(),
            covering_layers: crate::schedule::COVERING_LAYERS,
            backend: Spec::default(),
            tol: Default::default(),
            report: ReportOptions::default(),
        }
    }

    /// A `--gpus` worker (`gpus::Worker`): its shard, its JSON report where the parent reads it, and
    /// nothing else written or gated (the parent does that with the joined report).
    pub fn become_worker(&mut self, w: &crate::gpus::Worker) {
        self.shard = Some(w.shard);
        self.gpus = None;
        self.report = ReportOptions {
            formats: Formats {
                json: Some(w.json.clone()),
                color: crate::report::table::ColorChoice::Never,
                quiet: true,
                ..Formats::default()
            },
            baseline_factor: self.report.baseline_factor,
            ..ReportOptions::default()
        };
    }
}
