//! A decode runner's batches aimed at the production variants its run's own launches miss (issue #35,
//! item 2; `backend::serving::aims`, which the CPU mirror and CUDA run too): each at its launch's head
//! slice, page, split count and queries per step, over `crate::batch::variant`'s requests, within what
//! the runner `supports`, judged as its serving batch is (`variant_batch` in `runner_checks`). An aim
//! outside its `supports` is skipped, and the coverage section says which and why.

use super::batch::Batch;
use super::decode::Entry;
use super::protocol::SplitPartition;
use super::RunnerBackend;
use crate::backend::serving::{aims, sparse_aim, Aim};
use crate::backend::LayerCtx;
use crate::error::Result;
use crate::tiles::variants::SPARSE_ID;

impl RunnerBackend {
    /// The batches aimed at this layer's missed variants (once per layer, with the serving batch).
    pub(super) fn aimed_checks(
        &mut self,
        ctx: &LayerCtx,
        q_abs: &[f64],
        q_pe: &[f64],
        rows: &[f64],
    ) -> Result<()> {
        for aim in aims(ctx.cfg, ctx.sched) {
            if let Some(why) = self.aim_outside(&aim, ctx) {
                self.aims_skipped.insert(aim.id.clone(), why);
                continue;
            }
            let (cfg, sched) = aim.frame(ctx.cfg, ctx.sched);
            let framed = LayerCtx {
                cfg: &cfg,
                sched: &sched,
                ..*ctx
            };
            let reqs = crate::batch::variant(&sched, aim.launch.n_keys, sched.page_size);
            if reqs.is_empty() {
                continue;
            }
            let (h, hs, lkv, r) = (ctx.cfg.n_head, cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope);
            let (t, d, s_q) = (
                sched.total_tokens(),
                sched.decode_tokens(),
                aim.launch.q_len,
            );
            // Request q's s_q queries from decode token `first` on, heads 0..hs (rank 0's slice).
            let heads = |src: &[f64], w: usize, first: usize| -> Vec<f64> {
                (first..first + s_q)
                    .flat_map(|i| src[i * h * w..i * h * w + hs * w].iter().copied())
                    .collect()
            };
            let entries: Vec<Entry> = reqs
                .iter()
                .map(|q| {
                    let first = q.query.min(d - s_q);
                    Entry {
                        q_nope: heads(q_abs, lkv, first),
                        q_pe: heads(q_pe, r, first),
                        keys: (0..q.seq_len).map(|j| Some(j % t)).collect(),
                    }
                })
                .collect();
            let lens: Vec<String> = reqs.iter().map(|q| q.seq_len.to_string()).collect();
            let scope = format!(
                "{}; {} requests of {} keys",
                aim.label_of(h),
                reqs.len(),
                lens.join(", ")
            );
            let ret = self.send_decode(&framed, &entries, s_q, rows)?;
            let own = self.desc.decode_partition() == SplitPartition::Own;
            let b = Batch {
                ctx: &framed,
                rows,
                reqs,
                entries,
                ret,
                own,
                scope,
                s_q,
            };
            let checks = self.vs_fp64(&b, "variant_batch");
            if !checks.is_empty() && !self.aims_run.contains(&aim.id) {
                self.aims_run.push(aim.id.clone());
            }
            self.checks.extend(checks);
        }
        if sparse_aim(ctx).is_some() {
            self.aims_skipped.insert(
                SPARSE_ID.into(),
                "the sparse kernel's batch is our own (a runner's sparse_decode runs past top_k)"
                    .into(),
            );
        }
        Ok(())
    }

    /// Why the runner cannot take `aim`'s launch (`supports`), or `None`.
    fn aim_outside(&self, aim: &Aim, ctx: &LayerCtx) -> Option<String> {
        let (l, s) = (&aim.launch, &self.desc.supports);
        if s.page_sizes.as_ref().is_some_and(|p| !p.contains(&l.page)) {
            return Some(format!("page {} not in supports.page_sizes", l.page));
        }
        if s.heads.as_ref().is_some_and(|h| !h.contains(&l.heads)) {
            return Some(format!("{} heads not in supports.heads", l.heads));
        }
        if s.max_q_len.is_some_and(|m| l.q_len > m) {
            return Some(format!("q_len {} above supports.max_q_len", l.q_len));
        }
        if l.q_len > ctx.sched.decode_tokens() {
            return Some(format!("q_len {} above the run's decode tokens", l.q_len));
        }
        None
    }

    /// What the coverage section says of the aims: each skipped one and why (the ones run are
    /// `aimed_variants`, listed reached).
    pub(super) fn aim_notes(&self) -> Vec<String> {
        let split = match self.desc.decode_partition() {
            SplitPartition::Own => {
                " (its split count is its own: the aims' split counts were sent as num_splits only)"
            }
            _ => "",
        };
        let mut v: Vec<String> = self
            .aims_skipped
            .iter()
            .filter(|(id, _)| !self.aims_run.contains(id))
            .map(|(id, why)| {
                format!(
                    "coverage: runner {}: the batch aimed at {id} was not run: {why}",
                    self.desc.name
                )
            })
            .collect();
        if !self.aims_run.is_empty() && !split.is_empty() {
            v.push(format!(
                "coverage: runner {} ran batches aimed at {}{split}",
                self.desc.name,
                self.aims_run.join(", ")
            ));
        }
        v
    }
}
