//! glm5-next's k-pool indexer on the GPU (kernels/kpool.cu), for `Backend::kpool_indexer`.
//!
//! What runs where, along the CPU mirror's roundings (`backend::cpu::kpool`): on the host, q, the normed
//! k and the head weights (`cpu::indexer::operands`, no rope) and the gate scores `attn_in · gateᵀ`
//! stored in the run's dtype ([`inputs`]); on the GPU, per complete pool the softmax over its slots of
//! `g + ape` and the pooled key `Σ prob · k` in f32, rounded to the run's dtype (`kpool_pool`), the pool
//! scores `Σ_h w · ReLU(q·K)` in f32 (`kpool_scores`) and each query's top pools expanded to their tokens
//! with the visible tail (`kpool_topk`). With `--indexer-keys fp8` the pooled keys come back to the host
//! between the two, to be Hadamard-rotated and fp8-quantized with q by the mirror's own code
//! ([`fp8_scaled`]), and the scores read those values times their scales, as the mirror's do.
//!
//! Planted faults: `kpool_no_ape`, `kpool_softmax_channels` and `kpool_no_tail` compiled into the kernels
//! (`KERNEL_FAULTS`); `kpool_from_position_zero` on the host (the grid's origin, [`inputs`]); the two
//! shared-layer faults are the run's routing (`run::kpool::own_shared`), live once this indexer answers.
//!
//! `run --backend cuda`'s own since its first GPU run (`bench/gpu-check.sh kpool`, H100, 2026-12-05:
//! selections equal to the mirror's, the five faults caught). `tests/it/kpool_kernels_host.rs` runs the
//! kernels on the host against the mirror.

use super::device::{arg, DevBuf, Timer};
use super::indexer::On;
use super::kernels::{launch, KERNEL_FAULTS};
use crate::backend::cpu::indexer::{attn_in, fp8_rows, operands, scale_blocks, Plan};
use crate::backend::cpu::kpool::{self as mirror, KpoolPlan};
use crate::backend::cpu::ops::round_all;
use crate::backend::LayerCtx;
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::model::{KpoolIndexer, KpoolLayer, LayerWeights, MlaConfig};
use crate::precision::{Dtype, KeyPrecision};
use crate::reference::kpool::pool_starts;
use crate::reference::sparse::Selection;
use crate::rope::RopeTables;
use ndarray::{Array2, Array3};

/// Pools (threads) per CTA of `kpool_scores` (its KP_POOLS).
const POOLS_PER_CTA: usize = 128;

/// What the kernels are given, as the host prepares it (the mirror's operands and roundings).
#[derive(Debug, Clone)]
pub struct Inputs {
    /// `[T, Hi, Di]`, the run's dtype.
    pub q: Array3<f32>,
    /// `[T, Di]`, normed, the run's dtype.
    pub k: Array2<f32>,
    /// `[T, Di]`: the gate scores, stored in the run's dtype.
    pub g: Array2<f32>,
    /// `[kpool, Di]` f32.
    pub ape: Array2<f32>,
    /// `[T, Hi]` f32, pre-scaled by `(Hi·Di)^-0.5`.
    pub weights: Array2<f32>,
    pub kpool: usize,
    /// The first token of the grid's first complete pool, and how many complete pools there are.
    pub origin: usize,
    pub n_pools: usize,
    /// Pools per query (`top_k / kpool`), and whether the visible tail is appended (`select_tail`).
    pub budget: usize,
    pub tail: bool,
    pub top_k: usize,
    pub keys: KeyPrecision,
}

/// The grid's origin when pools are counted from `pad` tokens before token 0 (0: the model): the first
/// multiple of kpool at or after `pad`, less `pad`.
pub fn origin(kpool: usize, pad: usize) -> usize {
    (kpool - pad % kpool) % kpool
}

