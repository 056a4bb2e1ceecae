//! Which sequence lengths a sweep runs: every boundary of the schedule and of the kernel in use, with
//! the length just before and just after it, inside a range, plus the lengths the user asks for.
//!
//! A length `L` is the run's total tokens: prompt `P = L − D·q` (D decode steps of q tokens, as in the
//! schedule) and the decode steps after it; the last decode step sees `L` keys. A loop over keys changes
//! shape where a key count crosses a multiple of a period, so each boundary is a period on one of three
//! counts:
//!
//! - `L` itself: the page size (the cache end crosses a page);
//! - the prompt `P`: the prefill chunk (a full or partial last chunk) and the prefill kernel's key tiles
//!   (a chunk's keys, counted from its start);
//! - the keys per decode split of the last step, `ceil(L / S)` with S splits (`Schedule::split_ranges`):
//!   the decode kernel's key tiles and per-warp key slices, counted from each split's start. For a per-
//!   split count b the lengths are `S·b − 1` (b keys per split, the last split one short), `S·b` (every
//!   split exactly b) and `S·b + 1` (b + 1 per split).
//!
//! For a period p on `L` or `P` the lengths are each multiple `m·p` and `m·p ± 1`.

use crate::backend::KeyTiles;
use crate::error::{Error, Result};
use crate::schedule::Schedule;
use serde::Serialize;
use std::collections::BTreeMap;
use std::ops::RangeInclusive;

/// The count a boundary's period applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Count {
    /// L, the run's tokens.
    Total,
    /// P = L − decode tokens.
    Prompt,
    /// ceil(L / num_splits): the keys of each split of the last decode step.
    SplitKeys,
}

impl Count {
    fn symbol(self) -> &'static str {
        match self {
            Count::Total => "L",
            Count::Prompt => "P",
            Count::SplitKeys => "keys/split",
        }
    }
}

/// A family of boundaries: every multiple of `period` of one count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Boundary {
    /// What it is ("page", "chunk", "prefill flash tile", …; names of one period and count joined by
    /// " / ").
    pub name: String,
    pub count: Count,
    pub period: usize,
}

impl Boundary {
    fn new(name: impl Into<String>, count: Count, period: usize) -> Boundary {
        Boundary {
            name: name.into(),
            count,
            period,
        }
    }
    /// The run length at which its count is `c`, for a schedule's decode tokens and splits.
    fn length_at(&self, c: usize, decode: usize, splits: usize) -> Option<usize> {
        match self.count {
            Count::Total => Some(c),
            Count::Prompt => c.checked_add(decode),
            Count::SplitKeys => c.checked_mul(splits),
        }
    }
    /// Its span in run lengths: the distance between two of its multiples.
    fn span(&self, splits: usize) -> usize {
        match self.count {
            Count::SplitKeys => self.period.saturating_mul(splits),
            _ => self.period,
        }
    }
}

impl std::fmt::Display for Boundary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.name, self.period, self.count.symbol())
    }
}

/// The boundaries of a schedule on a backend with `tiles` (`Judging::key_tiles`) and the user's extra
/// tile sizes (`--tiles`, for a kernel mla-diff cannot see, such as an external runner's). A period of 1
/// would make every length a boundary and says nothing: left out. Same period on the same count: one
/// boundary, names joined.
pub fn boundaries(sched: &Schedule, tiles: &KeyTiles, extra: &[usize]) -> Vec<Boundary> {
    let mut v = vec![
        Boundary::new("page", Count::Total, sched.page_size),
        Boundary::new("chunk", Count::Prompt, sched.chunk),
    ];
    for t in &tiles.prefill {
        v.push(Boundary::new(
            format!("prefill {}", t.name),
            Count::Prompt,
            t.keys,
        ));
    }
    if sched.decode_steps > 0 {
        for t in &tiles.decode {
            v.push(Boundary::new(
                format!("decode {}", t.name),
                Count::SplitKeys,
                t.keys,
            ));
        }
    }
    for &k in extra {
        v.push(Boundary::new("--tiles", Count::Prompt, k));
        if sched.decode_steps > 0 {
            v.push(Boundary::new("--tiles", Count::SplitKeys, k));
        }
    }
    let mut out: Vec<Boundary> = Vec::new();
    for b in v.into_iter().filter(|b| b.period > 1) {
        match out
            .iter_mut()
            .find(|o| o.count == b.count && o.period == b.period)
        {
            Some(o) if !o.name.split(" / ").any(|n| n == b.name) => {
                o.name = format!("{} / {}", o.name, b.name)
            }
            Some(_) => {}
            None => out.push(b),
        }
    }
    out
}

