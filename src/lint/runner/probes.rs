//! Probes 3–7 (decode only): the cache row order, page addressing, MTP causality, the split partition
//! and the empty split. Each runs once the earlier ones have shown what it needs read right.

use super::judge::ScaleBase;
use super::prober::{DecodeCase, Prober};
use super::{unit, within, A};
use crate::backend::runner::protocol::{self, LseBase};
use crate::backend::runner::tensors::Output;
use crate::error::Result;
use crate::lint::{num, Findings};
use std::f64::consts::LN_2;

/// The split probe's keys and splits: vLLM's partition gives them 2, 2, 1 and 0 keys.
const L: usize = 5;
const S: usize = 4;

/// Probe 3: the order of a cache row.
pub(super) fn probe_row_order(
    p: &mut Prober,
    sb: &ScaleBase,
    out: &mut Findings,
) -> Result<Option<bool>> {
    let c = p.cfg;
    let (lkv, r) = (c.kv_lora_rank, c.qk_rope);
    let (w_nope, w_pe) = (2.0f32, 4.0f32);
    let mut q_nope = vec![0.0; lkv];
    q_nope[0] = w_nope;
    let mut q_pe = vec![0.0; r];
    q_pe[0] = w_pe;
    let key = |latent0: f32, pe0: f32| {
        let mut row = vec![0.0f32; lkv + r];
        row[0] = latent0;
        row[lkv] = pe0;
        DecodeCase {
            q_nope: q_nope.clone(),
            q_pe: q_pe.clone(),
            rows: vec![row],
            table: vec![0],
            pool: 2,
        }
    };
    // (key, its score q·k, its value's latent[0]) as [latent | k_pe] reads them.
    let cases = [
        (key(0.0, 1.0), w_pe as f64, 0.0),
        (key(1.0, 0.0), w_nope as f64, 1.0),
    ];
    let mut seen = Vec::new();
    for (case, dot, v0) in &cases {
        let Some(a) = p.decode(case, out)? else {
            return Ok(None);
        };
        let dot_found = a.mean_lse() * sb.to_e / sb.scale;
        let mut want = vec![0.0; a.out.len()];
        for hh in 0..c.n_head {
            want[hh * lkv] = *v0;
        }
        let out_ok = a.out_err(&want) <= 4.0 * a.u_out();
        let dot_ok = (dot_found - dot).abs() <= (8.0 * a.u_lse() + 1e-6) * dot.max(1.0);
        seen.push((dot_found, dot_ok && out_ok, a.out.get(lkv - r).copied()));
    }
    let check = "runner.decode.cache_row";
    if seen.iter().all(|s| s.1) {
        out.note(
            check,
            format!("[latent {lkv} | k_pe {r}]"),
            "a key with only k_pe[0] = 1 and one with only latent[0] = 1 scored and returned as that order says",
        );
        return Ok(Some(true));
    }
    // Read as [k_pe | latent]: the first key's 1 lands in the latent at lkv − r (q_nope 0 there), the
    // second's in k_pe[0] (weight w_pe).
    let swapped =
        (seen[0].0).abs() <= 1e-3 && (seen[1].0 - w_pe as f64).abs() <= 1e-2 * w_pe as f64;
    let found = format!(
        "a key with only k_pe[0] = 1 scored q·k = {} (expected {}), one with only latent[0] = 1 scored {} (expected {})",
        num(seen[0].0),
        num(w_pe as f64),
        num(seen[1].0),
        num(w_nope as f64)
    );
    if swapped {
        out.error(
            check,
            format!("[k_pe | latent]: {found}"),
            format!("[latent {lkv} | k_pe {r}]"),
            "the cache rows hold the normed latent first, then the roped k_pe (llama.cpp since it moved from [pe, kv] to [kv, pe], vLLM, FlashMLA); a kernel with the old order hard-coded scores every key with the wrong dims and returns k_pe as values (fault cache_pe_first)",
        );
    } else {
        out.error(
            check,
            found,
            format!("[latent {lkv} | k_pe {r}]: scores {} and {}, values latent[0] 0 and 1", num(w_pe as f64), num(w_nope as f64)),
            "the runner reads the rows [latent | k_pe] in some other layout: its scores or values come from the wrong columns",
        );
    }
    Ok(Some(false))
}

