//! The serving-shaped decode batch through the mirror's decode (issue #32, item 6; `crate::batch`):
//! requests of mixed lengths (thousands of keys, one key, shorter than a page, the whole sequence, a
//! page + 1) in one batch, each with its own block table into one pool and its own `cache_seqlens`,
//! the split partition of its own length (so the one-key request has empty splits). Checked as a
//! runner's serving batch is (`runner::checks::against_fp64`: fp64 from the batch's own inputs, the
//! `@runner` bound), reported in `runner_checks`.

use super::cache::PagedCache;
use super::decode::split_partial;
use super::flash::{merge, Partial};
use super::row3;
use crate::backend::runner::checks::{against_fp64, RunnerCheck};
use crate::backend::runner::decode::Entry;
use crate::backend::runner::RunnerBackend;
use crate::backend::LayerCtx;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use ndarray::Array3;

/// A bug planted in the batch's combine, only for tests (no catalogue entry: the catalogue's faults
/// are each caught at a stage check of the default run, which this one by construction is not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// An empty split's partial (out 0, lse −inf) merged with weight 1, as a combine that weighs
    /// `exp(lse − max)` without the −inf guard on a partial whose lse was written as the running max.
    EmptySplitWeightOne,
}

/// Each request's block table into one pool: the requests' pages interleaved (page `i` of every
/// request, then page `i + 1`), so a request read through another's table reads the wrong rows.
fn tables(lens: &[usize], page: usize) -> (Vec<Vec<usize>>, usize) {
    let pages: Vec<usize> = lens.iter().map(|l| l.div_ceil(page)).collect();
    let mut t: Vec<Vec<usize>> = pages.iter().map(|&n| Vec::with_capacity(n)).collect();
    let mut next = 0;
    for i in 0..pages.iter().copied().max().unwrap_or(0) {
        for (r, &n) in pages.iter().enumerate() {
            if i < n {
                t[r].push(next);
                next += 1;
            }
        }
    }
    (t, next)
}

