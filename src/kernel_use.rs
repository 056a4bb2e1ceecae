//! Which attention kernel ran a phase and how it cuts the work: what a backend reports
//! (`Backend::kernels`) and the coverage section counts boundary classes from (`coverage`). A ground-floor
//! value: backends below coverage name it, so it imports nothing of ours.

use serde::{Deserialize, Serialize};

/// The two attention phases of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Prefill,
    Decode,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

/// What kind of kernel ran a phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// The CPU mirror (the fused path's specification).
    Mirror,
    /// CUDA `attn_scalar`: one warp per row, 32-key tiles.
    Scalar,
    /// CUDA `attn_mma`: mma.sync tensor cores.
    Mma,
    /// CUDA `attn_wgmma`: Hopper's warpgroup MMA.
    Wgmma,
    /// A kernel mla-diff does not know the inside of (a runner).
    External,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Mirror => "mirror",
            Family::Scalar => "scalar",
            Family::Mma => "mma",
            Family::Wgmma => "wgmma",
            Family::External => "external",
        }
    }
}

/// How a kernel cuts a phase's work: what the classes are computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Geometry {
    /// Rows one CTA takes: decode (query, head) rows, prefill queries of one head.
    pub rows_per_cta: usize,
    /// Keys per tile of the online softmax.
    pub keys_per_tile: usize,
    /// Warp or warpgroup groups a tile's keys are split between when scoring (1: none).
    pub key_slices: usize,
    /// Key tiles in flight in the load pipeline (1: no pipeline).
    pub stages: usize,
    /// Each row cuts its key range at its own causal limit; otherwise the CTA's range ends at the limit
    /// of its last row and the other rows mask (`att_key_range`).
    pub per_row_ranges: bool,
}

/// The kernel the device would use for these dims in production, when another one ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Production {
    pub family: Family,
    pub label: String,
    /// Why it did not run, and what would run it.
    pub why: String,
}

/// The kernel that ran one phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelUse {
    pub phase: Phase,
    pub family: Family,
    /// The backend's name for it ("wgmma 2 warpgroups bn64 st2", "cpu-mirror, 64-key tiles").
    pub label: String,
    /// `None`: unknown (an external kernel): its tile classes are reported unknown.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub geometry: Option<Geometry>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub production: Option<Production>,
}

impl KernelUse {
    /// `family: label`, as the reports print it.
    pub fn describe(&self) -> String {
        format!("{}: {}", self.family.name(), self.label)
    }
}