/// Probe 4: a sequence over three shuffled pages among NaN ones.
pub(super) fn probe_paging(p: &mut Prober, sb: &ScaleBase, out: &mut Findings) -> Result<bool> {
    let c = p.cfg;
    let (lkv, r, page) = (c.kv_lora_rank, c.qk_rope, p.page);
    let n = 2 * page + 1;
    // Logical pages 0, 1, 2 at physical 5, 1, 3 of 7: out of order, with NaN pages 0, 2, 4, 6 around.
    let table = vec![5, 1, 3];
    // Token t's latent: (1 + t / lkv) at t % lkv; distinct (index, weight) pairs tell tokens apart.
    let rows: Vec<Vec<f32>> = (0..n)
        .map(|t| {
            let mut row = vec![0.0f32; lkv + r];
            row[t % lkv] = p.dt.round((1 + t / lkv) as f32);
            row
        })
        .collect();
    let mut want1 = vec![0.0f64; lkv];
    for row in &rows {
        for (w, v) in want1.iter_mut().zip(row) {
            *w += *v as f64 / n as f64;
        }
    }
    let case = DecodeCase {
        q_nope: vec![0.0; lkv],
        q_pe: vec![0.0; r],
        rows,
        table: table.clone(),
        pool: 7,
    };
    let Some(a) = p.decode(&case, out)? else {
        return Ok(false);
    };
    let want: Vec<f64> = want1.repeat(c.n_head);
    let err = a.out_err(&want);
    let lse_e = a.mean_lse() * sb.to_e;
    let lse_want = (n as f64).ln();
    let lse_ok = (lse_e - lse_want).abs() <= (8.0 * a.u_lse() + 1e-6) * lse_want;
    let check = "runner.decode.paging";
    let layout = format!(
        "{n} tokens through pages [5, 1, 3] of {page} rows (physical pages 0, 2, 4, 6 NaN)"
    );
    if err <= 4.0 * a.u_out() && lse_ok {
        out.note(
            check,
            layout,
            "every token read through the block table, at the page size given",
        );
        return Ok(true);
    }
    let found = if err.is_nan() || !lse_e.is_finite() {
        "NaN: it read NaN-poisoned rows, slots no block-table entry holds a token in".to_string()
    } else {
        format!(
            "an output {} off the tokens' mean latent (relative to its largest entry), LSE {} (expected ln {n} = {})",
            num(err),
            num(lse_e),
            num(lse_want)
        )
    };
    out.error(
        check,
        found,
        format!("the mean of the tokens' latents: {layout}"),
        format!(
            "token t lives at slot table[t / {page}]·{page} + t % {page}; a kernel compiled for another page size, or that ignores the block table, reads other sequences' rows or unwritten ones (fault page_off_by_one; MLA decode kernels that ignore page_size > 1)"
        ),
    );
    Ok(false)
}

