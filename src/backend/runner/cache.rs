//! A quantized latent cache on the wire (`run --kv-cache-dtype FMT`, docs/cache-formats.md): every op
//! that reads the latent cache (decode, sparse_prefill, sparse_decode) is sent it as the format's u8
//! bytes with `meta.cache` instead of the rows, and its `@runner` yardstick is fp64 over the rows a
//! reader decodes from those bytes (`Codec::decode`). Also the exact effect of a cache on the stages
//! downstream of a latent output (`latent_effects`), which widens the end-to-end checks.

use super::tensors::Named;
use super::RunnerBackend;
use crate::backend::cpu::front::MirrorWeights;
use crate::backend::LayerCtx;
use crate::kv_format::{tensor_scale, Codec, KvFormat};
use crate::trace::{CacheEffect, Stage, StageTensor};
use ndarray::Array2;
use std::ops::Range;

impl RunnerBackend {
    /// With a quantized cache format: the layer's cache rows encoded in its bytes (kept for the ops
    /// to send), and the rows as a reader decodes those bytes (`Codec::decode`), which every
    /// `@runner` yardstick of the layer is computed over. Otherwise the rows as they are.
    pub(super) fn encode_cache(&mut self, lkv: usize, r: usize, rows: Vec<f64>) -> Vec<f64> {
        self.cache_bytes = None;
        if self.kv.is_auto() {
            return rows;
        }
        let f32s: Vec<f32> = rows.iter().map(|&v| v as f32).collect();
        let codec = Codec::new(self.kv, lkv, r).with_tensor_scale(tensor_scale(&f32s));
        let (n, w) = (codec.bytes(), lkv + r);
        let mut bytes = vec![0xffu8; f32s.len() / w * n];
        let mut out = vec![0f32; f32s.len()];
        for ((row, b), o) in f32s
            .chunks(w)
            .zip(bytes.chunks_mut(n))
            .zip(out.chunks_mut(w))
        {
            // An unwritten row (NaN) stays 0xff bytes, as the paged pool's unwritten slots.
            if row.iter().all(|v| v.is_finite()) {
                codec.encode(row, b);
            }
            codec.decode(b, o);
        }
        self.cache_bytes = Some((codec, bytes));
        out.into_iter().map(f64::from).collect()
    }
}

/// A request's `meta.cache`: the format, the bytes per token and (`fp8`) the layer's scale.
pub(super) fn cache_meta(codec: &Codec) -> serde_json::Value {
    let n = codec.bytes();
    let mut meta = serde_json::json!({ "format": codec.format.name(), "bytes_per_token": n });
    if codec.format == KvFormat::Fp8 {
        meta["scale"] = serde_json::json!(codec.tensor_scale);
    }
    meta
}

/// A u8 tensor of a cache's bytes.
pub(super) fn u8_tensor(name: &'static str, shape: Vec<usize>, bytes: Vec<u8>) -> Named {
    Named {
        name,
        shape,
        bytes,
        dtype: safetensors::Dtype::U8,
    }
}

/// A paged request's `kv_cache` in the format's bytes, u8 `[pages, page_size, bytes_per_token]`: the
/// rows of each entry's keys (`keys`: per entry, its keys as rows of `bytes`, `None` a padded one) in
/// its pages (`tables`); unwritten slots and the spare page 0xff, a NaN in every part of the ds_mla
/// formats, as the CUDA path's pool. With its `meta.cache`.
pub(super) fn paged_bytes<'a>(
    codec: &Codec,
    bytes: &[u8],
    keys: impl Iterator<Item = &'a [Option<usize>]>,
    tables: &[Vec<usize>],
    total: usize,
    page: usize,
) -> (Named, serde_json::Value) {
    let n = codec.bytes();
    let mut pool = vec![0xffu8; total * page * n];
    for (b, ks) in keys.enumerate() {
        for (j, k) in ks.iter().enumerate() {
            let Some(k) = *k else { continue };
            let slot = tables[b][j / page] * page + j % page;
            pool[slot * n..(slot + 1) * n].copy_from_slice(&bytes[k * n..(k + 1) * n]);
        }
    }
    let t = u8_tensor("kv_cache", vec![total, page, n], pool);
    (t, cache_meta(codec))
}

/// A cache's exact effect on a latent output (`e_lat` `[n, H, Lkv]`, `e_lse` `[n, H]`, natural log,
/// for the run's token rows `rows`), carried through W_UV and o_proj in fp64 (both linear) to the
/// checks of `phase` (`"prefill"` or `"decode"`; the decode phase's `attn_latent` too): what their
/// end-to-end tolerances are widened by. Zero on the other phase's rows.
pub(super) fn latent_effects(
    ctx: &LayerCtx,
    mw: &MirrorWeights,
    (rows, phase): (Range<usize>, &str),
    e_lat: Vec<f64>,
    e_lse: &[f64],
    cache: &'static str,
) -> Vec<CacheEffect> {
    let (cfg, t_all) = (ctx.cfg, ctx.sched.total_tokens());
    let (h, lkv, dv) = (cfg.n_head, cfg.kv_lora_rank, cfg.v_head_dim);
    let n = rows.len();
    let mut e_heads = vec![0.0; t_all * h * dv];
    for hh in 0..h {
        let uv = mw.uv(cfg, hh).mapv(|v| v as f64);
        let e = Array2::from_shape_fn((n, lkv), |(d, k)| e_lat[(d * h + hh) * lkv + k]);
        let o = e.dot(&uv.t());
        for d in 0..n {
            let at = ((rows.start + d) * h + hh) * dv;
            for (x, &v) in e_heads[at..at + dv].iter_mut().zip(o.row(d)) {
                *x = v;
            }
        }
    }
    let wo = mw.o.mapv(|v| v as f64);
    let eh = Array2::from_shape_vec((t_all, h * dv), e_heads.clone()).expect("shape");
    let e_out = eh.dot(&wo.t());
    let out_shape = vec![t_all, wo.nrows()];
    let mut lse = vec![0.0; t_all * h];
    lse[rows.start * h..rows.end * h].copy_from_slice(e_lse);
    let mut effects = Vec::new();
    if phase == "decode" {
        effects.push((
            "attn_latent".to_string(),
            Stage::AttnLatent,
            vec![n, h, lkv],
            e_lat,
        ));
    }
    effects.extend([
        (format!("lse[{phase}]"), Stage::Lse, vec![t_all, h], lse),
        (
            format!("attn_heads[{phase}]"),
            Stage::AttnHeads,
            vec![t_all, h, dv],
            e_heads,
        ),
        (
            format!("attn_out[{phase}]"),
            Stage::AttnOut,
            out_shape,
            e_out.into_raw_vec_and_offset().0,
        ),
    ]);
    effects
        .into_iter()
        .map(|(check, stage, shape, data)| CacheEffect {
            check,
            cache,
            effect: StageTensor::new(stage, shape, data),
        })
        .collect()
}
