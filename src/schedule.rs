//! The serving schedule: how the T tokens of a run are fed through the fused path.
//!
//! Prefill the first `prompt_len` tokens in chunks of `chunk`, then `decode_steps` steps of `q_len` query
//! tokens each. Cache rows live in pages of `page_size` rows, addressed through a (shuffled) block table;
//! pages not owned by the sequence are poisoned with NaN. Decode attends over the cache with
//! `num_splits`-way split-KV. The split partition is part of the schedule, so that the reference can
//! compute the same split partials exactly.

use crate::error::{Error, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Tokens processed by prefill.
    pub prompt_len: usize,
    /// Prefill chunk size (a later chunk attends to the earlier ones through the cache).
    pub chunk: usize,
    /// Decode steps after the prompt.
    pub decode_steps: usize,
    /// Query tokens per decode step (> 1: speculative / MTP decode).
    pub q_len: usize,
    /// Rows per cache page.
    pub page_size: usize,
    /// Split-KV ways for decode.
    pub num_splits: usize,
    /// Seed of the block-table shuffle; `None` keeps pages in order.
    pub shuffle_seed: Option<u64>,
    /// Extra pages in the pool that the sequence does not own (NaN-poisoned).
    pub spare_pages: usize,
    /// Position of the first token (rope angle offset).
    pub pos_offset: usize,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            prompt_len: 48,
            chunk: 32,
            decode_steps: 16,
            q_len: 1,
            page_size: 16,
            num_splits: 4,
            shuffle_seed: Some(7),
            spare_pages: 3,
            pos_offset: 0,
        }
    }
}

/// Most tokens in a run; also the bound of `--page-size`, `--num-splits` and the spare pages, so that no
/// product of schedule counts can overflow.
pub const MAX_TOKENS: usize = 1 << 20;
/// Positions are 32-bit signed in serving engines (llama.cpp's `llama_pos`, vLLM's int32 positions).
pub const MAX_POSITION: usize = i32::MAX as usize;

impl Schedule {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Usage(format!("schedule: {m}")));
        if self.prompt_len == 0 && self.decode_steps == 0 {
            return bad("no tokens: prompt length and decode steps are both 0");
        }
        if self.chunk == 0 {
            return bad("--chunk must be at least 1");
        }
        if self.q_len == 0 {
            return bad("decode query length must be at least 1");
        }
        if self.page_size == 0 {
            return bad("--page-size must be at least 1");
        }
        if self.num_splits == 0 {
            return bad("--num-splits must be at least 1");
        }
        // Checked: in release builds a wrapped product would pass the limit and size arrays wrongly.
        let tokens = self
            .decode_steps
            .checked_mul(self.q_len)
            .and_then(|d| d.checked_add(self.prompt_len));
        match tokens {
            Some(t) if t <= MAX_TOKENS => {}
            _ => {
                return bad(&format!(
                "more than {MAX_TOKENS} tokens (--prompt-len {} + --decode-steps {} × --q-len {})",
                self.prompt_len, self.decode_steps, self.q_len
            ))
            }
        }
        for (name, v) in [
            ("--page-size", self.page_size),
            ("--num-splits", self.num_splits),
            ("spare pages", self.spare_pages),
        ] {
            if v > MAX_TOKENS {
                return bad(&format!("{name} {v} is above the limit {MAX_TOKENS}"));
            }
        }
        if self.pos_offset > MAX_POSITION - self.total_tokens() {
            return bad(&format!(
                "--pos-offset {} + {} tokens passes position {MAX_POSITION} (engines keep positions in 32-bit ints)",
                self.pos_offset,
                self.total_tokens()
            ));
        }
        Ok(())
    }
    /// T: all tokens of the run (saturating, so that an unvalidated schedule never looks small).
    pub fn total_tokens(&self) -> usize {
        self.decode_tokens().saturating_add(self.prompt_len)
    }
    /// Number of decode tokens (the rows of decode-only stages).
    pub fn decode_tokens(&self) -> usize {
        self.decode_steps.saturating_mul(self.q_len)
    }
    /// Token ranges of the prefill chunks.
    pub fn prefill_chunks(&self) -> Vec<Range<usize>> {
        (0..self.prompt_len)
            .step_by(self.chunk)
            .map(|s| s..s + self.chunk.min(self.prompt_len - s))
            .collect()
    }
    /// Token ranges of the decode steps.
    pub fn decode_ranges(&self) -> Vec<Range<usize>> {
        (0..self.decode_steps)
            .map(|i| {
                let s = self.prompt_len + i * self.q_len;
                s..s + self.q_len
            })
            .collect()
    }
    /// Key ranges of the splits for a decode step whose keys are `0..seq_len` (vLLM's partition:
    /// `ceil(seq_len / num_splits)` keys per split; trailing splits may be empty).
    pub fn split_ranges(&self, seq_len: usize) -> Vec<Range<usize>> {
        let per = seq_len.div_ceil(self.num_splits);
        (0..self.num_splits)
            .map(|k| (k * per).min(seq_len)..((k + 1) * per).min(seq_len))
            .collect()
    }
    /// Pages the sequence owns.
    pub fn pages_needed(&self) -> usize {
        self.total_tokens().div_ceil(self.page_size)
    }
    /// The block table: logical page i of the sequence lives in physical page `table[i]` of a pool of
    /// `pages_needed() + spare_pages` pages.
    pub fn block_table(&self) -> Vec<usize> {
        let pool = self.pages_needed() + self.spare_pages;
        let mut phys: Vec<usize> = (0..pool).collect();
        if let Some(seed) = self.shuffle_seed {
            phys.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        }
        phys.truncate(self.pages_needed());
        phys
    }
    pub fn pool_pages(&self) -> usize {
        self.pages_needed() + self.spare_pages
    }
    /// Physical cache row of token `t`.
    pub fn cache_slot(&self, table: &[usize], t: usize) -> usize {
        table[t / self.page_size] * self.page_size + t % self.page_size
    }
}

