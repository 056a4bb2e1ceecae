//! An external kernel as a backend (docs/runners.md): an inner optimized path (the CPU mirror or the
//! CUDA kernels) computes the layer up to the runner's entry stage; the runner's process computes its
//! ops (decode: absorbed attention over the paged latent cache; prefill: decompressed attention of a
//! chunk) from those tensors, as an engine would hand them over; its outputs replace the inner path's
//! stages, and what lies downstream of them (`attn_heads` of decode tokens, `attn_out`) is recomputed
//! from them by the CPU mirror's code. Each replaced stage also carries fp64 attention computed from the
//! runner's own inputs (`LayerTrace::at_runner`), which the comparator checks as `STAGE@runner`.

mod batch;
pub mod checks;
pub(crate) mod decode;
pub mod fp8_cache;
pub mod local;
mod prefill;
pub(crate) mod process;
pub mod protocol;
mod sparse;
mod sparse_decode;
pub mod tensors;
#[cfg(test)]
mod tests;

use super::cpu::front::{o_proj, MirrorWeights};
use super::{Backend, LayerCtx};
use crate::error::{Error, Result};
use crate::precision::Dtype;
use crate::trace::{LayerTrace, Stage, StageSet};
use ndarray::{Array2, Array3};
use protocol::{Describe, LseBase, LseLayout, Outcome, Process};
use tensors::{Named, Output, Outputs};

/// A runner over an inner optimized path.
pub struct RunnerBackend {
    inner: Box<dyn Backend>,
    pub desc: Describe,
    /// `--runner` as given, for the report's `environment.runner.command`.
    command: String,
    link: Link,
    dtype: Dtype,
    /// Output dtypes seen, per output: `lse[decode] -> bf16`.
    out_dtypes: std::collections::BTreeMap<String, &'static str>,
    /// Layer runs that went through the runner's sparse ops (DSA past top_k).
    sparse_runs: usize,
    /// The batch, padding, invariance, merge and input checks so far (`checks`).
    checks: Vec<checks::RunnerCheck>,
    /// Layers whose serving batch ran (once per layer, whatever the modes and repeats).
    batch_layers: std::collections::BTreeSet<usize>,
    /// Requests answered, and those whose inputs came back changed.
    requests: usize,
    /// Inputs that came back changed: (layer, op, tensor) → (requests, most values changed in one).
    mutations: std::collections::BTreeMap<(usize, String, &'static str), (usize, usize)>,
    /// Empty splits whose `split_out` the runner left holding something (don't-care, `decode`).
    unwritten_splits: usize,
    /// `(schedule's page, page run)` when the run's page was moved to one the runner takes.
    page_moved: Option<(usize, usize)>,
}

/// The kernels a runner declares a geometry for (`describe` `ops.OP.geometry.key_tile`), as coverage
/// targets: what the default schedule also covers.
pub fn declared_kernels(d: &Describe) -> Vec<crate::kernel_use::KernelUse> {
    use crate::kernel_use::{Family, KernelUse, Phase};
    [
        (Phase::Decode, &d.ops.decode),
        (Phase::Decode, &d.ops.sparse_decode),
        (Phase::Prefill, &d.ops.prefill),
        (Phase::Prefill, &d.ops.sparse_prefill),
    ]
    .into_iter()
    .filter_map(|(phase, op)| {
        let g = op.as_ref()?.geometry?.coverage()?;
        Some(KernelUse {
            phase,
            family: Family::External,
            label: format!("runner {} {}", d.name, d.version),
            geometry: Some(g),
            production: None,
        })
    })
    .collect()
}

/// The runner of a run as the report's `environment.runner` records it: what it declared in
/// `--describe`, the dtype each output came back in, and how it was started.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunnerInfo {
    pub name: String,
    pub version: String,
    /// `--runner` as given (split into words, no shell; docs/runners.md).
    pub command: String,
    pub ops: protocol::Ops,
    pub supports: protocol::Supports,
    pub conventions: protocol::Conventions,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch_invariant: bool,
    /// The dtype each output came back in, by the check it feeds (`lse[decode]`: `bf16`).
    pub returned_dtypes: std::collections::BTreeMap<String, String>,
}

