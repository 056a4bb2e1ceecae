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

pub mod dump;

use crate::backend::runner::checks::{against_fp64, RunnerCheck, Status};
use crate::backend::runner::decode::{local_attention, Dims, Entry};
use crate::error::{Error, Result};
use dump::{CallArgs, CallDir, Dump, Floats, Order};
use safetensors::tensor::Dtype as St;
use serde::Serialize;
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

/// Status of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
    /// A feature the check does not model (fp8 cache, sparse, sinks…), or a call that did not return.
    NotChecked,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::NotChecked => "not checked",
        }
    }
}

/// One MLA call, judged.
#[derive(Debug, Clone, Serialize)]
pub struct CallReport {
    /// The call's folder in the dump.
    pub folder: String,
    pub function: String,
    /// `call_sequence` (the `callNNNN` of the folder).
    pub call: u64,
    pub pid: u64,
    /// A call captured in a CUDA graph: the replay snapshot (`graph_flushes/flush_<n>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<u64>,
    /// The plan a wrapper run was paired with (its folder).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// The shapes, lengths and scale of the call, in words.
    pub shapes: String,
    pub verdict: Verdict,
    /// `out` (and `lse` when returned) against fp64 from the call's inputs; `model` checks with
    /// `--model`.
    pub checks: Vec<RunnerCheck>,
    /// Why a call was not checked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl CallReport {
    /// The worst check: the first failing one, else the one with the largest value/bound.
    fn worst(&self) -> Option<&RunnerCheck> {
        self.checks
            .iter()
            .find(|c| c.status == Status::Fail)
            .or_else(|| {
                self.checks
                    .iter()
                    .filter_map(|c| Some((c, c.value? / c.bound.filter(|b| *b > 0.0)?)))
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .map(|(c, _)| c)
            })
    }

    /// `function #call (shapes): VERDICT worst rel-L2 … (bound …)`.
    pub fn line(&self) -> String {
        let tail = match (self.verdict, self.worst()) {
            (Verdict::NotChecked, _) => self.reason.clone().unwrap_or_default(),
            (_, Some(c)) => c.detail.clone(),
            (_, None) => String::new(),
        };
        format!(
            "{} #{}{} (pid {}): {}: {} — {}",
            self.function,
            self.call,
            self.replay
                .map(|n| format!(" replay {n}"))
                .unwrap_or_default(),
            self.pid,
            self.shapes,
            self.verdict.name(),
            tail
        )
    }
}

/// The report of a dump.
#[derive(Debug, Clone, Serialize)]
pub struct DumpReport {
    pub flashinfer_report_version: u32,
    pub dir: String,
    /// Where the call order came from (`session` or `timestamps`).
    pub order: Order,
    /// The model of `--model`, if given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub calls: Vec<CallReport>,
    /// Wrapper plans read (each paired with the runs after it).
    pub plans: usize,
    /// Calls of other functions, skipped, by function.
    pub skipped: BTreeMap<String, usize>,
    /// Every checked call passed, and at least one was checked.
    pub pass: bool,
    pub message: String,
}

impl DumpReport {
    pub fn exit_code(&self) -> i32 {
        match self.pass {
            true => 0,
            false => 1,
        }
    }

    /// One line per call, then the summary.
    pub fn text(&self) -> String {
        let mut s = String::new();
        for c in &self.calls {
            s.push_str(&c.line());
            s.push('\n');
        }
        s.push_str(&self.message);
        s.push('\n');
        s
    }

    pub fn json(&self) -> String {
        format!(
            "{}\n",
            serde_json::to_string_pretty(self).expect("the report serializes")
        )
    }

