//! The runner side of `lint` (`--runner CMD`): the runner's `supports` against the model, then its
//! conventions probed through the real protocol (docs/runners.md) with tiny synthetic requests at the
//! model's own dims, each built so that one convention decides the answer exactly:
//!
//! 1. **softmax scale**: one key. The softmax of one score is 1, so `lse = scale·(q·k)` exactly and
//!    `scale_used = lse / (q·k)`. q and the key are all 1/8, so q·k does not depend on the row order.
//! 2. **LSE base**: two equal keys. `lse = s + ln 2` in base e, `s·log2(e) + 1` in base 2, so the two
//!    requests' LSEs differ by ln 2 or by 1 whatever the scale. Probe 1 is read in the base found here,
//!    so a base-2 LSE is not mistaken for a wrong scale.
//! 3. **cache row order** `[latent | k_pe]`: a key whose latent is zero and k_pe[0] = 1, and one whose
//!    latent[0] = 1 and k_pe zero, against a query weighting the two parts differently (2 and 4): the
//!    scores (read with the scale found in 1) and the values returned tell the order the runner read.
//! 4. **page addressing**: a sequence of 2·page + 1 tokens over three pages placed out of order among
//!    NaN-poisoned ones, every score zero: the output is the mean of the tokens' (distinct) latents only
//!    if every token was read through the block table. Probes 1–3 keep their keys on the first physical
//!    pages in order, so a page-size slip does not disturb them.
//!
//! 5. **MTP causality**: a step of two queries over two keys (latents A and 2A, scores 0): query 0
//!    sees key 0 only.
//! 6. **split partition** and 7. **empty split**: 5 keys in 4 splits, scores 0, so `e^split_lse`
//!    counts each split's keys (vLLM's partition: 2, 2, 1, 0) and the empty one must weigh 0.
//!
//! 8. **a quantized cache's scale convention** (`--kv-cache-dtype FMT`, a runner that lists FMT in
//!    `supports.cache_formats`): one key in the format's bytes whose readings under the conventions (scale
//!    as a multiplier, a divisor, twice, not at all; the rope with a scale or without) differ by factors
//!    of the scale (`cache.rs`); on the decode op and on each DSA op.
//!
//! Probes 5–7 run once the paging probe has shown that several keys over pages are read right. A
//! non-finite answer to probes 1–2 is one finding (`judge_non_finite`), not a wrong scale, base and
//! value at once.
//!
//! The prefill op gets probes 1 and 2, and so do the DSA ops (`sparse_prefill`, `sparse_decode`): one
//! query whose index row names one key, then two equal keys (then −1 padding; every other cache slot
//! NaN). All entries 1/8 stay exact through FlashMLA's fp8 cache (tile scale 2⁻¹¹, 1/8 = 256·2⁻¹¹),
//! so the same answers hold for a runner that reads one. Each comparison allows `8u`, `u` the unit roundoff of the dtype
//! the runner returned: far inside the factors the mistakes make (576^-0.5 vs 192^-0.5·mscale²: 3.25×;
//! base 2 vs e: 1.44× on the LSE, 1 vs ln 2 on the difference).

//!
//! One file per concern: `prober` (the requests and their answers), `judge` (probes 1–2, values,
//! non-finite answers), `probes` (probes 3–7); this file checks `supports` and runs them in order.

mod cache;
mod judge;
mod prober;
mod probes;

use super::{num, Findings, Options};
use crate::backend::runner::keep_io;
use crate::backend::runner::protocol::{self, Describe, LseBase, Process};
use crate::error::Result;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use judge::{judge_non_finite, judge_scale_base, judge_value, non_finite};
use prober::Prober;
use probes::{probe_mtp, probe_paging, probe_row_order, probe_splits};

/// Unit roundoff of a returned dtype.
fn unit(dtype: &str) -> f64 {
    match dtype {
        "bf16" => 2f64.powi(-8),
        "fp16" => 2f64.powi(-11),
        "f32" => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    }
}

/// `err ≤ tol`, false for NaN (a NaN never passes).
fn within(err: f64, tol: f64) -> bool {
    err <= tol
}

/// Every entry of probe 1 and 2's queries and keys (exact in every dtype; q·k = width/64).
const A: f32 = 0.125;

