//! A capture as the optimized path of a run: `run_layer` hands back what the engine computed for the
//! layer (read and aligned by `Capture::read`), so the run's reference, comparison, stage-local view
//! and reports apply unchanged. The layer input the run passes is the captured `x` itself
//! (`input::LayerInputs::Captured`), so the fp64 reference starts where the engine's layer started.
//!
//! Tensor parallel (`tp.world_size` N > 1): each rank's capture holds its heads (`tp::slice::heads`).
//! Each rank present is compared with the fp64 reference of its slice, with its stage-local view, as
//! `run --tp` judges a rank (the report's `tp` section); the run itself sees the ranks gathered as
//! `run --tp` gathers them (per-head stages concatenated, the partial attn_out all-reduced) when all N
//! ranks were captured, else only the replicated stages (attn_in, kv_latent, k_pe, cache_rows), the
//! head stages being judged per rank.

use super::{Capture, Captured};
use crate::backend::{Backend, LayerCtx};
use crate::compare::{self, LayerResult, ToleranceTable};
use crate::error::{Error, Result};
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::trace::{LayerTrace, Stage, StageSet};
use ndarray::Array2;

/// Stages every rank computes whole (replicated), the others being per head or partial.
const REPLICATED: [Stage; 4] = [Stage::AttnIn, Stage::KvLatent, Stage::KPe, Stage::CacheRows];

pub struct CaptureBackend {
    /// `(rank, its capture)` in rank order; one entry, rank 0, without TP.
    ranks: Vec<(usize, Captured)>,
    world: usize,
    engine: String,
    provided: StageSet,
    notices: Vec<String>,
    dtype: Dtype,
    tolerances: ToleranceTable,
    /// Per rank: its layer results (TP only).
    results: Vec<(usize, Vec<LayerResult>)>,
}

fn names(s: StageSet) -> Vec<&'static str> {
    Stage::ALL
        .iter()
        .filter(|&&st| s.contains(st))
        .map(|st| st.name())
        .collect()
}

impl CaptureBackend {
    /// The captures of one run (one per TP rank), each read for the same request and layers.
    pub fn new(
        cfg: &MlaConfig,
        caps: &[(Capture, Captured)],
        dtype: Dtype,
        tolerances: ToleranceTable,
    ) -> Result<CaptureBackend> {
        let world = caps[0].0.manifest.tp.world_size;
        let ranks = ranks(cfg, caps)?;
        let every = ranks
            .iter()
            .fold(StageSet::ALL, |s, (_, c)| s.intersect(c.provided));
        let provided = if world == 1 || ranks.len() == world {
            every
        } else {
            REPLICATED
                .iter()
                .filter(|&&s| every.contains(s))
                .fold(StageSet::NONE, |s, &st| s.with(st))
        };
        let engine = engine_name(&caps[0].0.manifest);
        let notices = notices(caps, &ranks, every, provided, &engine);
        let results = ranks.iter().map(|(r, _)| (*r, Vec::new())).collect();
        Ok(CaptureBackend {
            ranks,
            world,
            engine,
            provided,
            notices,
            dtype,
            tolerances,
            results,
        })
    }

    /// The report's `run.input` besides kind, path and request: the engine, every folder, the TP
    /// ranks, the stages captured (in every rank) and those not.
    pub fn summary(&self, dirs: &[String]) -> serde_json::Value {
        let captured = self
            .ranks
            .iter()
            .fold(StageSet::ALL, |s, (_, c)| s.intersect(c.provided));
        let lacking: Vec<&str> = names(StageSet::ALL.minus(captured))
            .into_iter()
            .filter(|n| !matches!(*n, "split_out" | "split_lse"))
            .collect();
        let mut stages = vec!["x"];
        stages.extend(names(captured));
        serde_json::json!({
            "paths": dirs,
            "engine": self.engine,
            "tp": {
                "world_size": self.world,
                "ranks": self.ranks.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            },
            "stages": stages,
            "not_captured": lacking,
            "uncompared": self.ranks[0].1.uncompared,
        })
    }

    /// The report's `tp` section (TP captures only).
    pub fn tp_result(
        self,
        cfg: &MlaConfig,
        layers: &[usize],
    ) -> Option<crate::report::tp::TpResult> {
        if self.world == 1 {
            return None;
        }
        let world = self.world;
        let ranks = self
            .results
            .into_iter()
            .map(|(rank, mut ls)| {
                ls.retain(|l| layers.contains(&l.layer));
                let h = crate::tp::slice::heads(cfg, world, rank);
                (rank, [h.start, h.end], ls)
            })
            .collect();
        Some(crate::report::tp::TpResult::new(world, None, ranks))
    }

