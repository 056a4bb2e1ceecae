//! DSA sparse attention on the GPU (kernels/sparse_attn.cu): prefill chunks and decode steps attend only
//! to `LayerCtx::selection`, read from the paged cache through FlashMLA-style index rows
//! (`reference::sparse::flashmla_indices`: page·page_size + offset, −1 padding).
//!
//! Both phases run in the absorbed form (as FlashMLA's sparse kernels do): q_abs = W_UKᵀ·q_nope per head,
//! the query `[q_abs | q_pe]` over the selected cache rows, then W_UV. Decode keeps the dense path's
//! split-KV by key position (so `split_out`/`split_lse` are the reference's partials over the selection)
//! and its LSE combine (decode.cu `combine_splits`); prefill is one split writing `lse` and, after W_UV,
//! `attn_heads` directly.

use super::blas::GemmPrecision;
use super::buffers::head_stride_qk;
use super::device::{arg, DevBuf};
use super::kernels::launch;
use super::launch::Sparse;
use super::layer::Layer;
use super::trace::down;
use crate::backend::runner::checks::RunnerCheck;
use crate::backend::serving::{judge_sparse, Outputs, Query};
use crate::backend::LayerCtx;
use crate::error::Result;
use crate::faults::{Active, Fault};
use crate::reference::sparse::{flashmla_indices, Selection};
use crate::schedule::Schedule;
use cudarc::cublas::sys::cublasOperation_t as Op;
use std::ops::Range;

/// (query, head) rows per CTA of `sparse_attn` (its SP_ROWS).
const ROWS_PER_CTA: usize = 4;

/// The coverage section's kernels of a sparse layer: `sparse_attn` in both phases. Its tiles are 32
/// consecutive entries of a query's index row, not key positions, so the dense tile classes do not apply
/// (no geometry: reported unknown).
pub fn kernel_uses() -> Vec<crate::kernel_use::KernelUse> {
    use crate::kernel_use::{Family, KernelUse, Phase};
    [Phase::Prefill, Phase::Decode]
        .into_iter()
        .map(|phase| KernelUse {
            phase,
            family: Family::Scalar,
            label: "sparse_attn (absorbed, one warp per (query, head), 32-index tiles)".into(),
            geometry: None,
            production: None,
        })
        .collect()
}

