//! `RunnerBackend` as a `Backend`: what the run and its judge ask of it (its description, notices,
//! coverage, the stages it provides and replaces), and `run_layer`, which hands the inner path's
//! tensors to the runner's ops and lays their outputs into the trace.

use super::protocol;
use super::{checks, declared_kernels, missing, set, RunnerBackend, RunnerInfo};
use crate::backend::cpu::front::{o_proj, MirrorWeights};
use crate::backend::{Backend, LayerCtx, SparseLayers};
use crate::error::{Error, Result};
use crate::trace::{LayerTrace, Stage, StageSet};
use ndarray::{Array2, Array3};

impl Backend for RunnerBackend {
    fn describe(&self) -> String {
        let d = &self.desc;
        let ops: Vec<String> = [
            ("decode", &d.ops.decode),
            ("prefill", &d.ops.prefill),
            ("sparse_prefill", &d.ops.sparse_prefill),
            ("sparse_decode", &d.ops.sparse_decode),
        ]
        .iter()
        .filter_map(|(n, s)| s.as_ref().map(|s| format!("{n}: {}", s.outputs.join(", "))))
        .collect();
        format!(
            "runner {} {} ({}) over {}",
            d.name,
            d.version,
            ops.join("; "),
            self.inner.describe()
        )
    }

    fn device(&self) -> Option<String> {
        self.inner.device()
    }

    /// The external kernel's softmax and merge are not known (numpy's normalises P first), nor how it
    /// sums its scores (the conservative model); its serving batches send the rows, not the cache's
    /// format. The rest follows the inner path where the runner leaves a phase or the indexer to it.
    fn judging(&self) -> crate::backend::Judging {
        let inner = self.inner.judging();
        let o = &self.desc.ops;
        crate::backend::Judging {
            known_attention: false,
            // Its prefill op is sent every key in the dtype (a quantized cache's context rows
            // rounded); the decode's reads as it declares them (`reads`).
            context_keys_in_dtype: o.prefill.is_some(),
            decode_cache_in_dtype: self.cache_in_dtype(),
            decode_p_e4m3: self.p_e4m3(),
            decode_qk_acc: self.qk_acc_bits(),
            // DSA: the runner's sparse ops over an inner path that attends over the selection itself
            // (the phase the runner leaves to it); a runner with neither op is refused past top_k.
            sparse: (o.sparse_prefill.is_some() || o.sparse_decode.is_some()) && inner.sparse,
            sparse_prefill_absorbed: o.sparse_prefill.is_some() || inner.sparse_prefill_absorbed,
            // The indexer is the inner path's (the runner computes attention only).
            has_indexer: inner.has_indexer,
            has_kpool_indexer: inner.has_kpool_indexer,
            outside_local_view: self.q_fp8_outside(inner.outside_local_view),
            sparse_layers: self.sparse_layers_over(inner.sparse_layers),
            key_tiles: self.tiles_over(inner.key_tiles),
            ..crate::backend::Judging::default()
        }
    }

