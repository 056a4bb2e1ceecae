//! The kernels/v4/ launches of a forward pass: the entries it closes (`v4_compress`), each query's
//! selection (`v4_index_scores`, `v4_index_topk`) and attention (`v4_attn`).

use super::{Comp, Ix, Layer, ATTN_ROWS, IX_KEYS};
use crate::backend::cuda::device::{arg, drv_err};
use crate::backend::cuda::kernels::launch;
use crate::error::Result;
use crate::model::v4::LayerKind;
use cudarc::driver::sys::CUfunction;
use std::ops::Range;

impl Layer<'_> {
    /// `v4_compress`: the entries of `cm` the tokens of `p` close.
    pub(super) fn compress(&self, cm: &Comp, p: &Range<usize>) -> Result<()> {
        let ws = cm.groups.closed_in(p);
        let (w0, d, m, csa) = (
            ws.start as i32,
            cm.d as i32,
            cm.groups.m as i32,
            cm.csa as i32,
        );
        let (start, rd, eps) = (
            p.start as i32,
            self.c.rope_dim as i32,
            self.c.rms_eps as f32,
        );
        let (cos, sin) = (self.crope.0.ptr, self.crope.1.ptr);
        let (kv, gate, ape) = (cm.kv.ptr, cm.gate.ptr, cm.ape.ptr);
        let (norm, out) = (cm.norm.ptr, cm.entries.ptr);
        launch(
            self.f.compress,
            "v4_compress",
            (ws.len() as u32, 1, 1),
            128,
            (cm.d * 4) as u32,
            &mut [
                arg(&kv),
                arg(&gate),
                arg(&ape),
                arg(&norm),
                arg(&out),
                arg(&w0),
                arg(&d),
                arg(&m),
                arg(&csa),
                arg(&start),
                arg(&rd),
                arg(&cos),
                arg(&sin),
                arg(&eps),
            ],
        )
    }

    /// The indexer's scores of the entries each query of `p` sees, and its top-k.
    pub(super) fn select(&self, ix: &Ix, p: &Range<usize>) -> Result<()> {
        let n_cols = ix.comp.n_entries;
        if n_cols == 0 {
            return Ok(());
        }
        let (t0, nc, m) = (p.start as i32, n_cols as i32, ix.comp.groups.m as i32);
        let (hi, di, k) = (ix.hi as i32, ix.di as i32, ix.k as i32);
        let smem = (ix.hi * ix.di + ix.hi + IX_KEYS * ix.di) * 4;
        let f = self.smem(self.f.scores, "v4_index_scores", smem)?;
        let (q, wts, keys) = (ix.q.ptr, ix.wts.ptr, ix.comp.entries.ptr);
        let (scores, topk) = (ix.scores.ptr, ix.topk.ptr);
        launch(
            f,
            "v4_index_scores",
            (p.len() as u32, n_cols.div_ceil(IX_KEYS) as u32, 1),
            (32 * IX_KEYS) as u32,
            smem as u32,
            &mut [
                arg(&q),
                arg(&wts),
                arg(&keys),
                arg(&scores),
                arg(&t0),
                arg(&nc),
                arg(&m),
                arg(&hi),
                arg(&di),
            ],
        )?;
        let np = n_cols.next_power_of_two();
        let f = self.smem(self.f.topk, "v4_index_topk", np * 8)?;
        launch(
            f,
            "v4_index_topk",
            (p.len() as u32, 1, 1),
            np.clamp(32, 1024) as u32,
            (np * 8) as u32,
            &mut [
                arg(&scores),
                arg(&topk),
                arg(&t0),
                arg(&nc),
                arg(&m),
                arg(&k),
            ],
        )
    }

    /// `f` with its dynamic shared memory raised to `bytes` where that is above the default 48 KiB.
    fn smem(&self, f: CUfunction, name: &str, bytes: usize) -> Result<CUfunction> {
        if bytes <= 48 * 1024 {
            return Ok(f);
        }
        use cudarc::driver::{result as drv, sys};
        unsafe {
            drv::function::set_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(drv_err(&format!(
            "raising {name}'s shared memory to {bytes} bytes (too many compressed entries for one CTA?)"
        )))?;
        Ok(f)
    }

    /// `v4_attn` for the queries of `p`.
    pub(super) fn attend(&self, p: &Range<usize>) -> Result<()> {
        let c = self.c;
        let rows_n = p.len() * c.n_head;
        let (comp, m) = match &self.comp {
            Some(cm) => (cm.entries.ptr, cm.groups.m as i32),
            None => (0u64, 0),
        };
        let (sel, ksel) = match &self.ix {
            Some(ix) if ix.k > 0 => (ix.topk.ptr, ix.k as i32),
            _ => (0u64, 0),
        };
        // A CSA layer with no entry by its last token attends to its window only (m 0, no selection).
        let m = match self.kind == LayerKind::Csa && sel == 0 {
            true => 0,
            false => m,
        };
        let (t0, nq, nh) = (p.start as i32, p.len() as i32, c.n_head as i32);
        let (win, scale) = (c.sliding_window as i32, c.softmax_scale as f32);
        let (q, rows, sinks) = (self.q.ptr, self.rows.ptr, self.sinks.ptr);
        let (heads, lse) = (self.heads.ptr, self.lse.ptr);
        launch(
            self.f.attn,
            "v4_attn",
            (rows_n.div_ceil(ATTN_ROWS) as u32, 1, 1),
            (32 * ATTN_ROWS) as u32,
            0,
            &mut [
                arg(&q),
                arg(&rows),
                arg(&comp),
                arg(&sel),
                arg(&ksel),
                arg(&sinks),
                arg(&heads),
                arg(&lse),
                arg(&t0),
                arg(&nq),
                arg(&nh),
                arg(&win),
                arg(&m),
                arg(&scale),
            ],
        )
    }
}
