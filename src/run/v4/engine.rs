//! The optimized path of a V4 run: the CPU mirror (`backend::cpu::v4`) or the CUDA kernels
//! (`backend::cuda::v4`), one layer at a time, each giving the stages of `trace::V4Stage`.

use crate::backend::cpu::v4::V4Mirror;
use crate::backend::cuda::v4::V4Cuda;
use crate::error::Result;
use crate::faults::Active;
use crate::kernel_use::Family;
use crate::model::v4::{V4Config, V4Weights};
use crate::precision::Dtype;
use crate::reference::v4::V4Layer;
use ndarray::ArrayView2;
use std::ops::Range;
use std::path::PathBuf;

/// Which optimized path a V4 run takes (`run --backend`; `auto`: CUDA with a GPU present, as for MLA).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum V4Backend {
    #[default]
    Cpu,
    /// The CUDA kernels, from `kernels_dir` (`--kernels`) if given.
    Cuda { kernels_dir: Option<PathBuf> },
}

/// An opened optimized path.
pub enum Engine {
    Mirror(V4Mirror),
    Cuda(Box<V4Cuda>),
}

impl Engine {
    pub fn open(b: &V4Backend, dtype: Dtype) -> Result<Engine> {
        Ok(match b {
            V4Backend::Cpu => Engine::Mirror(V4Mirror::new(dtype)),
            V4Backend::Cuda { kernels_dir } => {
                Engine::Cuda(Box::new(V4Cuda::new(dtype, kernels_dir.as_deref())?))
            }
        })
    }

    pub fn run_layer(
        &mut self,
        c: &V4Config,
        w: &V4Weights,
        layer: usize,
        x: ArrayView2<f64>,
        passes: &[Range<usize>],
        faults: Active,
    ) -> Result<V4Layer> {
        match self {
            Engine::Mirror(m) => Ok(m.run_layer(c, w, layer, x, passes, faults)),
            Engine::Cuda(g) => g.run_layer(c, w, layer, x, passes, faults),
        }
    }

    /// The report's `run.backend`.
    pub fn name(&self) -> &'static str {
        match self {
            Engine::Mirror(_) => "cpu",
            Engine::Cuda(_) => "cuda",
        }
    }

    /// The report's `environment.backend`.
    pub fn describe(&self) -> String {
        match self {
            Engine::Mirror(m) => format!(
                "cpu-mirror DeepSeek-V4 ({} storage, f32 accumulation)",
                m.dtype.name()
            ),
            Engine::Cuda(g) => g.describe(),
        }
    }

    pub fn gpu(&self) -> Option<String> {
        match self {
            Engine::Mirror(_) => None,
            Engine::Cuda(g) => Some(g.device()),
        }
    }

    /// What the coverage section names as the kernel of each phase.
    pub fn kernel(&self) -> (Family, &'static str) {
        match self {
            Engine::Mirror(_) => (
                Family::Mirror,
                "cpu-mirror DeepSeek-V4 (window + compressed attention, sink)",
            ),
            Engine::Cuda(_) => (Family::Scalar, crate::backend::cuda::v4::KERNELS),
        }
    }

    /// The first line of every report's notices: what was compared.
    pub fn notice(&self) -> &'static str {
        match self {
            Engine::Mirror(_) => "DeepSeek-V4: the CPU mirror of V4 attention against the fp64 reference; shadow mode only; every stage judged end to end by the V4 tolerance table (no stage-local view yet); the attention judged over the mirror's own CSA selection, the selection by topk_indices; the schedule's page size and splits do not apply (no paged cache or split-KV in the V4 mirror)",
            Engine::Cuda(_) => "DeepSeek-V4: the CUDA kernels of V4 attention (kernels/v4/, every stage computed on the GPU) against the fp64 reference; shadow mode only; every stage judged end to end by the V4 tolerance table (no stage-local view yet); the attention judged over the kernels' own CSA selection, the selection by topk_indices; the schedule's page size and splits do not apply (no paged cache or split-KV in the V4 kernels)",
        }
    }
}