/// The runner side: `describe`, `supports` against the model, then the probes. A runner that cannot be
/// started, describes itself badly or fails a request is an `Err` (exit 2, as in `run`).
pub fn lint(cmd: &str, cfg: Option<&MlaConfig>, opts: &Options, out: &mut Findings) -> Result<()> {
    let desc = protocol::describe(cmd)?;
    describe_note(&desc, out);
    let Some(c) = cfg else {
        out.note(
            "runner.probes",
            "not run",
            "the loader refuses the file, so the model's dims and scale are unknown",
        );
        return Ok(());
    };
    let (dims_ok, prefill_ok) = supports_dims(&desc, c, out);
    let page = supports_page(&desc, opts, out);
    let dt = supports_dtype(&desc, opts, out);
    if !dims_ok {
        out.note(
            "runner.probes",
            "not run",
            "the runner does not take the model's dims, so no request at them can be answered",
        );
        return Ok(());
    }
    let kv = supports_cache(&desc, c, opts, out);
    let proc = Process::start(cmd, &desc.name, keep_io())?;
    let mut p = Prober {
        proc,
        desc: &desc,
        cfg: c,
        dt,
        page,
        fill: f32::NAN,
        kv,
    };
    if desc.ops.decode.is_some() {
        probe_decode(&mut p, out)?;
    }
    for (op, on) in [
        ("sparse_prefill", desc.ops.sparse_prefill.is_some()),
        ("sparse_decode", desc.ops.sparse_decode.is_some()),
    ] {
        if on {
            probe_sparse(&mut p, op, out)?;
        }
    }
    if prefill_ok {
        probe_prefill(&mut p, out)?;
    }
    Ok(())
}

/// The runner's name, ops and declared LSE conventions.
fn describe_note(desc: &Describe, out: &mut Findings) {
    let ops: Vec<&str> = [
        desc.ops.decode.as_ref().map(|_| "decode"),
        desc.ops.prefill.as_ref().map(|_| "prefill"),
        desc.ops.sparse_prefill.as_ref().map(|_| "sparse_prefill"),
        desc.ops.sparse_decode.as_ref().map(|_| "sparse_decode"),
    ]
    .into_iter()
    .flatten()
    .collect();
    out.note(
        "runner",
        format!("{} ({})", desc.name, desc.version),
        format!(
            "ops {}; declares lse_base {}, lse_layout {}",
            ops.join(", "),
            match desc.conventions.lse_base {
                LseBase::E => "e",
                LseBase::Two => "2",
            },
            match desc.conventions.lse_layout {
                protocol::LseLayout::TokenHead => "token_head",
                protocol::LseLayout::HeadToken => "head_token",
            }
        ),
    );
}

/// `supports` against the model's dims: (every op's dims taken, the prefill op's too).
fn supports_dims(desc: &Describe, c: &MlaConfig, out: &mut Findings) -> (bool, bool) {
    let s = &desc.supports;
    let name = &desc.name;
    // (op it matters to, key, the model's value, the runner's list)
    let mut dims_ok = true;
    let mut prefill_ok = desc.ops.prefill.is_some();
    for (op, key, v, list) in [
        (None, "heads", c.n_head, &s.heads),
        (None, "kv_lora_rank", c.kv_lora_rank, &s.kv_lora_rank),
        (None, "qk_rope", c.qk_rope, &s.qk_rope),
        (
            Some("prefill"),
            "qk_head_dim",
            c.qk_head_dim(),
            &s.qk_head_dim,
        ),
        (Some("prefill"), "v_head_dim", c.v_head_dim, &s.v_head_dim),
    ] {
        if op == Some("prefill") && desc.ops.prefill.is_none() {
            continue;
        }
        if let Some(l) = list.as_ref().filter(|l| !l.contains(&v)) {
            out.error(
                &format!("runner.supports.{key}"),
                format!("{key} {v} (the model's)"),
                format!("one of {l:?} (what {name} takes)"),
                format!("{name} cannot run this model: a run is refused (exit 2), and a kernel given dims it is not specialised for would misread the rows"),
            );
            match op {
                None => dims_ok = false,
                Some(_) => prefill_ok = false,
            }
        }
    }
    (dims_ok, prefill_ok)
}

