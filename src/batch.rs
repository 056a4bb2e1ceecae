//! The serving-shaped decode batch (issue #32, items 6–8): requests of mixed lengths in one batch, as a
//! serving engine batches them, next to the schedule's own decode steps (which differ by `q_len` keys
//! from one entry to the next).
//!
//! The batch is a description only (lengths and queries per request); whoever runs it builds its own
//! paged cache from it. Each request attends, with one query, over `seq_len` key rows of the run's cache:
//! the sequence's rows `0..seq_len` when the sequence is that long, else the sequence's rows repeated
//! (row `j` is row `j mod T`), so that a request may hold thousands of keys without the fp64 reference's
//! O(T²) cost. Positions do not matter to the kernel (`q_pe` arrives roped), so a request's query is one
//! of the run's decode queries (request `r` takes decode token `r mod D`). What the batch is checked
//! against is fp64 attention over exactly those rows (the `@runner` yardstick), not the model.

use crate::schedule::Schedule;
use serde::{Deserialize, Serialize};

/// Keys of the batch's long request: thousands, more than 8 tiles of 128 keys in each of 2 splits, and
/// a multiple of neither 16, 32, 64 nor 128 (every tile size ends in a partial tile).
pub const LONG: usize = 2113;

/// One request of the batch: `q_len` queries (causal within the request, as the decode op's steps)
/// over `seq_len` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub seq_len: usize,
    pub q_len: usize,
    /// Decode token whose query the request uses (its first, for `q_len > 1`).
    pub query: usize,
    /// Why it is in the batch ("one key: the other splits empty", …).
    pub why: &'static str,
}

/// The serving batch of a schedule: one query per request, mixed lengths in a mixed order: the long
/// request, one key (every split past the first empty), a request shorter than a page, the whole
/// sequence, and a request of one key more than a page. Empty when the schedule has no decode step.
pub fn serving(s: &Schedule) -> Vec<Request> {
    let d = s.decode_tokens();
    if d == 0 {
        return Vec::new();
    }
    let p = s.page_size.max(1);
    let t = s.total_tokens();
    let lens: [(usize, &'static str); 5] = [
        (LONG, "thousands of keys: splits of many tiles"),
        (1, "one key: every split past the first is empty"),
        (
            (p / 2 + 1).min(p.saturating_sub(1)).max(1),
            "shorter than a page",
        ),
        (t, "the whole sequence"),
        (p + 1, "one key past a page"),
    ];
    lens.iter()
        .enumerate()
        .map(|(r, &(seq_len, why))| Request {
            seq_len,
            q_len: 1,
            // Spread over the decode queries, last first: the last sees the most context.
            query: d - 1 - (r * 7) % d,
            why,
        })
        .collect()
}

/// The batch aimed at one production decode variant (`backend::serving::aims`, issue #35): the
/// variant's launch length `n_keys` (the longest request: a launch's kernel is chosen by its longest),
/// one key, shorter than a page, and one key past a page of `page` rows, one query each. Empty when the
/// schedule has no decode step.
pub fn variant(s: &Schedule, n_keys: usize, page: usize) -> Vec<Request> {
    let d = s.decode_tokens();
    if d == 0 {
        return Vec::new();
    }
    let p = page.max(1);
    let lens: [(usize, &'static str); 4] = [
        (n_keys, "the variant's launch length"),
        (1, "one key: every split past the first is empty"),
        (
            (p / 2 + 1).min(p.saturating_sub(1)).max(1),
            "shorter than a page",
        ),
        (p + 1, "one key past a page"),
    ];
    lens.iter()
        .enumerate()
        .map(|(r, &(seq_len, why))| Request {
            seq_len: seq_len.min(n_keys.max(1)),
            q_len: 1,
            query: d - 1 - (r * 7) % d,
            why,
        })
        .collect()
}

/// The padded entries a CUDA-graph engine appends to reach a captured batch size (vLLM PR #37442/#37815,
/// flashinfer#2883, sglang PR #19902): one of zero length, one whose query is NaN over a one-key cache
/// of NaN. Their outputs are don't-care; the real entries' must not change, bit for bit.
pub const PADDING: [(usize, &str); 2] = [(0, "zero length"), (1, "NaN query over a NaN key")];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_batch_has_the_shapes_it_promises() {
        let s = Schedule::default();
        let b = serving(&s);
        let lens: Vec<usize> = b.iter().map(|r| r.seq_len).collect();
        assert!(lens.contains(&1) && lens.contains(&LONG));
        assert!(lens.iter().any(|&l| l < s.page_size));
        // One key and 4 splits: 3 empty splits.
        let splits = s.split_ranges(1);
        assert_eq!(splits.iter().filter(|r| r.is_empty()).count(), 3);
        for r in &b {
            assert!(r.query < s.decode_tokens());
        }
        let none = Schedule {
            decode_steps: 0,
            ..Schedule::default()
        };
        assert!(serving(&none).is_empty());
    }
}