    /// JUnit XML: one suite, one case per call (a failure per failing call, skipped when not checked).
    pub fn junit(&self) -> String {
        use quick_junit::{NonSuccessKind, Report, TestCase, TestCaseStatus, TestSuite};
        let mut r = Report::new("mla-diff");
        let mut suite = TestSuite::new(format!("flashinfer {}", self.dir));
        for c in &self.calls {
            let mut status = match c.verdict {
                Verdict::Pass => TestCaseStatus::success(),
                Verdict::Fail => TestCaseStatus::non_success(NonSuccessKind::Failure),
                Verdict::NotChecked => TestCaseStatus::skipped(),
            };
            if c.verdict != Verdict::Pass {
                status.set_message(c.line());
            }
            let mut case = TestCase::new(format!("{} #{}", c.function, c.call), status);
            case.set_classname(c.folder.as_str());
            case.set_system_out(
                c.checks
                    .iter()
                    .map(RunnerCheck::line)
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
            suite.add_test_case(case);
        }
        r.add_test_suite(suite);
        r.to_string().expect("JUnit XML renders")
    }

    /// A Markdown summary: the verdict, then a table of the calls.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "## mla-diff: FlashInfer calls in `{}`\n\n**{}**\n\n",
            self.dir, self.message
        );
        s.push_str("| call | function | shapes | verdict | worst |\n|---|---|---|---|---|\n");
        for c in &self.calls {
            let worst = match (c.verdict, c.worst()) {
                (Verdict::NotChecked, _) => c.reason.clone().unwrap_or_default(),
                (_, Some(w)) => w.detail.clone(),
                _ => String::new(),
            };
            s.push_str(&format!(
                "| {} | `{}` | {} | {} | {} |\n",
                c.call,
                c.function,
                c.shapes,
                c.verdict.name(),
                worst.replace('|', "\\|")
            ));
        }
        s
    }
}

/// One decoded call: the attention problem it posed and what it returned.
struct Problem {
    dims: Dims,
    /// Entries with their query count and causality.
    entries: Vec<(Entry, usize, bool)>,
    /// The cache rows the entries' keys index, `[n, L + R]`.
    rows: Vec<f64>,
    /// The returned output, rows in entry order, and the factor the kernel applies to it.
    out: Floats,
    out_scale: f64,
    /// The returned LSE in natural log, its dtype, and the base it came in.
    lse: Option<(Vec<f64>, &'static str, LseBase)>,
    in_dtype: &'static str,
    max_len: usize,
    shapes: String,
}

/// The base of a returned LSE as the call asked for it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum LseBase {
    E,
    Two,
    /// Not fixed by the call: trtllm_batch_decode_with_kv_cache_mla with `return_lse_base` unset
    /// and `backend="auto"` (flashinfer-python 0.7.2.post1: base 2 on trtllm-gen and sparse, natural
    /// log on CuTe DSL; an earlier version's trtllm-gen returned natural log). Judged in the base it is
    /// closer to, and the report says which.
    Either,
}

/// A call that is read but not checked: why.
struct NotChecked(String);

type Decoded = std::result::Result<Problem, NotChecked>;

fn bad(call: &CallDir, m: impl std::fmt::Display) -> Error {
    Error::Usage(format!("{}: {m}", call.name))
}

/// `lo–hi` or `n`.
fn span(v: &[usize]) -> String {
    let (lo, hi) = (
        v.iter().copied().min().unwrap_or(0),
        v.iter().copied().max().unwrap_or(0),
    );
    match lo == hi {
        true => lo.to_string(),
        false => format!("{lo}–{hi}"),
    }
}

fn is_fp8(d: St) -> bool {
    matches!(d, St::F8_E4M3 | St::F8_E5M2 | St::U8 | St::I8)
}

/// The first of `args` the call was given (arguments that change what the check models), or the first
/// of `tensors` that is fp8: why the call is not checked. A tensor missing from the dump is an error.
fn unmodelled(a: &CallArgs, args: &[&str], tensors: &[&str]) -> Result<Option<NotChecked>> {
    if let Some(f) = args.iter().find(|f| a.given(f)) {
        return Ok(Some(NotChecked(format!(
            "{f} given, which this check does not model"
        ))));
    }
    for t in tensors {
        match a.meta_of(t)? {
            None => {
                return Err(bad(
                    a.call,
                    format!(
                        "{} has no tensor '{t}' in inputs.safetensors",
                        a.call.function
                    ),
                ))
            }
            Some((d, _)) if is_fp8(d) => {
                return Ok(Some(NotChecked(format!(
                    "{t} is {d:?}: an fp8 tensor, which this check does not model"
                ))))
            }
            _ => {}
        }
    }
    Ok(None)
}