/// The host's part of the k-pool indexer of a full layer on the layer input `x` (`plan.reading`'s grid
/// origin is the host fault `kpool_from_position_zero`; its other misreadings are compiled in).
#[allow(clippy::too_many_arguments)]
pub fn inputs(
    cfg: &MlaConfig,
    k: &KpoolIndexer,
    kw: &KpoolLayer,
    w: &LayerWeights,
    rope: &RopeTables,
    x: &Array2<f64>,
    dt: Dtype,
    plan: KpoolPlan,
) -> Result<Inputs> {
    if plan.keys == KeyPrecision::Fp8 && !k.ic.head_dim.is_power_of_two() {
        return Err(Error::Usage(format!(
            "fp8 indexer keys need a power-of-two head dim for the Hadamard rotation, the file has {}",
            k.ic.head_dim
        )));
    }
    let tokens = Plan {
        keys: KeyPrecision::Storage,
        ..Plan::default()
    };
    let ops = operands(cfg, &k.ic, &kw.index, w, rope, x, dt, tokens)?;
    let a = attn_in(cfg, w, x, dt);
    let g = round_all(a.dot(&kw.pool.gate.t()), dt);
    let (t, kpool) = (x.nrows(), k.kp.kpool);
    let pad = plan.reading.pools_from_slot_zero;
    let start = pool_starts(t, kpool, pad);
    let origin = origin(kpool, pad);
    debug_assert!(start
        .iter()
        .enumerate()
        .all(|(p, &s)| s == origin + p * kpool));
    Ok(Inputs {
        q: ops.q,
        k: ops.k,
        g,
        ape: kw.pool.ape.clone(),
        weights: ops.weights,
        kpool,
        origin,
        n_pools: start.len(),
        budget: k.ic.top_k / kpool,
        tail: k.kp.select_tail,
        top_k: k.ic.top_k,
        keys: plan.keys,
    })
}

/// Fp8 keys: q and the pooled keys Hadamard-rotated and quantized to e4m3 with per-128 scales, then each
/// value times its scale (what the mirror's scores read), by the mirror's own functions.
pub fn fp8_scaled(q: &mut Array3<f32>, keys: &mut Array2<f32>) {
    let (qs, ks) = fp8_rows(q, keys);
    for (mut row, sc) in q.rows_mut().into_iter().zip(qs.rows()) {
        scale_blocks(row.as_slice_mut().expect("contiguous"), sc);
    }
    for (mut row, sc) in keys.rows_mut().into_iter().zip(ks.rows()) {
        scale_blocks(row.as_slice_mut().expect("contiguous"), sc);
    }
}

/// The launches' geometry: (grid, block, dynamic shared bytes) of `kpool_pool`, `kpool_scores`,
/// `kpool_topk` for `t` queries (the host test launches the emulated kernels with the same).
pub struct Geometry {
    pub pool: ((u32, u32), u32, u32),
    pub scores: ((u32, u32), u32, u32),
    pub topk: ((u32, u32), u32, u32),
    /// Token ids per query row of `kpool_topk`'s output.
    pub width: usize,
}

impl Inputs {
    pub fn geometry(&self) -> Geometry {
        let (t, _, di) = self.q.dim();
        // The top-k sorts a query's pools in shared memory, 8 bytes each, padded to a power of two.
        let n_pad = self.n_pools.next_power_of_two().max(1);
        Geometry {
            pool: ((self.n_pools as u32, 1), di as u32, 0),
            scores: (
                (t as u32, self.n_pools.div_ceil(POOLS_PER_CTA) as u32),
                POOLS_PER_CTA as u32,
                0,
            ),
            topk: (
                (t as u32, 1),
                (n_pad / 2).clamp(32, 1024) as u32,
                (n_pad * 8) as u32,
            ),
            width: self.budget * self.kpool + self.kpool - 1,
        }
    }

    /// The kernels' defines: the run's dtype, the indexer's dims, the kernel faults in `fx`.
    pub fn defines(&self, dt: Dtype, fx: Active) -> Vec<(String, String)> {
        let (_, hi, di) = self.q.dim();
        let d = |k: &str, v: usize| (k.to_string(), v.to_string());
        let code = match dt {
            Dtype::Bf16 => 0,
            Dtype::F16 => 1,
            Dtype::F32 => 2,
        };
        let mut defs = vec![
            d("MLA_DTYPE", code),
            d("KP_H", hi),
            d("KP_D", di),
            d("KP_N", self.kpool),
        ];
        for f in KERNEL_FAULTS.iter().filter(|f| fx.on(**f)) {
            defs.push(d(f.info().define, 1));
        }
        defs
    }
}

/// `kpool_topk`'s rows (`width` ids per query, -1 padded) as a `Selection`; a future key or one out of
/// range is an error (a kernel bug), not a panic.
pub fn selection(rows: &[i32], width: usize, top_k: usize) -> Result<Selection> {
    let mut keys = Vec::with_capacity(rows.len() / width.max(1));
    for (q, row) in rows.chunks(width.max(1)).enumerate() {
        let ks: Vec<u32> = row.iter().filter(|&&j| j >= 0).map(|&j| j as u32).collect();
        if let Some(j) = ks.iter().find(|&&j| j as usize > q) {
            return Err(Error::Environment(format!(
                "the CUDA k-pool indexer selected key {j} for query {q}, a future key"
            )));
        }
        keys.push(ks);
    }
    Ok(Selection::new(top_k, keys))
}