/// How requests reach the runner: a `--serve` process through files, or an in-process runner
/// (`inproc:NAME`, the Python API's) through memory.
enum Link {
    Process(Process),
    InProcess(Box<dyn protocol::InProcess>),
}

impl RunnerBackend {
    /// Ask `cmd --describe`, then start `cmd --serve` (or take the in-process runner `inproc:NAME`).
    /// `page_moved`: `(schedule's page, page run)` when the run's page was moved to one the runner
    /// takes ([`protocol::page_for`]), for the report's notice.
    pub fn open(
        cmd: &str,
        inner: Box<dyn Backend>,
        dtype: Dtype,
        page_moved: Option<(usize, usize)>,
    ) -> Result<RunnerBackend> {
        let (desc, link) = match protocol::take_in_process(cmd) {
            Some(r) => {
                let mut r = r?;
                (protocol::validate(r.describe()?)?, Link::InProcess(r))
            }
            None => {
                let desc = protocol::describe(cmd)?;
                let proc = Process::start(cmd, &desc.name, keep_io())?;
                (desc, Link::Process(proc))
            }
        };
        Ok(RunnerBackend {
            inner,
            desc,
            command: cmd.to_string(),
            link,
            dtype,
            out_dtypes: Default::default(),
            sparse_runs: 0,
            checks: Vec::new(),
            batch_layers: Default::default(),
            requests: 0,
            mutations: Default::default(),
            unwritten_splits: 0,
            page_moved,
        })
    }

    /// The scratch directory the tensors go through (none in process).
    pub fn scratch(&self) -> Option<&std::path::Path> {
        match &self.link {
            Link::Process(p) => Some(&p.scratch),
            Link::InProcess(_) => None,
        }
    }

    /// Refuse, before anything runs, a case the runner says it cannot take.
    fn check_supports(&self, ctx: &LayerCtx) -> Result<()> {
        let (cfg, sched, s) = (ctx.cfg, ctx.sched, &self.desc.supports);
        let name = &self.desc.name;
        let refuse = |key: &str, v: String, allowed: String| {
            Err(Error::Unsupported(format!(
                "runner {name} does not support {key} {v} (it takes {allowed})"
            )))
        };
        let list = |key: &str, v: usize, allowed: &Option<Vec<usize>>| match allowed {
            Some(a) if !a.contains(&v) => refuse(key, v.to_string(), format!("{a:?}")),
            _ => Ok(()),
        };
        if let Some(d) = &s.dtypes {
            if !d.iter().any(|x| x == self.dtype.name()) {
                return refuse("dtype", self.dtype.name().into(), format!("{d:?}"));
            }
        }
        list("heads", cfg.n_head, &s.heads)?;
        list("kv_lora_rank", cfg.kv_lora_rank, &s.kv_lora_rank)?;
        list("qk_rope", cfg.qk_rope, &s.qk_rope)?;
        if self.desc.ops.decode.is_some() && sched.decode_steps > 0 {
            list("page_size", sched.page_size, &s.page_sizes)?;
            if let Some(m) = s.max_q_len {
                if sched.q_len > m {
                    return refuse("q_len", sched.q_len.to_string(), format!("at most {m}"));
                }
            }
        }
        if self.desc.ops.prefill.is_some() && sched.prompt_len > 0 {
            list("qk_head_dim", cfg.qk_head_dim(), &s.qk_head_dim)?;
            list("v_head_dim", cfg.v_head_dim, &s.v_head_dim)?;
        }
        Ok(())
    }

