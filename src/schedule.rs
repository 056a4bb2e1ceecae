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
        if self.total_tokens() > 1 << 20 {
            return bad("more than 1M tokens");
        }
        Ok(())
    }
    /// T: all tokens of the run.
    pub fn total_tokens(&self) -> usize {
        self.prompt_len + self.decode_steps * self.q_len
    }
    /// Number of decode tokens (the rows of decode-only stages).
    pub fn decode_tokens(&self) -> usize {
        self.decode_steps * self.q_len
    }
    /// Token ranges of the prefill chunks.
    pub fn prefill_chunks(&self) -> Vec<Range<usize>> {
        (0..self.prompt_len)
            .step_by(self.chunk)
            .map(|s| s..(s + self.chunk).min(self.prompt_len))
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
