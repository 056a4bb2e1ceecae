//! Typed launches of the small kernels (kernels/norm_rope.cu, kernels/cache_write.cu), and the kernel set
//! of one layer. Each wrapper names its sizes; `launch` passes the kernel's parameters in the order the
//! kernel declares them (row strides as `long long`, counts as `int`).

use super::args::AttnArgs;
use super::attn::{Attn, PrefillLaunch};
use super::device::{arg, Gpu};
use super::kernels::{launch, Kernels, Module};
use crate::error::{Error, Result};
use crate::faults::Fault;
use crate::kv_format::KvFormat;
use crate::reference::sparse::Selection;
use crate::tiles::{decode_tiles, prefill_tiles, Dims, Tile};
use cudarc::driver::sys::CUfunction;
use std::rc::Rc;

/// `rmsnorm`: each of `rows` rows of `cols` values, `y = x·r·w` with `r = 1/sqrt(Σx²/cols + eps)`
/// (in place when `x == y`); one block of 256 threads per row.
pub struct RmsNorm {
    pub rows: usize,
    pub cols: usize,
    /// Row strides of `x` and `y`, in elements.
    pub x_stride: usize,
    pub y_stride: usize,
    pub eps: f32,
}

impl RmsNorm {
    pub fn launch(&self, f: CUfunction, x: u64, w: u64, y: u64) -> Result<()> {
        let (xrs, yrs, nc) = (self.x_stride as i64, self.y_stride as i64, self.cols as i32);
        launch(
            f,
            "rmsnorm",
            (self.rows as u32, 1, 1),
            256,
            0,
            &mut [
                arg(&x),
                arg(&xrs),
                arg(&w),
                arg(&y),
                arg(&yrs),
                arg(&nc),
                arg(&self.eps),
            ],
        )
    }
}

/// `rope`, in place: for tokens `first_token..first_token+rows`, the `R` columns from `offset` of each of
/// `heads` heads (head stride `head_stride`, row stride `row_stride`), with the f32 tables `cos`/`sin`.
pub struct Rope {
    pub rows: usize,
    pub first_token: usize,
    pub row_stride: usize,
    pub head_stride: usize,
    pub heads: usize,
    pub offset: usize,
}

impl Rope {
    pub fn launch(&self, f: CUfunction, x: u64, cos: u64, sin: u64) -> Result<()> {
        let (rs, hs, hn, off, t0) = (
            self.row_stride as i64,
            self.head_stride as i64,
            self.heads as i32,
            self.offset as i32,
            self.first_token as i32,
        );
        launch(
            f,
            "rope",
            (self.rows as u32, 1, 1),
            128,
            0,
            &mut [
                arg(&x),
                arg(&rs),
                arg(&hs),
                arg(&hn),
                arg(&off),
                arg(&cos),
                arg(&sin),
                arg(&t0),
            ],
        )
    }
}

/// `cache_write`: the rows `[latent | k_pe]` of tokens `first_token..first_token+rows` (from `src`,
/// contiguous) into the paged pool through the block table.
pub struct CacheWrite {
    pub rows: usize,
    pub first_token: usize,
}

impl CacheWrite {
    pub fn launch(&self, f: CUfunction, src: u64, pool: u64, table: u64) -> Result<()> {
        let t0 = self.first_token as i32;
        launch(
            f,
            "cache_write",
            (self.rows as u32, 1, 1),
            128,
            0,
            &mut [arg(&src), arg(&pool), arg(&table), arg(&t0)],
        )
    }
}

/// `cache_write_format` (compiled with `MLA_KV_FORMAT`, a quantized cache): the rows of tokens
/// `first_token..first_token+rows` quantized into their slots of the byte pool `kv`, and read back from
/// those bytes into the paged pool the attention kernels read.
pub struct CacheWriteFormat {
    pub rows: usize,
    pub first_token: usize,
    /// The per-tensor `fp8`'s scale (ignored by the per-row formats).
    pub tensor_scale: f32,
}

impl CacheWriteFormat {
    pub fn launch(&self, f: CUfunction, src: u64, pool: u64, kv: u64, table: u64) -> Result<()> {
        let t0 = self.first_token as i32;
        // The launch's rows are one request's (`MLA_FAULT_KV_SCALE_UNWRITTEN` needs a batched launch).
        let first_req_rows = self.rows as i32;
        let ts = self.tensor_scale;
        launch(
            f,
            "cache_write_format",
            (self.rows as u32, 1, 1),
            128,
            0,
            &mut [
                arg(&src),
                arg(&pool),
                arg(&kv),
                arg(&table),
                arg(&t0),
                arg(&first_req_rows),
                arg(&ts),
            ],
        )
    }
}