    /// One rank's trace judged against the fp64 reference of its slice (as `tp::TpBackend` judges).
    fn judge_rank(&mut self, ctx: &LayerCtx, x: &Array2<f64>, i: usize) -> Result<LayerTrace> {
        let (rank, ref c) = self.ranks[i];
        let opt = c.traces[&ctx.layer].clone();
        let cfg_r = crate::tp::slice::rank_config(ctx.cfg, self.world);
        let w = crate::tp::slice::rank_weights(ctx.cfg, ctx.weights, self.world, rank);
        let reference = crate::reference::run_layer(&cfg_r, &w, ctx.rope, x, ctx.sched)?;
        let provided = c.provided;
        let local = compare::local::compute(
            &compare::local::Inputs {
                weights: &w,
                frame: compare::local::Frame {
                    cfg: &cfg_r,
                    rope: ctx.rope,
                    sched: ctx.sched,
                    x,
                    dtype: self.dtype,
                    provided,
                    judging: &self.judging(),
                },
            },
            &opt,
        );
        let cctx = compare::Ctx {
            layer: ctx.layer,
            elementwise: true,
            sched: ctx.sched,
            block_table: ctx.block_table,
            provided,
        };
        let r = compare::compare_layer(
            &cctx,
            &reference,
            &opt,
            self.dtype,
            &self.tolerances,
            Some(&local),
        )?;
        if let Some((_, ls)) = self.results.iter_mut().find(|(q, _)| *q == rank) {
            if ls.last().is_none_or(|l| l.layer != ctx.layer) {
                ls.push(r);
            }
        }
        Ok(opt)
    }
}

impl Backend for CaptureBackend {
    fn describe(&self) -> String {
        match self.world {
            1 => format!("capture of {}", self.engine),
            n => format!("capture of {}, tensor parallel {n}", self.engine),
        }
    }
    fn provides(&self) -> StageSet {
        self.provided
    }
    fn run_layer(&mut self, ctx: &LayerCtx, x: &Array2<f64>) -> Result<LayerTrace> {
        // The run passes the captured input back; any other input has no captured counterpart.
        match self.ranks[0].1.inputs.get(&ctx.layer) {
            Some(cx) if cx == x => {}
            _ => {
                return Err(Error::Usage(format!(
                    "capture: layer {} was asked for on an input the engine did not see",
                    ctx.layer
                )))
            }
        }
        if !ctx.faults.is_empty() {
            return Err(Error::Usage(
                "--inject plants bugs in mla-diff's own optimized path, not in a capture: write the capture with --inject (run --write-capture)".into(),
            ));
        }
        if self.world == 1 {
            return Ok(self.ranks[0].1.traces[&ctx.layer].clone());
        }
        let traces = (0..self.ranks.len())
            .map(|i| self.judge_rank(ctx, x, i))
            .collect::<Result<Vec<_>>>()?;
        if self.ranks.len() == self.world {
            let mut out = crate::tp::slice::gather(&traces, self.dtype);
            out.storage = traces[0].storage.clone();
            return Ok(out);
        }
        let mut out = LayerTrace::new(ctx.layer);
        out.storage = traces[0].storage.clone();
        for t in &traces[0].stages {
            if self.provided.contains(t.stage) {
                out.push(t.clone());
            }
        }
        Ok(out)
    }
    /// An engine's attention is not known to be an online softmax with a stored split combine: the
    /// stage-local view takes the conservative model. The merged attn_out of a TP capture sums N
    /// partials the local view does not model. DSA: a capture with `topk` attended over the engine's
    /// own selection (`run_layer` hands back the captured trace whatever selection it is asked for),
    /// and that selection is its indexer's.
    fn judging(&self) -> crate::backend::Judging {
        let sparse = !self.ranks[0].1.topk.is_empty();
        crate::backend::Judging {
            known_attention: false,
            outside_local_view: match self.world {
                1 => StageSet::NONE,
                _ => StageSet::NONE.with(Stage::AttnOut),
            },
            sparse,
            has_indexer: sparse,
            ..crate::backend::Judging::default()
        }
    }
    fn notices(&self) -> Vec<String> {
        self.notices.clone()
    }
    /// The engine's own selection: its captured `topk`.
    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        ic: &crate::model::IndexerConfig,
        _iw: &crate::model::IndexerWeights,
        _x: &Array2<f64>,
        _keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        match self.ranks[0].1.topk.get(&ctx.layer) {
            Some(k) => Ok(Some(crate::reference::sparse::Selection::new(
                ic.top_k,
                k.clone(),
            ))),
            None => Err(Error::Usage(format!(
                "capture: layer {} has no topk, but this DSA run's queries see more keys than the indexer's top_k: capture the engine's selection (topk)",
                ctx.layer
            ))),
        }
    }
    fn query_origin(&self, t: usize) -> Option<String> {
        let c = &self.ranks[0].1;
        c.origin
            .get(t)
            .map(|(s, p)| format!("request {} step {s} position {p}", c.request))
    }
}

