//! Stage traces: the named intermediate tensors of one layer's attention, in dataflow order.
//!
//! Both sides of a comparison produce a `LayerTrace` with the same stages, shapes and axis names:
//! the fp64 reference and an optimized backend (CPU mirror, CUDA kernels, or an external kernel through
//! a capsule). Values are stored as f64 (an f32/bf16 value converts exactly). Everything is in one
//! canonical layout: rope pairs in the file's order, heads before dims, tokens in position order.

use serde::{Deserialize, Serialize};

/// One named stage of the MLA dataflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// RMSNorm(x, attn_norm): `[token, hidden]`.
    AttnIn,
    /// Per-head no-rope query part: `[token, head, dim]`.
    QNope,
    /// Per-head rope query part after rotation: `[token, head, dim]`.
    QPe,
    /// The kv latent after kv_a_norm: `[token, dim]`.
    KvLatent,
    /// The shared key rope part after rotation: `[token, dim]`.
    KPe,
    /// Rows read back from the paged latent cache, `[latent | k_pe]`, in token order: `[token, dim]`.
    CacheRows,
    /// Absorbed decode query `W_UKᵀ q_nope`: `[decode_token, head, dim]`.
    QAbsorbed,
    /// Split-KV partial outputs (latent space) of decode: `[decode_token, head, split, dim]`.
    SplitOut,
    /// Split-KV partial log-sum-exps (natural log; −inf for an empty split): `[decode_token, head, split]`.
    SplitLse,
    /// Decode attention output in latent space, after the split combine: `[decode_token, head, dim]`.
    AttnLatent,
    /// Log-sum-exp of the scaled scores per query and head (natural log): `[token, head]`.
    Lse,
    /// Per-head attention output in v space: `[token, head, dim]`.
    AttnHeads,
    /// Layer attention output after o_proj: `[token, hidden]`.
    AttnOut,
}

impl Stage {
    /// All stages in dataflow order.
    pub const ALL: [Stage; 13] = [
        Stage::AttnIn,
        Stage::QNope,
        Stage::QPe,
        Stage::KvLatent,
        Stage::KPe,
        Stage::CacheRows,
        Stage::QAbsorbed,
        Stage::SplitOut,
        Stage::SplitLse,
        Stage::AttnLatent,
        Stage::Lse,
        Stage::AttnHeads,
        Stage::AttnOut,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Stage::AttnIn => "attn_in",
            Stage::QNope => "q_nope",
            Stage::QPe => "q_pe",
            Stage::KvLatent => "kv_latent",
            Stage::KPe => "k_pe",
            Stage::CacheRows => "cache_rows",
            Stage::QAbsorbed => "q_absorbed",
            Stage::SplitOut => "split_out",
            Stage::SplitLse => "split_lse",
            Stage::AttnLatent => "attn_latent",
            Stage::Lse => "lse",
            Stage::AttnHeads => "attn_heads",
            Stage::AttnOut => "attn_out",
        }
    }
    pub fn from_name(s: &str) -> Option<Stage> {
        Stage::ALL.iter().copied().find(|st| st.name() == s)
    }
    /// Axis names, outermost first.
    pub fn axes(self) -> &'static [&'static str] {
        match self {
            Stage::AttnIn | Stage::AttnOut => &["token", "hidden"],
            Stage::QNope | Stage::QPe | Stage::AttnHeads => &["token", "head", "dim"],
            Stage::KvLatent | Stage::KPe | Stage::CacheRows => &["token", "dim"],
            Stage::QAbsorbed | Stage::AttnLatent => &["decode_token", "head", "dim"],
            Stage::SplitOut => &["decode_token", "head", "split", "dim"],
            Stage::SplitLse => &["decode_token", "head", "split"],
            Stage::Lse => &["token", "head"],
        }
    }
    /// Position in dataflow order.
    pub fn order(self) -> usize {
        Stage::ALL.iter().position(|&s| s == self).unwrap()
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of stages: what a backend declares it provides (`Backend::provides`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StageSet(u16);

impl StageSet {
    pub const NONE: StageSet = StageSet(0);
    pub const ALL: StageSet = StageSet((1 << Stage::ALL.len()) - 1);
    pub fn of(stages: &[Stage]) -> StageSet {
        stages.iter().fold(StageSet::NONE, |s, &st| s.with(st))
    }
    pub fn with(self, s: Stage) -> StageSet {
        StageSet(self.0 | 1 << s.order())
    }
    pub fn without(self, s: Stage) -> StageSet {
        StageSet(self.0 & !(1 << s.order()))
    }
    pub fn contains(self, s: Stage) -> bool {
        self.0 & (1 << s.order()) != 0
    }
}

/// One stage tensor: row-major data with the stage's axes.
#[derive(Debug, Clone, PartialEq)]
pub struct StageTensor {
    pub stage: Stage,
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl StageTensor {
    pub fn new(stage: Stage, shape: Vec<usize>, data: Vec<f64>) -> StageTensor {
        assert_eq!(
            shape.len(),
            stage.axes().len(),
            "stage {stage} has axes {:?}",
            stage.axes()
        );
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "stage {stage}: shape {shape:?} vs {} values",
            data.len()
        );
        StageTensor { stage, shape, data }
    }
    pub fn from_f32(stage: Stage, shape: Vec<usize>, data: &[f32]) -> StageTensor {
        Self::new(stage, shape, data.iter().map(|&v| v as f64).collect())
    }
    /// Decode a flat index into per-axis indices.
    pub fn unravel(&self, mut i: usize) -> Vec<usize> {
        let mut idx = vec![0; self.shape.len()];
        for (k, &d) in self.shape.iter().enumerate().rev() {
            idx[k] = i % d;
            i /= d;
        }
        idx
    }
}

/// All stage tensors of one layer, in dataflow order.
#[derive(Debug, Clone, Default)]
pub struct LayerTrace {
    pub layer: usize,
    pub stages: Vec<StageTensor>,
}

impl LayerTrace {
    pub fn new(layer: usize) -> LayerTrace {
        LayerTrace {
            layer,
            stages: Vec::new(),
        }
    }
    pub fn push(&mut self, t: StageTensor) {
        self.stages.push(t);
        self.stages.sort_by_key(|s| s.stage.order());
    }
    pub fn get(&self, stage: Stage) -> Option<&StageTensor> {
        self.stages.iter().find(|s| s.stage == stage)
    }
    pub fn get_mut(&mut self, stage: Stage) -> Option<&mut StageTensor> {
        self.stages.iter_mut().find(|s| s.stage == stage)
    }
}