/// The schedule a command line gives: each field laid over a base schedule when set (`run`, `export` and
/// `sweep` take the classic default, `Schedule::default()`, as that base).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    pub prompt_len: Option<usize>,
    pub decode_steps: Option<usize>,
    pub q_len: Option<usize>,
    pub chunk: Option<usize>,
    pub page_size: Option<usize>,
    pub num_splits: Option<usize>,
    /// Keep the block table in order instead of shuffling it.
    pub no_shuffle: bool,
    pub pos_offset: Option<usize>,
}

impl Overrides {
    /// Whether any field is set.
    pub fn given(&self) -> bool {
        let n = [
            self.prompt_len,
            self.decode_steps,
            self.q_len,
            self.chunk,
            self.page_size,
            self.num_splits,
            self.pos_offset,
        ];
        self.no_shuffle || n.iter().any(Option::is_some)
    }

    /// `base` with the set fields laid over it, checked.
    pub fn over(&self, base: Schedule) -> Result<Schedule> {
        let s = Schedule {
            prompt_len: self.prompt_len.unwrap_or(base.prompt_len),
            chunk: self.chunk.unwrap_or(base.chunk),
            decode_steps: self.decode_steps.unwrap_or(base.decode_steps),
            q_len: self.q_len.unwrap_or(base.q_len),
            page_size: self.page_size.unwrap_or(base.page_size),
            num_splits: self.num_splits.unwrap_or(base.num_splits),
            shuffle_seed: if self.no_shuffle {
                None
            } else {
                base.shuffle_seed
            },
            pos_offset: self.pos_offset.unwrap_or(base.pos_offset),
            ..base
        };
        s.validate()?;
        Ok(s)
    }

    /// The classic default with the set fields, checked.
    pub fn schedule(&self) -> Result<Schedule> {
        self.over(Schedule::default())
    }
}

/// Leading layers of a run that take the kernel-aware covering schedule when the rest take the
/// classic one ([`Split`]; `run --covering-layers`).
pub const COVERING_LAYERS: usize = 2;

/// A run whose layers do not all take one schedule (issue #39): the kernel-aware covering schedule
/// (the run's `schedule`, whose coverage the report gives) on the first selected layers, and the
/// cheaper classic schedule on the rest. The kernels a layer runs on depend on the model's dims, not on
/// the layer, so the covering layers cross every boundary class the covering schedule claims; the
/// rest are checked at the classic schedule. A layer's input is the residual stream after the earlier
/// layers at its own schedule's tokens: the classic layers' streams are recomputed over the covering
/// layers at the classic schedule (the reference, and in free mode the optimized path), uncompared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// The layers that ran the run's `schedule`, the first selected ones.
    pub covering_layers: Vec<usize>,
    /// The layers that ran `rest`: every other selected layer.
    pub rest_layers: Vec<usize>,
    /// The schedule of `rest_layers`.
    pub rest: Schedule,
}

impl Split {
    /// The split of `layers` (selected, in order) with the first `covering` on `sched` and the rest on
    /// `rest`; `None` when every layer is a covering one, or `rest` has no fewer tokens than `sched`
    /// (a split would save nothing).
    pub fn of(
        layers: &[usize],
        covering: usize,
        sched: &Schedule,
        rest: Schedule,
    ) -> Option<Split> {
        if layers.len() <= covering || rest.total_tokens() >= sched.total_tokens() {
            return None;
        }
        Some(Split {
            covering_layers: layers[..covering].to_vec(),
            rest_layers: layers[covering..].to_vec(),
            rest,
        })
    }

    /// The schedule layer `l` ran: `covering` (the run's) or the rest's.
    pub fn schedule_of<'a>(&'a self, l: usize, covering: &'a Schedule) -> &'a Schedule {
        match self.rest_layers.contains(&l) {
            true => &self.rest,
            false => covering,
        }
    }
}

