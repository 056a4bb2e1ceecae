//! `trtllm_batch_decode_with_kv_cache_mla` and `xqa_batch_decode_with_kv_cache_mla`: one call holds
//! the whole problem (query, paged cache, block tables, lengths, scales); causal over a request's
//! queries, LSE natural log unless the call or its backend says base 2.

use super::dump::{CallArgs, Floats};
use super::problem::{
    bad, compact, entries_of, idx, incomplete, returned, scale_arg, span, unmodelled, Decoded,
    LseBase, NotChecked, Problem,
};
use crate::backend::runner::decode::Dims;
use crate::error::Result;

/// A trtllm-gen / xqa decode call.
pub(super) fn decode_call(a: &CallArgs) -> Result<Decoded> {
    let call = a.call;
    if let Some(n) = not_modelled(a)? {
        return Ok(Err(n));
    }
    let q = Query::read(a)?;
    let (b, s_q, h, l, r) = (q.b, q.s_q, q.h, q.l, q.r);
    let scale = scale_arg(a, "bmm1_scale")?
        .ok_or_else(|| bad(call, "bmm1_scale is neither a number nor a tensor"))?;
    let out_scale = scale_arg(a, "bmm2_scale")?
        .ok_or_else(|| bad(call, "bmm2_scale is neither a number nor a tensor"))?;
    let (tables, page) = block_tables(a, b, s_q)?;
    let (pages, keys) = compact(&tables, page);
    let (rows, _, width, kv_dtype) = a.cache_pages("kv_cache", &pages)?;
    if width != l + r {
        return Err(bad(
            call,
            format!("kv_cache rows are {width} wide, the query's {}", l + r),
        ));
    }
    let (qa, qp) = q.split();
    let qr: Vec<std::ops::Range<usize>> = (0..b).map(|i| i * s_q..(i + 1) * s_q).collect();
    let entries = entries_of(&qa, &qp, &qr, keys, h, l, r, true);
    let all = 0..b * s_q;
    let (out, lse) = returned(a, std::slice::from_ref(&all), h, l, || lse_base(a))?;
    let lens: Vec<usize> = tables.iter().map(|t| t.1).collect();
    Ok(Ok(Problem {
        dims: Dims { heads: h, lkv: l, rope: r, scale },
        max_len: lens.iter().copied().max().unwrap_or(0),
        shapes: format!(
            "{b} requests, q {s_q} × {h} heads × {l}+{r}, {} keys, page {page}, cache {kv_dtype}, causal, bmm1_scale {scale:.6}{}, q {}",
            span(&lens),
            if out_scale != 1.0 { format!(", bmm2_scale {out_scale}") } else { String::new() },
            q.q.dtype
        ),
        entries,
        rows,
        out,
        out_scale,
        lse,
        in_dtype: q.q.dtype,
    }))
}

/// Why a decode call is not checked, if so: it did not return, it is sparse MLA, or it was given an
/// argument the check does not model (sinks, TRT-LLM's separate K/V indices, …) or an fp8 tensor.
fn not_modelled(a: &CallArgs) -> Result<Option<NotChecked>> {
    if let Some(n) = incomplete(a) {
        return Ok(Some(n));
    }
    if a.number("sparse_mla_top_k").unwrap_or(0.0) > 0.0 {
        return Ok(Some(NotChecked("sparse MLA (sparse_mla_top_k > 0): the keys are the sparse indices, which this check does not model".into())));
    }
    let args = [
        "sinks",
        "skip_softmax_threshold_scale_factor",
        "cum_seq_lens_q",
        "causal_seqlens_kv_global",
    ];
    if let Some(n) = unmodelled(a, &args, &[])? {
        return Ok(Some(n));
    }
    if !a.flag("uses_shared_paged_kv_idx", true) || a.flag("enable_dcp", false) {
        return Ok(Some(NotChecked("TRT-LLM's separate K/V page indices or decode context parallelism, which this check does not model".into())));
    }
    unmodelled(a, &[], &["query", "kv_cache"])
}

/// The call's query `[B, q, H, L + R]`, with `L` and `R` from its arguments.
struct Query {
    q: Floats,
    b: usize,
    s_q: usize,
    h: usize,
    l: usize,
    r: usize,
}

impl Query {
    fn read(a: &CallArgs) -> Result<Query> {
        let call = a.call;
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
        Ok(Query { q, b, s_q, h, l, r })
    }

    /// The query's latent and rope parts, as the yardstick takes them.
    fn split(&self) -> (Vec<f64>, Vec<f64>) {
        let (l, r, rows) = (self.l, self.r, self.b * self.s_q * self.h);
        let (mut qa, mut qp) = (Vec::with_capacity(rows * l), Vec::with_capacity(rows * r));
        for row in self.q.data.chunks_exact(l + r) {
            qa.extend_from_slice(&row[..l]);
            qp.extend_from_slice(&row[l..]);
        }
        (qa, qp)
    }
}

/// Per request of the batch of `b`, its pages and key count (`block_tables`, `seq_lens`), each
/// checked against the table and the `s_q` queries; and the cache's page size.
#[allow(clippy::type_complexity)]
fn block_tables(a: &CallArgs, b: usize, s_q: usize) -> Result<(Vec<(Vec<usize>, usize)>, usize)> {
    let call = a.call;
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
    Ok((tables, page))
}

/// The base of the returned LSE: `return_lse_base` if given, else the backend's (flashinfer-python
/// 0.7.2.post1), else not fixed by the call.
fn lse_base(a: &CallArgs) -> LseBase {
    match a.value("return_lse_base").and_then(|v| v.as_str()) {
        Some("basee") => LseBase::E,
        Some("base2") => LseBase::Two,
        _ => match a.value("backend").and_then(|v| v.as_str()) {
            Some("trtllm-gen") | Some("sparse") => LseBase::Two,
            Some("cute-dsl") => LseBase::E,
            _ => LseBase::Either,
        },
    }
}
