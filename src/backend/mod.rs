//! Optimized paths: what a serving engine computes, at its precision, on its schedule.
//! `cpu` is the CPU mirror (the executable specification of the fused path); `cuda` runs the kernels in
//! `kernels/` through NVRTC.
//!
//! The contract, for whoever adds a backend (an external kernel runner, another GPU API):
//! - implement [`Backend`] in one file: `run_layer(ctx, x)` computes one layer's attention from the
//!   [`LayerCtx`] (config, weights, rope tables, schedule and block table, the faults active in this
//!   layer) and returns its stage trace; `provides` names the stages that trace holds (a stage left
//!   out is reported as "not provided", never compared silently; a stage claimed but missing is an
//!   error); `describe` and `device` say what it is for the report;
//! - add one [`Kind`] and one line in [`open::Factory::open`] that builds it.
//!
//! Everything else (schedule, rope, faults, comparison, reports) stays where it is: a backend owns no
//! run state beyond its device and its storage precision.

pub mod common;
pub mod cpu;
pub mod cuda;
pub mod open;
pub mod runner;
pub mod serving;

pub use crate::tiles::{KeyTile, KeyTiles};
pub use open::{open, BackendInfo, Choice, Factory, Kind, Options};

use crate::error::Result;
use crate::faults::Active;
pub use crate::judging::{Judging, SparseLayers};
use crate::model::{LayerWeights, MlaConfig, RopeFactors};
use crate::rope::RopeTables;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, StageSet};
use ndarray::Array2;

/// Everything one layer run needs, made once per run by the driver (`crate::run`), so that every backend
/// sees the same tables and faults.
#[derive(Clone, Copy)]
pub struct LayerCtx<'a> {
    pub cfg: &'a MlaConfig,
    pub weights: &'a LayerWeights,
    /// The layer's index in the model (`weights.layer`).
    pub layer: usize,
    /// cos/sin tables (f64) of the run's positions, with the model's LongRoPE factors if it has them;
    /// a backend rounds them to its own precision.
    pub rope: &'a RopeTables,
    pub sched: &'a Schedule,
    /// `sched.block_table()`: logical page → physical page of the paged cache.
    pub block_table: &'a [usize],
    /// Planted bugs active in this layer (`mla-diff run --inject`); `Active::NONE` for a real run.
    pub faults: Active,
    /// DSA: the keys each query attends to (`run::dsa`); `None` for dense attention.
    pub selection: Option<&'a crate::reference::sparse::Selection>,
}

/// What a run computes once for all its layers: the rope tables and the block table.
pub struct RunTables {
    pub rope: RopeTables,
    pub block_table: Vec<usize>,
}

impl RunTables {
    pub fn new(
        cfg: &MlaConfig,
        factors: Option<&RopeFactors>,
        sched: &Schedule,
    ) -> Result<RunTables> {
        Ok(RunTables {
            rope: RopeTables::for_run(cfg, factors, sched.pos_offset, sched.total_tokens())?,
            block_table: sched.block_table(),
        })
    }
    /// The context of one layer on this run's tables.
    pub fn ctx<'a>(
        &'a self,
        cfg: &'a MlaConfig,
        weights: &'a LayerWeights,
        sched: &'a Schedule,
        faults: Active,
    ) -> LayerCtx<'a> {
        LayerCtx {
            cfg,
            weights,
            layer: weights.layer,
            rope: &self.rope,
            sched,
            block_table: &self.block_table,
            faults,
            selection: None,
        }
    }
}