    fn meta(&self, ctx: &LayerCtx, extra: serde_json::Value) -> serde_json::Value {
        let (cfg, sched) = (ctx.cfg, ctx.sched);
        let mut m = serde_json::json!({
            "dtype": self.dtype.name(),
            "softmax_scale": cfg.softmax_scale,
            "heads": cfg.n_head,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope": cfg.qk_nope,
            "qk_rope": cfg.qk_rope,
            "v_head_dim": cfg.v_head_dim,
            "page_size": sched.page_size,
            "num_splits": sched.num_splits,
            "q_len": sched.q_len,
            "causal": true,
        });
        if let (Some(m), serde_json::Value::Object(e)) = (m.as_object_mut(), extra) {
            m.extend(e);
        }
        m
    }

    /// Write the inputs, send the request, read the outputs.
    fn call(
        &mut self,
        op: &str,
        layer: usize,
        meta: &serde_json::Value,
        inputs: &[Named],
    ) -> Result<Outputs> {
        let proc = match &mut self.link {
            Link::Process(p) => p,
            Link::InProcess(r) => {
                return match r.call(op, layer, meta, inputs)? {
                    Ok(out) => Ok(out),
                    Err(reason) => Err(Error::Unsupported(format!(
                        "runner {} cannot take layer {layer} {op}: {reason}",
                        self.desc.name
                    ))),
                };
            }
        };
        let ex = proc.request(op, layer, inputs, meta)?;
        let (input, output) = (ex.input, ex.output);
        match ex.outcome? {
            Outcome::Ok(_) => {}
            Outcome::Unsupported(reason) => {
                return Err(Error::Unsupported(format!(
                    "runner {} cannot take layer {layer} {op}: {reason}",
                    self.desc.name
                )))
            }
        }
        let out = Outputs::read(&output, &self.desc.name)?;
        // A kernel that writes into its inputs (q scaled in place, the cache overwritten) corrupts an
        // engine's next step: the files, as the runner left them, must hold what was sent.
        self.requests += 1;
        for (name, n) in tensors::changed(&input, inputs)? {
            let m = self
                .mutations
                .entry((layer, op.to_string(), name))
                .or_insert((0, 0));
            *m = (m.0 + 1, m.1.max(n));
        }
        if !keep_io() {
            let _ = std::fs::remove_file(&input);
            let _ = std::fs::remove_file(&output);
        }
        Ok(out)
    }

    /// A runner's LSE as natural log in `[rows, H]` order (from `[rows, H]` or `[H, rows]`; per entry
    /// `b` of `entries` when the rows are `entries × s_q`).
    fn lse_rows(&self, o: &Output, entries: usize, s_q: usize, h: usize) -> Vec<f64> {
        let c = &self.desc.conventions;
        let k = match c.lse_base {
            LseBase::E => 1.0,
            LseBase::Two => std::f64::consts::LN_2,
        };
        let mut v = vec![0.0; entries * s_q * h];
        for b in 0..entries {
            for i in 0..s_q {
                for hh in 0..h {
                    let src = match c.lse_layout {
                        LseLayout::TokenHead => (b * s_q + i) * h + hh,
                        LseLayout::HeadToken => (b * h + hh) * s_q + i,
                    };
                    v[(b * s_q + i) * h + hh] = o.data[src] * k;
                }
            }
        }
        v
    }

    fn lse_shape(&self, entries: Option<usize>, s_q: usize, h: usize) -> Vec<usize> {
        let mut sh = match self.desc.conventions.lse_layout {
            LseLayout::TokenHead => vec![s_q, h],
            LseLayout::HeadToken => vec![h, s_q],
        };
        if let Some(b) = entries {
            sh.insert(0, b);
        }
        sh
    }
}

/// The checks whose stage a runner's ops replace, on a dense layer: the stages it returns and what is
/// recomputed from them by the CPU mirror's code (`attn_heads` of decode tokens, `attn_out`). A fault
/// planted there (`--inject`) would change nothing.
pub fn replaced_checks(d: &Describe) -> Vec<&'static str> {
    let mut v = Vec::new();
    if d.ops.decode.is_some() {
        v.extend([
            "attn_out[decode]",
            "split_out",
            "split_lse",
            "attn_latent",
            "lse[decode]",
            "attn_heads[decode]",
        ]);
    }
    if d.ops.prefill.is_some() {
        v.extend(["lse[prefill]", "attn_heads[prefill]", "attn_out[prefill]"]);
    }
    v
}