/// The call did not return a result the check can read: why, if so.
fn incomplete(a: &CallArgs) -> Option<NotChecked> {
    match a.status() {
        "completed" => None,
        "graph_capture_pending_flush" => Some(NotChecked(
            "captured in a CUDA graph and never flushed (no replay wrote its tensors)".into(),
        )),
        s => Some(NotChecked(format!(
            "the call did not return (execution_status {s}): the kernel raised, or the process ended first"
        ))),
    }
}

/// A non-negative index from a dumped integer.
fn idx(call: &CallDir, what: &str, v: i64) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(call, format!("{what} holds {v}")))
}

/// Cache pages referenced by `tables` (per entry: its pages), compacted: the distinct pages in first
/// use order and each entry's keys as rows of the compacted cache.
fn compact(tables: &[(Vec<usize>, usize)], page: usize) -> (Vec<usize>, Vec<Vec<Option<usize>>>) {
    let mut at: HashMap<usize, usize> = HashMap::new();
    let mut pages = Vec::new();
    let mut keys = Vec::new();
    for (t, len) in tables {
        let k = (0..*len)
            .map(|j| {
                let p = t[j / page];
                let n = *at.entry(p).or_insert_with(|| {
                    pages.push(p);
                    pages.len() - 1
                });
                Some(n * page + j % page)
            })
            .collect();
        keys.push(k);
    }
    (pages, keys)
}

/// Query rows `[rows, H, D]` of `q` for entry rows `r`.
fn q_rows(q: &[f64], r: std::ops::Range<usize>, width: usize) -> Vec<f64> {
    q[r.start * width..r.end * width].to_vec()
}

