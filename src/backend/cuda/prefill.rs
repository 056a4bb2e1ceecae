//! Prefill, chunk by chunk, in the decompressed form: causal attention over the chunk's own keys, then
//! (with cached context) non-causal attention over the context gathered from the cache and the LSE
//! merge of the two parts; then o_proj of the chunk.

use super::attn::{Attn, AttnArgs};
use super::buffers::head_stride_qk;
use super::kernels::{launch, Dims, Kernels, Module};
use super::launch::MergeStates;
use super::layer::Layer;
use super::tma::PrefillMaps;
use crate::error::Result;
use crate::faults::Fault;
use crate::schedule::Schedule;
use cudarc::driver::sys;
use std::ffi::c_void;
use std::rc::Rc;

/// The launch of the Hopper prefill kernel (kernels/prefill_sm90.cuh `attn_wgmma`), which takes its
/// operands' tensor maps as a second, `__grid_constant__` parameter (`Attn::run` passes one argument
/// struct): every launch of it goes through here, with the maps where TMA can address the operands and
/// `PrefillMaps::OFF` (cp.async loads) where not.
pub struct PrefillLaunch {
    f: sys::CUfunction,
    /// (dynamic shared bytes, threads, rows, keys) of the module's `attn_wgmma_config`.
    cfg: (u32, u32, u32, u32),
    /// The module encodes maps (`attn_wgmma_tma_param`): (p, r, dv) of its dims; None: cp.async only.
    tma: Option<(usize, usize, usize)>,
    _m: Rc<Module>,
}

impl PrefillLaunch {
    /// The launch of `att`'s kernel (its module compiled with `dims`), when that is the wgmma kernel.
    pub fn find(k: &mut Kernels, att: &Attn, dims: &Dims) -> Result<Option<PrefillLaunch>> {
        let Some(tile) = att.tile else {
            return Ok(None);
        };
        if !tile.wgmma || att.mqa || att.name != "attn_wgmma" {
            return Ok(None);
        }
        let mut d = dims.defines();
        d.extend(tile.defines());
        // Attn::load's module, from the cache.
        let m = k.module("prefill.cu", d)?;
        // Kernel sources older than the maps parameter lack the flag: `Attn::run` launches them.
        if !m.has_global("attn_wgmma_tma_param") {
            return Ok(None);
        }
        let c = m.global_i32s("attn_wgmma_config", 4)?;
        let tma = (m.global_i32s("attn_wgmma_tma_param", 1)?[0] == 1
            && super::device::elem_bytes(dims.dtype) == 2)
            .then_some((dims.p, dims.r, dims.dv));
        Ok(Some(PrefillLaunch {
            // Attn::load raised this function's shared-memory limit (same module, same handle).
            f: m.func("attn_wgmma")?,
            cfg: (c[0] as u32, c[1] as u32, c[2] as u32, c[3] as u32),
            tma,
            _m: m,
        }))
    }

    /// The kernel's parameter for `a`: its operands' maps, or OFF where TMA cannot address them.
    pub fn maps(&self, a: &AttnArgs) -> Result<PrefillMaps> {
        let Some((p, r, dv)) = self.tma else {
            return Ok(PrefillMaps::OFF);
        };
        Ok(PrefillMaps::encode(a, p, r, dv, self.cfg.2, self.cfg.3)?.unwrap_or(PrefillMaps::OFF))
    }

    /// Launch over one request (heads `a.n_heads`, queries `a.n_q`) with `maps` (from `maps`).
    pub fn run_with(&self, a: &AttnArgs, maps: &PrefillMaps) -> Result<()> {
        let (smem, threads, bm, _) = self.cfg;
        let grid = ((a.n_q as u32).div_ceil(bm), a.n_heads as u32, 1);
        let mut p = [
            a as *const AttnArgs as *mut c_void,
            maps as *const PrefillMaps as *mut c_void,
        ];
        launch(self.f, "attn_wgmma", grid, threads, smem, &mut p)
    }

    /// `run_with` the maps of `a`.
    pub fn run(&self, a: &AttnArgs) -> Result<()> {
        self.run_with(a, &self.maps(a)?)
    }
}

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
