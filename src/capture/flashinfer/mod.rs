//! FlashInfer API-logging dumps (`FLASHINFER_LOGLEVEL=10`, `FLASHINFER_DUMP_SAFETENSORS=1`), checked
//! call by call (`mla-diff flashinfer DIR`, docs/captures.md "FlashInfer API logging").
//!
//! Each MLA call the dump holds is judged against fp64 attention from the call's own inputs (the
//! absorbed query and its rope part, the paged latent cache through the call's page table, the
//! sequence lengths, the softmax scale; causal within a request's queries where the API is), with the
//! yardstick and the bound of the runner checks (`backend::runner::decode::local_attention`,
//! `checks::against_fp64`). A call holds no layer weights and no layer input: this checks the engine's
//! kernel call, not the model; `--model FILE` adds the model's softmax scale and dims, which catch an
//! engine that hands the kernel the wrong scale (YaRN's mscale² left out).
//!
//! The calls, as flashinfer's `api_logging.py` and `mla/_core.py` define them (read at flashinfer
//! commit fb28d72; docs/captures.md):
//! - `BatchMLAPagedAttentionWrapper.run(self, q_nope [N, H, L], q_pe [N, H, R], ckv_cache [P, page, L],
//!   kpe_cache [P, page, R], out, lse, return_lse, …, return_lse_base_on_e)`: its page table, lengths,
//!   causality and scale come from the same wrapper's latest `plan(self, qo_indptr, kv_indptr,
//!   kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, …)`,
//!   paired by `(process_id, self_id)` in call order. Its LSE is base 2 unless
//!   `return_lse_base_on_e`.
//! - `trtllm_batch_decode_with_kv_cache_mla` and `xqa_batch_decode_with_kv_cache_mla(query [B, q, H,
//!   L+R], kv_cache [P, page, L+R] or [P, 1, page, L+R], workspace, qk_nope_head_dim, kv_lora_rank,
//!   qk_rope_head_dim, block_tables [B, pages], seq_lens [B], max_seq_len, …, bmm1_scale, bmm2_scale,
//!   …, return_lse)`: out `[B, q, H, L]` times `bmm2_scale`, causal over the `q` queries of a request,
//!   LSE natural log.

mod decode;
pub mod dump;
mod problem;
mod report;
mod wrapper;

pub use report::{CallReport, DumpReport, Verdict};

use crate::backend::runner::checks::Status;
use crate::error::{Error, Result};
use dump::{CallArgs, CallDir, Dump, Order};
use problem::{bad, judge, Decoded, NotChecked};
use std::collections::{BTreeMap, HashMap};

/// The version of the JSON report (`flashinfer_report_version`).
pub const REPORT_VERSION: u32 = 1;

const PLAN: &str = "BatchMLAPagedAttentionWrapper.plan";
const RUN: &str = "BatchMLAPagedAttentionWrapper.run";
const DECODES: [&str; 2] = [
    "trtllm_batch_decode_with_kv_cache_mla",
    "xqa_batch_decode_with_kv_cache_mla",
];

/// Parameter names when a call's metadata has no `function_signature` (flashinfer's own order).
const PLAN_PARAMS: &[&str] = &[
    "self",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_len_arr",
    "num_heads",
    "head_dim_ckv",
    "head_dim_kpe",
    "page_size",
    "causal",
    "sm_scale",
    "q_data_type",
    "kv_data_type",
    "use_profiler",
];
const RUN_PARAMS: &[&str] = &[
    "self",
    "q_nope",
    "q_pe",
    "ckv_cache",
    "kpe_cache",
    "out",
    "lse",
    "return_lse",
    "profiler_buffer",
    "kv_len",
    "page_table",
    "return_lse_base_on_e",
    "o_scale",
];
const DECODE_PARAMS: &[&str] = &[
    "query",
    "kv_cache",
    "workspace_buffer",
    "qk_nope_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "block_tables",
    "seq_lens",
    "max_seq_len",
    "sparse_mla_top_k",
    "out",
    "bmm1_scale",
    "bmm2_scale",
];
/// `xqa_batch_decode_with_kv_cache_mla` has no `sparse_mla_top_k`.
const XQA_PARAMS: &[&str] = &[
    "query",
    "kv_cache",
    "workspace_buffer",
    "qk_nope_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "block_tables",
    "seq_lens",
    "max_seq_len",
    "out",
    "bmm1_scale",
    "bmm2_scale",
];

/// What the model says a call must use (`--model FILE`).
#[derive(Debug, Clone)]
pub struct ModelExpect {
    pub name: String,
    pub n_head: usize,
    pub kv_lora_rank: usize,
    pub qk_rope: usize,
    pub softmax_scale: f64,
    pub mscale: f64,
}

/// Read the dump in `dir`, check each MLA call (`progress`: one line per call on stderr as it goes).
pub fn check(
    dir: &std::path::Path,
    model: Option<&ModelExpect>,
    progress: bool,
) -> Result<DumpReport> {
    let d = Dump::open(dir)?;
    let mut plans: HashMap<(u64, u64), &CallDir> = HashMap::new();
    let mut n_plans = 0;
    let mut skipped = BTreeMap::new();
    let mut calls = Vec::new();
    for c in &d.calls {
        let f = c.function.as_str();
        let mla = f == PLAN || f == RUN || DECODES.contains(&f);
        if !mla {
            *skipped.entry(c.function.clone()).or_insert(0) += 1;
            continue;
        }
        if f == PLAN {
            let id = c.self_id.ok_or_else(|| bad(c, "a wrapper plan with no self_id in its metadata.jsonl: its runs cannot be paired with it"))?;
            plans.insert((c.pid, id), c);
            n_plans += 1;
            continue;
        }
        let (decoded, plan) = decode(c, d.order, &plans)?;
        let rep = call_report(c, decoded, plan, model);
        if progress {
            eprintln!("{}", rep.line());
        }
        calls.push(rep);
    }
    summary(dir, &d, model, calls, n_plans, skipped)
}

