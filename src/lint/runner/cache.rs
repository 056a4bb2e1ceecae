//! Probe 8, a quantized cache's scale convention (`lint --runner R --kv-cache-dtype FMT`, issue #38):
//! one key whose latent and rope values are all `A`, sent in the format's bytes (`kv_cache` u8,
//! `meta.cache`) as a run sends it. With one key the softmax weight is 1, so the runner's `attn_latent`
//! is the latent it read; with `q_nope` 0 and `q_pe` all `A` its LSE is `scale · A · Σ rope it read`.
//! Every scale group of that row has one scale `s` far from 1 (2⁻¹¹ for ds_mla and V4.1 fp8, ≈ A/448
//! for `fp8`, ≈ A/6 for fp4), so the readings of the conventions differ by factors of `s` and are told
//! apart exactly:
//!
//! - the latent: `q·s` (a multiplier, every format's convention), `q/s` (a divisor), `q·s·s` (twice),
//!   `q` (not applied);
//! - the rope: read as stored (`fp8_ds_mla` keeps it bf16, no scale) or with a scale (the formats that
//!   quantize it with the row; for ds_mla the last latent tile's, as a tile loop run on over the row).
//!
//! The convention found is named when it is not the format's (an error: a run fails at
//! `attn_latent@runner`); one matching none of them is an error with the value read.
//!
//! The same probe goes to each DSA op (`sparse_prefill`, `sparse_decode`), which a run sends the cache
//! in the format's bytes too: one query whose index row names the key's slot (then −1), `q` =
//! `[0 (Lkv) | A (R)]`; its findings are `runner.OP.cache_scale` / `runner.OP.cache_rope`.

use super::judge::ScaleBase;
use super::prober::{Answer, Prober};
use super::{within, A};
use crate::backend::runner::tensors::{floats, ints, Named};
use crate::error::Result;
use crate::kv_format::{Codec, KvFormat};
use crate::lint::{num, Findings};

/// A row's column as stored: its element's value and its group's scale (`Codec::columns`).
type Column = (f32, Option<f32>);

/// How a reader applies a quantized value's scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScaleUse {
    Multiply,
    Divide,
    Twice,
    Ignore,
}

impl ScaleUse {
    const ALL: [ScaleUse; 4] = [
        ScaleUse::Multiply,
        ScaleUse::Divide,
        ScaleUse::Twice,
        ScaleUse::Ignore,
    ];
    fn read(self, q: f64, s: f64) -> f64 {
        match self {
            ScaleUse::Multiply => q * s,
            ScaleUse::Divide => q / s,
            ScaleUse::Twice => q * s * s,
            ScaleUse::Ignore => q,
        }
    }
    fn name(self) -> &'static str {
        match self {
            ScaleUse::Multiply => "the scale as a multiplier (q·s)",
            ScaleUse::Divide => "the scale as a divisor (q/s)",
            ScaleUse::Twice => "the scale applied twice (q·s·s)",
            ScaleUse::Ignore => "the scale not applied (q)",
        }
    }
}

