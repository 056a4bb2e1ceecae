//! The layer's device buffers: its weights in the storage type (with the host faults that change a
//! weight) and every activation, scratch and output buffer, allocated once per layer before any launch.

use super::device::{elem_bytes, encode, DevBuf};
use crate::backend::LayerCtx;
use crate::error::Result;
use crate::faults::{Active, Fault};
use crate::model::weights::QProj;
use crate::precision::Dtype;

/// Upload an f32 host tensor (in its logical order) in the storage type.
pub fn up<S, D>(dt: Dtype, a: &ndarray::ArrayBase<S, D>) -> Result<DevBuf>
where
    S: ndarray::Data<Elem = f32>,
    D: ndarray::Dimension,
{
    let a = a.as_standard_layout();
    DevBuf::upload_f32(dt, a.as_slice().expect("standard layout"))
}

/// The layer's sizes (elements) and constants, as the launches use them.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    pub dt: Dtype,
    /// Bytes per stored element.
    pub es: usize,
    /// All tokens, hidden size.
    pub t_all: usize,
    pub e: usize,
    /// Heads, q/k nope dim, rope dim, latent rank, v head dim; `dqk = p + r`, `row = lkv + r`.
    pub h: usize,
    pub p: usize,
    pub r: usize,
    pub lkv: usize,
    pub dv: usize,
    pub dqk: usize,
    pub row: usize,
    /// Decode tokens, prompt length, KV splits.
    pub td: usize,
    pub p0: usize,
    pub ns: usize,
    pub eps: f32,
    /// The softmax scale the attention kernels are given, times log2(e).
    pub scale_log2: f32,
    /// A quantized cache's bytes per token (`kv_format`; 0: the cache is the run's dtype).
    pub kv_bytes: usize,
    /// The per-tensor `fp8`'s scale for this layer (1 until calibrated; the per-row formats ignore it).
    pub tensor_scale: f32,
}

impl Sizes {
    pub fn new(ctx: &LayerCtx, dt: Dtype, scale: f64) -> Sizes {
        let (cfg, sched) = (ctx.cfg, ctx.sched);
        let (p, r, lkv) = (cfg.qk_nope, cfg.qk_rope, cfg.kv_lora_rank);
        Sizes {
            dt,
            es: elem_bytes(dt),
            t_all: sched.total_tokens(),
            e: cfg.hidden,
            h: cfg.n_head,
            p,
            r,
            lkv,
            dv: cfg.v_head_dim,
            dqk: p + r,
            row: lkv + r,
            td: sched.decode_tokens(),
            p0: sched.prompt_len,
            ns: sched.num_splits,
            eps: cfg.rms_eps as f32,
            scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
            kv_bytes: 0,
            tensor_scale: 1.0,
        }
    }

    /// The sizes with the latent cache stored in `kv` (`kv_bytes`); a format the model's dims do not
    /// fit is refused, naming the dims it needs.
    pub fn with_kv_format(mut self, kv: crate::kv_format::KvFormat) -> Result<Sizes> {
        kv.fits(self.lkv, self.r)
            .map_err(crate::error::Error::Usage)?;
        if !kv.is_auto() {
            self.kv_bytes = kv.bytes_per_token(self.lkv, self.r, self.es);
        }
        Ok(self)
    }
}

/// The layer's weights on the device, in the storage type.
pub struct Weights {
    pub attn_norm: DevBuf,
    /// q-LoRA rank (0 for a plain q projection).
    pub lq: usize,
    pub q_a: Option<DevBuf>,
    pub q_a_norm: Option<DevBuf>,
    /// W_qb, or the plain W_q.
    pub q_b: DevBuf,
    pub kv_a: DevBuf,
    pub kv_a_norm: DevBuf,
    /// `[H·P, Lkv]`
    pub w_uk: DevBuf,
    /// `[H·Dv, Lkv]`
    pub w_uv: DevBuf,
    /// Host fault k_b_untransposed: the q_absorbed GEMM's W_UK, each head as W_UKᵀ.
    pub w_uk_t: Option<DevBuf>,
    /// Host fault q_abs_fp16_accum: that W_UK as fp16.
    pub w_uk_abs16: Option<DevBuf>,
    /// `[E, H·Dv]`
    pub o: DevBuf,
}

impl Weights {
    pub fn upload(ctx: &LayerCtx, dt: Dtype) -> Result<Weights> {
        let (cfg, w, fx) = (ctx.cfg, ctx.weights, ctx.faults);
        let attn_norm = up(dt, &w.attn_norm)?;
        let (lq, q_a, q_a_norm, q_b) = match &w.q {
            QProj::Lora { a, a_norm, b } => (
                a.nrows(),
                Some(up(dt, a)?),
                Some(up(dt, a_norm)?),
                up(dt, b)?,
            ),
            QProj::Plain { q } => (0, None, None, up(dt, q)?),
        };
        let kv_a = up(dt, &w.kv_a)?;
        let kv_a_norm = up(dt, &w.kv_a_norm)?;
        // Host fault kv_b_swap: each head's kv_b block split [v | k_nope] (the CPU mirror's own split).
        let swapped = fx
            .on(Fault::KvBSwap)
            .then(|| crate::backend::common::kv_b_split_swapped(cfg, w));
        let (uk, uv) = match &swapped {
            Some((uk, uv)) => (uk, uv),
            None => (&w.w_uk, &w.w_uv),
        };
        let w_uk = up(dt, uk)?; // [H·P, Lkv]
        let w_uv = up(dt, uv)?; // [H·Dv, Lkv]

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
            true => Some(up(dt, &ndarray::aview1(&uk_abs))?),
            false => None,
        };
        // Host fault q_abs_fp16_accum: that W_UK as fp16, converted from its stored values.
        let w_uk_abs16 = match fp16_accum {
            true => Some(DevBuf::upload(&encode(
                Dtype::F16,
                uk_abs.iter().map(|&v| dt.round(v) as f64),
            ))?),
            false => None,
        };
        let o = up(dt, &w.o)?; // [E, H·Dv]
        Ok(Weights {
            attn_norm,
            lq,
            q_a,
            q_a_norm,
            q_b,
            kv_a,
            kv_a_norm,
            w_uk,
            w_uv,
            w_uk_t,
            w_uk_abs16,
            o,
        })
    }
    /// The W_UK the q_absorbed GEMM reads.
    pub fn w_uk_abs(&self) -> u64 {
        self.w_uk_t.as_ref().map_or(self.w_uk.ptr, |b| b.ptr)
    }
}