/// An MLA call (not a plan) decoded into its problem, with the plan a wrapper run was paired with:
/// the latest plan of the same wrapper (`plans`, by process and `self_id`) before it.
fn decode(
    c: &CallDir,
    order: Order,
    plans: &HashMap<(u64, u64), &CallDir>,
) -> Result<(Decoded, Option<String>)> {
    let f = c.function.as_str();
    if c.flush.is_some() && order == Order::Timestamps {
        // Replays are flushed after the call's own timestamp: only session.jsonl orders them
        // among the plans.
        let why = "a CUDA-graph replay snapshot, and without session.jsonl its place among the plans is unknown";
        return Ok((Err(NotChecked(why.into())), None));
    }
    if f != RUN {
        let params = if f == DECODES[1] {
            XQA_PARAMS
        } else {
            DECODE_PARAMS
        };
        return Ok((decode::decode_call(&CallArgs::read(c, params)?)?, None));
    }
    let a = CallArgs::read(c, RUN_PARAMS)?;
    if a.has_tensor("page_table") && a.has_tensor("kv_len") {
        return Ok((wrapper::wrapper_run(&a, &a)?, None));
    }
    let id = c.self_id.ok_or_else(|| bad(c, "a wrapper run with no self_id in its metadata.jsonl: it cannot be paired with its plan"))?;
    let p = plans.get(&(c.pid, id)).ok_or_else(|| {
        bad(c, format!(
            "{RUN} of wrapper {id} (pid {}) has no {PLAN} of the same wrapper before it in the dump: the plan holds the page table (dump it too: FLASHINFER_DUMP_INCLUDE must match it, FLASHINFER_DUMP_MAX_COUNT not cut it)",
            c.pid
        ))
    })?;
    let pa = CallArgs::read(p, PLAN_PARAMS)?;
    Ok((wrapper::wrapper_run(&a, &pa)?, Some(p.name.clone())))
}

/// Call `c`'s line of the report: judged if it was decoded, else why not.
fn call_report(
    c: &CallDir,
    decoded: Decoded,
    plan: Option<String>,
    model: Option<&ModelExpect>,
) -> CallReport {
    let (shapes, verdict, checks, reason) = match decoded {
        Err(NotChecked(why)) => (
            String::from("—"),
            Verdict::NotChecked,
            Vec::new(),
            Some(why),
        ),
        Ok(p) => {
            let checks = judge(&p, model);
            let v = match checks.iter().all(|k| k.status != Status::Fail) {
                true => Verdict::Pass,
                false => Verdict::Fail,
            };
            (p.shapes, v, checks, None)
        }
    };
    CallReport {
        folder: c.name.clone(),
        function: c.function.clone(),
        call: c.seq,
        pid: c.pid,
        replay: c.flush,
        plan,
        shapes,
        verdict,
        checks,
        reason,
    }
}

/// The dump's report from its calls' lines: the verdict and its message. A dump with no MLA call
/// checked is an error that says what it held.
fn summary(
    dir: &std::path::Path,
    d: &Dump,
    model: Option<&ModelExpect>,
    calls: Vec<CallReport>,
    n_plans: usize,
    skipped: BTreeMap<String, usize>,
) -> Result<DumpReport> {
    let count = |v: Verdict| calls.iter().filter(|c| c.verdict == v).count();
    let (pass_n, fail_n, nc) = (
        count(Verdict::Pass),
        count(Verdict::Fail),
        count(Verdict::NotChecked),
    );
    if pass_n + fail_n == 0 {
        return Err(Error::Usage(format!(
            "{}: no MLA call to check ({} calls: {}; {} not checked{}); the MLA entry points are {RUN} (with its plan) and {}",
            dir.display(),
            d.calls.len(),
            d.counts().iter().map(|(f, n)| format!("{n} {f}")).collect::<Vec<_>>().join(", "),
            nc,
            calls.first().and_then(|c| c.reason.as_ref()).map(|r| format!(", first: {r}")).unwrap_or_default(),
            DECODES.join(", ")
        )));
    }
    let skipped_n: usize = skipped.values().sum();
    let first_fail = calls.iter().find(|c| c.verdict == Verdict::Fail);
    let message = match first_fail {
        None => format!(
            "PASS: {pass_n} MLA calls within the fp64 bound{}; {n_plans} plans read, {skipped_n} calls of other functions skipped",
            if nc > 0 { format!(", {nc} not checked") } else { String::new() }
        ),
        Some(f) => format!(
            "FLASHINFER CALL FAILED: {fail_n} of {} MLA calls (first: {} #{}, {}); {nc} not checked, {n_plans} plans read, {skipped_n} calls of other functions skipped",
            pass_n + fail_n,
            f.function,
            f.call,
            f.folder
        ),
    };
    Ok(DumpReport {
        flashinfer_report_version: REPORT_VERSION,
        dir: dir.display().to_string(),
        order: d.order,
        model: model.map(|m| m.name.clone()),
        calls,
        plans: n_plans,
        skipped,
        pass: fail_n == 0,
        message,
    })
}
