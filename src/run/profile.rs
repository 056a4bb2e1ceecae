//! `MLA_DIFF_PROFILE=1`: where a run's time goes, per phase, summed over its layers (stderr).
//!
//! The reference, then the next layer's load, run on their own thread next to the optimized path and
//! the local view, so their time overlaps theirs: the phases add up to more than the wall time when
//! that overlap works.

use std::time::{Duration, Instant};

pub struct Profile {
    on: bool,
    start: Instant,
    phases: Vec<(&'static str, Duration)>,
}

impl Profile {
    /// On when `MLA_DIFF_PROFILE` is set to anything but empty or `0`.
    pub fn from_env() -> Profile {
        let on = std::env::var("MLA_DIFF_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
        Profile {
            on,
            start: Instant::now(),
            phases: Vec::new(),
        }
    }

    pub fn add(&mut self, phase: &'static str, d: Duration) {
        match self.phases.iter_mut().find(|(p, _)| *p == phase) {
            Some((_, t)) => *t += d,
            None => self.phases.push((phase, d)),
        }
    }

    /// Run `f`, adding its time to `phase`.
    pub fn time<T>(&mut self, phase: &'static str, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let r = f();
        self.add(phase, t0.elapsed());
        r
    }

    /// The table on stderr, when on.
    pub fn print(&self) {
        if !self.on {
            return;
        }
        let wall = self.start.elapsed().as_secs_f64();
        eprintln!(
            "mla-diff: profile (seconds, summed over layers; the reference overlaps the rest)"
        );
        for (p, d) in &self.phases {
            let s = d.as_secs_f64();
            eprintln!("  {p:<28} {s:>9.2}  {:>5.1}%", 100.0 * s / wall.max(1e-9));
        }
        eprintln!("  {:<28} {wall:>9.2}", "wall (run loop)");
    }
}