/// Probe 8 on `op` (`decode`, `sparse_prefill` or `sparse_decode`), after its probes 1–2 (`sb`: the
/// runner's LSE base and softmax scale).
pub(super) fn probe_cache(
    p: &mut Prober,
    op: &str,
    kv: KvFormat,
    sb: &ScaleBase,
    out: &mut Findings,
) -> Result<()> {
    let c = p.cfg;
    let (lkv, r) = (c.kv_lora_rank, c.qk_rope);
    let row = vec![A; lkv + r];
    let codec = Codec::new(kv, lkv, r).with_tensor_scale(crate::kv_format::tensor_scale(&row));
    let mut bytes = vec![0u8; codec.bytes()];
    codec.encode(&row, &mut bytes);
    let cols = codec.columns(&bytes);
    let sent = match op {
        "decode" => send(p, &codec, &bytes, out)?,
        _ => send_sparse(p, op, &codec, &bytes, out)?,
    };
    let Some(ans) = sent else {
        return Ok(());
    };
    let check = &format!("runner.{op}.cache_scale");
    let latent = |u: ScaleUse| -> Vec<f64> {
        let one: Vec<f64> = cols[..lkv]
            .iter()
            .map(|&(q, s)| s.map_or(q as f64, |s| u.read(q as f64, s as f64)))
            .collect();
        one.repeat(c.n_head)
    };
    let tol = 4.0 * ans.u_out();
    let found = ScaleUse::ALL
        .into_iter()
        .find(|&u| within(ans.out_err(&latent(u)), tol));
    let what = format!(
        "a {kv} key of latent values {} (scale {})",
        num(A as f64),
        scale_of(&cols)
    );
    match found {
        Some(ScaleUse::Multiply) => out.note(
            check,
            ScaleUse::Multiply.name(),
            format!("{what} read back as the format stores it"),
        ),
        Some(u) => out.error(
            check,
            format!("{}: {what} read as {}", u.name(), num(latent(u)[0])),
            format!("{} ({})", ScaleUse::Multiply.name(), num(latent(ScaleUse::Multiply)[0])),
            format!("{kv} stores round(x / s) and its readers compute q·s; a reader of the other convention (vLLM stores x/scale, an inverse-scale reader x·scale_inv) or one that folds the scale in twice reads every latent value off by a factor of s: a run fails at attn_latent@runner"),
        ),
        None => out.error(
            check,
            format!("{what} read as {}", num(mean(&ans.out))),
            format!(
                "one of the conventions: {}",
                ScaleUse::ALL
                    .map(|u| format!("{} {}", u.name(), num(latent(u)[0])))
                    .join(", ")
            ),
            "the value the runner read matches no scale convention: its reader misreads the format's bytes (layout, element type or scale)",
        ),
    }
    if r > 0 {
        let check = &format!("runner.{op}.cache_rope");
        rope_convention(
            check,
            &ans,
            kv,
            (&cols[lkv..], &cols[..lkv]),
            found,
            sb,
            out,
        );
    }
    Ok(())
}

