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
    /// DSA: whether `run_layer` attends over `ctx.selection` only (sparse attention). A run past a DSA
    /// file's top_k refuses a backend that does not (`run::dsa`).
    fn sparse(&self) -> bool {
        false
    }
    /// Whether the serving batches it runs read their cache through the layer's cache format
    /// (`--kv-cache-dtype`): a fault of a write launch over several requests (`faults::BATCH_CHECK`)
    /// shows only there (the CPU mirror's batches do; CUDA's take the dtype's rows so far).
    fn batch_cache_in_format(&self) -> bool {
        false
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
    /// DSA: whether `indexer` is this path's own (planted indexer faults reach it); without one the run's
    /// stand-in (the CPU mirror's) takes no faults, so the selftest leaves the indexer faults out.
    fn has_indexer(&self) -> bool {
        false
    }
    /// DSA: where query token `t` of the run came from, for a failing selection's message (a capture
    /// names its step and position); `None`: the token index says it.
    fn query_origin(&self, _t: usize) -> Option<String> {
        None
    }
    /// DSA: whether its sparse prefill attends in the absorbed form over the cache rows (FlashMLA's
    /// sparse prefill, CUDA's `sparse_attn`), not decompressed over the own chunk and the context. The
    /// stage-local view does not model that form (its shared q_abs rounding moves every score of a row
    /// together: measured on the H200, prefill lse 4× the predicted error), so such a backend's sparse
    /// layers have none and are judged end to end (docs/dsa.md).
    fn sparse_prefill_absorbed(&self) -> bool {
        false
    }
    /// Stages whose stage-local view (`compare::local`) does not model this path, judged end to end
    /// instead: a tensor-parallel all-reduce's roundings of the partial o_proj outputs (`crate::tp`).
    fn outside_local_view(&self) -> StageSet {
        StageSet::NONE
    }
    /// Whether its attention is known to the stage-local view: P computed as exp(s − m) against a
    /// running row max before P·V (an online softmax: the max key's P is exactly 1, a key's P rounded
    /// in its binade against the final max unless its tile came before the max's), and `attn_latent`
    /// the LSE combine of the split partials it stores. External kernels are not known to do either
    /// (numpy's normalises P first and computes `attn_latent` apart from its splits): the view then
    /// takes every P, the max's too, rounded at the worst place of its binade, and the stored partials
    /// with the noise of a fresh computation.
    fn known_attention(&self) -> bool {
        true
    }
    /// How it sums an attention score's dot product: the stage-local view models that sum's noise
    /// (and, on tensor cores, the truncating accumulator's one-signed bias: on the H200 most of a GLM-5
    /// split_lse's error). Unknown kernels get the conservative model.
    fn score_sum(&self) -> crate::precision::ScoreSum {
        crate::precision::ScoreSum::Sequential
    }
    /// What the report should say about this backend after the run (e.g. a runner that returned its
    /// LSE in bf16); every format shows it.
    fn notices(&self) -> Vec<String> {
        Vec::new()
    }
    /// The key counts at which its attention kernels' loop structure changes (tiles, per-warp key
    /// slices), per phase: what `mla-diff sweep` puts boundary lengths around. A GPU backend knows its
    /// tiles once a layer has chosen them, so this is asked after a run; empty when unknown.
    fn key_tiles(&self) -> KeyTiles {
        KeyTiles::default()
    }

    /// The attention kernels it ran for `sched`, one per phase, with their tile geometry where it is
    /// known: the report's coverage section is computed from them (`crate::coverage`). Asked after the
    /// run. The default is an optimized path of unknown inside, whose tile classes are then reported
    /// unknown.
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
