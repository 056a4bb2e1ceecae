//! Integer bisection for the smallest failing length: pure functions over a predicate, so that the
//! logic is tested without running a model.

use serde::Serialize;

/// The pass→fail gap a sweep bisects: the smallest failing length tried and the largest passing length
/// below it, when lengths lie untried between them. `None` when nothing failed, when the smallest
/// failure is the first length tried (no passing length below it) or when the two are adjacent (the
/// smallest failing length is then already exact).
pub fn gap(tried: &[(usize, bool)]) -> Option<(usize, usize)> {
    let fail = tried
        .iter()
        .filter(|(_, pass)| !pass)
        .map(|(l, _)| *l)
        .min()?;
    let pass = tried
        .iter()
        .filter(|(l, pass)| *pass && *l < fail)
        .map(|(l, _)| *l)
        .max()?;
    (fail - pass > 1).then_some((pass, fail))
}

/// A bisection between a passing and a failing length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bisection {
    /// The largest passing length below the failure, as found by the sweep.
    pub pass: usize,
    /// The smallest failing length the sweep found.
    pub fail: usize,
    /// The smallest failing length in `pass..=fail` under the bisection's assumption (one pass→fail
    /// transition in the gap; with several it is one of them, still a failing length next to a passing
    /// one).
    pub smallest_failing: usize,
    /// The lengths run, in order, with whether each passed.
    pub probes: Vec<(usize, bool)>,
}

/// Bisect `(pass, fail)`: `passes(l)` runs length `l`. Takes `ceil(log2(fail − pass))` probes; ends
/// with `smallest_failing − 1` passing and `smallest_failing` failing.
pub fn bisect<E>(
    pass: usize,
    fail: usize,
    mut passes: impl FnMut(usize) -> Result<bool, E>,
) -> Result<Bisection, E> {
    assert!(pass < fail, "bisect needs pass < fail ({pass}, {fail})");
    let (mut lo, mut hi) = (pass, fail);
    let mut probes = Vec::new();
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let ok = passes(mid)?;
        probes.push((mid, ok));
        if ok {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Bisection {
        pass,
        fail,
        smallest_failing: hi,
        probes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    fn threshold(t: usize) -> impl FnMut(usize) -> Result<bool, Infallible> {
        move |l| Ok(l < t)
    }

    #[test]
    fn finds_every_threshold_in_the_gap_in_log_probes() {
        for (pass, fail) in [(16, 28), (1, 2), (3, 1000), (100, 101), (0, 7)] {
            for t in pass + 1..=fail {
                let b = bisect(pass, fail, threshold(t)).unwrap();
                assert_eq!(b.smallest_failing, t, "gap ({pass}, {fail}), threshold {t}");
                let bound = (usize::BITS - (fail - pass - 1).leading_zeros()) as usize;
                assert!(b.probes.len() <= bound, "{} probes", b.probes.len());
                assert!(b.probes.iter().all(|&(l, ok)| ok == (l < t)));
            }
        }
    }

    #[test]
    fn adjacent_lengths_need_no_probe() {
        let b = bisect(16, 17, |_| -> Result<bool, Infallible> {
            panic!("no probe")
        })
        .unwrap();
        assert_eq!((b.smallest_failing, b.probes.len()), (17, 0));
    }

    #[test]
    fn errors_stop_the_bisection() {
        let r = bisect(0, 100, |l| if l < 40 { Ok(true) } else { Err(l) });
        assert_eq!(r, Err(50));
    }

    #[test]
    fn non_monotone_failures_still_end_at_a_transition() {
        // Fails on 20..25 and from 30: the bisection ends next to a passing length, at a failing one.
        let fails = |l: usize| (20..25).contains(&l) || l >= 30;
        let b = bisect(10, 40, |l| Ok::<_, Infallible>(!fails(l))).unwrap();
        assert!(fails(b.smallest_failing) && !fails(b.smallest_failing - 1));
    }

    #[test]
    fn the_gap_is_below_the_smallest_failure() {
        let t = |v: &[(usize, bool)]| gap(v);
        assert_eq!(
            t(&[(4, true), (16, true), (28, false), (40, false)]),
            Some((16, 28))
        );
        // Failures out of order, a pass above them: the smallest failure and the pass below it.
        assert_eq!(
            t(&[(40, false), (4, true), (50, true), (28, false)]),
            Some((4, 28))
        );
        assert_eq!(t(&[(4, true), (5, false)]), None, "adjacent: exact");
        assert_eq!(t(&[(4, false), (16, true)]), None, "no pass below");
        assert_eq!(t(&[(4, true), (16, true)]), None, "nothing fails");
        assert_eq!(t(&[]), None);
    }
}
