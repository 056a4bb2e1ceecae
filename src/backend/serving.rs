//! The serving-shaped decode batch of our own kernels (issue #32, item 6; `crate::batch`): requests of
//! mixed lengths (thousands of keys, one key, shorter than a page, the whole sequence, a page + 1) in one
//! batch, each with its own block table into one pool and its own `cache_seqlens`, the split partition
//! of its own length (so the one-key request has empty splits). The CPU mirror (`cpu/serving.rs`) and the
//! CUDA backend (`cuda/serving.rs`) each run it through their decode; what is shared is here: the batch's
//! pool and tables, and the judgement, as a runner's serving batch is judged
//! (`runner::checks::against_fp64`: fp64 from the batch's own inputs, the `@runner` bound), reported in
//! `runner_checks`.

use crate::backend::runner::checks::{against_fp64, RunnerCheck};
use crate::backend::runner::decode::Entry;
use crate::backend::runner::RunnerBackend;
use crate::backend::LayerCtx;
use crate::batch::Request;
use crate::model::config::Arch;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::reference::sparse::Selection;
use crate::schedule::Schedule;
use crate::tiles::variants::{self as tv, Launch};
use crate::tiles::Dims;

/// A backend's record of the batches it ran: their checks, once per layer whatever the modes and
/// repeats, and what the report takes from them (`Backend::decode_extra`, `Backend::decode_launches`,
/// `Backend::runner_checks`).
#[derive(Debug, Clone, Default)]
pub struct Record {
    checks: Vec<RunnerCheck>,
    layers: std::collections::BTreeSet<usize>,
    /// The variants batches were aimed at (`aims`, `sparse_aim`), once they ran.
    aimed: Vec<String>,
}

impl Record {
    /// Whether layer `layer`'s batch is still to run (true once per layer).
    pub fn first_at(&mut self, layer: usize) -> bool {
        self.layers.insert(layer)
    }

    pub fn add(&mut self, checks: Vec<RunnerCheck>) {
        self.checks.extend(checks);
    }

    /// An aimed batch's checks and the variant it was aimed at.
    pub fn add_aimed(&mut self, id: &str, checks: Vec<RunnerCheck>) {
        if !checks.is_empty() && !self.aimed.iter().any(|a| a == id) {
            self.aimed.push(id.to_string());
        }
        self.checks.extend(checks);
    }

    /// The batch's requests, for the coverage section: none when no batch ran.
    pub fn decode_extra(&self, sched: &crate::schedule::Schedule) -> Vec<Request> {
        match self.checks.is_empty() {
            true => Vec::new(),
            false => crate::batch::serving(sched),
        }
    }

    /// The variants aimed batches ran for, for the coverage section.
    pub fn aimed_variants(&self) -> Vec<String> {
        self.aimed.clone()
    }

    /// The checks for the report's `runner_checks` (labelled "batch"); `None` when no batch ran.
    pub fn runner_checks(&self) -> Option<crate::backend::runner::checks::RunnerChecks> {
        match self.checks.is_empty() {
            true => None,
            false => Some(crate::backend::runner::checks::RunnerChecks::labelled(
                "batch",
                self.checks.clone(),
            )),
        }
    }
}

/// A production decode variant (`tiles::variants`) that the schedule's own decode launches do not
/// select (issue #35), and a launch of the serving matrix that does: a batch is aimed at it, run at
/// that launch's page, split count and head slice, and judged as the serving batch is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aim {
    pub id: String,
    pub launch: Launch,
}

impl Aim {
    /// The config and schedule the aimed batch runs under: the launch's heads (the first `heads`: rank
    /// 0's slice under tensor parallelism), page and split count.
    pub fn frame(&self, cfg: &MlaConfig, sched: &Schedule) -> (MlaConfig, Schedule) {
        let l = &self.launch;
        let mut c = cfg.clone();
        c.n_head = l.heads.min(cfg.n_head);
        let s = Schedule {
            page_size: l.page,
            num_splits: l.splits,
            ..sched.clone()
        };
        (c, s)
    }

    /// How the checks' scope names it, for a model of `n_head` heads.
    pub fn label_of(&self, n_head: usize) -> String {
        let l = &self.launch;
        format!(
            "aimed at {}: heads {} of {n_head}, page {}, {} split(s), {} keys",
            self.id, l.heads, l.page, l.splits, l.n_keys
        )
    }
}