/// The captures as TP ranks, in rank order: each of the run's world size, holding its even split
/// of the heads, once, of the same request and layers and the same layer inputs as the first.
fn ranks(cfg: &MlaConfig, caps: &[(Capture, Captured)]) -> Result<Vec<(usize, Captured)>> {
    let (cap0, c0) = &caps[0];
    let world = cap0.manifest.tp.world_size;
    let mut ranks: Vec<(usize, Captured)> = Vec::new();
    for (cap, c) in caps {
        let tp = cap.manifest.tp;
        let bad = |msg: String| Error::Usage(format!("capture {}: {msg}", cap.dir.display()));
        if tp.world_size != world {
            return Err(bad(format!(
                "tp.world_size {} but {} has {world}: captures of one run share it",
                tp.world_size,
                cap0.dir.display()
            )));
        }
        if world > 1 {
            crate::tp::slice::check_size(cfg, world)?;
            let h = crate::tp::slice::heads(cfg, world, tp.rank);
            if c.heads != h {
                return Err(bad(format!(
                    "rank {} of {world} holds heads {}..{}, but an even split gives it {}..{}",
                    tp.rank, c.heads.start, c.heads.end, h.start, h.end
                )));
            }
        } else if c.heads != (0..cfg.n_head) {
            return Err(bad(format!(
                "holds heads {}..{} of the model's {} with tp.world_size 1",
                c.heads.start, c.heads.end, cfg.n_head
            )));
        }
        if ranks.iter().any(|(r, _)| *r == tp.rank) {
            return Err(bad(format!("a second capture of rank {}", tp.rank)));
        }
        if c.sched != c0.sched || c.inputs.keys().ne(c0.inputs.keys()) {
            return Err(bad(format!(
                "request {} or its layers differ from {}'s",
                c.request,
                cap0.dir.display()
            )));
        }
        // Every rank saw the same layer input; a difference means the captures are not of one run.
        if let Some(l) = c
            .inputs
            .iter()
            .find(|(l, x)| c0.inputs[*l] != **x)
            .map(|(l, _)| *l)
        {
            return Err(bad(format!(
                "its x of layer {l} differs from {}'s: not the same run",
                cap0.dir.display()
            )));
        }
        ranks.push((tp.rank, c.clone()));
    }
    ranks.sort_by_key(|(r, _)| *r);
    Ok(ranks)
}

/// The engine as the manifest names it: `name version (detail)`.
fn engine_name(m: &super::Manifest) -> String {
    let mut engine = m.engine.name.clone();
    if let Some(v) = &m.engine.version {
        engine.push(' ');
        engine.push_str(v);
    }
    if let Some(d) = &m.engine.detail {
        engine.push_str(&format!(" ({d})"));
    }
    engine
}

/// The run's notices: what was captured and not, the stored types, the TP ranks, the DSA selection.
fn notices(
    caps: &[(Capture, Captured)],
    ranks: &[(usize, Captured)],
    every: StageSet,
    provided: StageSet,
    engine: &str,
) -> Vec<String> {
    let (cap0, c0) = &caps[0];
    let m = &cap0.manifest;
    let world = m.tp.world_size;
    let lacks: Vec<&str> = names(StageSet::ALL.minus(every))
        .into_iter()
        .filter(|n| !matches!(*n, "split_out" | "split_lse"))
        .collect();
    let dirs: Vec<String> = caps
        .iter()
        .map(|(c, _)| c.dir.display().to_string())
        .collect();
    let has = names(every);
    let mut notices = vec![format!(
        "capture {} of {engine}, request {} ({} tokens, {} prefill): stages captured: x{}{}; not captured: {}",
        dirs.join(", "),
        c0.request,
        c0.sched.total_tokens(),
        c0.sched.prompt_len,
        if has.is_empty() { "" } else { ", " },
        has.join(", "),
        if lacks.is_empty() { "none".to_string() } else { lacks.join(", ") },
    )];
    if !m.stage_dtypes.is_empty() {
        let per: Vec<String> = m
            .stage_dtypes
            .iter()
            .map(|(k, d)| format!("{k} {}", d.name()))
            .collect();
        notices.push(format!(
            "capture: stored in {}, except {}: each stage bounded by its own type (end to end by the coarsest up to it)",
            m.dtype.name(),
            per.join(", ")
        ));
    }
    if world > 1 {
        let present: Vec<usize> = ranks.iter().map(|(r, _)| *r).collect();
        notices.push(if ranks.len() == world {
            format!(
                "capture: tensor parallel {world}, every rank captured: the ranks' heads gathered and their partial attn_out summed are compared with the whole layer, each rank with its own slice (tp section)"
            )
        } else {
            format!(
                "capture: tensor parallel {world}, rank(s) {} captured: each compared as its slice of the heads (tp section); the whole layer only on the replicated stages ({})",
                crate::report::layer_list(&present),
                names(provided).join(", ")
            )
        });
    }
    if !c0.topk.is_empty() {
        notices.push(
            "capture: topk is the engine's DSA selection, checked against the reference's (dsa section) and its attention against fp64 over it".into(),
        );
    }
    notices
}