/// A wrapper run with its plan.
fn wrapper_run(a: &CallArgs, plan: &CallArgs) -> Result<Decoded> {
    let call = a.call;
    if let Some(n) = incomplete(a) {
        return Ok(Err(n));
    }
    if a.has_tensor("page_table") && a.has_tensor("kv_len") {
        return Ok(Err(NotChecked(
            "the cutlass backend's run (page_table and kv_len): its softmax scale is not an argument".into(),
        )));
    }
    for f in ["ckv_scale", "kpe_scale", "ckv_scale_arr", "o_scale"] {
        if a.given(f) {
            return Ok(Err(NotChecked(format!(
                "{f} given: an fp8 cache or output, which this check does not model"
            ))));
        }
    }
    // flashinfer 0.7's run also takes these; they change the scores or the scale the plan set.
    let args = [
        "sinks",
        "skip_softmax_threshold_scale_factor",
        "bmm1_scale",
        "bmm2_scale",
    ];
    if let Some(n) = unmodelled(a, &args, &["q_nope", "q_pe", "ckv_cache", "kpe_cache"])? {
        return Ok(Err(n));
    }
    let q_nope = a.floats("q_nope")?;
    let q_pe = a.floats("q_pe")?;
    let (n, h, l) = match q_nope.shape[..] {
        [n, h, l] => (n, h, l),
        _ => {
            return Err(bad(
                call,
                format!(
                    "q_nope has shape {:?}, not [tokens, heads, head_dim_ckv]",
                    q_nope.shape
                ),
            ))
        }
    };
    let r = match q_pe.shape[..] {
        [n2, h2, r] if n2 == n && h2 == h => r,
        _ => {
            return Err(bad(
                call,
                format!("q_pe has shape {:?}, q_nope {:?}", q_pe.shape, q_nope.shape),
            ))
        }
    };
    let pc = plan.call;
    // flashinfer 0.7's other plan forms: `metadata=MLAPlanMetadata(…)` is dumped as its repr (its
    // tensors are not in the dump), `block_tables=`/`seq_lens=` is not read yet.
    if plan.given("metadata") {
        return Ok(Err(NotChecked(format!(
            "its plan ({}) was given metadata=MLAPlanMetadata, which the dump holds as a repr, not its tensors",
            pc.name
        ))));
    }
    if !plan.has_tensor("qo_indptr") && plan.has_tensor("block_tables") {
        return Ok(Err(NotChecked(format!(
            "its plan ({}) uses the block_tables/seq_lens form, not read yet",
            pc.name
        ))));
    }
    let num = |k: &str| {
        plan.number(k).ok_or_else(|| {
            bad(
                pc,
                format!("the plan has no argument '{k}' in its metadata (input_metadata)"),
            )
        })
    };
    let (heads, ckv, kpe, page) = (
        num("num_heads")?,
        num("head_dim_ckv")?,
        num("head_dim_kpe")?,
        num("page_size")?,
    );
    let (sm_scale, causal) = (num("sm_scale")?, plan.flag("causal", false));
    if (heads as usize, ckv as usize, kpe as usize) != (h, l, r) {
        return Err(bad(
            call,
            format!(
                "planned for {heads} heads of {ckv}+{kpe} ({}), run with q_nope {:?} and q_pe {:?}",
                pc.name, q_nope.shape, q_pe.shape
            ),
        ));
    }
    let page = page as usize;
    if page == 0 {
        return Err(bad(pc, "page_size 0"));
    }
    let (_, qo) = plan.ints("qo_indptr")?;
    let (_, kv_indptr) = plan.ints("kv_indptr")?;
    let (_, kv_indices) = plan.ints("kv_indices")?;
    let (_, kv_len) = plan.ints("kv_len_arr")?;
    let b = kv_len.len();
    if qo.len() != b + 1 || kv_indptr.len() != b + 1 {
        return Err(bad(pc, format!(
            "qo_indptr has {} entries and kv_indptr {}, for {b} requests (kv_len_arr): both need {}",
            qo.len(), kv_indptr.len(), b + 1
        )));
    }
    let mut tables = Vec::new();
    let mut qr = Vec::new();
    for i in 0..b {
        let (q0, q1) = (
            idx(pc, "qo_indptr", qo[i])?,
            idx(pc, "qo_indptr", qo[i + 1])?,
        );
        let (k0, k1) = (
            idx(pc, "kv_indptr", kv_indptr[i])?,
            idx(pc, "kv_indptr", kv_indptr[i + 1])?,
        );
        let len = idx(pc, "kv_len_arr", kv_len[i])?;
        if q1 < q0 || q1 > n || k1 < k0 || k1 > kv_indices.len() {
            return Err(bad(
                pc,
                format!(
                    "request {i}: queries {q0}..{q1} of {n}, pages {k0}..{k1} of kv_indices' {}",
                    kv_indices.len()
                ),
            ));
        }
        if len > (k1 - k0) * page {
            return Err(bad(
                pc,
                format!(
                    "request {i}: kv_len_arr {len} needs {} pages of {page}, kv_indptr gives it {}",
                    len.div_ceil(page),
                    k1 - k0
                ),
            ));
        }
        if causal && q1 - q0 > len {
            return Err(bad(
                pc,
                format!("request {i}: {} causal queries over {len} keys", q1 - q0),
            ));
        }
        let t = kv_indices[k0..k1]
            .iter()
            .map(|&p| idx(pc, "kv_indices", p))
            .collect::<Result<Vec<_>>>()?;
        tables.push((t, len));
        qr.push(q0..q1);
    }
    let (pages, keys) = compact(&tables, page);
    let (ckv_rows, p1, w1, kv_dtype) = a.cache_pages("ckv_cache", &pages)?;
    let (kpe_rows, p2, w2, _) = a.cache_pages("kpe_cache", &pages)?;
    if (p1, w1, p2, w2) != (page, l, page, r) {
        return Err(bad(call, format!(
            "ckv_cache pages of {p1} × {w1} and kpe_cache pages of {p2} × {w2}; the plan's page is {page}, q's widths {l} and {r}"
        )));
    }
    let slots = pages.len() * page;
    let mut rows = Vec::with_capacity(slots * (l + r));
    for s in 0..slots {
        rows.extend_from_slice(&ckv_rows[s * l..(s + 1) * l]);
        rows.extend_from_slice(&kpe_rows[s * r..(s + 1) * r]);
    }
    let entries = entries_of(&q_nope.data, &q_pe.data, &qr, keys, h, l, r, causal);
    let return_lse = a.flag("return_lse", false);
    let (out, lse_raw) = match return_lse {
        true => (a.result(Some(0))?, a.result(Some(1))?),
        false => (a.result(None)?, None),
    };
    let key = if return_lse { "result_0" } else { "result" };
    let out = out.ok_or_else(|| {
        bad(
            call,
            format!("outputs.safetensors has no '{key}' (the call's output)"),
        )
    })?;
    let out = take_rows(call, out, &qr, h * l, "the output")?;
    let base_e = a.flag("return_lse_base_on_e", false);
    let lse = match (return_lse, lse_raw) {
        (false, _) => None,
        (true, None) => {
            return Err(bad(
                call,
                "return_lse is set but outputs.safetensors has no 'result_1' (the LSE)",
            ))
        }
        (true, Some(x)) => {
            let x = take_rows(call, x, &qr, h, "the LSE")?;
            Some((
                x.data,
                x.dtype,
                if base_e { LseBase::E } else { LseBase::Two },
            ))
        }
    };
    let lens: Vec<usize> = tables.iter().map(|t| t.1).collect();
    let qlens: Vec<usize> = qr.iter().map(|q| q.len()).collect();
    Ok(Ok(Problem {
        dims: Dims { heads: h, lkv: l, rope: r, scale: sm_scale },
        max_len: lens.iter().copied().max().unwrap_or(0),
        shapes: format!(
            "{b} requests, q {} × {h} heads × {l}+{r}, {} keys, page {page}, cache {}{}, sm_scale {sm_scale:.6}, q {} (plan #{})",
            span(&qlens),
            span(&lens),
            kv_dtype,
            if causal { ", causal" } else { "" },
            q_nope.dtype,
            plan.call.seq
        ),
        entries,
        rows,
        out,
        out_scale: 1.0,
        lse,
        in_dtype: q_nope.dtype,
    }))
}

