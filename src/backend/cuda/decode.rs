//! Decode steps in the absorbed form: `q_abs = W_UKᵀ·q_nope` per head (cuBLAS), the query
//! `[q_abs | q_pe]` over the paged cache with split-KV and the LSE combine, `W_UV` per head, o_proj.

use super::args::AttnArgs;
use super::blas::GemmPrecision;
use super::buffers::head_stride_qk;
use super::device::{encode, DevBuf};
use super::layer::Layer;
use super::trace::down;
use crate::error::Result;
use crate::precision::Dtype;
use crate::schedule::Schedule;
use cudarc::cublas::sys::cublasOperation_t as Op;

impl Layer<'_> {
    pub fn decode(&self, sched: &Schedule) -> Result<()> {
        let (z, a, w, blas) = (&self.z, self.a, self.w, self.blas);
        let (dt, es, h, p, r, lkv, dv) = (z.dt, z.es, z.h, z.p, z.r, z.lkv, z.dv);
        let (dqk, row, p0, ns) = (z.dqk, z.row, z.p0, z.ns);
        let dec = &self.k.decode;
        let partials = self.debug || ns > 1;
        for st in sched.decode_ranges() {
            let (s0, n) = (st.start, st.len());
            let d0 = s0 - p0;
            self.token_local(s0, n)?;
            // q_abs[t, h, :] = W_UK[h]ᵀ q_nope[t, h, :]   (per head: [Lkv, P] x [P, n])
            match &w.w_uk_abs16 {
                None => blas.batched(
                    GemmPrecision::Storage(dt),
                    Op::CUBLAS_OP_N,
                    lkv,
                    n,
                    p,
                    w.w_uk_abs(),
                    lkv,
                    p * lkv,
                    a.q.at(s0 * h * dqk, es),
                    h * dqk,
                    dqk,
                    a.qfull.at(d0 * h * row, es),
                    h * row,
                    row,
                    h,
                )?,
                // Host fault q_abs_fp16_accum: the same GEMM in fp16 (operands, accumulator, result),
                // then stored in the storage type; conversions on the host, as this is a test path.
                Some(w16) => {
                    let qn = down(&a.q, dt, s0 * h * dqk, n * h * dqk)?;
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
                    self.copy_heads(
                        (rdt.ptr, h * lkv, lkv),
                        (a.qfull.at(d0 * h * row, es), h * row, row),
                        lkv,
                        n,
                    )?;
                    // The copy must finish before its source buffer is freed.
                    self.gpu.sync("q_absorbed (fp16 fault path)")?;
                }
            }
            // q_pe after q_abs in each head's query row.
            self.copy_heads(
                (a.q.at(s0 * h * dqk + p, es), h * dqk, dqk),
                (a.qfull.at(d0 * h * row + lkv, es), h * row, row),
                r,
                n,
            )?;
            let args = AttnArgs {
                q: a.qfull.at(d0 * h * row, es),
                ka: a.pool.ptr,
                kb: a.pool.ptr,
                v: a.pool.ptr,
                table: a.table.ptr,
                out: a.lat.at(d0 * h * lkv, es),
                lse: a.lse.at(s0 * h, 4),
                part_out: a.part_out.at(d0 * h * ns * lkv, 4),
                part_lse: a.part_lse.at(d0 * h * ns, 4),
                n_keys: st.end as i32,
                n_q: n as i32,
                num_splits: ns as i32,
                causal: 1,
                scale_log2: z.scale_log2,
                ..AttnArgs::decode_layout(h, lkv, r)
            };
            match self.sparse {
                Some(sp) => self.decode_sparse_attention(sched, sp, st.clone(), partials)?,
                None => dec.run(&args, 1)?,
            }
            self.sync_if_debug("decode attention")?;
            if partials {
                dec.combine(&args, n * h)?;
            }
            // attn_heads[t, h, :] = W_UV[h] · attn_latent[t, h, :]   (per head: [Dv, Lkv] x [Lkv, n])
            blas.batched(
                GemmPrecision::Storage(dt),
                Op::CUBLAS_OP_T,
                dv,
                n,
                lkv,
                w.w_uv.ptr,
                lkv,
                dv * lkv,
                a.lat.at(d0 * h * lkv, es),
                h * lkv,
                lkv,
                a.heads.at(s0 * h * dv, es),
                h * dv,
                dv,
                h,
            )?;
            if !head_stride_qk(self.fx) {
                self.o_proj(s0, n, &a.heads)?;
            }
        }
        Ok(())
    }

    /// After the last step: o_proj under head_stride_qk (from the re-strided heads), the cache read-back
    /// in token order, and the wait for every queued kernel.
    pub fn finish(&self) -> Result<()> {
        let (z, a) = (&self.z, self.a);
        let (h, dv, dqk, t_all) = (z.h, z.dv, z.dqk, z.t_all);
        if head_stride_qk(self.fx) {
            self.copy_heads(
                (a.heads.ptr, h * dv, dqk),
                (a.restrided.ptr, h * dv, dv),
                dv,
                t_all,
            )?;
            self.o_proj(0, t_all, &a.restrided)?;
        }
        self.gather(0, t_all, a.ctx_rows.ptr)?;
        self.gpu.sync("the layer's kernels")
    }
}