/// MTP causality: a step of two queries (q = 0: every score 0) over two keys whose latents are A and
/// 2A. Query 0 sees key 0 only (A, LSE 0); query 1 both (1.5A, LSE ln 2).
pub(super) fn probe_mtp(p: &mut Prober, out: &mut Findings) -> Result<()> {
    let check = "runner.decode.mtp_causal";
    if let Some(m) = p.desc.supports.max_q_len.filter(|&m| m < 2) {
        out.note(
            check,
            "not probed",
            format!("the runner takes at most {m} query per decode step (supports.max_q_len)"),
        );
        return Ok(());
    }
    let c = p.cfg;
    let case = DecodeCase {
        q_nope: vec![0.0; c.kv_lora_rank],
        q_pe: vec![0.0; c.qk_rope],
        rows: vec![vec![A; c.cache_row()], vec![2.0 * A; c.cache_row()]],
        table: (0..2usize.div_ceil(p.page)).collect(),
        pool: 2usize.div_ceil(p.page) + 1,
    };
    let Some(a) = p.decode_step(&case, 2, 1, out)? else {
        return Ok(());
    };
    let n = a.out.len() / 2;
    let mut want = vec![A as f64; n];
    want.extend(vec![1.5 * A as f64; n]);
    if within(a.out_err(&want), 4.0 * a.u_out()) {
        out.note(
            check,
            "query 0 of a 2-query step sees key 0 only",
            "causal within the step, as the protocol asks (query i sees keys 0 .. L − s_q + i + 1)",
        );
        return Ok(());
    }
    let q0 = a.out[..n].iter().sum::<f64>() / n as f64;
    out.error(
        check,
        format!(
            "query 0 of a 2-query step over 2 keys returned {} (latents A = {} and 2A)",
            num(q0),
            num(A as f64)
        ),
        format!(
            "{} for query 0 (it sees key 0 only), {} for query 1",
            num(A as f64),
            num(1.5 * A as f64)
        ),
        "with MTP (q_len > 1) query i of a step sees keys 0 .. cache_seqlens − q_len + i + 1 (FlashMLA's causal=True); a kernel without the mask lets a draft token see the tokens after it",
    );
    Ok(())
}