fn profiling() -> bool {
    std::env::var("MLA_DIFF_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Index rows of queries `queries` and, per query, where each split's keys start in its row.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexRows {
    /// `[n_q, topk]` cache slots in key order, −1 padded.
    pub indices: Vec<i32>,
    /// `[n_q, splits + 1]`: split k of query i reads `indices[i][bounds[i][k]..bounds[i][k+1]]`.
    pub bounds: Vec<i32>,
    pub topk: usize,
}

/// The index rows of `queries` over `splits` (key-position ranges, ascending and contiguous). Fault
/// `sparse_index_page_base`: each index is the key's logical position (its logical page as the page
/// base), the block table skipped.
pub fn index_rows(
    sel: &Selection,
    queries: Range<usize>,
    splits: &[Range<usize>],
    block_table: &[usize],
    page: usize,
    fx: Active,
) -> IndexRows {
    let logical = fx.on(Fault::SparseIndexPageBase);
    let topk = sel.index_width(queries.clone());
    let (mut indices, mut bounds) = (Vec::new(), Vec::new());
    for t in queries {
        let keys = &sel.keys[t];
        let mut row = match logical {
            true => keys.iter().map(|&j| j as i32).collect(),
            false => flashmla_indices(keys, topk, block_table, page),
        };
        row.resize(topk, -1);
        indices.extend(row);
        // Keys are ascending: split k starts at the first key at or past its range's start.
        for s in splits {
            bounds.push(keys.partition_point(|&j| (j as usize) < s.start) as i32);
        }
        bounds.push(keys.len() as i32);
    }
    IndexRows {
        indices,
        bounds,
        topk,
    }
}

/// Where one sparse launch reads its query and writes its result.
struct Launch {
    q: u64,
    n_q: usize,
    splits: usize,
    /// Split partials (decode with several splits, or MLA_DEBUG) or the final out/lse.
    partials: bool,
    out: u64,
    lse: u64,
    part_out: u64,
    part_lse: u64,
}

impl Layer<'_> {
    fn sparse_launch(&self, sp: &Sparse, rows: &IndexRows, l: &Launch) -> Result<()> {
        let z = &self.z;
        let idx = DevBuf::upload(&rows.indices)?;
        let bnd = DevBuf::upload(&rows.bounds)?;
        let (out_rs, out_hs) = ((z.h * z.lkv) as i64, z.lkv as i64);
        let (n_q, nh, topk, ns) = (l.n_q as i32, z.h as i32, rows.topk as i32, l.splits as i32);
        let partials = l.partials as i32;
        let (q, pool, ip, bp) = (l.q, self.a.pool.ptr, idx.ptr, bnd.ptr);
        let grid = (
            (l.n_q * z.h).div_ceil(ROWS_PER_CTA) as u32,
            l.splits as u32,
            1,
        );
        // MLA_DIFF_PROFILE: the kernel's wall time between two syncs (what a peer's sparse kernel is
        // timed against: `bench/gpu-check.sh dsa_flashmla`).
        let t0 = match profiling() {
            true => {
                self.gpu.sync("sparse attention (profile)")?;
                Some(std::time::Instant::now())
            }
            false => None,
        };
        launch(
            sp.f,
            "sparse_attn",
            grid,
            (32 * ROWS_PER_CTA) as u32,
            0,
            &mut [
                arg(&q),
                arg(&pool),
                arg(&ip),
                arg(&bp),
                arg(&l.out),
                arg(&out_rs),
                arg(&out_hs),
                arg(&l.lse),
                arg(&l.part_out),
                arg(&l.part_lse),
                arg(&n_q),
                arg(&nh),
                arg(&topk),
                arg(&ns),
                arg(&partials),
                arg(&z.scale_log2),
            ],
        )?;
        // The index buffers are freed on return: wait for the kernel that reads them.
        self.gpu.sync("sparse attention")?;
        if let Some(t0) = t0 {
            eprintln!(
                "mla-diff: profile: sparse_attn {} queries x {} heads, topk {}, {} split(s): {:.3} ms",
                l.n_q,
                z.h,
                rows.topk,
                l.splits,
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
        Ok(())
    }

    /// `q_out[t, h, :] = [W_UK[h]ᵀ q_nope[t, h, :] | q_pe[t, h, :]]` for tokens `[t0, t0+n)`.
    pub fn absorb_query(&self, t0: usize, n: usize, q_out: u64) -> Result<()> {
        let (z, a, w) = (&self.z, self.a, self.w);
        let (es, h, p, r, lkv, dqk, row) = (z.es, z.h, z.p, z.r, z.lkv, z.dqk, z.row);
        self.blas.batched(
            GemmPrecision::Storage(z.dt),
            Op::CUBLAS_OP_N,
            lkv,
            n,
            p,
            w.w_uk_abs(),
            lkv,
            p * lkv,
            a.q.at(t0 * h * dqk, es),
            h * dqk,
            dqk,
            q_out,
            h * row,
            row,
            h,
        )?;
        self.copy_heads(
            (a.q.at(t0 * h * dqk + p, es), h * dqk, dqk),
            (q_out + (lkv * es) as u64, h * row, row),
            r,
            n,
        )
    }

    /// `heads[t, h, :] = W_UV[h] · lat[t, h, :]` for `n` tokens (per head: `[Dv, Lkv] x [Lkv, n]`).
    pub fn latent_to_heads(&self, lat: u64, n: usize, heads: u64) -> Result<()> {
        let z = &self.z;
        let (h, lkv, dv) = (z.h, z.lkv, z.dv);
        self.blas.batched(
            GemmPrecision::Storage(z.dt),
            Op::CUBLAS_OP_T,
            dv,
            n,
            lkv,
            self.w.w_uv.ptr,
            lkv,
            dv * lkv,
            lat,
            h * lkv,
            lkv,
            heads,
            h * dv,
            dv,
            h,
        )
    }

    /// Prefill over the selection, chunk by chunk: the chunk's rows go into the cache first, so its
    /// queries read their own chunk's keys and the context alike through the index rows.
    pub fn prefill_sparse(&self, sched: &Schedule, sp: &Sparse) -> Result<()> {
        let (z, a) = (&self.z, self.a);
        let (es, h, row, lkv, dv) = (z.es, z.h, z.row, z.lkv, z.dv);
        let cmax = sched.chunk.min(z.p0).max(1);
        let qf = DevBuf::alloc(cmax * h * row * es)?;
        let lat = DevBuf::alloc(cmax * h * lkv * es)?;
        for ch in sched.prefill_chunks() {
            let (c0, n) = (ch.start, ch.len());
            self.token_local(c0, n)?;
            self.absorb_query(c0, n, qf.ptr)?;
            let rows = index_rows(
                sp.sel,
                ch.clone(),
                // One split: every key the chunk's queries may see.
                std::slice::from_ref(&(0..ch.end)),
                sp.table,
                sched.page_size,
                self.fx,
            );
            let l = Launch {
                q: qf.ptr,
                n_q: n,
                splits: 1,
                partials: false,
                out: lat.ptr,
                lse: a.lse.at(c0 * h, 4),
                part_out: 0,
                part_lse: 0,
            };
            self.sparse_launch(sp, &rows, &l)?;
            self.latent_to_heads(lat.ptr, n, a.heads.at(c0 * h * dv, es))?;
            if !head_stride_qk(self.fx) {
                self.o_proj(c0, n, &a.heads)?;
            }
        }
        // The scratch buffers are freed on return.
        self.gpu.sync("sparse prefill")
    }

    /// Decode's attention over the selection for the step `st` (its absorbed query already in
    /// `a.qfull`): split-KV by key position as the dense kernel splits, partials for `combine_splits`.
    pub fn decode_sparse_attention(
        &self,
        sched: &Schedule,
        sp: &Sparse,
        st: Range<usize>,
        partials: bool,
    ) -> Result<()> {
        let (z, a) = (&self.z, self.a);
        let (es, h, row, lkv, ns) = (z.es, z.h, z.row, z.lkv, z.ns);
        let d0 = st.start - z.p0;
        let rows = index_rows(
            sp.sel,
            st.clone(),
            &sched.split_ranges(st.end),
            sp.table,
            sched.page_size,
            self.fx,
        );
        let l = Launch {
            q: a.qfull.at(d0 * h * row, es),
            n_q: st.len(),
            splits: ns,
            partials,
            out: a.lat.at(d0 * h * lkv, es),
            lse: a.lse.at(st.start * h, 4),
            part_out: a.part_out.at(d0 * h * ns * lkv, 4),
            part_lse: a.part_lse.at(d0 * h * ns, 4),
        };
        self.sparse_launch(sp, &rows, &l)
    }
}

impl Layer<'_> {
    /// The batch aimed at the sparse kernel on a run that stays within top_k
    /// (`serving::sparse_aim`: `sp` holds its selection and the run's block table): every decode
    /// query in one `sparse_attn` launch over its selected keys of the layer's cache pool, one split,
    /// into buffers of its own (after `finish`: the cache rows are gathered); judged by
    /// `serving::judge_sparse`.
    pub fn sparse_aimed(
        &self,
        ctx: &LayerCtx,
        sp: &Sparse,
        st: &super::serving::Stored,
    ) -> Result<Vec<RunnerCheck>> {
        let (z, a) = (&self.z, self.a);
        let (dt, es, h, lkv, row) = (z.dt, z.es, z.h, z.lkv, z.row);
        let (p0, d) = (z.p0, z.td);
        let rows = index_rows(
            sp.sel,
            p0..p0 + d,
            std::slice::from_ref(&(0..z.t_all)),
            sp.table,
            ctx.sched.page_size,
            self.fx,
        );
        let (lat, lse) = (DevBuf::alloc(d * h * lkv * es)?, DevBuf::alloc(d * h * 4)?);
        let l = Launch {
            q: a.qfull.ptr,
            n_q: d,
            splits: 1,
            partials: false,
            out: lat.ptr,
            lse: lse.ptr,
            part_out: a.part_out.ptr,
            part_lse: a.part_lse.ptr,
        };
        self.sparse_launch(sp, &rows, &l)?;
        let qf = &st.qf;
        let queries: Vec<Query> = (0..d)
            .map(|i| {
                let head = |hh: usize| &qf[(i * h + hh) * row..(i * h + hh + 1) * row];
                Query {
                    q_abs: (0..h).flat_map(|hh| head(hh)[..lkv].to_vec()).collect(),
                    q_pe: (0..h).flat_map(|hh| head(hh)[lkv..].to_vec()).collect(),
                }
            })
            .collect();
        let out = Outputs {
            lat: down(&lat, dt, 0, d * h * lkv)?,
            lse: lse
                .read::<f32>(0, d * h)?
                .into_iter()
                .map(f64::from)
                .collect(),
            sout: Vec::new(),
            slse: Vec::new(),
        };
        let who = "our decode (sparse_attn, one launch, one split)";
        Ok(judge_sparse(ctx, sp.sel, &queries, &st.rows, &out, dt, who))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_rows_go_through_the_block_table_and_bound_each_split() {
        // Query 5 keeps keys 1, 4, 5; page 4, logical page 0 → physical 2, 1 → 0; splits of 3 keys.
        let sel = Selection::new(
            3,
            vec![vec![], vec![], vec![], vec![], vec![], vec![1, 4, 5]],
        );
        let r = index_rows(&sel, 5..6, &[0..3, 3..6], &[2, 0], 4, Active::NONE);
        assert_eq!(r.topk, 3);
        assert_eq!(r.indices, vec![9, 0, 1]);
        assert_eq!(r.bounds, vec![0, 1, 3]);
        // The planted bug: logical positions, as if the table were the identity.
        let f = index_rows(
            &sel,
            5..6,
            &[0..3, 3..6],
            &[2, 0],
            4,
            Active::NONE.with(Fault::SparseIndexPageBase),
        );
        assert_eq!(f.indices, vec![1, 4, 5]);
        assert_eq!(f.bounds, r.bounds);
    }

    #[test]
    fn short_rows_pad_with_minus_one_and_empty_splits_are_empty() {
        let sel = Selection::new(4, vec![vec![0], vec![0, 1]]);
        let r = index_rows(&sel, 0..2, &[0..1, 1..2, 2..2], &[0], 4, Active::NONE);
        assert_eq!(r.topk, 4);
        assert_eq!(r.indices, vec![0, -1, -1, -1, 0, 1, -1, -1]);
        assert_eq!(r.bounds, vec![0, 1, 1, 1, 0, 1, 2, 2]);
    }
}