/// The entries of a call: per request its query rows (`qr`) and keys; a non-causal request with
/// several queries is one entry per query (each sees every key).
#[allow(clippy::too_many_arguments)]
fn entries_of(
    q_abs: &[f64],
    q_pe: &[f64],
    qr: &[std::ops::Range<usize>],
    keys: Vec<Vec<Option<usize>>>,
    h: usize,
    l: usize,
    r: usize,
    causal: bool,
) -> Vec<(Entry, usize, bool)> {
    let mut v = Vec::new();
    for (q, k) in qr.iter().zip(keys) {
        let groups: Vec<std::ops::Range<usize>> = match causal {
            true => vec![q.clone()],
            false => q.clone().map(|i| i..i + 1).collect(),
        };
        for g in groups {
            let s_q = g.len();
            v.push((
                Entry {
                    q_nope: q_rows(q_abs, g.clone(), h * l),
                    q_pe: q_rows(q_pe, g, h * r),
                    keys: k.clone(),
                },
                s_q,
                causal,
            ));
        }
    }
    v
}

/// The rows `qr` of a returned `[rows, …]` tensor of `width` values per row, in entry order.
fn take_rows(
    call: &CallDir,
    x: Floats,
    qr: &[std::ops::Range<usize>],
    width: usize,
    what: &str,
) -> Result<Floats> {
    let rows = x.data.len() / width.max(1);
    if x.data.len() != rows * width || qr.iter().any(|q| q.end > rows) {
        return Err(bad(
            call,
            format!(
                "{what} has shape {:?}: not [{} rows, {width} values each]",
                x.shape,
                qr.iter().map(|q| q.end).max().unwrap_or(0)
            ),
        ));
    }
    let data = qr
        .iter()
        .flat_map(|q| x.data[q.start * width..q.end * width].iter().copied())
        .collect();
    Ok(Floats {
        shape: x.shape,
        data,
        dtype: x.dtype,
    })
}

/// A scale given as a float or a one-element tensor.
fn scale_arg(a: &CallArgs, name: &str) -> Result<Option<f64>> {
    if a.has_tensor(name) {
        let t = a.floats(name)?;
        return Ok(t.data.first().copied());
    }
    Ok(match a.value(name) {
        None => Some(1.0),
        Some(v) => v.as_f64(),
    })
}