/// Environment variable that overrides the memory a run may use (bytes).
pub const MEMORY_ENV: &str = "MLA_DIFF_MAX_MEMORY";

impl Schedule {
    /// Bytes the largest buffers of one layer take (the fp64 reference, the CPU mirror's cache pool and
    /// split partials, and up to three stage traces), from the schedule and the model's dims. The reference's
    /// T×T scores per head and its [H, decode, T] absorbed scores make this quadratic in T.
    pub fn peak_bytes(&self, cfg: &crate::model::MlaConfig) -> u128 {
        let n = |v: usize| v as u128;
        let (t, d) = (n(self.total_tokens()), n(self.decode_tokens()));
        let (e, h, lkv, r) = (
            n(cfg.hidden),
            n(cfg.n_head),
            n(cfg.kv_lora_rank),
            n(cfg.qk_rope),
        );
        let (p, dv, s, w) = (
            n(cfg.qk_nope),
            n(cfg.v_head_dim),
            n(self.num_splits),
            n(cfg.cache_row()),
        );
        let pool_rows = n(self.pool_pages()).saturating_mul(n(self.page_size));
        // Saturating throughout: a count that overflows u128 is "too much" all the same.
        let m = |f: &[u128]| f.iter().fold(1u128, |a, &b| a.saturating_mul(b));
        let sum = |f: &[u128]| f.iter().fold(0u128, |a, &b| a.saturating_add(b));
        let scores = sum(&[m(&[t, t]), m(&[h, d, t]), m(&[d, t])]);
        let partials = m(&[d, h, s, lkv.saturating_add(1)]);
        let trace = sum(&[
            m(&[t, sum(&[e, e, m(&[h, sum(&[p, r, dv, 1])]), lkv, r, w])]),
            m(&[d, h, 3, lkv]),
            partials,
        ]);
        let f64s = sum(&[scores, m(&[3, trace]), m(&[t, h, sum(&[p, dv])]), partials]);
        let f32s = sum(&[m(&[pool_rows, w]), partials, m(&[2, trace])]);
        sum(&[m(&[8, f64s]), m(&[4, f32s])])
    }

    /// Refuse a schedule whose buffers (`peak_bytes`) exceed the memory available: MLA_DIFF_MAX_MEMORY if
    /// set, else MemAvailable from /proc/meminfo, else 64 GiB. Called before anything large is allocated.
    pub fn check_memory(&self, cfg: &crate::model::MlaConfig) -> Result<()> {
        let need = self.peak_bytes(cfg);
        let (avail, source) = available_memory()?;
        if need > avail as u128 {
            return Err(Error::Usage(format!(
                "schedule: one layer of this run needs about {} of memory ({} tokens: the reference keeps T×T scores), more than the {} available ({source}); use fewer tokens, splits or a smaller page, or set {MEMORY_ENV}",
                gib(need),
                self.total_tokens(),
                gib(avail as u128)
            )));
        }
        Ok(())
    }
}

fn gib(b: u128) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The memory a run may use and where that number comes from.
fn available_memory() -> Result<(u64, String)> {
    if let Ok(v) = std::env::var(MEMORY_ENV) {
        return v
            .trim()
            .parse::<u64>()
            .map(|b| (b, MEMORY_ENV.to_string()))
            .map_err(|_| Error::Usage(format!("{MEMORY_ENV}={v:?} is not a byte count")));
    }
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    Ok(match avail {
        Some(kb) => (kb.saturating_mul(1024), "MemAvailable".into()),
        None => (64 << 30, "assumed; MemAvailable unknown".into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_takes_the_first_layers_and_only_when_it_saves() {
        let covering = Schedule {
            prompt_len: 131,
            chunk: 129,
            decode_steps: 2,
            q_len: 132,
            ..Schedule::default()
        };
        let s = Split::of(&[3, 5, 7, 9], 2, &covering, Schedule::default()).unwrap();
        assert_eq!((s.covering_layers, s.rest_layers), (vec![3, 5], vec![7, 9]));
        assert_eq!(s.rest, Schedule::default());
        // No layer left for the rest, or a rest no cheaper: no split.
        assert!(Split::of(&[3, 5], 2, &covering, Schedule::default()).is_none());
        assert!(Split::of(&[3, 5, 7], usize::MAX, &covering, Schedule::default()).is_none());
        let short = Schedule {
            prompt_len: 20,
            ..Schedule::default()
        };
        assert!(Split::of(&[0, 1, 2], 1, &short, Schedule::default()).is_none());
        let sp = Split::of(&[0, 1, 2], 1, &covering, Schedule::default()).unwrap();
        assert_eq!(sp.schedule_of(0, &covering), &covering);
        assert_eq!(sp.schedule_of(2, &covering), &Schedule::default());
    }
}