/// The decode launches of `sched` itself, at the model's heads: one per decode step (the keys its last
/// query sees), and the serving batch's one launch (its longest request).
pub fn own_launches(cfg: &MlaConfig, sched: &Schedule) -> Vec<Launch> {
    let at = |n_keys: usize, q_len: usize| Launch {
        heads: cfg.n_head,
        q_len,
        page: sched.page_size,
        splits: sched.num_splits,
        n_keys,
    };
    let mut out: Vec<Launch> = sched
        .decode_ranges()
        .iter()
        .map(|r| at(r.end, r.len()))
        .collect();
    if let Some(long) = crate::batch::serving(sched).iter().map(|q| q.seq_len).max() {
        out.push(at(long, 1));
    }
    out
}

/// The batches a run's decode aims at: every production decode variant of the model's dims (on sm_90a,
/// the production device, whichever backend runs) that `own_launches` do not select. None without a
/// decode step.
pub fn aims(cfg: &MlaConfig, sched: &Schedule) -> Vec<Aim> {
    if sched.decode_tokens() == 0 {
        return Vec::new();
    }
    let d = Dims::of_model(cfg, Dtype::Bf16);
    let caps = crate::tiles::choice::HOPPER;
    let hit = tv::reached(&d, &caps, &own_launches(cfg, sched));
    tv::variants(&d, &caps, None)
        .into_iter()
        .filter_map(|v| match v.launch {
            Some(launch) if !hit.contains(&v.id) => Some(Aim { id: v.id, launch }),
            _ => None,
        })
        .collect()
}

/// Keys per query of the batch aimed at the DSA sparse kernel (`sparse_aim`).
pub const SPARSE_KEYS: usize = 32;

/// The selection of the batch aimed at `decode/sparse_attn/past-top-k` on a DSA file whose run stays
/// within top_k (issue #35): each decode query of the schedule keeps `SPARSE_KEYS` of its visible keys
/// (half of them, when it sees fewer than twice that), spread evenly over them from the first to its own, so the sparse kernel decodes indices through the
/// run's (shuffled) block table for a query that sees more keys than it attends to. `None`: not a DSA
/// architecture, a run already sparse (past top_k: the variant runs there), or no decode query.
pub fn sparse_aim(ctx: &LayerCtx) -> Option<Selection> {
    let dsa = matches!(ctx.cfg.arch, Arch::GlmDsa | Arch::Deepseek32);
    let s = ctx.sched;
    if !dsa || ctx.selection.is_some() || s.decode_tokens() == 0 {
        return None;
    }
    let keys = (0..s.total_tokens())
        .map(|t| match t < s.prompt_len {
            true => Vec::new(),
            // Fewer keys than the query sees (half of them up to `SPARSE_KEYS`): past "top_k".
            false => spread(t + 1, SPARSE_KEYS.min((t + 1).div_ceil(2))),
        })
        .collect();
    Some(Selection::new(SPARSE_KEYS, keys))
}

/// `k` of the keys `0..n`, evenly spread, the first and the last included (all of them when n ≤ k).
fn spread(n: usize, k: usize) -> Vec<u32> {
    match n <= k {
        true => (0..n as u32).collect(),
        false => (0..k).map(|i| (i * (n - 1) / (k - 1)) as u32).collect(),
    }
}

/// fp64 from the batch's own inputs: for query `i`, attention over the cache rows `keys(i)` — its
/// output, lse, split outputs and split lses, each concatenated over the queries.
fn fp64_of(
    ctx: &LayerCtx,
    queries: &[Query],
    rows: &[f64],
    keys: impl Fn(usize) -> Vec<Option<usize>>,
) -> [Vec<f64>; 4] {
    let mut all: [Vec<f64>; 4] = Default::default();
    for (i, qq) in queries.iter().enumerate() {
        let en = Entry {
            q_nope: qq.q_abs.clone(),
            q_pe: qq.q_pe.clone(),
            keys: keys(i),
        };
        let l = RunnerBackend::local_entry(ctx, &en, 1, rows);
        for (a, v) in all.iter_mut().zip([l.out, l.lse, l.sout, l.slse]) {
            a.extend(v);
        }
    }
    all
}