/// An optimized attention path that produces a stage trace for one layer.
pub trait Backend {
    /// A short description for reports ("cpu-mirror (bf16, f32 accumulation)", "cuda: NVIDIA H200 …").
    fn describe(&self) -> String;
    /// The accelerator it runs on, for the report's `environment.gpu` (`None` on the CPU).
    fn device(&self) -> Option<String> {
        None
    }
    /// The stages `run_layer`'s trace holds (for a schedule with decode steps; decode-only stages are
    /// absent from every trace when there are none).
    fn provides(&self) -> StageSet;
    /// Run one layer's attention on `ctx.sched`. `x` is the layer input `[T, hidden]` (before attn_norm).
    fn run_layer(&mut self, ctx: &LayerCtx, x: &Array2<f64>) -> Result<LayerTrace>;
    /// Whether `run_layer` reads only the weights as stored in its dtype (`LayerWeights::stored`) and
    /// never the file's values (no fp64 of its own over them, as a capture's or `--tp`'s): a run may
    /// then round a layer's weights in place once its reference has read them
    /// (`LayerWeights::round_in_place`, `run::footprint`). `false` keeps the file's values.
    fn reads_stored_weights_only(&self) -> bool {
        false
    }
    /// How the judges read its traces: the stage-local view's model of its roundings, the stages left
    /// to the end-to-end checks, its DSA abilities, its key tiles ([`Judging`]). The default is a
    /// dense path with an online softmax, the conservative score sum, no tiles (`Judging::default`). Asked before the
    /// run (DSA, selftest) and after each layer (the view), so a path may answer from its last layer.
    fn judging(&self) -> Judging {
        Judging::default()
    }
    /// DSA: this path's own lightning indexer on the layer input `x` (with `ctx.faults`); `None`: it has
    /// none, and the run stands in the CPU mirror's at the run's dtype, without faults (`run::dsa`).
    fn indexer(
        &mut self,
        _ctx: &LayerCtx,
        _ic: &crate::model::IndexerConfig,
        _iw: &crate::model::IndexerWeights,
        _x: &Array2<f64>,
        _keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        Ok(None)
    }
    /// glm5-next: this path's own k-pool indexer on the layer input `x`, with a full layer's k-pool
    /// tensors `kw` (and `ctx.faults`); `None`: it has none, and the run stands in the CPU mirror's at
    /// the run's dtype, without faults (`run::kpool`).
    fn kpool_indexer(
        &mut self,
        _ctx: &LayerCtx,
        _k: &crate::model::KpoolIndexer,
        _kw: &crate::model::KpoolLayer,
        _x: &Array2<f64>,
        _keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        Ok(None)
    }
    /// DSA: where query token `t` of the run came from, for a failing selection's message (a capture
    /// names its step and position); `None`: the token index says it.
    fn query_origin(&self, _t: usize) -> Option<String> {
        None
    }
    /// What the report should say about this backend after the run (e.g. a runner that returned its
    /// LSE in bf16); every format shows it.
    fn notices(&self) -> Vec<String> {
        Vec::new()
    }
    /// Decode requests its decode kernel ran besides the schedule's steps (a runner's serving batch,
    /// `crate::batch`): the coverage section counts them too.
    fn decode_extra(&self, _sched: &Schedule) -> Vec<crate::batch::Request> {
        Vec::new()
    }

    /// The production variants (`tiles::variants` ids) it ran batches aimed at (`serving::aims`,
    /// `serving::sparse_aim`): the coverage section lists them reached.
    fn aimed_variants(&self) -> Vec<String> {
        Vec::new()
    }

    /// Coverage warnings of its own: what it kept the schedule from reaching (a runner's `supports`).
    fn coverage_notes(&self, _sched: &Schedule) -> Vec<String> {
        Vec::new()
    }

    /// The runner of a `--runner` run, for the report's `environment.runner`; `None` for every other
    /// backend.
    fn runner(&self) -> Option<runner::RunnerInfo> {
        None
    }

    /// A runner's checks beyond the stages (`runner::checks`); `None` for every other backend.
    fn runner_checks(&self) -> Option<runner::checks::RunnerChecks> {
        None
    }

    /// The attention kernels it ran for `sched`, one per phase, with their tile geometry where it is
    /// known: the report's coverage section is computed from them (`crate::coverage`). Asked after the
    /// run. The default is an optimized path of unknown inside, whose tile classes are then reported
    /// unknown.
    fn kernels(&self, _cfg: &MlaConfig, _sched: &Schedule) -> Vec<crate::kernel_use::KernelUse> {
        use crate::kernel_use::{Family, KernelUse, Phase};
        [Phase::Prefill, Phase::Decode]
            .into_iter()
            .map(|phase| KernelUse {
                phase,
                family: Family::External,
                label: self.describe(),
                geometry: None,
                production: None,
            })
            .collect()
    }
}
