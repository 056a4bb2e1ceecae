//! DeepSeek-V4 attention on the GPU (docs/deepseek-v4.md), beside the V4 CPU mirror
//! (`backend::cpu::v4`, whose module doc is the specification it is held to), in the stages of
//! `trace::V4Stage`: the projections on cuBLAS in the run's dtype with f32 accumulation, RMSNorm and rope
//! by kernels/norm_rope.cu (the per-head q norm with unit weights, the de-rotation with −sin), and
//! kernels/v4/ for what MLA's kernels do not do: the compressors (`v4_compress`: pooling, norm and rope
//! of each entry a pass closes), the CSA indexer (`v4_index_scores`, `v4_index_topk`) and attention
//! over window rows ∪ compressed entries with the sink (`v4_attn`).
//!
//! A layer runs forward pass by forward pass (the schedule's prompt chunks, then its decode steps), on
//! each pass's tokens: attn_in, q_a, q, the window cache rows, each compressor's kv and gate projections
//! (its carried state: every fed token's, kept in NaN-poisoned buffers, so that a read of a token not yet
//! fed shows), the indexer's queries and head weights; then the entries the pass closes, each query's
//! selection, its attention. After the last pass, the de-rotation and the grouped output projection.
//! Nothing of the layer is computed on the host but the rope tables (f64 angles as f32, as the mirror's).
//!
//! Planted bugs: the four V4 faults are compiled into kernels/v4/ (`-D MLA_FAULT_…=1`: the window edge,
//! the compressor's groups and its state in v4/v4.cuh, the sink in v4/attn.cu); the host sizes its
//! launches by `plan`, the same arithmetic with the same faults.

mod layer;
pub mod plan;

use super::blas::Blas;
use super::device::Gpu;
use super::kernels::Kernels;
use super::nvrtc;
use crate::error::Result;
use crate::faults::Active;
use crate::model::v4::{V4Config, V4Weights};
use crate::precision::Dtype;
use crate::reference::v4::V4Layer;
use ndarray::ArrayView2;
use std::ops::Range;

/// The label of the kernels a V4 layer runs, for the report's coverage section.
pub const KERNELS: &str = "cuda DeepSeek-V4: v4_attn (one warp per query head, 32-key tiles; window + compressed entries, sink), v4_compress, v4_index_scores/v4_index_topk, cuBLAS projections";

/// The GPU, its kernels and cuBLAS, in one dtype.
pub struct V4Cuda {
    gpu: Gpu,
    kernels: Kernels,
    blas: Blas,
    pub dtype: Dtype,
}

impl V4Cuda {
    /// GPU 0 with the embedded kernels, or those of `kernels_dir` (`--kernels`).
    pub fn new(dtype: Dtype, kernels_dir: Option<&std::path::Path>) -> Result<V4Cuda> {
        let src = nvrtc::Sources::load(kernels_dir)?;
        // The driver first: "no GPU" is the more useful message on a machine without either.
        let gpu = Gpu::open()?;
        nvrtc::nvrtc_present()?;
        let blas = Blas::new()?;
        let kernels = Kernels::new(src, &gpu);
        Ok(V4Cuda {
            gpu,
            kernels,
            blas,
            dtype,
        })
    }

    pub fn describe(&self) -> String {
        let i = &self.gpu.info;
        format!(
            "cuda: {} (sm_{}{}, {} SMs), DeepSeek-V4 kernels ({} storage, f32 accumulation)",
            i.name,
            i.cc.0,
            i.cc.1,
            i.sms,
            self.dtype.name()
        )
    }

    pub fn device(&self) -> String {
        self.gpu.info.name.clone()
    }

    /// Layer `layer` on `x` (`[T, E]`, positions `0..T`) over the forward passes `passes`, with the
    /// faults `faults`: its stages in the reference's layout, as `V4Mirror::run_layer` gives them.
    pub fn run_layer(
        &mut self,
        c: &V4Config,
        w: &V4Weights,
        layer: usize,
        x: ArrayView2<f64>,
        passes: &[Range<usize>],
        faults: Active,
    ) -> Result<V4Layer> {
        layer::check_dims(c)?;
        self.gpu.bind()?;
        let fns = layer::Fns::load(&mut self.kernels, c, self.dtype, faults)?;
        let l = layer::Layer::new(&self.blas, fns, c, w, layer, x, self.dtype, faults)?;
        for p in passes {
            l.pass(p)?;
        }
        l.finish()?;
        let tr = l.trace();
        self.gpu
            .sync("the DeepSeek-V4 layer's kernels (an earlier launch may have faulted)")?;
        tr
    }
}

#[cfg(test)]
mod tests {
    use super::layer::Fns;
    use crate::backend::cuda::nvrtc::{self, Sources};
    use crate::faults::{Active, Fault};
    use crate::model::v4::V4Config;
    use crate::precision::Dtype;

    /// The modules a V4 layer loads compile with exactly the defines it gives them (the golden's head
    /// of 80 with rope 16, every V4 fault on; `kernels check` compiles the units at the MLA dim sets),
    /// where NVRTC and the CUDA headers are present (CI's wheels); skipped with a line otherwise.
    #[test]
    fn a_layers_modules_compile_with_its_defines() {
        if nvrtc::nvrtc_present().is_err() || nvrtc::include_paths().is_empty() {
            eprintln!("SKIPPED: no NVRTC or CUDA headers (LD_LIBRARY_PATH, MLA_DIFF_CUDA_INCLUDE)");
            return;
        }
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/golden/deepseek-v4.gguf");
        let c = V4Config::from_gguf(&crate::gguf::GgufFile::open(&p).unwrap()).unwrap();
        let faults = [
            Fault::WindowOffByOne,
            Fault::CompressGroupOffByOne,
            Fault::CompressorStateDropped,
            Fault::SinkDropped,
        ]
        .iter()
        .fold(Active::NONE, |a, f| a.with(*f));
        let mods = Fns::modules(&c, Dtype::Bf16, faults);
        assert!(mods[1].1.contains(&("V4_D".into(), "80".into())));
        assert!(mods[0].1.contains(&("MLA_R".into(), "16".into())));
        let jobs: Vec<nvrtc::Job> = mods
            .iter()
            .map(|(u, d)| (*u, d.clone(), "sm_90a", false))
            .collect();
        for (r, (u, _)) in nvrtc::compile_all(&Sources::embedded(), &jobs)
            .into_iter()
            .zip(&mods)
        {
            let c = r.unwrap_or_else(|e| panic!("{u}: {e}"));
            assert!(c.cubin.is_some_and(|b| b.starts_with(b"\x7fELF")), "{u}");
        }
    }
}