    fn notices(&self) -> Vec<String> {
        let outs: Vec<String> = self
            .out_dtypes
            .iter()
            .map(|(c, d)| format!("{c} {d}"))
            .collect();
        let mut v = vec![format!(
            "runner {} produced {} (dtypes as returned: {}); upstream stages from {}; attn_heads of decode tokens and attn_out recomputed from its outputs by the CPU mirror's code",
            self.desc.name,
            self.out_dtypes.keys().cloned().collect::<Vec<_>>().join(", "),
            outs.join(", "),
            self.inner.describe()
        )];
        // An LSE stored in a 16-bit type loses ~3 decimal digits: fine for a single pass, not for
        // merging partial states (DCP, chunked context) downstream.
        for (c, d) in &self.out_dtypes {
            if c.starts_with("lse") && matches!(*d, "bf16" | "fp16") {
                v.push(format!(
                    "runner {} returns {c} in {d}, not f32: its @runner bound is {d}'s",
                    self.desc.name
                ));
            }
        }
        if let Some((default, chosen)) = self.page_moved {
            v.push(format!(
                "page size {chosen}: runner {} does not take the schedule's page {default} (its supports.page_sizes: {}), so the run uses the largest page it takes below that, else its smallest (--page-size picks another)",
                self.desc.name,
                self.desc.supports.page_sizes.as_deref().map(|l| format!("{l:?}")).unwrap_or_default()
            ));
        }
        if self.unwritten_splits > 0 {
            v.push(format!(
                "runner {} left {} empty splits' split_out holding non-zero values (NaN or garbage; their split_lse −inf or of weight 0): don't-care, compared as 0 — an empty split is judged by its LSE",
                self.desc.name, self.unwritten_splits
            ));
        }
        if self.sparse_runs > 0 {
            let o = &self.desc.ops;
            let ran: Vec<&str> = [
                ("sparse_prefill", o.sparse_prefill.is_some()),
                ("sparse_decode", o.sparse_decode.is_some()),
            ]
            .iter()
            .filter_map(|(n, on)| on.then_some(*n))
            .collect();
            let rest = match (o.sparse_prefill.is_some(), o.sparse_decode.is_some()) {
                (true, false) => "their decode steps, and the indexer, are",
                (false, true) => "their prefill, and the indexer, are",
                _ => "the indexer is",
            };
            v.push(format!(
                "runner {} ran {} on the DSA layers past top_k ({} layer runs: each layer with the reference's selection and with the optimized side's own); {rest} {}'s",
                self.desc.name,
                ran.join(" and "),
                self.sparse_runs,
                self.inner.describe()
            ));
        }
        // Sent the cache's bytes (`--kv-cache-dtype`), the runner writes no cache of its own.
        if let Some(c) = self
            .desc
            .ops
            .sparse_decode
            .as_ref()
            .and_then(|s| s.kv_cache.as_ref())
            .filter(|_| self.kv.is_auto())
        {
            v.push(format!(
                "runner {}'s sparse_decode reads a {c} cache (FlashMLA's fp8: e4m3, a power-of-two scale per 128 latent columns, bf16 rope), written by the runner from the rows sent: its @runner checks are against fp64 over that cache, and the end-to-end decode checks' tolerances include the cache's exact effect (cache_effect)",
                self.desc.name
            ));
        }
        if self.q_fp8() {
            v.push(format!(
                "runner {} reads q in e4m3 with the fp8 cache (conventions.q_fp8): its decode requests carry q on the e4m3 grid of one power-of-two scale per layer (meta.q_scale); its @runner checks are against fp64 over that q and the cache as read, and the end-to-end decode checks' tolerances include q's quantization with the cache's exact effect",
                self.desc.name
            ));
        }
        if self.cache_in_dtype() {
            v.push(format!(
                "runner {} reads the {} cache's dequantized rows rounded to {} (conventions.cache_dequant): its decode's @runner checks are against fp64 over the rows so rounded, and the stage-local view attends over them",
                self.desc.name, self.kv.name(), self.dtype.name()
            ));
        }
        if self.p_e4m3() {
            v.push(format!(
                "runner {} rounds P to e4m3 before P·V with the fp8 cache (conventions.p_fp8): the stage-local view's decode P rounding, and the bound of its @runner checks, are e4m3's",
                self.desc.name
            ));
        }
        if let Some(nb) = self.qk_acc_bits() {
            v.push(format!(
                "runner {} accumulates its fp8 QKᵀ in e8m{nb} (conventions.qk_acc): the stage-local view's decode scores carry that accumulator's truncation after each 32-wide k-step, not an f32 sum's",
                self.desc.name
            ));
        }
        if self.out_dtypes.is_empty() {
            v.clear();
        }
        v
    }