/// The smallest length a schedule takes: its decode tokens (prompt 0), and at least 1.
pub fn min_length(sched: &Schedule) -> usize {
    sched.decode_tokens().max(1)
}

/// The schedule for length `l`: `sched` with the prompt that makes `l` tokens.
pub fn schedule_at(sched: &Schedule, l: usize) -> Result<Schedule> {
    let d = sched.decode_tokens();
    let prompt_len = l.checked_sub(d).filter(|_| l >= 1).ok_or_else(|| {
        Error::Usage(format!(
            "length {l} is shorter than the schedule's {d} decode tokens (--decode-steps {} × --q-len {}); lengths start at {}",
            sched.decode_steps,
            sched.q_len,
            min_length(sched)
        ))
    })?;
    let s = Schedule {
        prompt_len,
        ..sched.clone()
    };
    s.validate()?;
    Ok(s)
}

/// Default upper end of the range: every boundary crossed at least twice past the smallest length.
pub fn default_max(sched: &Schedule, bounds: &[Boundary]) -> usize {
    let span = bounds
        .iter()
        .map(|b| b.span(sched.num_splits))
        .max()
        .unwrap_or(1);
    min_length(sched)
        .saturating_add(span.saturating_mul(2))
        .saturating_add(1)
}

/// Each boundary's lengths inside `range`, with where each comes from ("page L=32+1").
pub fn boundary_lengths(
    sched: &Schedule,
    bounds: &[Boundary],
    range: &RangeInclusive<usize>,
) -> BTreeMap<usize, Vec<String>> {
    let (d, s) = (sched.decode_tokens(), sched.num_splits);
    let mut out: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for b in bounds {
        for m in 1usize.. {
            let Some(c) = m.checked_mul(b.period) else {
                break;
            };
            let Some(at) = b.length_at(c, d, s) else {
                break;
            };
            if at > range.end().saturating_add(1) {
                break;
            }
            for (l, off) in [
                (at.checked_sub(1), "-1"),
                (Some(at), ""),
                (at.checked_add(1), "+1"),
            ] {
                let Some(l) = l.filter(|l| range.contains(l)) else {
                    continue;
                };
                let origin = match b.count {
                    Count::SplitKeys => format!("{} L={s}x{c}{off}", b.name),
                    count => format!("{} {}={c}{off}", b.name, count.symbol()),
                };
                out.entry(l).or_default().push(origin);
            }
        }
    }
    out
}