/// The rope part of probe 8: the runner's LSE against the rope read as stored or with a scale.
fn rope_convention(
    check: &str,
    ans: &Answer,
    kv: KvFormat,
    (rope, latent): (&[Column], &[Column]),
    found: Option<ScaleUse>,
    sb: &ScaleBase,
    out: &mut Findings,
) {
    // ds_mla's rope has no scale: "with a scale" is the last latent tile's (a tile loop run on).
    let last = latent.last().and_then(|c| c.1);
    let u = found.unwrap_or(ScaleUse::Multiply);
    let sum = |scaled: bool| -> f64 {
        rope.iter()
            .map(|&(q, s)| match (scaled, s.or(last)) {
                (true, Some(s)) => u.read(q as f64, s as f64),
                _ => q as f64,
            })
            .sum()
    };
    let lse = |scaled: bool| sb.scale * A as f64 * sum(scaled);
    let got = mean(&ans.lse) * sb.to_e;
    let tol = |w: f64| 1e-3 * w.abs() + 64.0 * ans.u_lse();
    let stored_ok = (got - lse(false)).abs() <= tol(lse(false));
    let scaled_ok = (got - lse(true)).abs() <= tol(lse(true));
    // The format's own convention: ds_mla's rope is stored bf16; the others quantize it with the row.
    let want_scaled = !matches!(kv, KvFormat::Fp8DsMla | KvFormat::Fp8DsMlaNope);
    let name = |scaled: bool| match (scaled, want_scaled) {
        (true, true) => "the rope read with its group's scale, as the latent",
        (true, false) => "the rope read with a scale (the last latent tile's), as if quantized",
        (false, true) => "the rope read without its scale",
        (false, false) => "the rope read as stored (bf16, no scale)",
    };
    match (stored_ok, scaled_ok) {
        (s, t) if (s && !want_scaled) || (t && want_scaled) => {
            out.note(check, name(want_scaled), format!("as {kv} stores it"))
        }
        (s, t) if s || t => out.error(
            check,
            format!("{}: LSE {}", name(t), num(got)),
            format!("{} (LSE {})", name(want_scaled), num(lse(want_scaled))),
            format!("the rope part of a {kv} row is {}; a reader that treats it otherwise misreads every k_pe, so every score: a run fails at attn_latent@runner", match want_scaled { true => "quantized with its group's scale", false => "bf16 and carries no scale" }),
        ),
        _ => out.error(
            check,
            format!("LSE {} for q_nope 0 and q_pe {} over one key", num(got), num(A as f64)),
            format!("{} (as stored) or {} (scaled)", num(lse(false)), num(lse(true))),
            "the rope the runner read matches neither convention: its reader misreads the rope bytes",
        ),
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The probe row's (first) scale, for the findings' text.
fn scale_of(cols: &[(f32, Option<f32>)]) -> String {
    cols.iter()
        .find_map(|c| c.1)
        .map_or("none".into(), |s| num(s as f64))
}

/// One decode request over one key stored as `bytes` in `codec`'s format (slot 0; the rest of the
/// pool and a spare page 0xff, unwritten), `q_nope` 0 and `q_pe` all `A`.
fn send(p: &mut Prober, codec: &Codec, bytes: &[u8], out: &mut Findings) -> Result<Option<Answer>> {
    let c = p.cfg;
    let (h, lkv, r, page, dt) = (c.n_head, c.kv_lora_rank, c.qk_rope, p.page, p.dt);
    let n = codec.bytes();
    let mut pool = vec![0xffu8; 2 * page * n];
    pool[..n].copy_from_slice(bytes);
    let inputs = [
        floats("q_nope", vec![1, 1, h, lkv], &vec![0.0; h * lkv], dt),
        floats("q_pe", vec![1, 1, h, r], &vec![A; h * r], dt),
        Named {
            name: "kv_cache",
            shape: vec![2, page, n],
            bytes: pool,
            dtype: safetensors::Dtype::U8,
        },
        ints("block_table", vec![1, 2], &[0, 1]),
        ints("cache_seqlens", vec![1], &[1]),
    ];
    let mut cache = serde_json::json!({ "format": codec.format.name(), "bytes_per_token": n });
    if codec.format == KvFormat::Fp8 {
        cache["scale"] = serde_json::json!(codec.tensor_scale);
    }
    p.call(
        "decode",
        &inputs,
        serde_json::json!({ "q_len": 1, "num_splits": 1, "cache": cache }),
        "attn_latent",
        &[1, 1, h, lkv],
        vec![1, 1, h],
        out,
    )
}

/// One request of a DSA op over one key stored as `bytes` in `codec`'s format (slot 0; the other
/// slots 0xff, unwritten): one query `[0 (Lkv) | A (R)]` per head whose index row names slot 0, then
/// −1 (as a run pads it).
fn send_sparse(
    p: &mut Prober,
    op: &str,
    codec: &Codec,
    bytes: &[u8],
    out: &mut Findings,
) -> Result<Option<Answer>> {
    let c = p.cfg;
    let (h, lkv, r, page, dt) = (c.n_head, c.kv_lora_rank, c.qk_rope, p.page, p.dt);
    let n = codec.bytes();
    let slots = 2 * page;
    let mut pool = vec![0xffu8; slots * n];
    pool[..n].copy_from_slice(bytes);
    let mut q = Vec::with_capacity(h * (lkv + r));
    for _ in 0..h {
        q.extend(std::iter::repeat_n(0.0, lkv));
        q.extend(std::iter::repeat_n(A, r));
    }
    let idx = [0, -1, -1, -1];
    let (qs, cache, is, lse, lat) = match op {
        "sparse_prefill" => (
            vec![1, h, lkv + r],
            ("kv", vec![slots, 1, n]),
            vec![1, 1, 4],
            vec![1, h],
            vec![1, h, lkv],
        ),
        _ => (
            vec![1, 1, h, lkv + r],
            ("kv_cache", vec![2, page, n]),
            vec![1, 1, 4],
            vec![1, 1, h],
            vec![1, 1, h, lkv],
        ),
    };
    let inputs = [
        floats("q", qs, &q, dt),
        Named {
            name: cache.0,
            shape: cache.1,
            bytes: pool,
            dtype: safetensors::Dtype::U8,
        },
        ints("indices", is, &idx),
    ];
    let mut meta = serde_json::json!({ "context_len": 0, "top_k": 4, "d_v": lkv });
    meta["cache"] = serde_json::json!({ "format": codec.format.name(), "bytes_per_token": n });
    if codec.format == KvFormat::Fp8 {
        meta["cache"]["scale"] = serde_json::json!(codec.tensor_scale);
    }
    p.call(op, &inputs, meta, "attn_latent", &lat, lse, out)
}
