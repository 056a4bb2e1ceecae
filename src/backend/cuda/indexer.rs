//! The DSA lightning indexer on the GPU (kernels/indexer.cu): CUDA's own `Backend::indexer`.
//!
//! What runs where: q, k and the head weights are the CPU mirror's (`cpu::indexer::operands`: the
//! projections, LayerNorm, rope and, with `--indexer-keys fp8`, the Hadamard rotation and fp8
//! quantization, on the host in the run's dtype); the scores (q·k per indexer head, the fp8 block scales,
//! ReLU, the weighted sum over heads, the causal cut) and the per-query top-k run on the GPU
//! (`indexer_scores`, `indexer_topk`). Planted faults: the rope pairing swap on the host (where q and k
//! are roped), the non-causal scores, the missing ReLU and the top-k boundary compiled into the kernels.
//!
//! `MLA_DIFF_PROFILE=1` also times the CPU mirror's scores and top-k on the same operands (the stand-in
//! CUDA used before) and counts the keys the two selections disagree on (stderr).

use super::device::Gpu;
use super::device::{arg, DevBuf, Timer};
use super::kernels::Kernels;
use super::kernels::{launch, KERNEL_FAULTS};
use crate::backend::cpu::indexer::{self as mirror, Operands};
use crate::backend::LayerCtx;
use crate::error::{Error, Result};
use crate::model::{IndexerConfig, IndexerWeights};
use crate::precision::KeyPrecision;
use crate::reference::sparse::Selection;
use ndarray::Array2;

/// Keys (warps) per CTA of `indexer_scores` (its IX_KEYS).
const KEYS_PER_CTA: usize = 8;

/// The GPU side's result and its timings (ms; `scores_ms`/`topk_ms` by CUDA events).
pub struct GpuIndexer {
    pub selection: Selection,
    pub host_ms: f64,
    pub scores_ms: f32,
    pub topk_ms: f32,
}

/// What the indexer uses of the backend: its GPU, kernel cache and storage type (the parts, not
/// `CudaBackend`, so that this module sits below the backend that calls it).
pub struct On<'a> {
    pub gpu: &'a Gpu,
    pub kernels: &'a mut Kernels,
    pub dtype: crate::precision::Dtype,
}

/// CUDA's indexer for one layer on the layer input `x` (`ctx.faults` planted).
pub fn run(
    be: &mut On<'_>,
    ctx: &LayerCtx,
    ic: &IndexerConfig,
    iw: &IndexerWeights,
    x: &Array2<f64>,
    keys: KeyPrecision,
) -> Result<GpuIndexer> {
    be.gpu.bind()?;
    let dt = be.dtype;
    let plan = crate::backend::cpu::indexer::plan_for(ctx.faults, keys);
    let t0 = std::time::Instant::now();
    let ops = mirror::operands(ctx.cfg, ic, iw, ctx.weights, ctx.rope, x, dt, plan)?;
    let host_ms = t0.elapsed().as_secs_f64() * 1e3;
    let r = scores_topk(be, ctx, &ops, ic.top_k)?;
    // As `run::profile` reads it.
    if std::env::var("MLA_DIFF_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0") {
        let t1 = std::time::Instant::now();
        let cpu = mirror::score_and_select(&ops, ic.top_k, plan).selection;
        let cpu_ms = t1.elapsed().as_secs_f64() * 1e3;
        let differ: usize = (0..cpu.n_queries())
            .map(|t| symmetric_difference(&cpu.keys[t], &r.selection.keys[t]))
            .sum();
        eprintln!(
            "mla-diff: profile: layer {} indexer ({} tokens, {} heads of {}, top_k {}): host q/k/weights {:.1} ms; GPU scores {:.2} ms + top-k {:.2} ms; CPU mirror scores + top-k {:.1} ms; selections differ in {differ} keys",
            ctx.layer,
            ops.q.dim().0,
            ic.heads,
            ic.head_dim,
            ic.top_k,
            host_ms,
            r.scores_ms,
            r.topk_ms,
            cpu_ms,
        );
    }
    Ok(GpuIndexer { host_ms, ..r })
}

fn symmetric_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().filter(|j| b.binary_search(j).is_err()).count()
        + b.iter().filter(|j| a.binary_search(j).is_err()).count()
}

/// The kernels' defines: the run's dtype, the indexer's dims and the indexer faults of the layer.
fn defines(be: &On<'_>, ctx: &LayerCtx, ops: &Operands) -> Vec<(String, String)> {
    let (_, hi, di) = ops.q.dim();
    let d = |k: &str, v: usize| (k.to_string(), v.to_string());
    let mut defs = vec![
        d(
            "MLA_DTYPE",
            match be.dtype {
                crate::precision::Dtype::Bf16 => 0,
                crate::precision::Dtype::F16 => 1,
                crate::precision::Dtype::F32 => 2,
            },
        ),
        d("IX_H", hi),
        d("IX_D", di),
    ];
    for f in KERNEL_FAULTS.iter().filter(|f| ctx.faults.on(**f)) {
        defs.push(d(f.info().define, 1));
    }
    defs
}

