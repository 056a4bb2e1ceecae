//! Reading the layer's stages back from the device into a `LayerTrace` (storage type or f32 to f64),
//! in the reference's shapes.

use super::device::{decode, elem_bytes, DevBuf};
use super::layer::Layer;
use crate::error::Result;
use crate::kv_format::KvFormat;
use crate::precision::Dtype;
use crate::trace::{CacheEffect, LayerTrace, Stage, StageTensor};

/// Download `n` storage-type elements starting at element `off`.
pub fn down(b: &DevBuf, dt: Dtype, off: usize, n: usize) -> Result<Vec<f64>> {
    let es = elem_bytes(dt);
    let raw: Vec<u8> = b.read(off * es, n * es)?;
    Ok(decode(dt, &raw))
}

fn down_f32(b: &DevBuf, off: usize, n: usize) -> Result<Vec<f64>> {
    use rayon::prelude::*;
    Ok(b.read::<f32>(off, n)?
        .into_par_iter()
        .map(|v| v as f64)
        .collect())
}

/// Column slice `[c0, c0+w)` of a row-major `[rows, cols]` tensor.
fn cols(v: &[f64], rows: usize, cols: usize, c0: usize, w: usize) -> Vec<f64> {
    let mut o = Vec::with_capacity(rows * w);
    for r in 0..rows {
        o.extend_from_slice(&v[r * cols + c0..r * cols + c0 + w]);
    }
    o
}

impl Layer<'_> {
    /// The trace of layer `layer` (after `finish`).
    pub fn trace(&self, layer: usize) -> Result<LayerTrace> {
        let (z, a) = (&self.z, self.a);
        let (dt, t_all, e, h, p, r, lkv, dv) = (z.dt, z.t_all, z.e, z.h, z.p, z.r, z.lkv, z.dv);
        let (dqk, row, td, ns) = (z.dqk, z.row, z.td, z.ns);
        let mut tr = LayerTrace::new(layer);
        tr.push(StageTensor::new(
            Stage::AttnIn,
            vec![t_all, e],
            down(&a.attn_in, dt, 0, t_all * e)?,
        ));
        let qv = down(&a.q, dt, 0, t_all * h * dqk)?;
        tr.push(StageTensor::new(
            Stage::QNope,
            vec![t_all, h, p],
            cols(&qv, t_all * h, dqk, 0, p),
        ));
        tr.push(StageTensor::new(
            Stage::QPe,
            vec![t_all, h, r],
            cols(&qv, t_all * h, dqk, p, r),
        ));
        let kvv = down(&a.kv, dt, 0, t_all * row)?;
        tr.push(StageTensor::new(
            Stage::KvLatent,
            vec![t_all, lkv],
            cols(&kvv, t_all, row, 0, lkv),
        ));
        tr.push(StageTensor::new(
            Stage::KPe,
            vec![t_all, r],
            cols(&kvv, t_all, row, lkv, r),
        ));
        tr.push(StageTensor::new(
            Stage::CacheRows,
            vec![t_all, row],
            down(&a.ctx_rows, dt, 0, t_all * row)?,
        ));
        if td > 0 {
            if self.debug {
                let qf = down(&a.qfull, dt, 0, td * h * row)?;
                tr.push(StageTensor::new(
                    Stage::QAbsorbed,
                    vec![td, h, lkv],
                    cols(&qf, td * h, row, 0, lkv),
                ));
                tr.push(StageTensor::new(
                    Stage::SplitOut,
                    vec![td, h, ns, lkv],
                    down_f32(&a.part_out, 0, td * h * ns * lkv)?,
                ));
                tr.push(StageTensor::new(
                    Stage::SplitLse,
                    vec![td, h, ns],
                    down_f32(&a.part_lse, 0, td * h * ns)?,
                ));
            }
            tr.push(StageTensor::new(
                Stage::AttnLatent,
                vec![td, h, lkv],
                down(&a.lat, dt, 0, td * h * lkv)?,
            ));
        }
        tr.push(StageTensor::new(
            Stage::Lse,
            vec![t_all, h],
            down_f32(&a.lse, 0, t_all * h)?,
        ));
        tr.push(StageTensor::new(
            Stage::AttnHeads,
            vec![t_all, h, dv],
            down(&a.heads, dt, 0, t_all * h * dv)?,
        ));
        tr.push(StageTensor::new(
            Stage::AttnOut,
            vec![t_all, e],
            down(&a.out, dt, 0, t_all * e)?,
        ));
        Ok(tr)
    }
}

impl Layer<'_> {
    /// This layer over the dtype's cache (the same kernels with `cache_write`, fresh activations; no
    /// batches), for a run over a quantized cache in `kv` (`None` for `auto`): what the format's effect
    /// is measured against ([`with_cache_effect`]), and the rows the per-tensor `fp8`'s scale is
    /// calibrated on ([`tensor_scale`]).
    pub fn plain_trace(
        &self,
        ctx: &crate::backend::LayerCtx,
        x: &ndarray::Array2<f64>,
        lq: usize,
        kv: KvFormat,
    ) -> Result<Option<LayerTrace>> {
        if kv.is_auto() {
            return Ok(None);
        }
        let z = super::buffers::Sizes {
            kv_bytes: 0,
            ..self.z
        };
        let a = super::buffers::Acts::alloc(ctx, &z, x, lq)?;
        let plain = Layer { a: &a, z, ..*self };
        plain.prefill(ctx.sched)?;
        plain.decode(ctx.sched)?;
        plain.finish()?;
        plain.trace(ctx.layer).map(Some)
    }
}

/// The per-tensor `fp8`'s scale of a layer: `kv_format::tensor_scale` over the rows it writes (its
/// `kv_latent` and `k_pe` stages), the calibration the CPU mirror and the judge make on the same rows.
pub fn tensor_scale(plain: &LayerTrace) -> f32 {
    let rows = [Stage::KvLatent, Stage::KPe]
        .into_iter()
        .filter_map(|s| plain.get(s))
        .flat_map(|t| t.data.iter().map(|&v| v as f32))
        .collect::<Vec<f32>>();
    crate::kv_format::tensor_scale(&rows)
}

/// `tr` (the layer over a cache in `kv`) with the format named and its effect on each stage it reaches,
/// as the CPU mirror pushes it (`trace::CacheEffect`, which widens the end-to-end checks; the
/// stage-local view bounds the stages by the format's rounding instead): `plain`'s stages subtracted
/// from `tr`'s. The per-tensor `fp8`'s rows are read from the dtype's staging pool (`cache_dequant`).
pub fn with_cache_effect(
    mut tr: LayerTrace,
    plain: Option<&LayerTrace>,
    kv: KvFormat,
    dt: Dtype,
) -> LayerTrace {
    tr.cache_format = kv;
    if let Some(plain) = plain {
        tr.cache_effect = CacheEffect::between(&tr.stages, &plain.stages, kv.name());
    }
    if kv == KvFormat::Fp8 && dt != Dtype::F32 {
        tr.cache_dequant = Some(dt);
    }
    tr
}
