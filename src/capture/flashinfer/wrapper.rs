//! `BatchMLAPagedAttentionWrapper.run` with its plan: the queries and caches come with the run, the
//! page table, lengths, causality and scale with the same wrapper's latest `plan`.

use super::dump::{CallArgs, CallDir, Floats};
use super::problem::{
    bad, compact, entries_of, idx, incomplete, returned, span, unmodelled, Decoded, LseBase,
    NotChecked, Problem,
};
use crate::backend::runner::decode::Dims;
use crate::error::Result;
use std::ops::Range;

/// A wrapper run with its plan.
pub(super) fn wrapper_run(a: &CallArgs, plan: &CallArgs) -> Result<Decoded> {
    let call = a.call;
    if let Some(n) = not_modelled(a)? {
        return Ok(Err(n));
    }
    let q = Queries::read(a)?;
    let (h, l, r) = (q.h, q.l, q.r);
    let p = match Plan::read(plan, call, &q)? {
        Ok(p) => p,
        Err(n) => return Ok(Err(n)),
    };
    let (tables, qr) = p.requests(q.n)?;
    let page = p.page;
    let (pages, keys) = compact(&tables, page);
    let (rows, kv_dtype) = cache_rows(a, &pages, page, l, r)?;
    let entries = entries_of(&q.nope.data, &q.pe.data, &qr, keys, h, l, r, p.causal);
    let base_e = a.flag("return_lse_base_on_e", false);
    let (out, lse) = returned(a, &qr, h, l, || match base_e {
        true => LseBase::E,
        false => LseBase::Two,
    })?;
    let lens: Vec<usize> = tables.iter().map(|t| t.1).collect();
    let qlens: Vec<usize> = qr.iter().map(|q| q.len()).collect();
    let sm_scale = p.sm_scale;
    Ok(Ok(Problem {
        dims: Dims { heads: h, lkv: l, rope: r, scale: sm_scale },
        max_len: lens.iter().copied().max().unwrap_or(0),
        shapes: format!(
            "{} requests, q {} × {h} heads × {l}+{r}, {} keys, page {page}, cache {}{}, sm_scale {sm_scale:.6}, q {} (plan #{})",
            tables.len(),
            span(&qlens),
            span(&lens),
            kv_dtype,
            if p.causal { ", causal" } else { "" },
            q.nope.dtype,
            plan.call.seq
        ),
        entries,
        rows,
        out,
        out_scale: 1.0,
        lse,
        in_dtype: q.nope.dtype,
    }))
}

/// Why a wrapper run is not checked, if so: it did not return, it is the cutlass backend's form, or
/// it was given an argument the check does not model (fp8 scales, sinks, …) or an fp8 tensor.
fn not_modelled(a: &CallArgs) -> Result<Option<NotChecked>> {
    if let Some(n) = incomplete(a) {
        return Ok(Some(n));
    }
    if a.has_tensor("page_table") && a.has_tensor("kv_len") {
        return Ok(Some(NotChecked(
            "the cutlass backend's run (page_table and kv_len): its softmax scale is not an argument".into(),
        )));
    }
    for f in ["ckv_scale", "kpe_scale", "ckv_scale_arr", "o_scale"] {
        if a.given(f) {
            return Ok(Some(NotChecked(format!(
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
    unmodelled(a, &args, &["q_nope", "q_pe", "ckv_cache", "kpe_cache"])
}

/// The run's queries, `q_nope` `[n, H, L]` and `q_pe` `[n, H, R]`.
struct Queries {
    nope: Floats,
    pe: Floats,
    n: usize,
    h: usize,
    l: usize,
    r: usize,
}

impl Queries {
    fn read(a: &CallArgs) -> Result<Queries> {
        let call = a.call;
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
        Ok(Queries {
            nope: q_nope,
            pe: q_pe,
            n,
            h,
            l,
            r,
        })
    }
}

/// What a run takes from its plan: the page size, the scale, causality and the page-table arguments.
struct Plan<'a> {
    plan: &'a CallArgs<'a>,
    page: usize,
    sm_scale: f64,
    causal: bool,
}

impl<'a> Plan<'a> {
    /// The plan of a run with queries `q`; a plan form not read yet is not checked, one planned for
    /// other dims than the run's is an error.
    fn read(
        plan: &'a CallArgs<'a>,
        call: &CallDir,
        q: &Queries,
    ) -> Result<std::result::Result<Plan<'a>, NotChecked>> {
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
        if (heads as usize, ckv as usize, kpe as usize) != (q.h, q.l, q.r) {
            return Err(bad(
                call,
                format!(
                    "planned for {heads} heads of {ckv}+{kpe} ({}), run with q_nope {:?} and q_pe {:?}",
                    pc.name, q.nope.shape, q.pe.shape
                ),
            ));
        }
        let page = page as usize;
        if page == 0 {
            return Err(bad(pc, "page_size 0"));
        }
        Ok(Ok(Plan {
            plan,
            page,
            sm_scale,
            causal,
        }))
    }

    /// Per request of the plan, its pages and key count (`kv_indices` from `kv_indptr`, `kv_len_arr`)
    /// and its query rows of the run's `n` (`qo_indptr`), each checked against what it indexes.
    #[allow(clippy::type_complexity)]
    fn requests(&self, n: usize) -> Result<(Vec<(Vec<usize>, usize)>, Vec<Range<usize>>)> {
        let (plan, page) = (self.plan, self.page);
        let pc = plan.call;
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
            if self.causal && q1 - q0 > len {
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
        Ok((tables, qr))
    }
}

/// The rows `[slots, L + R]` of the cache `pages` (`ckv_cache`'s latent next to `kpe_cache`'s rope
/// part), and the cache's dtype.
fn cache_rows(
    a: &CallArgs,
    pages: &[usize],
    page: usize,
    l: usize,
    r: usize,
) -> Result<(Vec<f64>, &'static str)> {
    let (ckv_rows, p1, w1, kv_dtype) = a.cache_pages("ckv_cache", pages)?;
    let (kpe_rows, p2, w2, _) = a.cache_pages("kpe_cache", pages)?;
    if (p1, w1, p2, w2) != (page, l, page, r) {
        return Err(bad(a.call, format!(
            "ckv_cache pages of {p1} × {w1} and kpe_cache pages of {p2} × {w2}; the plan's page is {page}, q's widths {l} and {r}"
        )));
    }
    let slots = pages.len() * page;
    let mut rows = Vec::with_capacity(slots * (l + r));
    for s in 0..slots {
        rows.extend_from_slice(&ckv_rows[s * l..(s + 1) * l]);
        rows.extend_from_slice(&kpe_rows[s * r..(s + 1) * r]);
    }
    Ok((rows, kv_dtype))
}
