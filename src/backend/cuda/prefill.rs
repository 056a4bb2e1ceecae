//! Prefill, chunk by chunk, in the decompressed form: causal attention over the chunk's own keys, then
//! (with cached context) non-causal attention over the context gathered from the cache and the LSE
//! merge of the two parts; then o_proj of the chunk.

use super::args::AttnArgs;
use super::buffers::head_stride_qk;
use super::launch::MergeStates;
use super::layer::Layer;
use crate::error::Result;
use crate::faults::Fault;
use crate::schedule::Schedule;

/// Where one prefill attention pass reads its keys and writes its result.
struct Pass {
    /// Decompressed k_nope `[keys, H·P]`, cache-layout rows (k_pe after Lkv), values `[keys, H·Dv]`.
    k_nope: u64,
    rows: u64,
    v: u64,
    n_keys: usize,
    causal: bool,
    out: u64,
    lse: u64,
}

impl Layer<'_> {
    /// Attention args for the chunk's queries `[c0, c0+n)` over the keys of `pass`.
    fn prefill_args(&self, c0: usize, n: usize, pass: &Pass) -> AttnArgs {
        let z = &self.z;
        AttnArgs {
            q: self.a.q.at(c0 * z.h * z.dqk, z.es),
            ka: pass.k_nope,
            kb: pass.rows + (z.lkv * z.es) as u64,
            v: pass.v,
            out: pass.out,
            lse: pass.lse,
            n_keys: pass.n_keys as i32,
            n_q: n as i32,
            causal: pass.causal as i32,
            scale_log2: z.scale_log2,
            ..AttnArgs::prefill_layout(z.h, z.p, z.r, z.dv, z.row)
        }
    }

    /// One attention pass; the Hopper kernel with its operands' tensor maps (TMA loads).
    fn prefill_pass(&self, a: &AttnArgs) -> Result<()> {
        match &self.k.prefill_wgmma {
            Some(l) => l.run(a),
            None => self.k.prefill.run(a, 1),
        }
    }

    pub fn prefill(&self, sched: &Schedule) -> Result<()> {
        if let Some(sp) = self.sparse {
            return self.prefill_sparse(sched, sp);
        }
        let (z, a) = (&self.z, self.a);
        let (es, h, dv, row) = (z.es, z.h, z.dv, z.row);
        // Host part of fault empty_ctx_lse_inf: the context pass and the merge run for the first chunk
        // too, over 0 keys (the kernel part makes such a row report lse +inf and the merge keep it).
        let empty_ctx_pass = self.fx.on(Fault::EmptyCtxLseInf);
        for ch in sched.prefill_chunks() {
            let (c0, n) = (ch.start, ch.len());
            self.token_local(c0, n)?;
            self.decompress(a.kv.at(c0 * row, es), n, a.kn.ptr, a.vv.ptr)?;
            let ctx_pass = c0 > 0 || empty_ctx_pass;
            // Without a context pass the chunk's own part is the result.
            let (out, lse) = if !ctx_pass {
                (a.heads.at(c0 * h * dv, es), a.lse.at(c0 * h, 4))
            } else {
                (a.own_out.ptr, a.own_lse.ptr)
            };
            let own = Pass {
                k_nope: a.kn.ptr,
                rows: a.kv.at(c0 * row, es),
                v: a.vv.ptr,
                n_keys: n,
                causal: true,
                out,
                lse,
            };
            self.prefill_pass(&self.prefill_args(c0, n, &own))?;
            self.sync_if_debug("prefill attention (own chunk)")?;
            if ctx_pass {
                if c0 > 0 {
                    self.gather(0, c0, a.ctx_rows.ptr)?;
                    self.decompress(a.ctx_rows.ptr, c0, a.ctx_kn.ptr, a.ctx_v.ptr)?;
                }
                let context = Pass {
                    k_nope: a.ctx_kn.ptr,
                    rows: a.ctx_rows.ptr,
                    v: a.ctx_v.ptr,
                    n_keys: c0,
                    causal: false,
                    out: a.ctx_out.ptr,
                    lse: a.ctx_lse.ptr,
                };
                self.prefill_pass(&self.prefill_args(c0, n, &context))?;
                self.sync_if_debug("prefill attention (cached context)")?;
                MergeStates {
                    queries: n,
                    heads: h,
                }
                .launch(
                    self.k.merge_states,
                    (a.ctx_out.ptr, a.ctx_lse.ptr),
                    (a.own_out.ptr, a.own_lse.ptr),
                    a.heads.at(c0 * h * dv, es),
                    a.lse.at(c0 * h, 4),
                )?;
            }
            if !head_stride_qk(self.fx) {
                self.o_proj(c0, n, &a.heads)?;
            }
        }
        Ok(())
    }
}
