//! The CUDA backend: the fused MLA path on the GPU, same schedule and stage trace as the CPU mirror.
//!
//! Per prefill chunk / decode step, the token-local part (RMSNorm, projections through cuBLAS, rope,
//! kv_a_norm) runs on the chunk's rows, the rows `[latent | k_pe]` go into the NaN-poisoned paged cache,
//! then attention: prefill in the decompressed form (causal over the chunk, non-causal over the cached
//! context, LSE merge), decode in the absorbed form with split-KV and an LSE combine; then W_UV and o_proj.
//!
//! Planted bugs (`crate::faults`, `LayerCtx::faults`) change what the CPU mirror's versions change:
//! the kernel faults (`kernels::KERNEL_FAULTS`) are compiled in as `-D MLA_FAULT_…=1` through `Dims`, so a
//! layer-targeted fault gets its own lazily compiled module set next to the clean one (both cached by
//! their defines); the host faults are switched below, each at the one launch, weight or scale it models.

pub mod bench;
pub mod check;
pub mod device;
pub mod kernels;
pub mod nvrtc;
pub mod shared;
pub mod validate;

use crate::backend::{Backend, Dtype, LayerCtx};
use crate::error::{Error, Result};
use crate::faults::Fault;
use crate::model::weights::QProj;
use crate::trace::{LayerTrace, Stage, StageSet, StageTensor};
use cudarc::cublas::sys::cublasOperation_t as Op;
use device::{arg, decode, elem_bytes, encode, DevBuf, Gpu};
use kernels::{launch, Attn, AttnArgs, Blas, Dims, GemmPrecision, Kernels, Tile};
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct CudaOptions {
    pub dtype: Dtype,
    /// Read kernels from this directory instead of the embedded copy.
    pub kernels_dir: Option<PathBuf>,
    /// Also record decode's internal stages (q_absorbed, split partials and lse); compiled in as MLA_DEBUG.
    pub debug: bool,
    /// Use the scalar attention kernels even where the tensor-core ones apply (a cross-check).
    pub force_scalar: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            dtype: Dtype::Bf16,
            kernels_dir: None,
            debug: true,
            force_scalar: false,
        }
    }
}

/// Tile choices for decode, best first (by `mla-diff bench decode` on an H200, bench/RESULTS.md); the
/// first whose shared memory fits the device is used.
pub fn decode_tiles(rows: usize) -> Vec<Tile> {
    if rows >= 64 {
        vec![
            // Hopper: warpgroup MMA (sm_90a; skipped elsewhere or for dims it does not take).
            Tile::wgmma(Tile::new(4, 2, 64, 2, 2)),
            // 8 warps: S on 16x32 warp tiles, P·V on 32x256 (two m-tiles share each V fragment).
            Tile::new(4, 2, 64, 2, 2),
            // S on 32x32 warp tiles by 4 warps: fewer fragment bytes, but slower on the H200.
            Tile::new(4, 2, 64, 2, 2).s_phase(2, 2),
            // 16 warps (8 compute S), P·V on 32x64: 128 registers, no spills, but slower on the H200.
            Tile::new(4, 4, 64, 2, 2).s_phase(1, 2),
            Tile::new(4, 2, 64, 2, 1),
            Tile::new(2, 2, 32, 2, 1),
        ]
    } else {
        vec![
            Tile::new(1, 4, 32, 2, 1),
            Tile::new(1, 8, 64, 2, 1),
            Tile::new(1, 4, 64, 2, 1),
        ]
    }
}

/// Tile choices for prefill, best first (with one warp column P stays in registers).
pub fn prefill_tiles() -> Vec<Tile> {
    vec![
        Tile::new(8, 1, 64, 2, 1),
        Tile::new(4, 1, 64, 2, 1),
        Tile::new(4, 1, 32, 2, 1),
        Tile::new(2, 1, 32, 2, 1),
    ]
}