/// The GPU's result: the selection, the pool scores `[T, n_pools]` and the kernels' times (ms).
pub struct GpuKpool {
    pub selection: Selection,
    pub pool_scores: Array2<f32>,
    pub host_ms: f64,
    pub gpu_ms: f32,
}

/// CUDA's k-pool indexer of a full layer on the layer input `x` (`ctx.faults` planted).
pub fn run(
    be: &mut On<'_>,
    ctx: &LayerCtx,
    k: &KpoolIndexer,
    kw: &KpoolLayer,
    x: &Array2<f64>,
    keys: KeyPrecision,
) -> Result<GpuKpool> {
    be.gpu.bind()?;
    let plan = mirror::plan_for(ctx.faults, keys, ctx.sched.pos_offset);
    let t0 = std::time::Instant::now();
    let inp = inputs(ctx.cfg, k, kw, ctx.weights, ctx.rope, x, be.dtype, plan)?;
    let host_ms = t0.elapsed().as_secs_f64() * 1e3;
    let r = launches(be, ctx, &inp)?;
    if std::env::var("MLA_DIFF_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0") {
        profile(ctx, k, kw, x, be.dtype, plan, &inp, &r);
    }
    Ok(GpuKpool { host_ms, ..r })
}

/// `MLA_DIFF_PROFILE=1`: the mirror's k-pool indexer (with the same plan) on the same input, and how far
/// the GPU's scores and selection are from it (stderr; `bench/gpu-check.sh kpool` reads the line).
#[allow(clippy::too_many_arguments)]
fn profile(
    ctx: &LayerCtx,
    k: &KpoolIndexer,
    kw: &KpoolLayer,
    x: &Array2<f64>,
    dt: Dtype,
    plan: KpoolPlan,
    inp: &Inputs,
    r: &GpuKpool,
) {
    let t1 = std::time::Instant::now();
    let m = match mirror::run(ctx.cfg, k, kw, ctx.weights, ctx.rope, x, dt, plan) {
        Ok(m) => m,
        Err(e) => return eprintln!("mla-diff: profile: layer {} k-pool mirror: {e}", ctx.layer),
    };
    let cpu_ms = t1.elapsed().as_secs_f64() * 1e3;
    let (differ, worst) = against_mirror(&m, &r.selection, &r.pool_scores, inp);
    eprintln!(
        "mla-diff: profile: layer {} k-pool indexer ({} tokens, {} pools of {}): host {:.1} ms; GPU {:.2} ms; CPU mirror {cpu_ms:.1} ms; selections differ in {differ} keys; pool scores differ by at most {worst:.2e} of the row's largest",
        ctx.layer,
        inp.q.dim().0,
        inp.n_pools,
        inp.kpool,
        r.host_ms,
        r.gpu_ms,
    );
}

/// The keys two selections disagree on (summed over queries), and the largest difference of the visible
/// pool scores relative to the largest magnitude in the query's row.
pub fn against_mirror(
    m: &mirror::MirrorKpool,
    sel: &Selection,
    scores: &Array2<f32>,
    inp: &Inputs,
) -> (usize, f64) {
    let differ = (0..sel.n_queries())
        .map(|t| {
            let (a, b) = (&m.selection.keys[t], &sel.keys[t]);
            a.iter().filter(|j| b.binary_search(j).is_err()).count()
                + b.iter().filter(|j| a.binary_search(j).is_err()).count()
        })
        .sum();
    let mut worst = 0f64;
    for t in 0..scores.nrows() {
        let vis = (0..inp.n_pools)
            .filter(|p| inp.origin + (p + 1) * inp.kpool <= t + 1)
            .count();
        let row_max = (0..vis).fold(0f64, |a, p| a.max((m.pool_scores[[t, p]] as f64).abs()));
        for p in 0..vis {
            let d = (scores[[t, p]] as f64 - m.pool_scores[[t, p]] as f64).abs();
            worst = worst.max(d / row_max.max(f64::MIN_POSITIVE));
        }
    }
    (differ, worst)
}