/// With `MLA_DIFF_KEEP_RUNNER_IO` set, the request files stay in the scratch directory (printed on
/// stderr): the exact tensors a runner was given, for its author.
pub fn keep_io() -> bool {
    std::env::var_os(KEEP_IO_ENV).is_some()
}
pub const KEEP_IO_ENV: &str = "MLA_DIFF_KEEP_RUNNER_IO";

fn missing(st: Stage) -> Error {
    Error::Usage(format!(
        "the optimized path under the runner gave no {st} stage, which the runner needs"
    ))
}

fn set(tr: &mut LayerTrace, st: Stage, data: Vec<f64>) -> Result<()> {
    let t = tr.get_mut(st).ok_or_else(|| missing(st))?;
    debug_assert_eq!(t.data.len(), data.len());
    t.data = data;
    Ok(())
}

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

    /// The external kernel's softmax and merge are not known (numpy's normalises P first).
    fn known_attention(&self) -> bool {
        false
    }
    fn key_tiles(&self) -> crate::backend::KeyTiles {
        // The runner's kernel tiles are its own (unknown here): only the phases it leaves to the inner
        // backend keep that backend's tiles.
        // A tile the runner declares is what `sweep` aims at.
        let mut t = self.inner.key_tiles();
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
        if let Some(c) = self
            .desc
            .ops
            .sparse_decode
            .as_ref()
            .and_then(|s| s.kv_cache.as_ref())
        {
            v.push(format!(
                "runner {}'s sparse_decode reads a {c} cache (FlashMLA's fp8: e4m3, a power-of-two scale per 128 latent columns, bf16 rope), written by the runner from the rows sent: its @runner checks are against fp64 over that cache, and the end-to-end decode checks' tolerances include the cache's exact effect (cache_effect)",
                self.desc.name
            ));
        }
        if self.out_dtypes.is_empty() {
            v.clear();
        }
        v
    }

    /// DSA: the runner's sparse ops over an inner path that attends over the selection itself (the
    /// phase the runner leaves to it); a runner with neither op is refused past top_k, as before.
    fn sparse(&self) -> bool {
        let o = &self.desc.ops;
        (o.sparse_prefill.is_some() || o.sparse_decode.is_some()) && self.inner.sparse()
    }
    /// An fp8 cache under the sparse decode is not the stage-local view's model (it models the rows
    /// as stored): its decode stages are judged end to end, with the cache's effect (`CacheEffect`).
    fn outside_local_view(&self) -> StageSet {
        let mut s = self.inner.outside_local_view();
        if self.desc.ops.sparse_decode.is_some() {
            for st in [
                Stage::AttnLatent,
                Stage::Lse,
                Stage::SplitOut,
                Stage::SplitLse,
                Stage::AttnHeads,
                Stage::AttnOut,
            ] {
                s = s.with(st);
            }
        }
        s
    }
    fn sparse_prefill_absorbed(&self) -> bool {
        self.desc.ops.sparse_prefill.is_some() || self.inner.sparse_prefill_absorbed()
    }
    /// The indexer is the inner path's (the runner computes attention only).
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
    fn has_indexer(&self) -> bool {
        self.inner.has_indexer()
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

    /// What `supports` kept the schedule from reaching (coverage warnings in every format).
    fn coverage_notes(&self, sched: &crate::schedule::Schedule) -> Vec<String> {
        let mut v = Vec::new();
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
        // FlashMLA's sparse decode returns the merged result only.
        if self.desc.ops.sparse_decode.is_some() {
            s = s.without(Stage::SplitOut).without(Stage::SplitLse);
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
