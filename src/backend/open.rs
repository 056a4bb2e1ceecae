//! The one place backends are made: a kind (or `Auto`) and plain options in, the backend and its facts
//! out. A new backend is one `Kind` and one line in `Factory::open`.

use super::cpu::CpuMirror;
use super::cuda::shared::{SharedCuda, SharedGpu};
use super::runner::RunnerBackend;
use super::Backend;
use crate::error::Result;
use crate::precision::Dtype;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which optimized path runs; its name is the report's `run.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The CPU mirror of the fused path.
    Cpu,
    /// The CUDA kernels in kernels/ (needs an NVIDIA GPU and driver).
    Cuda,
    /// What a serving engine computed, read from a capture (`run --capture`, `crate::capture`); not
    /// made by the factory nor chosen on a command line.
    #[value(skip)]
    Capture,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Cpu => "cpu",
            Kind::Cuda => "cuda",
            Kind::Capture => "capture",
        }
    }
}

/// A kind as the user picks it: one of them, or `Auto`, which the factory resolves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Choice {
    /// The CPU mirror of the fused path.
    Cpu,
    /// The CUDA kernels in kernels/ (needs an NVIDIA GPU and driver).
    Cuda,
    /// CUDA when a GPU is present, else the CPU mirror.
    Auto,
}

impl From<Kind> for Choice {
    fn from(k: Kind) -> Choice {
        match k {
            Kind::Cpu => Choice::Cpu,
            Kind::Cuda => Choice::Cuda,
            // Not a command-line value (`value(skip)`): no command can pass it here; the CPU mirror
            // is the path a capture's numbers are checked like.
            Kind::Capture => Choice::Cpu,
        }
    }
}

impl Choice {
    /// `Auto`: CUDA with a GPU present or an explicit kernel directory (whose errors are then errors),
    /// else the CPU mirror.
    pub fn resolve(self, kernels_dir: Option<&std::path::Path>) -> Kind {
        match self {
            Choice::Cpu => Kind::Cpu,
            Choice::Cuda => Kind::Cuda,
            Choice::Auto if kernels_dir.is_none() && !super::cuda::device::gpu_present() => {
                Kind::Cpu
            }
            Choice::Auto => Kind::Cuda,
        }
    }
}

/// Plain options every backend is made from (each takes what applies to it).
#[derive(Debug, Clone)]
pub struct Options {
    /// Storage precision of weights and activations.
    pub dtype: Dtype,
    /// CUDA: read kernels from this directory instead of the embedded copy.
    pub kernels_dir: Option<PathBuf>,
    /// An external runner command (docs/runners.md) over the chosen backend: its ops replace the
    /// backend's stages.
    pub runner: Option<String>,
    /// `(schedule's page, page run)` when the run's page was moved to one the runner takes
    /// (`runner::protocol::page_for`): the runner backend's notice says so.
    pub runner_page_moved: Option<(usize, usize)>,
    /// The latent cache's byte format (`run --kv-cache-dtype`): the CPU mirror stores every format,
    /// the CUDA kernels the per-row ones; a runner those its `supports.cache_formats` lists (decode).
    pub kv_format: crate::kv_format::KvFormat,
}

/// The facts of an opened backend, for the report.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendInfo {
    pub kind: Kind,
    /// `Backend::describe` ("cpu-mirror (bf16, f32 accumulation)", "cuda: NVIDIA H200 (sm_90, …), bf16").
    pub description: String,
    /// The GPU's name, if it runs on one.
    pub gpu: Option<String>,
}

impl BackendInfo {
    pub fn of(kind: Kind, b: &dyn Backend) -> BackendInfo {
        BackendInfo {
            kind,
            description: b.describe(),
            gpu: b.device(),
        }
    }
}

/// Opens backends; GPU state (context, cuBLAS handle, compiled kernels) is made on first use and shared
/// by every backend this factory opens afterwards (`mla-diff selftest` opens one per case).
#[derive(Default)]
pub struct Factory {
    gpu: SharedGpu,
}

impl Factory {
    pub fn new() -> Factory {
        Factory::default()
    }
    pub fn open(&mut self, choice: Choice, o: &Options) -> Result<(Box<dyn Backend>, BackendInfo)> {
        let kind = choice.resolve(o.kernels_dir.as_deref());
        // Kernel sources are CUDA's: on the mirror they would be ignored, and the run would not test them.
        if let (Kind::Cpu, Some(d)) = (kind, &o.kernels_dir) {
            return Err(crate::error::Error::Usage(format!(
                "--kernels {}: the CPU mirror compiles no kernels; use --backend cuda (or drop --kernels)",
                d.display()
            )));
        }
        let kv = o.kv_format;
        let mut b: Box<dyn Backend> = match kind {
            Kind::Cpu => Box::new(CpuMirror::new(o.dtype).with_kv_format(o.kv_format)),
            Kind::Capture => {
                return Err(crate::error::Error::Usage(
                    "a capture is opened by run --capture, not by a backend choice".into(),
                ))
            }
            Kind::Cuda => {
                let opts = super::cuda::CudaOptions {
                    dtype: o.dtype,
                    kernels_dir: o.kernels_dir.clone(),
                    debug: true,
                    force_scalar: false,
                };
                let b = SharedCuda::open(&mut self.gpu, opts)?.with_kv_format(kv);
                // The reference's and the local view's fp64 products on the same GPU.
                super::cuda::dgemm::install()?;
                Box::new(b)
            }
        };
        if let Some(cmd) = &o.runner {
            b = Box::new(
                RunnerBackend::open(cmd, b, o.dtype, o.runner_page_moved)?.with_kv_format(kv)?,
            );
        }
        let info = BackendInfo::of(kind, b.as_ref());
        Ok((b, info))
    }
}

/// Open one backend (with its own GPU state).
pub fn open(choice: Choice, o: &Options) -> Result<(Box<dyn Backend>, BackendInfo)> {
    Factory::new().open(choice, o)
}

/// Which optimized path a command runs and how it is made, before the run decides its dtype and page
/// (`run`, `replay`, `sweep`; the command line's backend options, as plain values).
#[derive(Debug, Clone)]
pub struct Spec {
    pub choice: Choice,
    /// CUDA: compile the kernels in this directory instead of the built-in ones.
    pub kernels_dir: Option<PathBuf>,
    /// An external runner command over the chosen backend (docs/runners.md).
    pub runner: Option<String>,
    /// Seconds a runner may take to describe itself or answer one request.
    pub runner_timeout: u64,
    /// The latent cache's byte format.
    pub kv_format: crate::kv_format::KvFormat,
}

impl Default for Spec {
    fn default() -> Spec {
        Spec {
            choice: Choice::Auto,
            kernels_dir: None,
            runner: None,
            runner_timeout: super::runner::protocol::DEFAULT_TIMEOUT_S,
            kv_format: crate::kv_format::KvFormat::Auto,
        }
    }
}

impl Spec {
    /// The backend for a run in `dtype`, with its facts for the report; `runner_page_moved`: the page
    /// the run moved to one the runner takes (the runner backend's notice).
    pub fn open(
        &self,
        dtype: Dtype,
        runner_page_moved: Option<(usize, usize)>,
    ) -> Result<(Box<dyn Backend>, BackendInfo)> {
        super::runner::protocol::set_timeout(self.runner_timeout);
        open(
            self.choice,
            &Options {
                dtype,
                kernels_dir: self.kernels_dir.clone(),
                runner: self.runner.clone(),
                runner_page_moved,
                kv_format: self.kv_format,
            },
        )
    }
}