/// The page size the probes use: the asked one, or the runner's pick where it takes another; a
/// decode runner's max_q_len against --q-len.
fn supports_page(desc: &Describe, opts: &Options, out: &mut Findings) -> usize {
    let (s, name) = (&desc.supports, &desc.name);
    let mut page = opts.page_size;
    if desc.ops.decode.is_some() {
        if let Some(l) = s
            .page_sizes
            .as_ref()
            .filter(|l| !l.contains(&opts.page_size) && !l.is_empty() && !opts.page_size_given)
        {
            page = protocol::pick_page(opts.page_size, l);
            out.note(
                "runner.supports.page_size",
                format!("page size {page}"),
                format!("{name} does not take page {} (it takes {l:?}): the probes use {page}, the largest it takes below, else its smallest; a run without --page-size picks the same way from its own schedule's page (the default run starts from its covering page, and its notice names the page it took)", opts.page_size),
            );
        } else if let Some(l) = s
            .page_sizes
            .as_ref()
            .filter(|l| !l.contains(&opts.page_size))
        {
            out.error(
                "runner.supports.page_size",
                format!("page size {} (--page-size, else the default schedule's)", opts.page_size),
                format!("one of {l:?} (what {name} takes)"),
                format!("a run at this page size is refused (exit 2); a kernel compiled for one page size and handed another reads the wrong rows (fault page_off_by_one). The probes below use page {}", l.first().copied().unwrap_or(opts.page_size)),
            );
            page = l.first().copied().unwrap_or(opts.page_size);
        }
        if let Some(m) = s.max_q_len.filter(|&m| opts.q_len > m) {
            out.error(
                "runner.supports.max_q_len",
                format!("q_len {}", opts.q_len),
                format!("at most {m}"),
                format!("{name} takes at most {m} query tokens per decode step (MTP); a run with --q-len {} is refused", opts.q_len),
            );
        }
    }
    page
}

/// The quantized cache format the decode probes also send (`--kv-cache-dtype`): `None` for the dtype's
/// cache, a format the model does not fit (`lint`'s model side says so), or one the runner does not list
/// in `supports.cache_formats` (an error: a run is refused).
fn supports_cache(
    desc: &Describe,
    c: &MlaConfig,
    opts: &Options,
    out: &mut Findings,
) -> Option<crate::kv_format::KvFormat> {
    let kv = opts.kv_format;
    let o = &desc.ops;
    let reads_cache = o.decode.is_some() || o.sparse_prefill.is_some() || o.sparse_decode.is_some();
    if kv.is_auto() || !reads_cache {
        return None;
    }
    if let Err(e) = kv.fits(c.kv_lora_rank, c.qk_rope) {
        out.error(
            "runner.kv_cache_dtype",
            format!("--kv-cache-dtype {kv}"),
            "a format the model's dims fit",
            format!("{e}: a run is refused (exit 2)"),
        );
        return None;
    }
    let listed = desc.supports.cache_formats.clone().unwrap_or_default();
    if !listed.iter().any(|f| f == kv.name()) {
        out.error(
            "runner.supports.cache_formats",
            format!("--kv-cache-dtype {kv}"),
            format!("one of {listed:?} (what {} reads)", desc.name),
            format!("a run with --kv-cache-dtype {kv} is refused (exit 2): the runner would be handed bytes it does not read"),
        );
        return None;
    }
    Some(kv)
}

/// The storage type the probes use: the asked one, or the first the runner takes.
fn supports_dtype(desc: &Describe, opts: &Options, out: &mut Findings) -> Dtype {
    let (s, name) = (&desc.supports, &desc.name);
    let mut dt = opts.dtype;
    if let Some(l) = s
        .dtypes
        .as_ref()
        .filter(|l| !l.iter().any(|d| d == opts.dtype.name()))
    {
        out.error(
            "runner.supports.dtype",
            opts.dtype.name(),
            format!("one of {l:?}"),
            format!(
                "{name} does not take {} storage: a run with --dtype {} is refused",
                opts.dtype.name(),
                opts.dtype.name()
            ),
        );
        let pick = [Dtype::Bf16, Dtype::F16, Dtype::F32]
            .into_iter()
            .find(|d| l.iter().any(|x| x == d.name()));
        dt = pick.unwrap_or(dt);
    }
    dt
}

