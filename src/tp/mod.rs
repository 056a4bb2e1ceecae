//! `run --tp N`: the layer as a tensor-parallel engine runs it. Serving engines run
//! DeepSeek-V3 with TP-8: each GPU holds 16 of the 128 heads and its kernels see only those. Rank r runs
//! its heads of q_b, k_b/v_b and its columns of o_proj (`slice.rs`), its partial o_proj output is
//! all-reduced (summed) across the ranks, and the result is the layer's attn_out.
//!
//! [`TpBackend`] wraps the optimized path: each layer runs once per rank on the rank's slice, and the
//! ranks' traces are gathered (per-head stages along the head axis, attn_out all-reduced) into the whole
//! layer's trace, which the run compares with the whole layer's fp64 reference as usual: the *merged*
//! result. Each rank's own trace is also compared with the fp64 reference of its slice (its own error,
//! attn_out being its partial): the *per-rank* results, in the report's `tp` section. A failing rank fails
//! the run and is named in the verdict, so a bug in one rank's kernel is attributed to that rank.

pub mod slice;

use crate::backend::{Backend, Judging, LayerCtx};
use crate::compare::{self, LayerResult, ToleranceTable};
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::report::tp::TpResult;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, StageSet};
use ndarray::Array2;

/// The tensor-parallel split of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpSpec {
    /// N: ranks sharing the heads.
    pub size: usize,
    /// Plant the run's `--inject` faults in this rank only (`--inject-rank`); in every rank when `None`.
    pub fault_rank: Option<usize>,
}

impl TpSpec {
    /// Check the spec against the model: N divides the heads, the ranks exist.
    pub fn check(&self, cfg: &MlaConfig) -> Result<()> {
        slice::check_size(cfg, self.size)?;
        if let Some(r) = self.fault_rank.filter(|&r| r >= self.size) {
            return Err(Error::Usage(format!(
                "--inject-rank {r}: --tp {} has ranks 0..{}",
                self.size, self.size
            )));
        }
        Ok(())
    }
}

/// The optimized path run as N tensor-parallel ranks (see the module's documentation).
pub struct TpBackend<'a> {
    inner: &'a mut dyn Backend,
    spec: TpSpec,
    dtype: Dtype,
    tolerances: ToleranceTable,
    /// Per rank that runs: its layer results, the first call of each layer only (the deciding mode's;
    /// `--repeat` calls the same layer again).
    results: Vec<(usize, Vec<LayerResult>)>,
}

impl<'a> TpBackend<'a> {
    pub fn new(
        inner: &'a mut dyn Backend,
        spec: TpSpec,
        dtype: Dtype,
        tolerances: ToleranceTable,
    ) -> TpBackend<'a> {
        let results = (0..spec.size).map(|r| (r, Vec::new())).collect();
        TpBackend {
            inner,
            spec,
            dtype,
            tolerances,
            results,
        }
    }

    /// The per-rank results of the run's `layers`, for the report (a shard also ran the layers before
    /// its slice, to make its inputs: those are not its results).
    pub fn result(self, cfg: &MlaConfig, layers: &[usize]) -> TpResult {
        let size = self.spec.size;
        let ranks = self
            .results
            .into_iter()
            .map(|(rank, mut ls)| {
                ls.retain(|l| layers.contains(&l.layer));
                let h = slice::heads(cfg, size, rank);
                (rank, [h.start, h.end], ls)
            })
            .collect();
        TpResult::new(size, self.spec.fault_rank, ranks)
    }
}

impl Backend for TpBackend<'_> {
    fn describe(&self) -> String {
        format!(
            "{}, tensor parallel {}",
            self.inner.describe(),
            self.spec.size
        )
    }
    fn device(&self) -> Option<String> {
        self.inner.device()
    }
    fn provides(&self) -> StageSet {
        self.inner.provides()
    }
    fn notices(&self) -> Vec<String> {
        let mut n = self.inner.notices();
        if self.spec.size > 1 {
            n.push(format!(
                "tensor parallel {}: the merged attn_out is judged end to end (calibrated tolerances), not by the stage-local view, which models one o_proj GEMM and not the all-reduce of {} partial outputs each stored in the run's dtype",
                self.spec.size, self.spec.size
            ));
        }
        n
    }
    /// The inner path's attention; a merged attn_out of more than one rank sums partials the local
    /// view does not model. No DSA through tp (refused past top_k, as before the descriptor).
    fn judging(&self) -> Judging {
        Judging {
            outside_local_view: match self.spec.size {
                1 => StageSet::NONE,
                _ => StageSet::NONE.with(crate::trace::Stage::AttnOut),
            },
            ..self.inner.judging().attention_only()
        }
    }
    fn kernels(&self, cfg: &MlaConfig, sched: &Schedule) -> Vec<crate::kernel_use::KernelUse> {
        // The kernels saw a rank's heads.
        self.inner
            .kernels(&slice::rank_config(cfg, self.spec.size), sched)
    }

    fn run_layer(&mut self, ctx: &LayerCtx, x: &Array2<f64>) -> Result<LayerTrace> {
        let size = self.spec.size;
        let cfg_r = slice::rank_config(ctx.cfg, size);
        let first_call = self
            .results
            .first()
            .is_none_or(|(_, ls)| ls.last().is_none_or(|l| l.layer != ctx.layer));
        let mut traces = Vec::with_capacity(size);
        for rank in 0..size {
            let w = slice::rank_weights(ctx.cfg, ctx.weights, size, rank);
            let reference = crate::reference::run_layer(&cfg_r, &w, ctx.rope, x, ctx.sched)?;
            let faults = match self.spec.fault_rank {
                Some(f) if f != rank => Active::NONE,
                _ => ctx.faults,
            };
            let rctx = LayerCtx {
                cfg: &cfg_r,
                weights: &w,
                faults,
                ..*ctx
            };
            let opt = self.inner.run_layer(&rctx, x)?;
            if first_call {
                let cctx = compare::Ctx {
                    layer: ctx.layer,
                    elementwise: true,
                    sched: ctx.sched,
                    block_table: ctx.block_table,
                    provided: self.inner.provides(),
                };
                // Judged as shadow mode judges a layer: with the stage-local view of the rank's slice.
                let local = compare::local::compute(
                    &compare::local::Inputs {
                        weights: &w,
                        frame: compare::local::Frame {
                            cfg: &cfg_r,
                            rope: ctx.rope,
                            sched: ctx.sched,
                            x,
                            dtype: self.dtype,
                            provided: self.inner.provides(),
                            judging: &self.inner.judging(),
                        },
                    },
                    &opt,
                );
                let r = compare::compare_layer(
                    &cctx,
                    &reference,
                    &opt,
                    self.dtype,
                    &self.tolerances,
                    Some(&local),
                )?;
                if let Some((_, ls)) = self.results.iter_mut().find(|(q, _)| *q == rank) {
                    ls.push(r);
                }
            }
            traces.push(opt);
        }
        Ok(slice::gather(&traces, self.dtype))
    }
}
