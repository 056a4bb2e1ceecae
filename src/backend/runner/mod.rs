//! An external kernel as a backend (docs/runners.md): an inner optimized path (the CPU mirror or the
//! CUDA kernels) computes the layer up to the runner's entry stage; the runner's process computes its
//! ops (decode: absorbed attention over the paged latent cache; prefill: decompressed attention of a
//! chunk) from those tensors, as an engine would hand them over; its outputs replace the inner path's
//! stages, and what lies downstream of them (`attn_heads` of decode tokens, `attn_out`) is recomputed
//! from them by the CPU mirror's code. Each replaced stage also carries fp64 attention computed from the
//! runner's own inputs (`LayerTrace::at_runner`), which the comparator checks as `STAGE@runner`.

mod aimed;
mod backend;
mod batch;
mod cache;
pub mod checks;
pub(crate) mod decode;
pub mod fp8_cache;
pub mod local;
mod prefill;
pub(crate) mod process;
pub mod protocol;
mod q_fp8;
mod qk_acc;
mod reads;
mod sparse;
mod sparse_decode;
pub mod tensors;
#[cfg(test)]
mod tests;

use super::{Backend, LayerCtx};
use crate::error::{Error, Result};
use crate::precision::Dtype;
use crate::trace::{LayerTrace, Stage};
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
    /// The production variants batches were aimed at through the runner (`aimed`), and those skipped
    /// (outside its `supports`) with why.
    aims_run: Vec<String>,
    aims_skipped: std::collections::BTreeMap<String, String>,
    /// Requests answered, and those whose inputs came back changed.
    requests: usize,
    /// Inputs that came back changed: (layer, op, tensor) → (requests, most values changed in one).
    mutations: std::collections::BTreeMap<(usize, String, &'static str), (usize, usize)>,
    /// Empty splits whose `split_out` the runner left holding something (don't-care, `decode`).
    unwritten_splits: usize,
    /// `(schedule's page, page run)` when the run's page was moved to one the runner takes.
    page_moved: Option<(usize, usize)>,
    /// The cache's byte format (`run --kv-cache-dtype`; `auto`: the run's dtype).
    kv: crate::kv_format::KvFormat,
    /// This layer's cache rows in `kv`'s bytes (`Codec::bytes()` per row, as `cache_rows` orders
    /// them), with the codec that wrote them: what the decode and sparse ops send in place of the rows.
    cache_bytes: Option<(crate::kv_format::Codec, Vec<u8>)>,
    /// This layer's q scale when its decode requests carry q in e4m3 (`conventions.q_fp8`), sent as
    /// `meta.q_scale`.
    q_scale: Option<f32>,
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
            aims_run: Vec::new(),
            aims_skipped: Default::default(),
            requests: 0,
            mutations: Default::default(),
            unwritten_splits: 0,
            page_moved,
            kv: Default::default(),
            cache_bytes: None,
            q_scale: None,
        })
    }

    /// The cache in `kv`'s bytes for every op that reads the latent cache (decode, sparse_prefill,
    /// sparse_decode): refused, before any layer runs, unless the runner's `supports.cache_formats`
    /// lists the format.
    pub fn with_kv_format(mut self, kv: crate::kv_format::KvFormat) -> Result<RunnerBackend> {
        if kv.is_auto() {
            return Ok(self);
        }
        let name = &self.desc.name;
        let listed = self.desc.supports.cache_formats.clone().unwrap_or_default();
        if !listed.iter().any(|f| f == kv.name()) {
            return Err(Error::Usage(format!(
                "--kv-cache-dtype {kv}: runner {name} does not read a {kv} cache (its describe's supports.cache_formats: {listed:?}); drop --kv-cache-dtype or use a runner that lists it"
            )));
        }
        self.kv = kv;
        Ok(self)
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

/// A stage's values as the inner path under the runner computed them: what an op sends.
fn stage(tr: &LayerTrace, st: Stage) -> Result<Vec<f64>> {
    tr.get(st)
        .map(|t| t.data.clone())
        .ok_or_else(|| missing(st))
}

fn set(tr: &mut LayerTrace, st: Stage, data: Vec<f64>) -> Result<()> {
    let t = tr.get_mut(st).ok_or_else(|| missing(st))?;
    debug_assert_eq!(t.data.len(), data.len());
    t.data = data;
    Ok(())
}