/// Run the serving batch of `ctx.sched` at this layer: `acfg` the kernels' view of the config,
/// `q_abs` `[D, H, Lkv]` and `q_pe` `[T, H, R]` the stored queries, `cache` the run's cache after all
/// writes. Empty when the schedule has no decode step.
#[allow(clippy::too_many_arguments)]
pub fn checks(
    ctx: &LayerCtx,
    acfg: &MlaConfig,
    q_abs: &Array3<f32>,
    q_pe: &Array3<f32>,
    cache: &PagedCache,
    dt: Dtype,
    plant: Option<Plant>,
) -> Vec<RunnerCheck> {
    let (cfg, sched) = (ctx.cfg, ctx.sched);
    let reqs = crate::batch::serving(sched);
    if reqs.is_empty() {
        return Vec::new();
    }
    let (h, lkv, r, t, page) = (
        cfg.n_head,
        cfg.kv_lora_rank,
        cfg.qk_rope,
        sched.total_tokens(),
        sched.page_size,
    );
    let width = lkv + r;
    // The batch's cache: request `q`'s key `j` is the run's row `j mod T`, in the request's own pages.
    let lens: Vec<usize> = reqs.iter().map(|q| q.seq_len).collect();
    let (tabs, n_pages) = tables(&lens, page);
    let mut pool = vec![f32::NAN; n_pages * page * width];
    for (q, tab) in reqs.iter().zip(&tabs) {
        for j in 0..q.seq_len {
            let at = (tab[j / page] * page + j % page) * width;
            pool[at..at + width].copy_from_slice(cache.row(j % t));
        }
    }
    let mut bc = PagedCache::from_pool(width, page, Vec::new(), pool);

    // Our decode over the batch: per request its own table, length and split partition.
    let s = sched.num_splits;
    let n = reqs.len();
    let (mut lat, mut lse) = (vec![0f64; n * h * lkv], vec![0f64; n * h]);
    let (mut sout, mut slse) = (vec![0f64; n * h * s * lkv], vec![0f64; n * h * s]);
    for (i, q) in reqs.iter().enumerate() {
        bc.table = tabs[i].clone();
        let splits = sched.split_ranges(q.seq_len);
        for hh in 0..h {
            let (qa, qp) = (
                row3(q_abs, q.query, hh),
                row3(q_pe, sched.prompt_len + q.query, hh),
            );
            let parts: Vec<Partial> = splits
                .iter()
                .map(|sr| split_partial(acfg, &bc, qa, qp, sr.clone(), dt))
                .collect();
            let row = i * h + hh;
            for (k, p) in parts.iter().enumerate() {
                let at = (row * s + k) * lkv;
                for (o, &v) in sout[at..at + lkv].iter_mut().zip(&p.out) {
                    *o = v as f64;
                }
                slse[row * s + k] = p.lse as f64;
            }
            let m = match plant {
                Some(Plant::EmptySplitWeightOne) => {
                    let top = parts
                        .iter()
                        .map(|p| p.lse)
                        .fold(f32::NEG_INFINITY, f32::max);
                    let moved: Vec<Partial> = parts
                        .iter()
                        .map(|p| match p.lse == f32::NEG_INFINITY {
                            true => Partial {
                                out: p.out.clone(),
                                lse: top,
                            },
                            false => p.clone(),
                        })
                        .collect();
                    merge(&moved)
                }
                None => merge(&parts),
            }
            .rounded(dt);
            for (o, &v) in lat[row * lkv..(row + 1) * lkv].iter_mut().zip(&m.out) {
                *o = v as f64;
            }
            lse[row] = m.lse as f64;
        }
    }

    // fp64 from the batch's own inputs (the stored queries and cache rows), as for a runner's batch.
    let rows: Vec<f64> = cache.gather(0..t).iter().map(|&v| v as f64).collect();
    let (mut l_out, mut l_lse, mut l_sout, mut l_slse) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for q in &reqs {
        let en = Entry {
            q_nope: (0..h)
                .flat_map(|hh| row3(q_abs, q.query, hh).iter().map(|&v| v as f64))
                .collect(),
            q_pe: (0..h)
                .flat_map(|hh| {
                    row3(q_pe, sched.prompt_len + q.query, hh)
                        .iter()
                        .map(|&v| v as f64)
                })
                .collect(),
            keys: (0..q.seq_len).map(|j| Some(j % t)).collect(),
        };
        let l = RunnerBackend::local_entry(ctx, &en, 1, &rows);
        l_out.extend(l.out);
        l_lse.extend(l.lse);
        l_sout.extend(l.sout);
        l_slse.extend(l.slse);
    }
    let scope = format!(
        "our decode, {n} requests of {} keys",
        lens.iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let terms = crate::batch::LONG.max(t) * width;
    let (run, layer) = (dt.name(), ctx.layer);
    let check = |what: &str, ro: (&[f64], &[f64]), dtype: &str, skip: &dyn Fn(usize) -> bool| {
        against_fp64(
            run,
            layer,
            "serving_batch",
            what,
            ro,
            dtype,
            terms,
            skip,
            &scope,
        )
    };
    // An empty split's out is don't-care: its lse (−inf) weighs it 0 in the merge.
    let empty = |i: usize| l_slse[i / lkv] == f64::NEG_INFINITY;
    vec![
        check("attn_latent", (&l_out, &lat), run, &|_| false),
        check("lse", (&l_lse, &lse), "f32", &|_| false),
        check("split_out", (&l_sout, &sout), "f32", &empty),
        check("split_lse", (&l_slse, &slse), "f32", &|_| false),
    ]
}

#[cfg(test)]
mod tests {
    #[test]
    fn tables_interleave_the_requests_pages() {
        let (t, n) = super::tables(&[5, 1, 9], 4);
        assert_eq!(n, 2 + 1 + 3);
        assert_eq!(t, vec![vec![0, 3], vec![1], vec![2, 4, 5]]);
    }
}