fn scores_topk(
    be: &mut On<'_>,
    ctx: &LayerCtx,
    ops: &Operands,
    top_k: usize,
) -> Result<GpuIndexer> {
    let (t, hi, di) = ops.q.dim();
    // Static shared memory: one query's heads (IX_H·IX_D f32).
    if hi * di * 4 > 48 * 1024 {
        return Err(Error::Usage(format!(
            "the CUDA indexer holds a query's {hi} heads of {di} in 48 KiB of shared memory; this file's need {} KiB",
            hi * di * 4 / 1024
        )));
    }
    // The top-k sorts a query's keys in shared memory, 8 bytes each, padded to a power of two.
    let n_pad = t.next_power_of_two();
    let smem = n_pad * 8;
    if smem > be.gpu.info.smem_optin {
        return Err(Error::Usage(format!(
            "the CUDA indexer's top-k sorts a query's keys in shared memory: {t} tokens need {} KiB, the device allows {} KiB",
            smem / 1024,
            be.gpu.info.smem_optin / 1024
        )));
    }
    let defs = defines(be, ctx, ops);
    let m = be.kernels.module("indexer.cu", defs)?;
    let (f_scores, f_topk) = (
        m.func("indexer_scores")?,
        m.func_smem("indexer_topk", smem)?,
    );
    let up = |a: ndarray::ArrayViewD<f32>| {
        DevBuf::upload(a.as_standard_layout().as_slice().expect("standard layout"))
    };
    let q = up(ops.q.view().into_dyn())?;
    let k = up(ops.k.view().into_dyn())?;
    let qs = up(ops.q_scales.view().into_dyn())?;
    let ks = up(ops.k_scales.view().into_dyn())?;
    let w = up(ops.weights.view().into_dyn())?;
    let scores = DevBuf::alloc(t * t * 4)?;
    let out = DevBuf::alloc(t * top_k.max(1) * 4)?;
    let (n_tok, kk, nb) = (t as i32, top_k as i32, ops.k_scales.dim().1 as i32);
    let timer = Timer::new()?;
    timer.start()?;
    launch(
        f_scores,
        "indexer_scores",
        (t as u32, t.div_ceil(KEYS_PER_CTA) as u32, 1),
        (32 * KEYS_PER_CTA) as u32,
        0,
        &mut [
            arg(&q.ptr),
            arg(&qs.ptr),
            arg(&k.ptr),
            arg(&ks.ptr),
            arg(&w.ptr),
            arg(&scores.ptr),
            arg(&n_tok),
            arg(&nb),
        ],
    )?;
    let scores_ms = timer.stop_ms()?;
    timer.start()?;
    launch(
        f_topk,
        "indexer_topk",
        (t as u32, 1, 1),
        (n_pad / 2).clamp(32, 1024) as u32,
        smem as u32,
        &mut [arg(&scores.ptr), arg(&out.ptr), arg(&n_tok), arg(&kk)],
    )?;
    let topk_ms = timer.stop_ms()?;
    be.gpu.sync("the indexer kernels")?;
    let idx: Vec<i32> = out.read(0, t * top_k)?;
    let keys = (0..t)
        .map(|q| {
            idx[q * top_k..(q + 1) * top_k]
                .iter()
                .filter(|&&j| j >= 0)
                .map(|&j| j as u32)
                .collect()
        })
        .collect();
    Ok(GpuIndexer {
        selection: selection_checked(top_k, keys)?,
        host_ms: 0.0,
        scores_ms,
        topk_ms,
    })
}

/// The kernel's rows as a `Selection`, refusing a future key (a kernel bug, not a panic).
fn selection_checked(top_k: usize, keys: Vec<Vec<u32>>) -> Result<Selection> {
    for (q, ks) in keys.iter().enumerate() {
        if let Some(j) = ks.iter().find(|&&j| j as usize > q) {
            return Err(Error::Environment(format!(
                "the CUDA indexer selected key {j} for query {q}, a future key"
            )));
        }
    }
    Ok(Selection::new(top_k, keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_future_key_is_an_error_not_a_panic() {
        assert!(selection_checked(2, vec![vec![0], vec![0, 1]]).is_ok());
        let e = selection_checked(2, vec![vec![1], vec![0, 1]]).unwrap_err();
        assert!(e.to_string().contains("future key"), "{e}");
    }
}