/// kernels/cache_write.cu's `MLA_KV_FORMAT` for a cache format; `None`: the dtype's cache.
pub fn kv_format_code(kv: KvFormat) -> Option<u32> {
    match kv {
        KvFormat::Auto => None,
        KvFormat::Fp8 => Some(1),
        KvFormat::Fp8DsMla => Some(2),
        KvFormat::Fp8DsMlaNope => Some(3),
        KvFormat::Fp8V41 => Some(4),
        KvFormat::Fp4V41 => Some(5),
    }
}

/// `cache_gather`: the cache rows of tokens `first_token..first_token+rows` back into `dst`, in token order.
pub struct CacheGather {
    pub rows: usize,
    pub first_token: usize,
}

impl CacheGather {
    pub fn launch(&self, f: CUfunction, pool: u64, table: u64, dst: u64) -> Result<()> {
        let t0 = self.first_token as i32;
        launch(
            f,
            "cache_gather",
            (self.rows as u32, 1, 1),
            128,
            0,
            &mut [arg(&pool), arg(&table), arg(&dst), arg(&t0)],
        )
    }
}

/// `copy_heads`: `width` columns of each of `heads` heads, for `rows` rows, between strided layouts.
pub struct CopyHeads {
    pub rows: usize,
    pub heads: usize,
    pub width: usize,
    pub src_row_stride: usize,
    pub src_head_stride: usize,
    pub dst_row_stride: usize,
    pub dst_head_stride: usize,
}

