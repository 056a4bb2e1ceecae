//! One layer run on the device: the kernels, weights, buffers and sizes the stages share, and the
//! helpers several of them use (cache gather, decompression, o_proj, debug syncs). The stages are in
//! `front.rs` (token-local part and cache write), `prefill.rs`, `decode.rs`; `trace.rs` reads them back.

use super::blas::Blas;
use super::buffers::{Acts, Sizes, Weights};
use super::device::{DevBuf, Gpu};
use super::launch::{CacheGather, CopyHeads, LayerKernels, Sparse};
use crate::error::Result;
use crate::faults::Active;

pub struct Layer<'a> {
    pub gpu: &'a Gpu,
    pub blas: &'a Blas,
    pub k: &'a LayerKernels,
    pub w: &'a Weights,
    pub a: &'a Acts,
    pub z: Sizes,
    pub fx: Active,
    /// MLA_DEBUG: decode's internal stages are recorded and every attention launch is synchronised.
    pub debug: bool,
    /// DSA: attention over a selection only (`sparse.rs`); `None`: dense.
    pub sparse: Option<&'a Sparse<'a>>,
}

impl Layer<'_> {
    /// Cache rows of tokens `[t0, t0+n)` into `dst`, in token order.
    pub fn gather(&self, t0: usize, n: usize, dst: u64) -> Result<()> {
        CacheGather {
            rows: n,
            first_token: t0,
        }
        .launch(self.k.cache_gather, self.a.pool.ptr, self.a.table.ptr, dst)
    }

    /// Decompress `n` latent rows (row stride `Lkv+R`) into k_nope `[n, H·P]` and v `[n, H·Dv]`.
    pub fn decompress(&self, lat_rows: u64, n: usize, kdst: u64, vdst: u64) -> Result<()> {
        let z = &self.z;
        let (h, p, dv, lkv, row) = (z.h, z.p, z.dv, z.lkv, z.row);
        self.blas.linear(
            z.dt,
            n,
            h * p,
            lkv,
            lat_rows,
            row,
            self.w.w_uk.ptr,
            kdst,
            h * p,
        )?;
        self.blas.linear(
            z.dt,
            n,
            h * dv,
            lkv,
            lat_rows,
            row,
            self.w.w_uv.ptr,
            vdst,
            h * dv,
        )
    }

    /// o_proj of rows `[t0, t0+n)` from heads with row stride H·Dv.
    pub fn o_proj(&self, t0: usize, n: usize, src: &DevBuf) -> Result<()> {
        let z = &self.z;
        let (h, dv, e, es) = (z.h, z.dv, z.e, z.es);
        self.blas.linear(
            z.dt,
            n,
            e,
            h * dv,
            src.at(t0 * h * dv, es),
            h * dv,
            self.w.o.ptr,
            self.a.out.at(t0 * e, es),
            e,
        )
    }

    /// Strided copy of `width` columns of each head for `n` rows: `(pointer, row stride, head stride)`
    /// for source and destination.
    pub fn copy_heads(
        &self,
        (src, src_row_stride, src_head_stride): (u64, usize, usize),
        (dst, dst_row_stride, dst_head_stride): (u64, usize, usize),
        width: usize,
        n: usize,
    ) -> Result<()> {
        CopyHeads {
            rows: n,
            heads: self.z.h,
            width,
            src_row_stride,
            src_head_stride,
            dst_row_stride,
            dst_head_stride,
        }
        .launch(self.k.copy_heads, src, dst)
    }

    /// With MLA_DEBUG, wait for the queued work so that a kernel fault is named by `what`.
    pub fn sync_if_debug(&self, what: &str) -> Result<()> {
        if self.debug {
            self.gpu.sync(what)
        } else {
            Ok(())
        }
    }
}