pub struct CudaBackend {
    pub gpu: Gpu,
    pub kernels: Kernels,
    pub blas: Blas,
    pub opts: CudaOptions,
    /// Which attention kernels the last layer used ("mma 4x2 warps…" / "scalar").
    pub last_paths: String,
}

impl CudaBackend {
    pub fn new(opts: CudaOptions) -> Result<CudaBackend> {
        let src = nvrtc::Sources::load(opts.kernels_dir.as_deref())?;
        // The driver first: "no GPU" is the more useful message on a machine without either.
        let gpu = Gpu::open()?;
        nvrtc::nvrtc_present()?;
        let blas = Blas::new()?;
        let kernels = Kernels::new(src, &gpu);
        Ok(CudaBackend {
            gpu,
            kernels,
            blas,
            opts,
            last_paths: String::new(),
        })
    }
}

/// Upload an f32 host tensor in the storage type.
fn up(dt: Dtype, v: impl IntoIterator<Item = f32>) -> Result<DevBuf> {
    DevBuf::upload(&encode(dt, v.into_iter().map(|x| x as f64)))
}

/// Download `n` storage-type elements starting at element `off`.
fn down(b: &DevBuf, dt: Dtype, off: usize, n: usize) -> Result<Vec<f64>> {
    let es = elem_bytes(dt);
    let raw: Vec<u8> = b.read(off * es, n * es)?;
    Ok(decode(dt, &raw))
}