/// A trtllm-gen / xqa decode call.
fn decode_call(a: &CallArgs) -> Result<Decoded> {
    let call = a.call;
    if let Some(n) = incomplete(a) {
        return Ok(Err(n));
    }
    if a.number("sparse_mla_top_k").unwrap_or(0.0) > 0.0 {
        return Ok(Err(NotChecked("sparse MLA (sparse_mla_top_k > 0): the keys are the sparse indices, which this check does not model".into())));
    }
    let args = [
        "sinks",
        "skip_softmax_threshold_scale_factor",
        "cum_seq_lens_q",
        "causal_seqlens_kv_global",
    ];
    if let Some(n) = unmodelled(a, &args, &[])? {
        return Ok(Err(n));
    }
    if !a.flag("uses_shared_paged_kv_idx", true) || a.flag("enable_dcp", false) {
        return Ok(Err(NotChecked("TRT-LLM's separate K/V page indices or decode context parallelism, which this check does not model".into())));
    }
    if let Some(n) = unmodelled(a, &[], &["query", "kv_cache"])? {
        return Ok(Err(n));
    }
    let q = a.floats("query")?;
    let (b, s_q, h, w) = match q.shape[..] {
        [b, s, h, w] => (b, s, h, w),
        _ => {
            return Err(bad(
                call,
                format!(
                "query has shape {:?}, not [batch, q_len, heads, kv_lora_rank + qk_rope_head_dim]",
                q.shape
            ),
            ))
        }
    };
    let num = |k: &str| {
        a.number(k).ok_or_else(|| {
            bad(
                call,
                format!("no argument '{k}' in its metadata (input_metadata)"),
            )
        })
    };
    let (l, r) = (
        num("kv_lora_rank")? as usize,
        num("qk_rope_head_dim")? as usize,
    );
    if l + r != w {
        return Err(bad(
            call,
            format!(
                "query's last dim is {w}, kv_lora_rank {l} + qk_rope_head_dim {r} = {}",
                l + r
            ),
        ));
    }
    let scale = scale_arg(a, "bmm1_scale")?
        .ok_or_else(|| bad(call, "bmm1_scale is neither a number nor a tensor"))?;
    let out_scale = scale_arg(a, "bmm2_scale")?
        .ok_or_else(|| bad(call, "bmm2_scale is neither a number nor a tensor"))?;
    let (tsh, table) = a.ints("block_tables")?;
    let (_, lens) = a.ints("seq_lens")?;
    let max_pages = match tsh[..] {
        [b2, m] if b2 == b => m,
        _ => {
            return Err(bad(
                call,
                format!("block_tables has shape {tsh:?}, not [{b}, pages]"),
            ))
        }
    };
    if lens.len() != b {
        return Err(bad(
            call,
            format!("seq_lens has {} entries for a batch of {b}", lens.len()),
        ));
    }
    let (_, ksh) = a.meta_of("kv_cache")?.expect("checked above");
    let page = match ksh[..] {
        [_, g, _] | [_, 1, g, _] => g,
        _ => return Err(bad(call, format!("kv_cache has shape {ksh:?}; a paged cache is [pages, page_size, width] or [pages, 1, page_size, width]"))),
    };
    if page == 0 {
        return Err(bad(
            call,
            format!("kv_cache has shape {ksh:?}: pages of 0 rows"),
        ));
    }
    let mut tables = Vec::new();
    for i in 0..b {
        let len = idx(call, "seq_lens", lens[i])?;
        if len > max_pages * page {
            return Err(bad(call, format!("request {i}: seq_lens {len} needs {} pages of {page}, block_tables has {max_pages}", len.div_ceil(page))));
        }
        if s_q > len {
            return Err(bad(
                call,
                format!("request {i}: {s_q} queries over {len} keys"),
            ));
        }
        let t = table[i * max_pages..i * max_pages + len.div_ceil(page)]
            .iter()
            .map(|&p| idx(call, "block_tables", p))
            .collect::<Result<Vec<_>>>()?;
        tables.push((t, len));
    }
    let (pages, keys) = compact(&tables, page);
    let (rows, _, width, kv_dtype) = a.cache_pages("kv_cache", &pages)?;
    if width != w {
        return Err(bad(
            call,
            format!("kv_cache rows are {width} wide, the query's {w}"),
        ));
    }
    // Split the query into its latent and rope parts, as the yardstick takes them.
    let (mut qa, mut qp) = (
        Vec::with_capacity(b * s_q * h * l),
        Vec::with_capacity(b * s_q * h * r),
    );
    for row in q.data.chunks_exact(w) {
        qa.extend_from_slice(&row[..l]);
        qp.extend_from_slice(&row[l..]);
    }
    let qr: Vec<std::ops::Range<usize>> = (0..b).map(|i| i * s_q..(i + 1) * s_q).collect();
    let entries = entries_of(&qa, &qp, &qr, keys, h, l, r, true);
    let return_lse = a.flag("return_lse", false);
    let (out, lse_raw) = match return_lse {
        true => (a.result(Some(0))?, a.result(Some(1))?),
        false => (a.result(None)?, None),
    };
    let key = if return_lse { "result_0" } else { "result" };
    let out = out.ok_or_else(|| {
        bad(
            call,
            format!("outputs.safetensors has no '{key}' (the call's output)"),
        )
    })?;
    let all = 0..b * s_q;
    let tok = std::slice::from_ref(&all);
    let out = take_rows(call, out, tok, h * l, "the output")?;
    let lse = match (return_lse, lse_raw) {
        (false, _) => None,
        (true, None) => {
            return Err(bad(
                call,
                "return_lse is set but outputs.safetensors has no 'result_1' (the LSE)",
            ))
        }
        (true, Some(x)) => {
            let x = take_rows(call, x, tok, h, "the LSE")?;
            let base = match a.value("return_lse_base").and_then(|v| v.as_str()) {
                Some("basee") => LseBase::E,
                Some("base2") => LseBase::Two,
                _ => match a.value("backend").and_then(|v| v.as_str()) {
                    Some("trtllm-gen") | Some("sparse") => LseBase::Two,
                    Some("cute-dsl") => LseBase::E,
                    _ => LseBase::Either,
                },
            };
            Some((x.data, x.dtype, base))
        }
    };
    let lens: Vec<usize> = tables.iter().map(|t| t.1).collect();
    Ok(Ok(Problem {
        dims: Dims { heads: h, lkv: l, rope: r, scale },
        max_len: lens.iter().copied().max().unwrap_or(0),
        shapes: format!(
            "{b} requests, q {s_q} × {h} heads × {l}+{r}, {} keys, page {page}, cache {kv_dtype}, causal, bmm1_scale {scale:.6}{}, q {}",
            span(&lens),
            if out_scale != 1.0 { format!(", bmm2_scale {out_scale}") } else { String::new() },
            q.dtype
        ),
        entries,
        rows,
        out,
        out_scale,
        lse,
        in_dtype: q.dtype,
    }))
}

