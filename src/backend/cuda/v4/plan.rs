//! DeepSeek-V4's index arithmetic on the host: kernels/v4/v4.cuh restated (the window edge, each
//! compression window's tokens and closing token, the entries a query sees), for what the host sizes and
//! launches — the entries a forward pass closes, how many there are, the width of the top-k rows. The
//! kernels compute the same from their own copy (with the planted bugs compiled in); the tests hold both
//! to the CPU mirror's compressor state machine (`backend::cpu::v4`).

use crate::faults::{Active, Fault};
use std::ops::Range;

/// One compressor's windows: ratio `m`, with the planted bugs that move them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups {
    pub m: usize,
    /// `compress_group_off_by_one`: the groups start one token early (v4.cuh `V4_GROUP_SHIFT`).
    pub shift: usize,
    /// `compressor_state_dropped`: a forward pass pools only its own tokens (v4.cuh `v4_state_from`).
    pub state_dropped: bool,
}

impl Groups {
    pub fn new(m: usize, faults: Active) -> Groups {
        Groups {
            m,
            shift: faults.on(Fault::CompressGroupOffByOne) as usize,
            state_dropped: faults.on(Fault::CompressorStateDropped),
        }
    }

    /// The token that closes entry `w` (`v4_close`).
    pub fn close(&self, w: usize) -> usize {
        (w + 1) * self.m - 1 - self.shift
    }

    /// The first token of entry `w`'s window (`v4_first`).
    pub fn first(&self, w: usize) -> usize {
        (w * self.m).saturating_sub(self.shift)
    }

    /// Token `t`'s slot in its window (`v4_slot`).
    pub fn slot(&self, t: usize) -> usize {
        (t + self.shift) % self.m
    }

    /// The entries closed by the tokens `0..n` (`v4_visible(n − 1)`).
    pub fn closed_by(&self, n: usize) -> usize {
        (n + self.shift) / self.m
    }

    /// The entries the tokens of `pass` close.
    pub fn closed_in(&self, pass: &Range<usize>) -> Range<usize> {
        self.closed_by(pass.start)..self.closed_by(pass.end)
    }

    /// The tokens entry `w` pools when it closes in a forward pass starting at `pass_start`: CSA's
    /// previous window (its Ca half; empty for HCA and entry 0), and its own window.
    pub fn tokens(&self, w: usize, csa: bool, pass_start: usize) -> (Range<usize>, Range<usize>) {
        let lo = if self.state_dropped { pass_start } else { 0 };
        let own = self.first(w).max(lo)..self.close(w) + 1;
        let prev = match csa && w > 0 {
            true => self.first(w - 1).max(lo)..self.close(w - 1) + 1,
            false => 0..0,
        };
        // An empty range as `0..0`, whatever its bounds.
        let norm = |r: Range<usize>| if r.is_empty() { 0..0 } else { r };
        (norm(prev), norm(own))
    }
}

