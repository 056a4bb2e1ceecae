//! The optimized-path choice of `run`, `selftest` and `bench`, moved here verbatim from main.rs.

use clap::ValueEnum;
use mla_diff::backend::{Backend, Dtype};
use mla_diff::error::Error;
use mla_diff::faults::FaultSet;
use std::path::PathBuf;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The CPU mirror of the fused path.
    Cpu,
    /// The CUDA kernels in kernels/ (needs an NVIDIA GPU and driver).
    Cuda,
    /// CUDA when a GPU is present, else the CPU mirror.
    Auto,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SelftestBackend {
    /// The CPU mirror of the fused path.
    Cpu,
    /// The CUDA kernels (faults switched on by their MLA_FAULT_* defines).
    Cuda,
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
pub enum BenchBackend {
    Cuda,
}

/// The backend, its kind for the report ("cpu" / "cuda") and the GPU's name.
pub type Chosen = (Box<dyn Backend>, &'static str, Option<String>);

/// The CPU mirror for a file (with its LongRoPE factors) and planted faults.
pub fn cpu_mirror(
    file: &mla_diff::gguf::GgufFile,
    dtype: Dtype,
    faults: FaultSet,
) -> Result<Box<dyn Backend>, Error> {
    let cfg = mla_diff::model::MlaConfig::from_gguf(file)?;
    let factors = mla_diff::model::rope_factors::RopeFactors::load(file, &cfg)?;
    Ok(Box::new(
        mla_diff::backend::cpu::CpuMirror::new(dtype)
            .with_rope_factors(factors)
            .with_faults(faults),
    ))
}

/// The optimized backend the user asked for, its kind for the report, and the GPU name if any.
pub fn make_backend(
    choice: BackendArg,
    dtype: Dtype,
    file: &mla_diff::gguf::GgufFile,
    kernels: Option<PathBuf>,
    faults: FaultSet,
) -> Result<Chosen, Error> {
    let cpu = |file| cpu_mirror(file, dtype, faults.clone());
    match choice {
        BackendArg::Cpu => Ok((cpu(file)?, "cpu", None)),
        BackendArg::Auto
            if kernels.is_none() && !mla_diff::backend::cuda::device::gpu_present() =>
        {
            Ok((cpu(file)?, "cpu", None))
        }
        // Auto with a GPU present, or an explicit kernel directory: the GPU path (its errors are errors).
        BackendArg::Cuda | BackendArg::Auto => {
            let cfg = mla_diff::model::MlaConfig::from_gguf(file)?;
            let factors = mla_diff::model::rope_factors::RopeFactors::load(file, &cfg)?;
            let b =
                mla_diff::backend::cuda::CudaBackend::new(mla_diff::backend::cuda::CudaOptions {
                    dtype,
                    kernels_dir: kernels,
                    debug: true,
                    force_scalar: false,
                })?
                .with_rope_factors(factors)
                .with_faults(faults);
            let name = b.gpu.info.name.clone();
            Ok((Box::new(b), "cuda", Some(name)))
        }
    }
}