/// The checks of the sparse aimed batch: fp64 over each decode query's selected keys (`sel`, from
/// `sparse_aim`) of the run's cache rows `rows` (`[T, width]`, token order, as stored) against `out`
/// (`lat` `[D, H, Lkv]`, `lse` `[D, H]`; one split: no partials), the queries `queries` one per decode
/// token, as check `variant_batch`.
pub fn judge_sparse(
    ctx: &LayerCtx,
    sel: &Selection,
    queries: &[Query],
    rows: &[f64],
    out: &Outputs,
    dt: Dtype,
    who: &str,
) -> Vec<RunnerCheck> {
    let p0 = ctx.sched.prompt_len;
    let [l_out, l_lse, _, _] = fp64_of(ctx, queries, rows, |d| {
        sel.keys[p0 + d].iter().map(|&j| Some(j as usize)).collect()
    });
    let scope = format!(
        "{who}, aimed at {}: {} decode queries over {SPARSE_KEYS} of their keys each (at most half), spread from the first to their own (a fixed selection, not the indexer's)",
        tv::SPARSE_ID,
        queries.len()
    );
    let terms = rows.len();
    let (run, layer) = (dt.name(), ctx.layer);
    let check = |what: &str, ro: (&[f64], &[f64]), dtype: &str| {
        against_fp64(
            run,
            layer,
            "variant_batch",
            what,
            ro,
            dtype,
            terms,
            |_| false,
            &scope,
        )
    };
    vec![
        check("attn_latent", (&l_out, &out.lat), run),
        check("lse", (&l_lse, &out.lse), "f32"),
    ]
}

/// The batch of a schedule laid out in one paged pool.
pub struct Batch {
    pub reqs: Vec<Request>,
    /// Each request's block table into the pool.
    pub tables: Vec<Vec<usize>>,
    /// Pages in the pool.
    pub n_pages: usize,
    pub page: usize,
    /// Elements of a cache row (`Lkv + R`).
    pub width: usize,
}

impl Batch {
    /// The serving batch of `ctx.sched`; `None` when the schedule has no decode step.
    pub fn of(ctx: &LayerCtx) -> Option<Batch> {
        Batch::laid_out(ctx, crate::batch::serving(ctx.sched))
    }

    /// The batch aimed at a variant, for a `ctx` framed by `Aim::frame` (its page and splits).
    pub fn aimed(ctx: &LayerCtx, aim: &Aim) -> Option<Batch> {
        let reqs = crate::batch::variant(ctx.sched, aim.launch.n_keys, ctx.sched.page_size);
        Batch::laid_out(ctx, reqs)
    }

    /// `reqs` in a pool of `ctx.sched`'s pages.
    fn laid_out(ctx: &LayerCtx, reqs: Vec<Request>) -> Option<Batch> {
        if reqs.is_empty() {
            return None;
        }
        let page = ctx.sched.page_size;
        let lens: Vec<usize> = reqs.iter().map(|q| q.seq_len).collect();
        let (tables, n_pages) = tables(&lens, page);
        Some(Batch {
            reqs,
            tables,
            n_pages,
            page,
            width: ctx.cfg.kv_lora_rank + ctx.cfg.qk_rope,
        })
    }

    pub fn lens(&self) -> Vec<usize> {
        self.reqs.iter().map(|q| q.seq_len).collect()
    }

    /// The pool from the run's cache rows (`rows`, `[T, width]` in token order): request `q`'s key `j`
    /// is the run's row `j mod T`, in the request's own pages; `fill` (NaN) in every slot no request uses.
    pub fn pool<V: Copy>(&self, rows: &[V], fill: V) -> Vec<V> {
        let (w, page) = (self.width, self.page);
        let t = rows.len() / w;
        let mut pool = vec![fill; self.n_pages * page * w];
        for (q, tab) in self.reqs.iter().zip(&self.tables) {
            for j in 0..q.seq_len {
                let at = (tab[j / page] * page + j % page) * w;
                pool[at..at + w].copy_from_slice(&rows[(j % t) * w..(j % t + 1) * w]);
            }
        }
        pool
    }