/// The first window row query `t` sees (`v4_window_start`): `window − 1` past rows and its own; with
/// `window_off_by_one`, `window` past rows.
pub fn window_start(t: usize, window: usize, faults: Active) -> usize {
    let past = match faults.on(Fault::WindowOffByOne) {
        true => window,
        false => window - 1,
    };
    t.saturating_sub(past)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::v4::compress_closes;

    /// The state machine of `backend::cpu::v4::compress`, restated: per pass, the tokens fed; a window
    /// closes at the token whose slot is the last; CSA pools the last closed window's tokens too; the
    /// fault drops both at a pass boundary. Each entry: (previous window's tokens, own tokens, closing
    /// token, the pass's first token), tokens with their slots.
    #[allow(clippy::type_complexity)]
    fn simulate(
        m: usize,
        shift: usize,
        dropped: bool,
        passes: &[Range<usize>],
    ) -> Vec<(Vec<(usize, usize)>, Vec<(usize, usize)>, usize, usize)> {
        let (mut pending, mut prev, mut out) = (Vec::new(), Vec::new(), Vec::new());
        for p in passes {
            if dropped {
                pending.clear();
                prev = Vec::new();
            }
            for t in p.clone() {
                let u = t + shift;
                pending.push((t, u % m));
                if u % m == m - 1 {
                    out.push((prev.clone(), pending.clone(), t, p.start));
                    prev = std::mem::take(&mut pending);
                }
            }
        }
        out
    }

    fn splits(t_len: usize) -> Vec<Vec<Range<usize>>> {
        let mut v = vec![vec![0..t_len]];
        for chunk in [1, 3, 64, 100] {
            let mut ps: Vec<Range<usize>> = (0..t_len)
                .step_by(chunk)
                .map(|a| a..(a + chunk).min(t_len))
                .collect();
            // a prompt in chunks then single decode steps
            if chunk == 64 {
                let last = ps.pop().unwrap();
                ps.extend(last.map(|t| t..t + 1));
            }
            v.push(ps);
        }
        v
    }

    /// Every entry's tokens, slots, closing token and the pass closing it, for both ratios, every split
    /// of the sequence into passes and each of the two compressor faults (and both): as the state machine.
    #[test]
    fn groups_are_the_mirror_state_machine() {
        let t_len = 300;
        for m in [4, 128] {
            for (shift, dropped) in [(0, false), (1, false), (0, true), (1, true)] {
                let mut faults = Active::NONE;
                if shift == 1 {
                    faults = faults.with(Fault::CompressGroupOffByOne);
                }
                if dropped {
                    faults = faults.with(Fault::CompressorStateDropped);
                }
                let g = Groups::new(m, faults);
                for passes in splits(t_len) {
                    let sim = simulate(m, shift, dropped, &passes);
                    assert_eq!(sim.len(), g.closed_by(t_len), "m {m} shift {shift}");
                    for (w, (prev, own, close, start)) in sim.iter().enumerate() {
                        assert_eq!(g.close(w), *close);
                        let (gp, go) = g.tokens(w, true, *start);
                        let with_slots =
                            |r: Range<usize>| r.map(|t| (t, g.slot(t))).collect::<Vec<_>>();
                        assert_eq!(&with_slots(go), own, "m {m} w {w} own");
                        assert_eq!(&with_slots(gp), prev, "m {m} w {w} prev");
                        assert!(g.tokens(w, false, *start).0.is_empty());
                    }
                    for p in &passes {
                        let closed: Vec<usize> =
                            (0..sim.len()).filter(|&w| p.contains(&sim[w].2)).collect();
                        assert_eq!(closed, g.closed_in(p).collect::<Vec<_>>());
                    }
                    // The query's visible entries: those closed at or before it.
                    for t in 0..t_len {
                        let seen = sim.iter().filter(|e| e.2 <= t).count();
                        assert_eq!(seen, g.closed_by(t + 1));
                    }
                }
            }
        }
    }

    /// The CPU mirror's own compressor closes the same entries at the same tokens.
    #[test]
    fn closing_tokens_are_the_mirrors() {
        for m in [4, 128] {
            for faults in [
                Active::NONE,
                Active::NONE.with(Fault::CompressGroupOffByOne),
                Active::NONE.with(Fault::CompressorStateDropped),
            ] {
                let g = Groups::new(m, faults);
                let passes = vec![0..70, 70..200, 200..201, 201..260];
                let closes = compress_closes(m, 260, &passes, faults);
                let want: Vec<usize> = (0..g.closed_by(260)).map(|w| g.close(w)).collect();
                assert_eq!(closes, want, "m {m}");
            }
        }
    }

    #[test]
    fn the_window_keeps_window_minus_one_past_rows() {
        assert_eq!(window_start(0, 128, Active::NONE), 0);
        assert_eq!(window_start(127, 128, Active::NONE), 0);
        assert_eq!(window_start(128, 128, Active::NONE), 1);
        let f = Active::NONE.with(Fault::WindowOffByOne);
        assert_eq!(window_start(128, 128, f), 0);
        assert_eq!(window_start(129, 128, f), 1);
    }
}