fn down_f32(b: &DevBuf, off: usize, n: usize) -> Result<Vec<f64>> {
    Ok(b.read::<f32>(off, n)?
        .into_iter()
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

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        let i = &self.gpu.info;
        format!(
            "cuda: {} (sm_{}{}, {} SMs), {}{}",
            i.name,
            i.cc.0,
            i.cc.1,
            i.sms,
            self.opts.dtype.name(),
            if self.opts.force_scalar {
                ", scalar attention"
            } else {
                ""
            }
        )
    }

    fn device(&self) -> Option<String> {
        Some(self.gpu.info.name.clone())
    }

    fn provides(&self) -> StageSet {
        // Decode's internal stages are recorded only with MLA_DEBUG compiled in.
        match self.opts.debug {
            true => StageSet::ALL,
            false => StageSet::ALL
                .without(Stage::QAbsorbed)
                .without(Stage::SplitOut)
                .without(Stage::SplitLse),
        }
    }

    fn run_layer(&mut self, ctx: &LayerCtx, x: &ndarray::Array2<f64>) -> Result<LayerTrace> {
        let (cfg, w, sched) = (ctx.cfg, ctx.weights, ctx.sched);
        sched.validate()?;
        // The run's cos/sin tables (f64 on the host, uploaded as f32, as the CPU mirror rounds them).
        let tables = ctx.rope;
        crate::reference::check_inputs(cfg, w, tables, x, sched)?;
        self.gpu.bind()?;
        let dt = self.opts.dtype;
        let es = elem_bytes(dt);
        let (t_all, e) = (sched.total_tokens(), cfg.hidden);
        if x.dim() != (t_all, e) {
            return Err(Error::Usage(format!(
                "layer input is {:?}, the schedule needs [{t_all}, {e}]",
                x.dim()
            )));
        }
        let (h, p, r, lkv, dv) = (
            cfg.n_head,
            cfg.qk_nope,
            cfg.qk_rope,
            cfg.kv_lora_rank,
            cfg.v_head_dim,
        );
        let dqk = p + r;
        let row = lkv + r;
        let td = sched.decode_tokens();
        let p0 = sched.prompt_len;
        let ns = sched.num_splits;
        let page = sched.page_size;
        let eps = cfg.rms_eps as f32;
        let fx = ctx.faults;
        // The softmax scale the attention kernels are given (host faults: mscale² missing, 1/sqrt(Lkv+R)).
        let scale = crate::backend::cpu::kernel_scale(cfg, fx);
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        let dims = Dims {
            dtype: dt,
            lkv,
            r,
            p,
            dv,
            h,
            page,
            neox: cfg.rope.pairing == crate::model::config::RopePairing::Neox,
            debug: self.opts.debug,
            faults: fx,
        };

        // Kernels.
        let k = &mut self.kernels;
        let m_nr = k.module("norm_rope.cu", dims.defines())?;
        let m_cw = k.module("cache_write.cu", dims.defines())?;
        let f_norm = m_nr.func("rmsnorm")?;
        let f_rope = m_nr.func("rope")?;
        let f_cw = m_cw.func("cache_write")?;
        let f_gather = m_cw.func("cache_gather")?;
        let f_copy = m_cw.func("copy_heads")?;
        let pre = Attn::load(
            k,
            &self.gpu,
            "prefill.cu",
            &dims,
            &prefill_tiles(),
            self.opts.force_scalar,
        )?;
        let dec = Attn::load(
            k,
            &self.gpu,
            "decode.cu",
            &dims,
            &decode_tiles(sched.q_len * h),
            self.opts.force_scalar,
        )?;
        let m_pre = k.module("prefill.cu", {
            let mut d = dims.defines();
            d.extend(pre.tile.unwrap_or(Tile::SCALAR_ONLY).defines());
            d
        })?;
        let m_dec = k.module("decode.cu", {
            let mut d = dims.defines();
            d.extend(dec.tile.unwrap_or(Tile::SCALAR_ONLY).defines());
            d
        })?;
        for m in [&m_pre, &m_dec] {
            let sz = m.global_i32s("attn_args_size", 1)?[0] as usize;
            if sz != std::mem::size_of::<AttnArgs>() {
                return Err(Error::Environment(format!(
                    "{}: struct AttnArgs is {sz} bytes in the kernel but {} on the host (kernels/attention.cuh and src/backend/cuda/kernels.rs disagree)",
                    m.unit,
                    std::mem::size_of::<AttnArgs>()
                )));
            }
        }
        let f_merge = m_pre.func("merge_states")?;
        let path = |a: &Attn| match a.tile {
            Some(t) if a.uses_mma() => format!("mma ({})", t.label()),
            _ => "scalar".to_string(),
        };
        self.last_paths = format!("prefill: {}; decode: {}", path(&pre), path(&dec));

        // Weights in the storage type.
        let wn_attn = up(dt, w.attn_norm.iter().copied())?;
        let (lq, wq_a, wq_an, wq_b) = match &w.q {
            QProj::Lora { a, a_norm, b } => (
                a.nrows(),
                Some(up(dt, a.iter().copied())?),
                Some(up(dt, a_norm.iter().copied())?),
                up(dt, b.iter().copied())?,
            ),
            QProj::Plain { q } => (0, None, None, up(dt, q.iter().copied())?),
        };
        let wkv_a = up(dt, w.kv_a.iter().copied())?;
        let wkv_n = up(dt, w.kv_a_norm.iter().copied())?;
        // Host fault kv_b_swap: each head's kv_b block split [v | k_nope] (the CPU mirror's own split).
        let swapped = fx
            .on(Fault::KvBSwap)
            .then(|| crate::backend::cpu::front::kv_b_split_swapped(cfg, w));
        let (uk, uv) = match &swapped {
            Some((uk, uv)) => (uk, uv),
            None => (&w.w_uk, &w.w_uv),
        };
        let w_uk = up(dt, uk.iter().copied())?; // [H·P, Lkv]
        let w_uv = up(dt, uv.iter().copied())?; // [H·Dv, Lkv]

        // The q_absorbed GEMM's W_UK. Host fault k_b_untransposed: each head's buffer holds W_UKᵀ
        // ([Lkv, P] row-major, attn_k_b as stored) but is read as [P, Lkv], as the CPU mirror does.
        let (kb_untransposed, fp16_accum) =
            (fx.on(Fault::KBUntransposed), fx.on(Fault::QAbsFp16Accum));
        let uk_abs: Vec<f32> = match (kb_untransposed, fp16_accum) {
            (false, false) => Vec::new(),
            (true, _) => uk.view().permuted_axes([0, 2, 1]).iter().copied().collect(),
            (false, true) => uk.iter().copied().collect(),
        };
        let w_uk_t = match kb_untransposed {
            true => Some(up(dt, uk_abs.iter().copied())?),
            false => None,
        };
        let w_uk_abs = w_uk_t.as_ref().map_or(w_uk.ptr, |b| b.ptr);
        // Host fault q_abs_fp16_accum: that W_UK as fp16, converted from its stored values.
        let w_uk_abs16 = match fp16_accum {
            true => Some(DevBuf::upload(&encode(
                Dtype::F16,
                uk_abs.iter().map(|&v| dt.round(v) as f64),
            ))?),
            false => None,
        };
        let w_o = up(dt, w.o.iter().copied())?; // [E, H·Dv]

        // Activations.
        let xb = DevBuf::upload(&encode(dt, x.iter().copied()))?;
        let attn_in = DevBuf::alloc(t_all * e * es)?;
        let qa = DevBuf::alloc(t_all * lq.max(1) * es)?;
        let q = DevBuf::alloc(t_all * h * dqk * es)?;
        let kv = DevBuf::alloc(t_all * row * es)?;
        let pool = DevBuf::alloc(sched.pool_pages() * page * row * es)?;
        pool.fill_nan(dt)?;
        let table: Vec<i32> = ctx.block_table.iter().map(|&v| v as i32).collect();
        let table_b = DevBuf::upload(&table)?;
        let (cos, sin) = tables.to_f32();
        let cos_b = DevBuf::upload(&cos)?;
        let sin_b = DevBuf::upload(&sin)?;
        let cmax = sched.chunk.min(p0).max(1);
        let kn = DevBuf::alloc(cmax * h * p * es)?;
        let vv = DevBuf::alloc(cmax * h * dv * es)?;
        let own_out = DevBuf::alloc(cmax * h * dv * es)?;
        let own_lse = DevBuf::alloc(cmax * h * 4)?;
        let ctx_out = DevBuf::alloc(cmax * h * dv * es)?;
        let ctx_lse = DevBuf::alloc(cmax * h * 4)?;
        let ctx_rows = DevBuf::alloc(t_all.max(1) * row * es)?;
        let ctx_kn = DevBuf::alloc(p0.max(1) * h * p * es)?;
        let ctx_v = DevBuf::alloc(p0.max(1) * h * dv * es)?;
        // Host fault head_stride_qk: o_proj reads the heads with head stride P+R, so it runs once after
        // all heads exist, from a re-strided copy; reads past the last row land in NaN padding (the CPU
        // mirror's `restride_heads` reads NaN there too).
        let head_stride_qk = fx.on(Fault::HeadStrideQk);
        let heads_pad = if head_stride_qk { h * dqk } else { 0 };
        let heads = DevBuf::alloc((t_all * h * dv + heads_pad) * es)?;
        let restrided = DevBuf::alloc(if head_stride_qk {
            t_all * h * dv * es
        } else {
            0
        })?;
        if head_stride_qk {
            heads.fill_nan(dt)?;
        }
        let lse = DevBuf::alloc(t_all * h * 4)?;
        let qfull = DevBuf::alloc(td.max(1) * h * row * es)?;
        let part_out = DevBuf::alloc(td.max(1) * h * ns * lkv * 4)?;
        let part_lse = DevBuf::alloc(td.max(1) * h * ns * 4)?;
        let lat = DevBuf::alloc(td.max(1) * h * lkv * es)?;
        let out = DevBuf::alloc(t_all * e * es)?;
        let blas = &self.blas;

        // RMSNorm of `rows` rows.
        let norm = |xp: u64,
                    xrs: usize,
                    wp: u64,
                    yp: u64,
                    yrs: usize,
                    n_rows: usize,
                    n_cols: usize|
         -> Result<()> {
            let (xrs, yrs, nc) = (xrs as i64, yrs as i64, n_cols as i32);
            launch(
                f_norm,
                "rmsnorm",
                (n_rows as u32, 1, 1),
                256,
                0,
                &mut [
                    arg(&xp),
                    arg(&xrs),
                    arg(&wp),
                    arg(&yp),
                    arg(&yrs),
                    arg(&nc),
                    arg(&eps),
                ],
            )
        };
        let rope = |bp: u64,
                    rs: usize,
                    hs: usize,
                    heads_n: usize,
                    off: usize,
                    t0: usize,
                    n_rows: usize|
         -> Result<()> {
            let (rs, hs, hn, off, t0) =
                (rs as i64, hs as i64, heads_n as i32, off as i32, t0 as i32);
            launch(
                f_rope,
                "rope",
                (n_rows as u32, 1, 1),
                128,
                0,
                &mut [
                    arg(&bp),
                    arg(&rs),
                    arg(&hs),
                    arg(&hn),
                    arg(&off),
                    arg(&cos_b.ptr),
                    arg(&sin_b.ptr),
                    arg(&t0),
                ],
            )
        };
        // Token-local stages for tokens [t0, t0+n), then their cache rows.
        let token_local = |t0: usize, n: usize| -> Result<()> {
            norm(
                xb.at(t0 * e, es),
                e,
                wn_attn.ptr,
                attn_in.at(t0 * e, es),
                e,
                n,
                e,
            )?;
            let ain = attn_in.at(t0 * e, es);
            match (&wq_a, &wq_an) {
                (Some(a), Some(an)) => {
                    blas.linear(dt, n, lq, e, ain, e, a.ptr, qa.at(t0 * lq, es), lq)?;
                    norm(
                        qa.at(t0 * lq, es),
                        lq,
                        an.ptr,
                        qa.at(t0 * lq, es),
                        lq,
                        n,
                        lq,
                    )?;
                    blas.linear(
                        dt,
                        n,
                        h * dqk,
                        lq,
                        qa.at(t0 * lq, es),
                        lq,
                        wq_b.ptr,
                        q.at(t0 * h * dqk, es),
                        h * dqk,
                    )?;
                }
                _ => blas.linear(
                    dt,
                    n,
                    h * dqk,
                    e,
                    ain,
                    e,
                    wq_b.ptr,
                    q.at(t0 * h * dqk, es),
                    h * dqk,
                )?,
            }
            rope(q.at(t0 * h * dqk, es), h * dqk, dqk, h, p, t0, n)?;
            blas.linear(dt, n, row, e, ain, e, wkv_a.ptr, kv.at(t0 * row, es), row)?;
            let kv_norm = || {
                norm(
                    kv.at(t0 * row, es),
                    row,
                    wkv_n.ptr,
                    kv.at(t0 * row, es),
                    row,
                    n,
                    lkv,
                )
            };
            let kv_rope = || rope(kv.at(t0 * row, es), row, 0, 1, lkv, t0, n);
            let t0i = t0 as i32;
            let write = || {
                launch(
                    f_cw,
                    "cache_write",
                    (n as u32, 1, 1),
                    128,
                    0,
                    &mut [
                        arg(&kv.at(t0 * row, es)),
                        arg(&pool.ptr),
                        arg(&table_b.ptr),
                        arg(&t0i),
                    ],
                )
            };
            // Host faults latent_before_norm / k_pe_before_rope: the cache row written before the
            // in-place norm of the latent columns / rope of the k_pe columns (the two touch disjoint
            // columns, so the order of the others is unchanged).
            let (late_norm, late_rope) =
                (fx.on(Fault::LatentBeforeNorm), fx.on(Fault::KPeBeforeRope));
            if !late_norm {
                kv_norm()?;
            }
            if !late_rope {
                kv_rope()?;
            }
            write()?;
            if late_norm {
                kv_norm()?;
            }
            if late_rope {
                kv_rope()?;
            }
            Ok(())
        };
        let gather = |t0: usize, n: usize, dst: u64| -> Result<()> {
            let t0i = t0 as i32;
            launch(
                f_gather,
                "cache_gather",
                (n as u32, 1, 1),
                128,
                0,
                &mut [arg(&pool.ptr), arg(&table_b.ptr), arg(&dst), arg(&t0i)],
            )
        };
        // Strided copy of `width` columns of each of the H heads, for `n` rows (`copy_heads`).
        #[allow(clippy::too_many_arguments)]
        let copy_heads = |src: u64,
                          src_rs: usize,
                          src_hs: usize,
                          dst: u64,
                          dst_rs: usize,
                          dst_hs: usize,
                          width: usize,
                          n: usize|
         -> Result<()> {
            let (srs, shs, drs, dhs, hh, wd) = (
                src_rs as i64,
                src_hs as i64,
                dst_rs as i64,
                dst_hs as i64,
                h as i32,
                width as i32,
            );
            launch(
                f_copy,
                "copy_heads",
                (n as u32, 1, 1),
                128,
                0,
                &mut [
                    arg(&src),
                    arg(&srs),
                    arg(&shs),
                    arg(&dst),
                    arg(&drs),
                    arg(&dhs),
                    arg(&hh),
                    arg(&wd),
                ],
            )
        };
        // Decompress latent rows (row stride `row`) into k_nope [n, H·P] and v [n, H·Dv].
        let decompress = |lat_rows: u64, n: usize, kdst: u64, vdst: u64| -> Result<()> {
            blas.linear(dt, n, h * p, lkv, lat_rows, row, w_uk.ptr, kdst, h * p)?;
            blas.linear(dt, n, h * dv, lkv, lat_rows, row, w_uv.ptr, vdst, h * dv)
        };
        // Prefill attention args for the chunk's queries [c0, c0+n) over keys held in (kn, rows, v).
        #[allow(clippy::too_many_arguments)]
        let prefill_args = |c0: usize,
                            n: usize,
                            knp: u64,
                            rowsp: u64,
                            vp: u64,
                            n_keys: usize,
                            causal: bool,
                            outp: u64,
                            lsep: u64| AttnArgs {
            q: q.at(c0 * h * dqk, es),
            ka: knp,
            kb: rowsp + (lkv * es) as u64,
            v: vp,
            out: outp,
            lse: lsep,
            n_keys: n_keys as i32,
            n_q: n as i32,
            causal: causal as i32,
            scale_log2,
            ..AttnArgs::prefill_layout(h, p, r, dv, row)
        };
        // o_proj of rows [t0, t0+n) from heads with row stride H·Dv.
        let o_proj = |t0: usize, n: usize, src: &DevBuf| -> Result<()> {
            blas.linear(
                dt,
                n,
                e,
                h * dv,
                src.at(t0 * h * dv, es),
                h * dv,
                w_o.ptr,
                out.at(t0 * e, es),
                e,
            )
        };
        let sync_if_debug = |what: &str| -> Result<()> {
            if self.opts.debug {
                self.gpu.sync(what)
            } else {
                Ok(())
            }
        };

        // Host part of fault empty_ctx_lse_inf: the context pass and the merge run for the first chunk
        // too, over 0 keys (the kernel part makes such a row report lse +inf and the merge keep it).
        let empty_ctx_pass = fx.on(Fault::EmptyCtxLseInf);
        // Prefill, chunk by chunk.
        for ch in sched.prefill_chunks() {
            let (c0, n) = (ch.start, ch.len());
            token_local(c0, n)?;
            decompress(kv.at(c0 * row, es), n, kn.ptr, vv.ptr)?;
            let ctx_pass = c0 > 0 || empty_ctx_pass;
            let (o_ptr, l_ptr) = if !ctx_pass {
                (heads.at(c0 * h * dv, es), lse.at(c0 * h, 4))
            } else {
                (own_out.ptr, own_lse.ptr)
            };
            pre.run(
                &prefill_args(
                    c0,
                    n,
                    kn.ptr,
                    kv.at(c0 * row, es),
                    vv.ptr,
                    n,
                    true,
                    o_ptr,
                    l_ptr,
                ),
                1,
            )?;
            sync_if_debug("prefill attention (own chunk)")?;
            if ctx_pass {
                if c0 > 0 {
                    gather(0, c0, ctx_rows.ptr)?;
                    decompress(ctx_rows.ptr, c0, ctx_kn.ptr, ctx_v.ptr)?;
                }
                pre.run(
                    &prefill_args(
                        c0,
                        n,
                        ctx_kn.ptr,
                        ctx_rows.ptr,
                        ctx_v.ptr,
                        c0,
                        false,
                        ctx_out.ptr,
                        ctx_lse.ptr,
                    ),
                    1,
                )?;
                sync_if_debug("prefill attention (cached context)")?;
                let (op, ol) = (heads.at(c0 * h * dv, es), lse.at(c0 * h, 4));
                let hh = h as i32;
                launch(
                    f_merge,
                    "merge_states",
                    ((n * h) as u32, 1, 1),
                    128,
                    0,
                    &mut [
                        arg(&ctx_out.ptr),
                        arg(&ctx_lse.ptr),
                        arg(&own_out.ptr),
                        arg(&own_lse.ptr),
                        arg(&op),
                        arg(&ol),
                        arg(&hh),
                    ],
                )?;
            }
            if !head_stride_qk {
                o_proj(c0, n, &heads)?;
            }
        }

        // Decode steps.
        let partials = self.opts.debug || ns > 1;
        for st in sched.decode_ranges() {
            let (s0, n) = (st.start, st.len());
            let d0 = s0 - p0;
            token_local(s0, n)?;
            // q_abs[t, h, :] = W_UK[h]ᵀ q_nope[t, h, :]   (per head: [Lkv, P] x [P, n])
            match &w_uk_abs16 {
                None => blas.batched(
                    GemmPrecision::Storage(dt),
                    Op::CUBLAS_OP_N,
                    lkv,
                    n,
                    p,
                    w_uk_abs,
                    lkv,
                    p * lkv,
                    q.at(s0 * h * dqk, es),
                    h * dqk,
                    dqk,
                    qfull.at(d0 * h * row, es),
                    h * row,
                    row,
                    h,
                )?,
                // Host fault q_abs_fp16_accum: the same GEMM in fp16 (operands, accumulator, result),
                // then stored in the storage type; conversions on the host, as this is a test path.
                Some(w16) => {
                    let qn = down(&q, dt, s0 * h * dqk, n * h * dqk)?;
                    let q16 = DevBuf::upload(&encode(Dtype::F16, qn.into_iter()))?;
                    let c16 = DevBuf::alloc(n * h * lkv * 2)?;
                    blas.batched(
                        GemmPrecision::Fp16Accum,
                        Op::CUBLAS_OP_N,
                        lkv,
                        n,
                        p,
                        w16.ptr,
                        lkv,
                        p * lkv,
                        q16.ptr,
                        h * dqk,
                        dqk,
                        c16.ptr,
                        h * lkv,
                        lkv,
                        h,
                    )?;
                    let r16 = down(&c16, Dtype::F16, 0, n * h * lkv)?;
                    let rdt = DevBuf::upload(&encode(dt, r16.into_iter()))?;
                    copy_heads(
                        rdt.ptr,
                        h * lkv,
                        lkv,
                        qfull.at(d0 * h * row, es),
                        h * row,
                        row,
                        lkv,
                        n,
                    )?;
                    // The copy must finish before its source buffer is freed.
                    self.gpu.sync("q_absorbed (fp16 fault path)")?;
                }
            }
            {
                let (srs, shs, drs, dhs, hh, wd) = (
                    (h * dqk) as i64,
                    dqk as i64,
                    (h * row) as i64,
                    row as i64,
                    h as i32,
                    r as i32,
                );
                let (sp, dp) = (q.at(s0 * h * dqk + p, es), qfull.at(d0 * h * row + lkv, es));
                launch(
                    f_copy,
                    "copy_heads",
                    (n as u32, 1, 1),
                    128,
                    0,
                    &mut [
                        arg(&sp),
                        arg(&srs),
                        arg(&shs),
                        arg(&dp),
                        arg(&drs),
                        arg(&dhs),
                        arg(&hh),
                        arg(&wd),
                    ],
                )?;
            }
            let a = AttnArgs {
                q: qfull.at(d0 * h * row, es),
                ka: pool.ptr,
                kb: pool.ptr,
                v: pool.ptr,
                table: table_b.ptr,
                out: lat.at(d0 * h * lkv, es),
                lse: lse.at(s0 * h, 4),
                part_out: part_out.at(d0 * h * ns * lkv, 4),
                part_lse: part_lse.at(d0 * h * ns, 4),
                n_keys: st.end as i32,
                n_q: n as i32,
                num_splits: ns as i32,
                causal: 1,
                scale_log2,
                ..AttnArgs::decode_layout(h, lkv, r)
            };
            dec.run(&a, 1)?;
            sync_if_debug("decode attention")?;
            if partials {
                dec.combine(&a, n * h)?;
            }
            // attn_heads[t, h, :] = W_UV[h] · attn_latent[t, h, :]   (per head: [Dv, Lkv] x [Lkv, n])
            blas.batched(
                GemmPrecision::Storage(dt),
                Op::CUBLAS_OP_T,
                dv,
                n,
                lkv,
                w_uv.ptr,
                lkv,
                dv * lkv,
                lat.at(d0 * h * lkv, es),
                h * lkv,
                lkv,
                heads.at(s0 * h * dv, es),
                h * dv,
                dv,
                h,
            )?;
            if !head_stride_qk {
                o_proj(s0, n, &heads)?;
            }
        }
        if head_stride_qk {
            copy_heads(heads.ptr, h * dv, dqk, restrided.ptr, h * dv, dv, dv, t_all)?;
            o_proj(0, t_all, &restrided)?;
        }
        gather(0, t_all, ctx_rows.ptr)?;
        self.gpu.sync("the layer's kernels")?;

        // The trace.
        let mut tr = LayerTrace::new(ctx.layer);
        tr.push(StageTensor::new(
            Stage::AttnIn,
            vec![t_all, e],
            down(&attn_in, dt, 0, t_all * e)?,
        ));
        let qv = down(&q, dt, 0, t_all * h * dqk)?;
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
        let kvv = down(&kv, dt, 0, t_all * row)?;
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
            down(&ctx_rows, dt, 0, t_all * row)?,
        ));
        if td > 0 {
            if self.opts.debug {
                let qf = down(&qfull, dt, 0, td * h * row)?;
                tr.push(StageTensor::new(
                    Stage::QAbsorbed,
                    vec![td, h, lkv],
                    cols(&qf, td * h, row, 0, lkv),
                ));
                tr.push(StageTensor::new(
                    Stage::SplitOut,
                    vec![td, h, ns, lkv],
                    down_f32(&part_out, 0, td * h * ns * lkv)?,
                ));
                tr.push(StageTensor::new(
                    Stage::SplitLse,
                    vec![td, h, ns],
                    down_f32(&part_lse, 0, td * h * ns)?,
                ));
            }
            tr.push(StageTensor::new(
                Stage::AttnLatent,
                vec![td, h, lkv],
                down(&lat, dt, 0, td * h * lkv)?,
            ));
        }
        tr.push(StageTensor::new(
            Stage::Lse,
            vec![t_all, h],
            down_f32(&lse, 0, t_all * h)?,
        ));
        tr.push(StageTensor::new(
            Stage::AttnHeads,
            vec![t_all, h, dv],
            down(&heads, dt, 0, t_all * h * dv)?,
        ));
        tr.push(StageTensor::new(
            Stage::AttnOut,
            vec![t_all, e],
            down(&out, dt, 0, t_all * e)?,
        ));
        Ok(tr)
    }
}
