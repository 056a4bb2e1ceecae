//! A logged MLA call decoded into the attention problem it posed (`Problem`), what the two call
//! readers (`wrapper.rs`, `decode.rs`) share to decode one, and its judgement against fp64 from the
//! call's own inputs.

use super::dump::{CallArgs, CallDir, Floats};
use super::ModelExpect;
use crate::backend::runner::checks::{against_fp64, RunnerCheck, Status};
use crate::backend::runner::decode::{local_attention, Dims, Entry};
use crate::error::{Error, Result};
use safetensors::tensor::Dtype as St;
use std::collections::HashMap;

/// One decoded call: the attention problem it posed and what it returned.
pub(super) struct Problem {
    pub dims: Dims,
    /// Entries with their query count and causality.
    pub entries: Vec<(Entry, usize, bool)>,
    /// The cache rows the entries' keys index, `[n, L + R]`.
    pub rows: Vec<f64>,
    /// The returned output, rows in entry order, and the factor the kernel applies to it.
    pub out: Floats,
    pub out_scale: f64,
    /// The returned LSE in natural log, its dtype, and the base it came in.
    pub lse: Option<Lse>,
    pub in_dtype: &'static str,
    pub max_len: usize,
    pub shapes: String,
}

/// The base of a returned LSE as the call asked for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum LseBase {
    E,
    Two,
    /// Not fixed by the call: trtllm_batch_decode_with_kv_cache_mla with `return_lse_base` unset
    /// and `backend="auto"` (flashinfer-python 0.7.2.post1: base 2 on trtllm-gen and sparse, natural
    /// log on CuTe DSL; an earlier version's trtllm-gen returned natural log). Judged in the base it is
    /// closer to, and the report says which.
    Either,
}

/// A call that is read but not checked: why.
pub(super) struct NotChecked(pub String);

pub(super) type Decoded = std::result::Result<Problem, NotChecked>;

pub(super) fn bad(call: &CallDir, m: impl std::fmt::Display) -> Error {
    Error::Usage(format!("{}: {m}", call.name))
}

/// `lo–hi` or `n`.
pub(super) fn span(v: &[usize]) -> String {
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
pub(super) fn unmodelled(
    a: &CallArgs,
    args: &[&str],
    tensors: &[&str],
) -> Result<Option<NotChecked>> {
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
pub(super) fn incomplete(a: &CallArgs) -> Option<NotChecked> {
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
pub(super) fn idx(call: &CallDir, what: &str, v: i64) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(call, format!("{what} holds {v}")))
}

/// Cache pages referenced by `tables` (per entry: its pages), compacted: the distinct pages in first
/// use order and each entry's keys as rows of the compacted cache.
pub(super) fn compact(
    tables: &[(Vec<usize>, usize)],
    page: usize,
) -> (Vec<usize>, Vec<Vec<Option<usize>>>) {
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

/// The entries of a call: per request its query rows (`qr`) and keys; a non-causal request with
/// several queries is one entry per query (each sees every key).
#[allow(clippy::too_many_arguments)]
pub(super) fn entries_of(
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
pub(super) fn take_rows(
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
pub(super) fn scale_arg(a: &CallArgs, name: &str) -> Result<Option<f64>> {
    if a.has_tensor(name) {
        let t = a.floats(name)?;
        return Ok(t.data.first().copied());
    }
    Ok(match a.value(name) {
        None => Some(1.0),
        Some(v) => v.as_f64(),
    })
}

/// The LSE a call returned: natural log values, its dtype, the base it came in.
pub(super) type Lse = (Vec<f64>, &'static str, LseBase);

/// What the call returned: its output rows `qr` (`H · L` values each) and, with `return_lse`, its LSE
/// rows (`H` each) in the base `base` says.
pub(super) fn returned(
    a: &CallArgs,
    qr: &[std::ops::Range<usize>],
    h: usize,
    l: usize,
    base: impl FnOnce() -> LseBase,
) -> Result<(Floats, Option<Lse>)> {
    let call = a.call;
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
    let out = take_rows(call, out, qr, h * l, "the output")?;
    let lse = match (return_lse, lse_raw) {
        (false, _) => None,
        (true, None) => {
            return Err(bad(
                call,
                "return_lse is set but outputs.safetensors has no 'result_1' (the LSE)",
            ))
        }
        (true, Some(x)) => {
            let x = take_rows(call, x, qr, h, "the LSE")?;
            Some((x.data, x.dtype, base()))
        }
    };
    Ok((out, lse))
}

/// Judge a decoded call against fp64 from its inputs (and the model's scale and dims).
pub(super) fn judge(p: &Problem, model: Option<&ModelExpect>) -> Vec<RunnerCheck> {
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