    /// The inner path's indexer (the runner computes attention only).
    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        ic: &crate::model::IndexerConfig,
        iw: &crate::model::IndexerWeights,
        x: &Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        self.inner.indexer(ctx, ic, iw, x, keys)
    }
    fn kpool_indexer(
        &mut self,
        ctx: &LayerCtx,
        k: &crate::model::KpoolIndexer,
        kw: &crate::model::KpoolLayer,
        x: &Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        self.inner.kpool_indexer(ctx, k, kw, x, keys)
    }

    fn kernels(
        &self,
        cfg: &crate::model::MlaConfig,
        sched: &crate::schedule::Schedule,
    ) -> Vec<crate::kernel_use::KernelUse> {
        use crate::kernel_use::{Family, Phase};
        // The phases the runner computes are its kernels, whose tiles mla-diff cannot see.
        let mut k = self.inner.kernels(cfg, sched);
        for u in k.iter_mut() {
            let runs = match u.phase {
                Phase::Decode => {
                    self.desc.ops.decode.is_some() || self.desc.ops.sparse_decode.is_some()
                }
                Phase::Prefill => {
                    self.desc.ops.prefill.is_some() || self.desc.ops.sparse_prefill.is_some()
                }
            };
            if runs {
                u.family = Family::External;
                u.label = format!("runner {} {}", self.desc.name, self.desc.version);
                u.geometry = declared_kernels(&self.desc)
                    .into_iter()
                    .find(|d| d.phase == u.phase)
                    .and_then(|d| d.geometry);
                u.production = None;
            }
        }
        k
    }

    /// The serving batch its decode op also ran (`batch`): counted in the coverage section.
    fn decode_extra(&self, sched: &crate::schedule::Schedule) -> Vec<crate::batch::Request> {
        match self.desc.ops.decode.is_some() && self.batch_layers.iter().next().is_some() {
            true => crate::batch::serving(sched),
            false => Vec::new(),
        }
    }

    /// The production variants it ran batches aimed at (`aimed`).
    fn aimed_variants(&self) -> Vec<String> {
        self.aims_run.clone()
    }

    /// What `supports` kept the schedule and the aimed batches from reaching (coverage warnings in
    /// every format).
    fn coverage_notes(&self, sched: &crate::schedule::Schedule) -> Vec<String> {
        let mut v = self.aim_notes();
        let (d, s) = (&self.desc, &self.desc.supports);
        if d.ops.decode.is_some() && sched.q_len == 1 {
            if let Some(m) = s.max_q_len {
                v.push(format!(
                    "coverage: runner {} takes at most {m} query per decode step (supports.max_q_len): no MTP step (causality within a step) was run",
                    d.name
                ));
            }
        }
        if let Some(dec) = &d.ops.decode {
            if !dec.has("split_out") {
                v.push(format!(
                    "coverage: runner {} returns no split partials: its split-KV partials and combine are checked only through the merged output",
                    d.name
                ));
            }
        }
        v
    }

    fn runner(&self) -> Option<RunnerInfo> {
        let d = &self.desc;
        Some(RunnerInfo {
            name: d.name.clone(),
            version: d.version.clone(),
            command: self.command.clone(),
            ops: d.ops.clone(),
            supports: d.supports.clone(),
            conventions: d.conventions,
            batch_invariant: d.batch_invariant,
            returned_dtypes: self
                .out_dtypes
                .iter()
                .map(|(c, t)| (c.clone(), t.to_string()))
                .collect(),
        })
    }

    fn runner_checks(&self) -> Option<checks::RunnerChecks> {
        if self.requests == 0 {
            return None;
        }
        let mut c = self.checks.clone();
        for ((layer, op, name), (reqs, n)) in &self.mutations {
            c.push(checks::RunnerCheck {
                layer: Some(*layer),
                check: "input_mutation".into(),
                status: checks::Status::Fail,
                what: name.to_string(),
                value: None,
                bound: None,
                detail: format!(
                    "the runner wrote into its input {name} in {reqs} {op} request(s) of the layer: up to {n} of its values changed"
                ),
            });
        }
        if self.mutations.is_empty() {
            c.push(checks::RunnerCheck {
                layer: None,
                check: "input_mutation".into(),
                status: checks::Status::Pass,
                what: "every input".into(),
                value: None,
                bound: None,
                detail: format!(
                    "every input file of the {} requests held what was sent after the reply",
                    self.requests
                ),
            });
        }
        Some(checks::RunnerChecks::new(c))
    }

    fn provides(&self) -> StageSet {
        let mut s = self.inner.provides();
        if let Some(dec) = &self.desc.ops.decode {
            // Partials of the kernel's own partition have no reference of the run's: they are
            // checked by merge consistency (`runner_checks`), not as stages.
            if !dec.has("split_out")
                || self.desc.decode_partition() == protocol::SplitPartition::Own
            {
                s = s.without(Stage::SplitOut).without(Stage::SplitLse);
            }
        }
        s
    }

    fn run_layer(&mut self, ctx: &LayerCtx, x: &Array2<f64>) -> Result<LayerTrace> {
        self.check_supports(ctx)?;
        let mut tr = self.inner.run_layer(ctx, x)?;
        let mut at = Vec::new();
        // The weights as the inner path stores them, for the decompression and projections around the
        // runner's ops (no planted bug: faults live in the inner path).
        let mw = MirrorWeights::new(
            ctx.cfg,
            ctx.weights,
            self.dtype,
            crate::faults::Active::NONE,
        );
        match ctx.selection {
            // A DSA layer past top_k: only the sparse ops (a dense op would attend over every key);
            // a phase the runner has no sparse op for stays the inner path's, which attends over the
            // selection.
            Some(sel) => {
                let o = &self.desc.ops;
                let (pre, dec) = (o.sparse_prefill.is_some(), o.sparse_decode.is_some());
                if !pre && !dec {
                    return Err(Error::Unsupported(format!(
                        "runner {} has no sparse_prefill or sparse_decode op, and layer {} is a DSA layer past top_k",
                        self.desc.name, ctx.layer
                    )));
                }
                let mut ran = false;
                if pre && ctx.sched.prompt_len > 0 {
                    self.sparse_prefill(ctx, sel, &mw, &mut tr, &mut at)?;
                    ran = true;
                }
                if dec && ctx.sched.decode_steps > 0 {
                    self.sparse_decode(ctx, sel, &mw, &mut tr, &mut at)?;
                    ran = true;
                }
                self.sparse_runs += ran as usize;
            }
            None => {
                if self.desc.ops.decode.is_none() && self.desc.ops.prefill.is_none() {
                    return Err(Error::Unsupported(format!(
                        "runner {} has only sparse ops, which run on DSA layers past top_k; layer {} is dense (a dense model, or no query sees more than the indexer's top_k keys)",
                        self.desc.name, ctx.layer
                    )));
                }
                if self.desc.ops.prefill.is_some() && ctx.sched.prompt_len > 0 {
                    self.prefill(ctx, &mw, &mut tr, &mut at)?;
                }
                if self.desc.ops.decode.is_some() && ctx.sched.decode_steps > 0 {
                    self.decode(ctx, &mw, &mut tr, &mut at)?;
                }
            }
        }
        // attn_out from the heads as they now stand (the runner's rows included).
        let (t, h, dv) = (ctx.sched.total_tokens(), ctx.cfg.n_head, ctx.cfg.v_head_dim);
        let heads = tr
            .get(Stage::AttnHeads)
            .ok_or_else(|| missing(Stage::AttnHeads))?;
        let heads =
            Array3::from_shape_vec((t, h, dv), heads.data.iter().map(|&v| v as f32).collect())
                .map_err(|e| Error::Usage(format!("attn_heads: {e}")))?;
        let out = o_proj(&mw, &heads, self.dtype);
        set(
            &mut tr,
            Stage::AttnOut,
            out.iter().map(|&v| v as f64).collect(),
        )?;
        for a in &at {
            self.out_dtypes.insert(a.check.clone(), a.out_dtype);
        }
        tr.at_runner = at;
        Ok(tr)
    }
}