/// Activations, the paged cache, scratch and outputs of one layer.
pub struct Acts {
    /// The layer input `[T, E]`.
    pub x: DevBuf,
    pub attn_in: DevBuf,
    /// q-LoRA's `q_a` `[T, Lq]`.
    pub qa: DevBuf,
    /// `[T, H, P+R]`
    pub q: DevBuf,
    /// kv_a's output, normed and roped in place: `[T, Lkv+R]`.
    pub kv: DevBuf,
    /// The NaN-poisoned paged cache and its block table. With a quantized cache, the rows its reader
    /// dequantizes from `kv` (kernels/cache_write.cu `cache_write_format`).
    pub pool: DevBuf,
    /// A quantized cache's bytes, `[pool slots, kv_bytes]`, every byte 0xff until written (an e4m3 NaN,
    /// an f32 NaN scale); empty for the run's dtype.
    pub kv_bytes: DevBuf,
    pub table: DevBuf,
    pub cos: DevBuf,
    pub sin: DevBuf,
    /// Fault `rope_on_nope`'s tables (`common::nope_rope_tables`): cos and sin of DeepSeek's 64-dim rope.
    pub nope_rope: Option<(DevBuf, DevBuf)>,
    /// Prefill: the chunk's decompressed keys and values, its own attention part.
    pub kn: DevBuf,
    pub vv: DevBuf,
    pub own_out: DevBuf,
    pub own_lse: DevBuf,
    /// Prefill: the cached context's part, rows (also the final cache read-back), keys and values.
    pub ctx_out: DevBuf,
    pub ctx_lse: DevBuf,
    pub ctx_rows: DevBuf,
    pub ctx_kn: DevBuf,
    pub ctx_v: DevBuf,
    /// `[T, H, Dv]` (NaN padding after it under head_stride_qk), and its re-strided copy.
    pub heads: DevBuf,
    pub restrided: DevBuf,
    /// `[T, H]` f32
    pub lse: DevBuf,
    /// Decode: the absorbed query `[td, H, Lkv+R]`, split partials (f32), the latent output.
    pub qfull: DevBuf,
    pub part_out: DevBuf,
    pub part_lse: DevBuf,
    pub lat: DevBuf,
    /// `[T, E]`
    pub out: DevBuf,
}

impl Acts {
    pub fn alloc(ctx: &LayerCtx, z: &Sizes, x: &ndarray::Array2<f64>, lq: usize) -> Result<Acts> {
        let sched = ctx.sched;
        let (dt, es, t_all, e, h, p, dv) = (z.dt, z.es, z.t_all, z.e, z.h, z.p, z.dv);
        let (dqk, row, lkv, td, p0, ns) = (z.dqk, z.row, z.lkv, z.td, z.p0, z.ns);
        let page = sched.page_size;
        let xb = DevBuf::upload(&encode(dt, x.iter().copied()))?;
        let attn_in = DevBuf::alloc(t_all * e * es)?;
        let qa = DevBuf::alloc(t_all * lq.max(1) * es)?;
        let q = DevBuf::alloc(t_all * h * dqk * es)?;
        let kv = DevBuf::alloc(t_all * row * es)?;
        let pool = DevBuf::alloc(sched.pool_pages() * page * row * es)?;
        pool.fill_nan(dt)?;
        let kv_b = match z.kv_bytes {
            0 => DevBuf::alloc(0)?,
            n => DevBuf::upload(&vec![0xffu8; sched.pool_pages() * page * n])?,
        };
        let table: Vec<i32> = ctx.block_table.iter().map(|&v| v as i32).collect();
        let table_b = DevBuf::upload(&table)?;
        let (cos, sin) = ctx.rope.to_f32();
        let cos_b = DevBuf::upload(&cos)?;
        let sin_b = DevBuf::upload(&sin)?;
        let nope_rope =
            match crate::backend::common::nope_rope_tables(ctx.cfg, ctx.rope, ctx.faults) {
                Some(t) => {
                    let (c, s) = t.to_f32();
                    Some((DevBuf::upload(&c)?, DevBuf::upload(&s)?))
                }
                None => None,
            };
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
        let head_stride_qk = head_stride_qk(ctx.faults);
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
        Ok(Acts {
            x: xb,
            attn_in,
            qa,
            q,
            kv,
            pool,
            kv_bytes: kv_b,
            table: table_b,
            cos: cos_b,
            sin: sin_b,
            nope_rope,
            kn,
            vv,
            own_out,
            own_lse,
            ctx_out,
            ctx_lse,
            ctx_rows,
            ctx_kn,
            ctx_v,
            heads,
            restrided,
            lse,
            qfull,
            part_out,
            part_lse,
            lat,
            out,
        })
    }
}

/// Host fault head_stride_qk: o_proj runs once, after all heads, from a re-strided copy.
pub fn head_stride_qk(fx: Active) -> bool {
    fx.on(Fault::HeadStrideQk)
}