/// The three launches on the prepared inputs.
fn launches(be: &mut On<'_>, ctx: &LayerCtx, inp: &Inputs) -> Result<GpuKpool> {
    let (t, hi, di) = inp.q.dim();
    // Static shared memory: one query's heads (KP_H·KP_D f32), and a pool's logits (KP_N·KP_D f32).
    if hi.max(inp.kpool) * di * 4 > 48 * 1024 {
        return Err(Error::Usage(format!(
            "the CUDA k-pool indexer holds a query's {hi} heads and a pool's {} slots of {di} in 48 KiB of shared memory",
            inp.kpool
        )));
    }
    if di > 1024 {
        return Err(Error::Usage(format!(
            "the CUDA k-pool indexer pools with one thread per channel: {di} > 1024"
        )));
    }
    let geo = inp.geometry();
    if geo.topk.2 as usize > be.gpu.info.smem_optin {
        return Err(Error::Usage(format!(
            "the CUDA k-pool indexer's top-k sorts a query's {} pools in shared memory ({} KiB), the device allows {} KiB",
            inp.n_pools,
            geo.topk.2 / 1024,
            be.gpu.info.smem_optin / 1024
        )));
    }
    let m = be
        .kernels
        .module("kpool.cu", inp.defines(be.dtype, ctx.faults))?;
    let (f_pool, f_scores, f_topk) = (
        m.func("kpool_pool")?,
        m.func("kpool_scores")?,
        m.func_smem("kpool_topk", geo.topk.2 as usize)?,
    );
    let up = |a: ndarray::ArrayViewD<f32>| {
        DevBuf::upload(a.as_standard_layout().as_slice().expect("standard layout"))
    };
    let kbuf = up(inp.k.view().into_dyn())?;
    let g = up(inp.g.view().into_dyn())?;
    let ape = up(inp.ape.view().into_dyn())?;
    let w = up(inp.weights.view().into_dyn())?;
    let mut q = inp.q.clone();
    let pooled = DevBuf::alloc(inp.n_pools * di * 4)?;
    let scores = DevBuf::alloc(t * inp.n_pools * 4)?;
    let out = DevBuf::alloc(t * geo.width * 4)?;
    let (np, origin) = (inp.n_pools as i32, inp.origin as i32);
    let (budget, tail) = (inp.budget as i32, inp.tail as i32);
    let timer = Timer::new()?;
    let mut gpu_ms = 0f32;
    if inp.n_pools > 0 {
        timer.start()?;
        let ((gx, gy), b, s) = geo.pool;
        let mut a = [
            arg(&kbuf.ptr),
            arg(&g.ptr),
            arg(&ape.ptr),
            arg(&pooled.ptr),
            arg(&origin),
        ];
        launch(f_pool, "kpool_pool", (gx, gy, 1), b, s, &mut a)?;
        gpu_ms += timer.stop_ms()?;
        if inp.keys == KeyPrecision::Fp8 {
            let v: Vec<f32> = pooled.read(0, inp.n_pools * di)?;
            let mut keys = Array2::from_shape_vec((inp.n_pools, di), v).expect("[n_pools, Di]");
            fp8_scaled(&mut q, &mut keys);
            pooled.write(keys.as_slice().expect("standard layout"))?;
        }
        let qb = up(q.view().into_dyn())?;
        timer.start()?;
        let ((gx, gy), b, s) = geo.scores;
        let mut a = [
            arg(&qb.ptr),
            arg(&pooled.ptr),
            arg(&w.ptr),
            arg(&scores.ptr),
            arg(&np),
            arg(&origin),
        ];
        launch(f_scores, "kpool_scores", (gx, gy, 1), b, s, &mut a)?;
        gpu_ms += timer.stop_ms()?;
    }
    timer.start()?;
    let ((gx, gy), b, s) = geo.topk;
    let mut a = [
        arg(&scores.ptr),
        arg(&out.ptr),
        arg(&np),
        arg(&origin),
        arg(&budget),
        arg(&tail),
    ];
    launch(f_topk, "kpool_topk", (gx, gy, 1), b, s, &mut a)?;
    gpu_ms += timer.stop_ms()?;
    be.gpu.sync("the k-pool indexer kernels")?;
    let rows: Vec<i32> = out.read(0, t * geo.width)?;
    let sc: Vec<f32> = scores.read(0, t * inp.n_pools)?;
    Ok(GpuKpool {
        selection: selection(&rows, geo.width, inp.top_k)?,
        pool_scores: Array2::from_shape_vec((t, inp.n_pools), sc).expect("[T, n_pools]"),
        host_ms: 0.0,
        gpu_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_origin_is_the_first_pool_start() {
        for (kpool, pad) in [(4, 0), (4, 5), (16, 5), (16, 16), (16, 21), (3, 2)] {
            let start = pool_starts(40, kpool, pad);
            assert_eq!(start[0], origin(kpool, pad), "kpool {kpool} pad {pad}");
        }
    }

    #[test]
    fn rows_become_a_selection_and_a_future_key_is_an_error() {
        let s = selection(&[0, -1, 1, 0], 2, 2).unwrap();
        assert_eq!(s.keys, vec![vec![0], vec![0, 1]]);
        let e = selection(&[1, -1, 0, 1], 2, 2).unwrap_err();
        assert!(e.to_string().contains("future key"), "{e}");
    }
}