impl CopyHeads {
    pub fn launch(&self, f: CUfunction, src: u64, dst: u64) -> Result<()> {
        let (srs, shs, drs, dhs, hh, wd) = (
            self.src_row_stride as i64,
            self.src_head_stride as i64,
            self.dst_row_stride as i64,
            self.dst_head_stride as i64,
            self.heads as i32,
            self.width as i32,
        );
        launch(
            f,
            "copy_heads",
            (self.rows as u32, 1, 1),
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
    }
}

/// `merge_states` (prefill.cu): per (query, head) row, the LSE merge of the cached-context part and the
/// chunk's own part into `out`/`lse` (vLLM `merge_attn_states`); one block per row.
pub struct MergeStates {
    pub queries: usize,
    pub heads: usize,
}

impl MergeStates {
    /// `ctx` and `own`: (out, lse) of the two parts.
    pub fn launch(
        &self,
        f: CUfunction,
        ctx: (u64, u64),
        own: (u64, u64),
        out: u64,
        lse: u64,
    ) -> Result<()> {
        let hh = self.heads as i32;
        launch(
            f,
            "merge_states",
            ((self.queries * self.heads) as u32, 1, 1),
            128,
            0,
            &mut [
                arg(&ctx.0),
                arg(&ctx.1),
                arg(&own.0),
                arg(&own.1),
                arg(&out),
                arg(&lse),
                arg(&hh),
            ],
        )
    }
}

/// The defines with DeepSeek's rope in place of the model's: 64 dims, NORM pairs (fault `rope_on_nope`).
fn deepseek_rope(mut defs: Vec<(String, String)>) -> Vec<(String, String)> {
    for (k, v) in defs.iter_mut() {
        match k.as_str() {
            "MLA_R" => *v = crate::backend::common::DEEPSEEK_ROPE.to_string(),
            "MLA_ROPE_NEOX" => *v = "0".into(),
            _ => {}
        }
    }
    defs
}

/// The kernels one layer runs, compiled for its dims (the modules are kept alive with them).
pub struct LayerKernels {
    _modules: Vec<Rc<Module>>,
    pub rmsnorm: CUfunction,
    pub rope: CUfunction,
    /// Fault `rope_on_nope` on a NoPE model: `rope` compiled at DeepSeek's width (MLA_R 64, NORM pairs).
    pub nope_rope: Option<CUfunction>,
    pub cache_write: CUfunction,
    /// A quantized cache's writer (`with_kv_format`); `None`: the run's dtype, `cache_write`.
    pub cache_write_format: Option<CUfunction>,
    pub cache_gather: CUfunction,
    pub copy_heads: CUfunction,
    pub merge_states: CUfunction,
    pub prefill: Attn,
    /// The launch of `prefill`'s kernel when it is the Hopper one (`attn_wgmma`: its tensor maps are a
    /// second parameter); None: `prefill.run`.
    pub prefill_wgmma: Option<PrefillLaunch>,
    pub decode: Attn,
}

impl LayerKernels {
    /// Compile (or take from the cache) the layer's modules; decode's tile is chosen for `q_rows`
    /// query rows per request (q_len · heads).
    pub fn load(
        k: &mut Kernels,
        gpu: &Gpu,
        dims: &Dims,
        q_rows: usize,
        force_scalar: bool,
    ) -> Result<LayerKernels> {
        let m_nr = k.module("norm_rope.cu", dims.defines())?;
        let m_cw = k.module("cache_write.cu", dims.defines())?;
        let rmsnorm = m_nr.func("rmsnorm")?;
        let rope = m_nr.func("rope")?;
        // Host fault rope_on_nope: the kernel a DeepSeek front has, whatever the file's rope width.
        let m_nope = match dims.faults.on(Fault::RopeOnNope) && dims.r == 0 {
            true => Some(k.module("norm_rope.cu", deepseek_rope(dims.defines()))?),
            false => None,
        };
        let nope_rope = m_nope.as_ref().map(|m| m.func("rope")).transpose()?;
        let cache_write = m_cw.func("cache_write")?;
        let cache_gather = m_cw.func("cache_gather")?;
        let copy_heads = m_cw.func("copy_heads")?;
        let pre = Attn::load(k, gpu, "prefill.cu", dims, &prefill_tiles(), force_scalar)?;
        let prefill_wgmma = PrefillLaunch::find(k, &pre, dims)?;
        let dec = Attn::load(
            k,
            gpu,
            "decode.cu",
            dims,
            &decode_tiles(q_rows),
            force_scalar,
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
                    "{}: struct AttnArgs is {sz} bytes in the kernel but {} on the host (kernels/attention.cuh and src/backend/cuda/args.rs disagree)",
                    m.unit,
                    std::mem::size_of::<AttnArgs>()
                )));
            }
        }
        let merge_states = m_pre.func("merge_states")?;
        Ok(LayerKernels {
            _modules: [m_nr, m_cw, m_pre, m_dec]
                .into_iter()
                .chain(m_nope)
                .collect(),
            rmsnorm,
            rope,
            nope_rope,
            cache_write,
            cache_write_format: None,
            cache_gather,
            copy_heads,
            merge_states,
            prefill: pre,
            prefill_wgmma,
            decode: dec,
        })
    }

    /// The writer of a quantized cache in `kv`'s byte format (kernels/cache_write.cu, compiled with
    /// `MLA_KV_FORMAT`; a plain run's modules and their cache keys are unchanged).
    pub fn with_kv_format(mut self, k: &mut Kernels, dims: &Dims, kv: KvFormat) -> Result<Self> {
        if kv.is_auto() {
            return Ok(self);
        }
        let Some(code) = kv_format_code(kv) else {
            return Err(Error::Usage(format!(
                "--kv-cache-dtype {kv} has no CUDA cache writer"
            )));
        };
        let mut d = dims.defines();
        d.push(("MLA_KV_FORMAT".into(), code.to_string()));
        let m = k.module("cache_write.cu", d)?;
        self.cache_write_format = Some(m.func("cache_write_format")?);
        self._modules.push(m);
        Ok(self)
    }

    /// Which attention kernels run: "prefill: mma (…); decode: scalar".
    pub fn paths(&self) -> String {
        let path = |a: &Attn| crate::tiles::choice::path_label(a.tile, a.uses_mma());
        format!(
            "prefill: {}; decode: {}",
            path(&self.prefill),
            path(&self.decode)
        )
    }
}

/// The compiled `sparse_attn` kernel and the selection it attends over.
pub struct Sparse<'s> {
    _m: Rc<Module>,
    /// Launched by `sparse.rs` (`Layer::sparse_launch`).
    pub(super) f: CUfunction,
    pub sel: &'s Selection,
    /// The run's block table (logical page → physical page), for the index rows.
    pub table: &'s [usize],
}

impl<'s> Sparse<'s> {
    pub fn load(
        k: &mut Kernels,
        dims: &Dims,
        sel: &'s Selection,
        table: &'s [usize],
    ) -> Result<Sparse<'s>> {
        let m = k.module("sparse_attn.cu", dims.defines())?;
        let f = m.func("sparse_attn")?;
        Ok(Sparse {
            _m: m,
            f,
            sel,
            table,
        })
    }
}