/// Probes 1–2 on the decode op, then (once they hold) 3–7.
fn probe_decode(p: &mut Prober, out: &mut Findings) -> Result<()> {
    let (desc, c) = (p.desc, p.cfg);
    let dot = c.cache_row() as f64 * (A as f64) * (A as f64);
    let one = p.uniform(1);
    let two = p.uniform(2);
    if let (Some(a1), Some(a2)) = (p.decode(&one, out)?, p.decode(&two, out)?) {
        let nf = [(&a1, &one, "one key"), (&a2, &two, "two equal keys")]
            .into_iter()
            .find_map(|(a, case, what)| Some((non_finite(a, "attn_latent")?, case, what)));
        if let Some((found, case, what)) = nf {
            p.fill = 0.0;
            let again = p.decode(case, out)?;
            p.fill = f32::NAN;
            judge_non_finite("decode", what, found, Some(again), out);
        } else {
            let sb = judge_scale_base("decode", desc, c, dot, &a1, &a2, out);
            judge_value("decode", &a1, A as f64, "the one key's latent", out);
            if sb.scale.is_finite() && sb.scale > 0.0 {
                let read = match probe_row_order(p, &sb, out)? {
                    Some(true) => probe_paging(p, &sb, out)?,
                    Some(false) => {
                        out.note(
                            "runner.decode.paging",
                            "not probed",
                            "the rows are already misread, so a paging probe could not tell its errors apart",
                        );
                        false
                    }
                    None => false,
                };
                // Several keys over pages must be read right before causality and the split
                // partition can be told apart.
                if read {
                    probe_mtp(p, out)?;
                    probe_splits(p, out)?;
                }
                if let Some(kv) = p.kv {
                    cache::probe_cache(p, "decode", kv, &sb, out)?;
                }
            }
        }
    }
    Ok(())
}

/// Probes 1–2 on a DSA op (`sparse_prefill`, `sparse_decode`), then (once they hold) 8.
fn probe_sparse(p: &mut Prober, op: &str, out: &mut Findings) -> Result<()> {
    let (desc, c) = (p.desc, p.cfg);
    let dot = c.cache_row() as f64 * (A as f64) * (A as f64);
    if let (Some(a1), Some(a2)) = (p.sparse(op, 1, out)?, p.sparse(op, 2, out)?) {
        let nf = [(&a1, 1, "one key"), (&a2, 2, "two equal keys")]
            .into_iter()
            .find_map(|(a, keys, what)| Some((non_finite(a, "attn_latent")?, keys, what)));
        if let Some((found, keys, what)) = nf {
            p.fill = 0.0;
            let again = p.sparse(op, keys, out)?;
            p.fill = f32::NAN;
            judge_non_finite(op, what, found, Some(again), out);
        } else {
            let sb = judge_scale_base(op, desc, c, dot, &a1, &a2, out);
            judge_value(op, &a1, A as f64, "the one key's latent", out);
            if let Some(kv) = p.kv.filter(|_| sb.scale.is_finite() && sb.scale > 0.0) {
                cache::probe_cache(p, op, kv, &sb, out)?;
            }
        }
    }
    Ok(())
}

/// Probes 1–2 on the prefill op, then causality within a chunk.
fn probe_prefill(p: &mut Prober, out: &mut Findings) -> Result<()> {
    let (desc, c) = (p.desc, p.cfg);
    let dot = c.qk_head_dim() as f64 * (A as f64) * (A as f64);
    if let (Some(a1), Some(a2)) = (p.prefill(1, out)?, p.prefill(2, out)?) {
        let nf = [(&a1, "one key"), (&a2, "two equal keys")]
            .into_iter()
            .find_map(|(a, what)| Some((non_finite(a, "attn_heads")?, what)));
        if let Some((found, what)) = nf {
            judge_non_finite("prefill", what, found, None, out);
        } else {
            judge_scale_base("prefill", desc, c, dot, &a1, &a2, out);
            judge_value("prefill", &a1, A as f64, "the one key's value", out);
        }
    }
    if let Some(ans) = p.prefill_causal(out)? {
        let n = ans.out.len() / 2;
        let mut want = vec![A as f64; n];
        want.extend(vec![1.5 * A as f64; n]);
        if !within(ans.out_err(&want), 4.0 * ans.u_out()) {
            let q0 = ans.out[..n].iter().sum::<f64>() / n as f64;
            out.error(
                "runner.prefill.causal",
                format!("query 0 of a chunk returned {} (values A = {} and 2A of keys 0 and 1)", num(q0), num(A as f64)),
                format!("{} for query 0 (it sees key 0 only), {} for query 1", num(A as f64), num(1.5 * A as f64)),
                "prefill attention is causal within the chunk (query i sees keys 0 .. context_len + i); a kernel called non-causal lets every token see the chunk's later tokens (vLLM's forward_mha runs the chunk causal and the cached context non-causal)",
            );
        } else {
            out.note(
                "runner.prefill.causal",
                "query 0 sees key 0 only",
                "causal within the chunk, as the protocol asks",
            );
        }
    }
    Ok(())
}