/// The user's `--lengths`: a comma list of `N`, `A..B` (half-open) or `A..=B`, a range optionally with
/// `:STEP` (every STEP-th length from A). Returns the lengths it names and the range they span.
pub fn parse_lengths(spec: &str) -> Result<(Vec<usize>, RangeInclusive<usize>)> {
    let bad = |m: String| Error::Usage(format!("--lengths {spec:?}: {m}"));
    let num = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| bad(format!("{s:?} is not a length")))
    };
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let (range, step) = match part.split_once(':') {
            Some((r, st)) => (r, Some(num(st)?)),
            None => (part, None),
        };
        if step == Some(0) {
            return Err(bad("a step must be at least 1".into()));
        }
        let (a, b) = if let Some((a, b)) = range.split_once("..=") {
            (num(a)?, num(b)?)
        } else if let Some((a, b)) = range.split_once("..") {
            let (a, b) = (num(a)?, num(b)?);
            if b <= a {
                return Err(bad(format!("{range} is empty")));
            }
            (a, b - 1)
        } else if step.is_some() {
            return Err(bad(format!("a step needs a range: {part}")));
        } else {
            let n = num(range)?;
            (n, n)
        };
        if b < a {
            return Err(bad(format!("{range} is empty")));
        }
        if b > crate::schedule::MAX_TOKENS {
            return Err(bad(format!(
                "{b} is above the limit of {} tokens",
                crate::schedule::MAX_TOKENS
            )));
        }
        out.push(a);
        out.extend((a..=b).step_by(step.unwrap_or(b - a + 1).max(1)));
        out.push(b);
    }
    out.sort_unstable();
    out.dedup();
    let range = out[0]..=*out.last().expect("one length at least");
    Ok((out, range))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::KeyTile;

    fn sched(decode_steps: usize, page: usize, splits: usize) -> Schedule {
        Schedule {
            decode_steps,
            page_size: page,
            num_splits: splits,
            chunk: 32,
            ..Schedule::default()
        }
    }

    fn tiles(prefill: usize, decode: &[usize]) -> KeyTiles {
        KeyTiles {
            prefill: vec![KeyTile::new("flash tile", prefill)],
            decode: decode
                .iter()
                .map(|&k| KeyTile::new(format!("tile {k}"), k))
                .collect(),
        }
    }

    #[test]
    fn each_boundary_gives_its_multiples_and_their_neighbours() {
        let s = sched(2, 16, 4);
        let b = boundaries(&s, &tiles(64, &[32]), &[]);
        let ls = boundary_lengths(&s, &b, &(1..=200));
        // Pages: multiples of 16 and ±1.
        for m in 1..=12 {
            for l in [16 * m - 1, 16 * m, 16 * m + 1] {
                assert!(ls[&l].iter().any(|o| o.starts_with("page L=")), "{l}");
            }
        }
        // Chunks and prefill tiles on the prompt: L = P + 2.
        assert!(ls[&(32 + 2)].contains(&"chunk P=32".to_string()));
        assert!(ls[&(64 + 2 + 1)].contains(&"prefill flash tile P=64+1".to_string()));
        // Decode tiles on the keys per split: L = 4·32·m ± 1; every split exactly 32 keys at L = 128.
        assert!(ls[&127].contains(&"decode tile 32 L=4x32-1".to_string()));
        assert!(ls[&129].contains(&"decode tile 32 L=4x32+1".to_string()));
        assert_eq!(s.split_ranges(128).iter().map(|r| r.len()).max(), Some(32));
        assert_eq!(s.split_ranges(129).iter().map(|r| r.len()).max(), Some(33));
        // Nothing outside the range, nothing that is no boundary.
        assert!(ls.keys().all(|l| (1..=200).contains(l)));
        assert!(!ls.contains_key(&40), "40 is no boundary here");
    }

    #[test]
    fn one_period_twice_is_one_boundary_and_period_one_none() {
        // The chunk and the prefill tile both 32 on P; a page of 1 would make every length a boundary.
        let s = sched(1, 1, 2);
        let b = boundaries(&s, &tiles(32, &[32, 32]), &[32]);
        let on_p: Vec<&Boundary> = b.iter().filter(|b| b.count == Count::Prompt).collect();
        assert_eq!(on_p.len(), 1, "{b:?}");
        assert_eq!(on_p[0].name, "chunk / prefill flash tile / --tiles");
        assert!(b.iter().all(|b| b.period > 1));
        assert_eq!(
            b.iter().filter(|b| b.count == Count::SplitKeys).count(),
            1,
            "{b:?}"
        );
    }

    #[test]
    fn prefill_only_schedules_have_no_decode_boundaries() {
        let s = sched(0, 16, 4);
        let b = boundaries(&s, &tiles(64, &[64]), &[128]);
        assert!(b.iter().all(|b| b.count != Count::SplitKeys), "{b:?}");
    }

    #[test]
    fn the_default_range_crosses_every_boundary_twice() {
        let s = sched(16, 16, 4);
        let b = boundaries(&s, &tiles(64, &[64, 32]), &[]);
        let hi = default_max(&s, &b);
        assert_eq!(min_length(&s), 16);
        // The widest: 64 keys per split × 4 splits.
        assert_eq!(hi, 16 + 2 * 4 * 64 + 1);
        let ls = boundary_lengths(&s, &b, &(min_length(&s)..=hi));
        assert!(ls.contains_key(&(2 * 4 * 64 + 1)));
    }

    #[test]
    fn a_length_sets_the_prompt() {
        let s = sched(3, 16, 4);
        assert_eq!(schedule_at(&s, 10).unwrap().prompt_len, 7);
        assert_eq!(schedule_at(&s, 3).unwrap().prompt_len, 0);
        assert_eq!(schedule_at(&s, 10).unwrap().total_tokens(), 10);
        let e = schedule_at(&s, 2).unwrap_err().to_string();
        assert!(e.contains("lengths start at 3"), "{e}");
        assert!(schedule_at(&sched(0, 16, 4), 0).is_err());
    }

    #[test]
    fn lengths_parse_lists_ranges_and_steps() {
        assert_eq!(parse_lengths("5").unwrap(), (vec![5], 5..=5));
        assert_eq!(parse_lengths("10..14").unwrap(), (vec![10, 13], 10..=13));
        assert_eq!(
            parse_lengths("10..=20:5").unwrap(),
            (vec![10, 15, 20], 10..=20)
        );
        assert_eq!(
            parse_lengths("4..40:12, 100").unwrap(),
            (vec![4, 16, 28, 39, 100], 4..=100)
        );
        for bad in [
            "",
            "x",
            "10..10",
            "10..=9",
            "5:2",
            "1..9:0",
            "1..=99999999",
            "-3",
        ] {
            let e = parse_lengths(bad).unwrap_err();
            assert!(matches!(e, Error::Usage(_)), "{bad}: {e}");
        }
    }
}