/// The split partition and empty splits: 5 keys in 4 splits (q = 0: every score 0), key t's latent 1
/// at column t. vLLM's partition `[k·⌈L/S⌉, (k+1)·⌈L/S⌉)` gives splits of 2, 2, 1 and 0 keys, so
/// split k's `split_lse` is ln(its keys) and its `split_out` their mean latent; the last is empty, and
/// must weigh 0 in a merge (−inf, or ≥ 103 below the largest).
pub(super) fn probe_splits(p: &mut Prober, out: &mut Findings) -> Result<()> {
    let (check, empty_check) = ("runner.decode.split_partition", "runner.decode.empty_split");
    let d = p.desc;
    // `split_lse` read in the declared base, as a run reads it (the LSE base probe judges `lse`).
    let to_e = match d.conventions.lse_base {
        LseBase::E => 1.0,
        LseBase::Two => LN_2,
    };
    let partials = d
        .ops
        .decode
        .as_ref()
        .is_some_and(|o| o.has("split_out") && o.has("split_lse"));
    if !partials || d.decode_partition() == protocol::SplitPartition::Own {
        let why = match partials {
            false => "the decode op returns no split partials",
            true => "the kernel chooses its own split partition (geometry.split_partition own)",
        };
        out.note(check, "not probed", why);
        out.note(empty_check, "not probed", why);
        return Ok(());
    }
    let c = p.cfg;
    let (h, lkv, r) = (c.n_head, c.kv_lora_rank, c.qk_rope);
    let want_keys = [2usize, 2, 1, 0];
    let rows: Vec<Vec<f32>> = (0..L)
        .map(|t| {
            let mut row = vec![0.0f32; lkv + r];
            row[t] = 1.0;
            row
        })
        .collect();
    let pages = L.div_ceil(p.page);
    let case = DecodeCase {
        q_nope: vec![0.0; lkv],
        q_pe: vec![0.0; r],
        rows,
        table: (0..pages).collect(),
        pool: pages + 1,
    };
    let Some(mut a) = p.decode_step(&case, 1, S, out)? else {
        return Ok(());
    };
    let so = a.rest.take("split_out", &[1, 1, h, S, lkv], "decode")?;
    let sl = a.rest.take("split_lse", &[1, 1, h, S], "decode")?;
    let (keys_found, ok) = split_counts(&so, &sl, h, lkv, to_e, &want_keys);
    let list = |v: &[f64]| {
        v.iter()
            .map(|&x| num((x * 1e3).round() / 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let layout = format!("{L} keys in {S} splits");
    if !ok {
        out.error(
            check,
            format!("keys per split [{}] (e^split_lse, every score 0), or partials not their mean latent: {layout}", list(&keys_found)),
            "[2, 2, 1, 0]: split k over keys [k·⌈L/S⌉, (k+1)·⌈L/S⌉) = [0, 2), [2, 4), [4, 5), [5, 5), each partial normalised within its split",
            "the protocol's split partials follow vLLM's partition of L = cache_seqlens[b] (a kernel with another one declares geometry.split_partition own); partials on other boundaries cannot be merged with vLLM's or checked against its reference",
        );
        out.note(
            empty_check,
            "not probed",
            "the split partition is already wrong",
        );
        return Ok(());
    }
    out.note(
        check,
        format!("keys per split [2, 2, 1, 0]: {layout}"),
        "vLLM's partition [k·⌈L/S⌉, (k+1)·⌈L/S⌉), each partial normalised within its split",
    );
    judge_empty_split(&sl, h, to_e, out);
    Ok(())
}

/// Per split: the keys its LSE says it holds (e^lse: every score is 0), worst over the heads, and
/// whether every partial is the mean latent of its keys.
fn split_counts(
    so: &Output,
    sl: &Output,
    h: usize,
    lkv: usize,
    to_e: f64,
    want_keys: &[usize; S],
) -> (Vec<f64>, bool) {
    let (u_out, u_lse) = (unit(so.dtype), unit(sl.dtype));
    let mut keys_found = vec![0.0f64; S];
    let mut ok = true;
    for hh in 0..h {
        for (k, &n) in want_keys.iter().enumerate() {
            let lse = sl.data[hh * S + k] * to_e;
            let found = lse.exp();
            if hh == 0
                || (found - n as f64).abs() > (keys_found[k] - n as f64).abs()
                || found.is_nan()
            {
                keys_found[k] = found;
            }
            if n == 0 {
                continue;
            }
            let lo: usize = want_keys[..k].iter().sum();
            let part = &so.data[(hh * S + k) * lkv..(hh * S + k + 1) * lkv];
            let mean_ok = part.iter().enumerate().all(|(j, &v)| {
                let w = if (lo..lo + n).contains(&j) {
                    1.0 / n as f64
                } else {
                    0.0
                };
                (v - w).abs() <= 4.0 * u_out
            });
            let lse_ok =
                (lse - (n as f64).ln()).abs() <= 8.0 * u_lse * (n as f64).ln().max(1.0) + 1e-6;
            ok &= mean_ok && lse_ok;
        }
    }
    (keys_found, ok)
}

/// The empty split (the last of 4): −inf, or a weight of 0 in an f32 merge.
fn judge_empty_split(sl: &Output, h: usize, to_e: f64, out: &mut Findings) {
    let empty_check = "runner.decode.empty_split";
    let bad = (0..h)
        .map(|hh| {
            let row = &sl.data[hh * S..(hh + 1) * S];
            let max = row[..S - 1]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(v * to_e));
            (row[S - 1] * to_e, max)
        })
        .find(|&(e, max)| !(e == f64::NEG_INFINITY || e < max - 103.0));
    match bad {
        None => out.note(
            empty_check,
            "split 3 of 4 (no key) weighs 0",
            "its split_lse is −inf or 103 below the largest: its split_out is then don't-care",
        ),
        Some((e, max)) => out.error(
            empty_check,
            format!("split 3 of 4 holds no key, and its split_lse is {} (the largest is {})", num(e), num(max)),
            "−inf (or a value whose weight in an f32 merge is 0: more than ~103 below the largest)",
            "an empty split's LSE decides its weight in the merge: a finite one gives its partial (0, or an unwritten buffer's garbage) a share of the output",
        ),
    }
}