    /// The block tables as one `[n, max_pages]` i32 table (a kernel's `block_table`): unused slots
    /// point at page `n_pages`, one past the pool, which a kernel's caller fills with NaN.
    pub fn flat_table(&self) -> (Vec<i32>, usize) {
        let max_pages = self.tables.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let flat = self
            .tables
            .iter()
            .flat_map(|t| (0..max_pages).map(|i| *t.get(i).unwrap_or(&self.n_pages) as i32))
            .collect();
        (flat, max_pages)
    }
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

/// What a decode over the batch returned, as values: `lat` `[n, H, Lkv]`, `lse` `[n, H]` (natural log),
/// the split partials `sout` `[n, H, S, Lkv]` and `slse` `[n, H, S]` (empty when the kernel kept none).
pub struct Outputs {
    pub lat: Vec<f64>,
    pub lse: Vec<f64>,
    pub sout: Vec<f64>,
    pub slse: Vec<f64>,
}

/// A request's query as the decode read it: `q_abs` `[H, Lkv]` and `q_pe` `[H, R]`.
pub struct Query {
    pub q_abs: Vec<f64>,
    pub q_pe: Vec<f64>,
}

/// The batch's checks: fp64 from the batch's own inputs (the queries and the run's cache rows `rows`,
/// `[T, width]`, as stored) against `out`, labelled `who` ("our decode", …), as check `check`
/// (`serving_batch`, `variant_batch`).
#[allow(clippy::too_many_arguments)]
pub fn judge(
    check_name: &str,
    ctx: &LayerCtx,
    batch: &Batch,
    queries: &[Query],
    rows: &[f64],
    out: &Outputs,
    dt: Dtype,
    who: &str,
) -> Vec<RunnerCheck> {
    let lkv = ctx.cfg.kv_lora_rank;
    let t = rows.len() / batch.width;
    let [l_out, l_lse, l_sout, l_slse] = fp64_of(ctx, queries, rows, |i| {
        (0..batch.reqs[i].seq_len).map(|j| Some(j % t)).collect()
    });
    let lens = batch.lens();
    let scope = format!(
        "{who}, {} requests of {} keys",
        lens.len(),
        lens.iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let terms = crate::batch::LONG.max(t) * batch.width;
    let (run, layer) = (dt.name(), ctx.layer);
    let check = |what: &str, ro: (&[f64], &[f64]), dtype: &str, skip: &dyn Fn(usize) -> bool| {
        against_fp64(run, layer, check_name, what, ro, dtype, terms, skip, &scope)
    };
    // An empty split's out is don't-care: its lse (−inf) weighs it 0 in the merge.
    let empty = |i: usize| l_slse[i / lkv] == f64::NEG_INFINITY;
    let mut checks = vec![
        check("attn_latent", (&l_out, &out.lat), run, &|_| false),
        check("lse", (&l_lse, &out.lse), "f32", &|_| false),
    ];
    if !out.slse.is_empty() {
        checks.push(check("split_out", (&l_sout, &out.sout), "f32", &empty));
        checks.push(check("split_lse", (&l_slse, &out.slse), "f32", &|_| false));
    }
    checks
}

#[cfg(test)]
mod tests {
    use crate::model::catalogue::Preset;

    #[test]
    fn aims_are_the_variants_the_schedule_misses_each_at_its_own_launch() {
        // GLM-5's test dims (64 heads, 576/512) on the covering schedule (page 16, 2 splits): every
        // decode variant but the schedule's own attn_wgmma by ld.global is aimed at, at the launch that
        // selects it (a head slice for the few-heads kernels).
        let cfg = Preset::Glm5.test_config();
        let s = crate::coverage::covering::covering(&cfg);
        let aims = super::aims(&cfg, &s);
        let ids: Vec<&str> = aims.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "decode/attn_mma/ld.global",
                "decode/attn_small/tma-ring-multi-tile-page",
                "decode/attn_wgmma/tma",
                "decode/attn_wgmma/tma-multi-tile-page",
                "decode/attn_wgmma_pairs/tma",
                "decode/attn_wgmma_pairs/tma-multi-tile-page",
            ]
        );
        for a in &aims {
            let (c, fs) = a.frame(&cfg, &s);
            assert_eq!(
                (c.n_head, fs.page_size, fs.num_splits),
                (a.launch.heads, a.launch.page, a.launch.splits)
            );
            // The frame keeps the run's tokens: the batch's queries are the run's decode queries.
            assert_eq!(fs.total_tokens(), s.total_tokens());
        }
        assert!(
            aims[1].launch.heads < cfg.n_head,
            "attn_small from a TP slice"
        );
        // The schedule's own launches reach the rest; nothing is aimed at without a decode step.
        let none = crate::schedule::Schedule {
            decode_steps: 0,
            ..s.clone()
        };
        assert!(super::aims(&cfg, &none).is_empty());
    }
    #[test]
    fn tables_interleave_the_requests_pages() {
        let (t, n) = super::tables(&[5, 1, 9], 4);
        assert_eq!(n, 2 + 1 + 3);
        assert_eq!(t, vec![vec![0, 3], vec![1], vec![2, 4, 5]]);
        let b = super::Batch {
            reqs: Vec::new(),
            tables: t,
            n_pages: n,
            page: 4,
            width: 1,
        };
        // Unused slots point one past the pool (the NaN page).
        assert_eq!(b.flat_table(), (vec![0, 3, 6, 1, 6, 6, 2, 4, 5], 3));
    }
}