/// Judge a decoded call against fp64 from its inputs (and the model's scale and dims).
fn judge(p: &Problem, model: Option<&ModelExpect>) -> Vec<RunnerCheck> {
    let (mut r_out, mut r_lse) = (Vec::new(), Vec::new());
    for (e, s_q, _) in &p.entries {
        let l = local_attention(&p.dims, e, *s_q, &p.rows, |_| Vec::new());
        r_out.extend(l.out.iter().map(|v| v * p.out_scale));
        r_lse.extend(l.lse);
    }
    let terms = p.max_len.max(1) * (p.dims.lkv + p.dims.rope);
    // `scope` opens the detail (what was compared), so that the call's line reads on its own.
    let check = |what: &str, ro: (&[f64], &[f64]), dtype: &str, scope: &str| {
        let mut c = against_fp64(
            p.in_dtype,
            0,
            "flashinfer_call",
            what,
            ro,
            dtype,
            terms,
            |_| false,
            scope,
        );
        c.layer = None;
        c
    };
    let mut v = vec![check("out", (&r_out, &p.out.data), p.out.dtype, "out")];
    if let Some((lse, dtype, base)) = &p.lse {
        let two: Vec<f64> = lse.iter().map(|v| v * std::f64::consts::LN_2).collect();
        let c = match base {
            LseBase::E => check("lse", (&r_lse, lse), dtype, "lse"),
            LseBase::Two => check(
                "lse",
                (&r_lse, &two),
                dtype,
                "lse (base 2, compared as natural log)",
            ),
            LseBase::Either => {
                let e = check("lse", (&r_lse, lse), dtype, "lse (base not fixed by the call: return_lse_base unset, backend auto; nearer natural log)");
                let t = check("lse", (&r_lse, &two), dtype, "lse (base not fixed by the call: return_lse_base unset, backend auto; nearer base 2)");
                match t.value.unwrap_or(f64::INFINITY) < e.value.unwrap_or(f64::INFINITY) {
                    true => t,
                    false => e,
                }
            }
        };
        v.push(c);
    }
    if let Some(m) = model {
        v.extend(model_checks(p, m));
    }
    v
}

