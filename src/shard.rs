//! `--shard i/n`: a deterministic slice of a run's work, so that n processes (a Slurm job array, a
//! Kubernetes Indexed Job, or plain processes) share it and `mla-diff merge` joins their reports into
//! exactly the report one run would have written.
//!
//! The slice is contiguous and balanced: of L items, shard i gets `i·L/n .. (i+1)·L/n` (sizes differ by
//! at most one, every item in exactly one shard, shard 0 first); the items are the selected layers.
//! How a shard runs: `run::shard`.

use crate::error::{Error, Result};
use std::ops::Range;

/// Shard `index` of `count` (0-based, as Slurm's `SLURM_ARRAY_TASK_ID` and Kubernetes'
/// `JOB_COMPLETION_INDEX` count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// Parse `--shard i/n` with 0 ≤ i < n.
    pub fn parse(spec: &str) -> Result<Shard> {
        let bad = |m: &str| Error::Usage(format!("--shard {spec:?}: {m}"));
        let (i, n) = spec
            .split_once('/')
            .ok_or_else(|| bad("expected i/n, e.g. 0/4 (shard i of n, counted from 0)"))?;
        let num = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| bad(&format!("{s:?} is not a number")))
        };
        let (index, count) = (num(i)?, num(n)?);
        if count == 0 || index >= count {
            return Err(bad("needs 0 ≤ i < n (shards are counted from 0)"));
        }
        Ok(Shard { index, count })
    }

    /// This shard's items of `len`: a contiguous, balanced range. Refused when there are fewer items
    /// than shards (a shard with nothing to do is a mistake in the job's size, not a run).
    pub fn range(&self, len: usize, what: &str) -> Result<Range<usize>> {
        if len < self.count {
            return Err(Error::Usage(format!(
                "--shard {}/{}: only {len} {what} to share among {} shards; use at most {len} shards",
                self.index, self.count, self.count
            )));
        }
        Ok(self.index * len / self.count..(self.index + 1) * len / self.count)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}
