//! The token-local part of a prefill chunk or decode step (attn_norm, q / q-LoRA through cuBLAS, rope,
//! kv_a, kv_a_norm) and the write of its rows `[latent | k_pe]` into the paged cache.

use super::launch::{CacheWrite, CacheWriteFormat, RmsNorm, Rope};
use super::layer::Layer;
use crate::error::Result;
use crate::faults::Fault;

impl Layer<'_> {
    /// `rmsnorm` over `cols` columns of `n` rows `stride` apart, in place or not, at the layer's eps.
    fn norm(&self, n: usize, cols: usize, stride: usize) -> RmsNorm {
        RmsNorm {
            rows: n,
            cols,
            x_stride: stride,
            y_stride: stride,
            eps: self.z.eps,
        }
    }

    /// Token-local stages for tokens `[t0, t0+n)`, then their cache rows.
    pub fn token_local(&self, t0: usize, n: usize) -> Result<()> {
        let (z, w, a, k, blas) = (&self.z, self.w, self.a, self.k, self.blas);
        let (dt, es, e, h, p, dqk) = (z.dt, z.es, z.e, z.h, z.p, z.dqk);
        let lq = w.lq;
        let norm = |cols: usize, stride: usize| self.norm(n, cols, stride);
        norm(e, e).launch(
            k.rmsnorm,
            a.x.at(t0 * e, es),
            w.attn_norm.ptr,
            a.attn_in.at(t0 * e, es),
        )?;
        let ain = a.attn_in.at(t0 * e, es);
        match (&w.q_a, &w.q_a_norm) {
            (Some(qa_w), Some(an)) => {
                blas.linear(dt, n, lq, e, ain, e, qa_w.ptr, a.qa.at(t0 * lq, es), lq)?;
                norm(lq, lq).launch(
                    k.rmsnorm,
                    a.qa.at(t0 * lq, es),
                    an.ptr,
                    a.qa.at(t0 * lq, es),
                )?;
                blas.linear(
                    dt,
                    n,
                    h * dqk,
                    lq,
                    a.qa.at(t0 * lq, es),
                    lq,
                    w.q_b.ptr,
                    a.q.at(t0 * h * dqk, es),
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
                w.q_b.ptr,
                a.q.at(t0 * h * dqk, es),
                h * dqk,
            )?,
        }
        // q_pe: the R columns after P of each head.
        Rope {
            rows: n,
            first_token: t0,
            row_stride: h * dqk,
            head_stride: dqk,
            heads: h,
            offset: p,
        }
        .launch(k.rope, a.q.at(t0 * h * dqk, es), a.cos.ptr, a.sin.ptr)?;
        self.kv_rows(t0, n, ain)
    }

    /// kv_a's rows of tokens `[t0, t0+n)` from `ain` (the normed layer input), normed and roped in place,
    /// and written to the cache.
    fn kv_rows(&self, t0: usize, n: usize, ain: u64) -> Result<()> {
        let (z, w, a, k, blas) = (&self.z, self.w, self.a, self.k, self.blas);
        let (dt, es, e, lkv, row) = (z.dt, z.es, z.e, z.lkv, z.row);
        let norm = |cols: usize, stride: usize| self.norm(n, cols, stride);
        blas.linear(
            dt,
            n,
            row,
            e,
            ain,
            e,
            w.kv_a.ptr,
            a.kv.at(t0 * row, es),
            row,
        )?;
        let kv_rows = a.kv.at(t0 * row, es);
        // kv_a_norm over the latent columns, in place.
        let kv_norm = || norm(lkv, row).launch(k.rmsnorm, kv_rows, w.kv_a_norm.ptr, kv_rows);
        // k_pe: the R columns after Lkv, one shared head.
        let kv_rope = || {
            Rope {
                rows: n,
                first_token: t0,
                row_stride: row,
                head_stride: 0,
                heads: 1,
                offset: lkv,
            }
            .launch(k.rope, kv_rows, a.cos.ptr, a.sin.ptr)
        };
        // Host fault rope_on_nope (a NoPE model): DeepSeek's rope on the normed latent's last 64 columns,
        // where its row has k_pe, as the CPU mirror's `front::kv`.
        let nope_rope = || match (k.nope_rope, &a.nope_rope) {
            (Some(f), Some((cos, sin))) => Rope {
                rows: n,
                first_token: t0,
                row_stride: row,
                head_stride: 0,
                heads: 1,
                offset: lkv - crate::backend::common::DEEPSEEK_ROPE,
            }
            .launch(f, kv_rows, cos.ptr, sin.ptr),
            _ => Ok(()),
        };
        let write = || self.write_rows(t0, n, kv_rows);
        // Host faults latent_before_norm / k_pe_before_rope: the cache row written before the
        // in-place norm of the latent columns / rope of the k_pe columns (the two touch disjoint
        // columns, so the order of the others is unchanged).
        let (late_norm, late_rope) = (
            self.fx.on(Fault::LatentBeforeNorm),
            self.fx.on(Fault::KPeBeforeRope),
        );
        if !late_norm {
            kv_norm()?;
            nope_rope()?;
        }
        if !late_rope {
            kv_rope()?;
        }
        write()?;
        if late_norm {
            kv_norm()?;
            nope_rope()?;
        }
        if late_rope {
            kv_rope()?;
        }
        Ok(())
    }
}

impl Layer<'_> {
    /// The cache rows of tokens `[t0, t0+n)` (at `kv_rows`) into the paged pool: as the run's dtype
    /// (`cache_write`), or a quantized cache's bytes and the pool rows read back from them
    /// (`cache_write_format`; `kv_bytes` 0 — the pass that measures the format's effect,
    /// `cache_effect` — writes the dtype's).
    fn write_rows(&self, t0: usize, n: usize, kv_rows: u64) -> Result<()> {
        let (a, k) = (self.a, self.k);
        match k.cache_write_format.filter(|_| self.z.kv_bytes > 0) {
            Some(f) => CacheWriteFormat {
                rows: n,
                first_token: t0,
                tensor_scale: self.z.tensor_scale,
            }
            .launch(f, kv_rows, a.pool.ptr, a.kv_bytes.ptr, a.table.ptr),
            None => CacheWrite {
                rows: n,
                first_token: t0,
            }
            .launch(k.cache_write, kv_rows, a.pool.ptr, a.table.ptr),
        }
    }
}