/// The call's scale and dims against the model's.
fn model_checks(p: &Problem, m: &ModelExpect) -> Vec<RunnerCheck> {
    let d = &p.dims;
    let rec = |what: &str, pass: bool, value: Option<f64>, detail: String| RunnerCheck {
        layer: None,
        check: "model".into(),
        status: if pass { Status::Pass } else { Status::Fail },
        what: what.into(),
        value,
        bound: None,
        detail,
    };
    let ratio = m.softmax_scale / d.scale;
    let rel = (d.scale - m.softmax_scale).abs() / m.softmax_scale;
    let ms2 = m.mscale * m.mscale;
    let why = if m.mscale != 1.0 && (ratio - ms2).abs() < 1e-4 * ms2 {
        format!(": the model's divided by mscale² {ms2:.6} — YaRN's mscale² left out")
    } else if m.mscale != 1.0 && (ratio - m.mscale).abs() < 1e-4 * m.mscale {
        format!(
            ": the model's divided by mscale {:.6} — mscale applied once, not squared",
            m.mscale
        )
    } else {
        String::new()
    };
    let dims_ok = d.lkv == m.kv_lora_rank
        && d.rope == m.qk_rope
        && d.heads > 0
        && m.n_head.is_multiple_of(d.heads);
    vec![
        rec(
            "softmax_scale",
            rel <= 1e-5,
            Some(rel),
            format!(
                "softmax_scale: the call's {:.6}, {}'s {:.6}{why}",
                d.scale, m.name, m.softmax_scale
            ),
        ),
        rec(
            "dims",
            dims_ok,
            None,
            format!(
                "dims: the call's {} heads × {}+{}, {}'s {} heads (or a TP slice of them) × {}+{}",
                d.heads, d.lkv, d.rope, m.name, m.n_head, m.kv_lora_rank, m.qk_rope
            ),
        ),
    ]
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
        let (decoded, plan) = if c.flush.is_some() && d.order == Order::Timestamps {
            // Replays are flushed after the call's own timestamp: only session.jsonl orders them
            // among the plans.
            let why = "a CUDA-graph replay snapshot, and without session.jsonl its place among the plans is unknown";
            (Err(NotChecked(why.into())), None)
        } else if f == RUN {
            let a = CallArgs::read(c, RUN_PARAMS)?;
            if a.has_tensor("page_table") && a.has_tensor("kv_len") {
                (wrapper_run(&a, &a)?, None)
            } else {
                let id = c.self_id.ok_or_else(|| bad(c, "a wrapper run with no self_id in its metadata.jsonl: it cannot be paired with its plan"))?;
                let p = plans.get(&(c.pid, id)).ok_or_else(|| {
                    bad(c, format!(
                        "{RUN} of wrapper {id} (pid {}) has no {PLAN} of the same wrapper before it in the dump: the plan holds the page table (dump it too: FLASHINFER_DUMP_INCLUDE must match it, FLASHINFER_DUMP_MAX_COUNT not cut it)",
                        c.pid
                    ))
                })?;
                let pa = CallArgs::read(p, PLAN_PARAMS)?;
                (wrapper_run(&a, &pa)?, Some(p.name.clone()))
            }
        } else {
            let params = if f == DECODES[1] {
                XQA_PARAMS
            } else {
                DECODE_PARAMS
            };
            (decode_call(&CallArgs::read(c, params)?)?, None)
        };
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
        let rep = CallReport {
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
        };
        if progress {
            eprintln!("{}", rep.line());
        }
        calls.push(rep);
    }
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