impl RunnerBackend {
    /// The key tiles `sweep` aims at: the runner's kernel tiles are its own (unknown here) unless it
    /// declares them; only the phases it leaves to the inner path keep that path's tiles.
    fn tiles_over(&self, mut t: crate::backend::KeyTiles) -> crate::backend::KeyTiles {
        let o = &self.desc.ops;
        let declared = |ops: [&Option<protocol::OpSpec>; 2]| -> Vec<crate::backend::KeyTile> {
            ops.iter()
                .filter_map(|op| op.as_ref()?.geometry?.key_tile)
                .map(|k| {
                    crate::backend::KeyTile::new(format!("runner {} key tile", self.desc.name), k)
                })
                .collect()
        };
        if o.decode.is_some() || o.sparse_decode.is_some() {
            t.decode = declared([&o.decode, &o.sparse_decode]);
        }
        if o.prefill.is_some() || o.sparse_prefill.is_some() {
            t.prefill = declared([&o.prefill, &o.sparse_prefill]);
        }
        t
    }

    /// On a layer that runs sparse, its sparse decode returns the merged result only (no split
    /// partials: the trace's are the inner path's), and an fp8 cache under it is not the stage-local
    /// view's model (it models the rows as stored): its decode stages are judged end to end there, with
    /// the cache's effect (`CacheEffect`). Its dense layers run the dense ops and keep every check.
    fn sparse_layers_over(&self, mut s: SparseLayers) -> SparseLayers {
        if self.desc.ops.sparse_decode.is_some() {
            s.not_provided = s.not_provided.with(Stage::SplitOut).with(Stage::SplitLse);
            for st in [
                Stage::AttnLatent,
                Stage::Lse,
                Stage::SplitOut,
                Stage::SplitLse,
                Stage::AttnHeads,
                Stage::AttnOut,
            ] {
                s.outside_local_view = s.outside_local_view.with(st);
            }
        }
        s
    }
}
