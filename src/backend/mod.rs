//! Optimized paths: what a serving engine computes, at its precision, on its schedule.
//! `cpu` is the CPU mirror (the executable specification of the fused path); `cuda` runs the kernels in
//! `kernels/` through NVRTC.

pub mod cpu;
pub mod cuda;

use crate::error::Result;
use crate::model::{LayerWeights, MlaConfig};
use crate::schedule::Schedule;
use crate::trace::LayerTrace;
use serde::{Deserialize, Serialize};

/// Storage precision of weights and activations on the optimized path (accumulation is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    #[value(name = "fp16", alias = "f16")]
    #[serde(rename = "fp16", alias = "f16")]
    F16,
    F32,
}

impl Dtype {
    /// Round an f32 to this storage type and back (round-to-nearest-even; f16 overflows to ±inf).
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
            Dtype::F16 => half::f16::from_f32(x).to_f32(),
            Dtype::F32 => x,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
            Dtype::F32 => "f32",
        }
    }
}

/// An optimized attention path that produces a stage trace for one layer.
pub trait Backend {
    /// A short description for reports ("cpu-mirror", "cuda: NVIDIA H200").
    fn describe(&self) -> String;
    /// Planted bugs switched on in this path (`crate::faults`); recorded in the report.
    fn injected(&self) -> Vec<crate::faults::Injection> {
        Vec::new()
    }
    /// Run one layer's attention on the schedule. `x` is the layer input `[T, hidden]` (before attn_norm).
    fn run_layer(
        &mut self,
        cfg: &MlaConfig,
        w: &LayerWeights,
        x: &ndarray::Array2<f64>,
        sched: &Schedule,
    ) -> Result<LayerTrace>;
}
