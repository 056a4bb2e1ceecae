//! `MLA_DIFF_PROFILE=1`: where a run's time goes, per phase, summed over its layers (stderr), and how
//! far the process's peak resident set (`VmHWM`, Linux) rose while each phase ran on the run's thread.
//!
//! The reference runs on its own thread next to the optimized path, and the judges (local view and
//! comparison) on theirs next to the next layers, so their time overlaps the rest: the phases add up
//! to more than the wall time when that overlap works, and a peak reached during that overlap is
//! counted to the phase on the run's thread. Each phase also shows the process's CPU time (user +
//! system, every thread) while it ran, and so how many cores it kept busy on average.
//!
//! A sampler thread reads the resident set every 10 ms while the run loop runs, so the peak is also
//! split into anonymous memory (the heap: weights, traces) and file-backed pages (the mapped GGUF, the
//! CUDA libraries' code), and the resident set at the loop's start (libraries, CUDA context) is known.
//! Where the binary counts its allocations (`crate::alloc`), the live heap is sampled too, and its exact
//! peak reported: the resident set above it is the allocator's slack and memory allocated outside Rust
//! (the CUDA driver's).

use std::time::{Duration, Instant};

pub struct Profile {
    on: bool,
    start: Instant,
    /// The process's CPU time at `start`: a split run makes one profile per pass, so each counts its own.
    cpu0: Duration,
    /// Per phase: time, the peak RSS growth (kB) seen across it, and the process's CPU time across it.
    phases: Vec<(&'static str, Duration, u64, Duration)>,
    sampler: Option<Sampler>,
}

/// The resident set's parts, kB, from `/proc/self/status`.
#[derive(Debug, Clone, Copy, Default)]
struct Rss {
    total: u64,
    anon: u64,
    file: u64,
    shmem: u64,
}

fn rss_now() -> Option<Rss> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| -> Option<u64> {
        let l = s.lines().find(|l| l.starts_with(key))?;
        l.split_whitespace().nth(1)?.parse().ok()
    };
    Some(Rss {
        total: kb("VmRSS:")?,
        anon: kb("RssAnon:")?,
        file: kb("RssFile:")?,
        shmem: kb("RssShmem:")?,
    })
}

/// The sampler thread: the resident set at its start and at its largest sample, and the live heap at
/// both (bytes; zero where the allocator is not counted).
struct Sampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Sampled>,
}

#[derive(Default)]
struct Sampled {
    first: Rss,
    peak: Rss,
    at: Duration,
    heap_first: usize,
    heap_at_peak: usize,
}

impl Sampler {
    fn start() -> Option<Sampler> {
        let first = rss_now()?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let t0 = Instant::now();
            let heap_first = crate::alloc::live();
            let mut s = Sampled {
                first,
                peak: first,
                heap_first,
                heap_at_peak: heap_first,
                ..Default::default()
            };
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(r) = rss_now().filter(|r| r.total > s.peak.total) {
                    (s.peak, s.at, s.heap_at_peak) = (r, t0.elapsed(), crate::alloc::live());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            s
        });
        Some(Sampler { stop, thread })
    }

    fn finish(self) -> Sampled {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The process's CPU time so far, user + system, all threads (zero where unreadable).
pub fn cpu_time() -> Duration {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// The process's peak resident set so far, kB (`None` off Linux or when unreadable).
pub fn peak_rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

impl Profile {
    /// On when `MLA_DIFF_PROFILE` is set to anything but empty or `0`.
    pub fn from_env() -> Profile {
        Profile::new(std::env::var("MLA_DIFF_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
    }

    fn new(on: bool) -> Profile {
        Profile {
            on,
            start: Instant::now(),
            cpu0: match on {
                true => cpu_time(),
                false => Duration::ZERO,
            },
            phases: Vec::new(),
            sampler: on.then(Sampler::start).flatten(),
        }
    }

    /// The process's CPU time since this profile started.
    fn loop_cpu(&self) -> Duration {
        cpu_time().saturating_sub(self.cpu0)
    }

    /// `d` of wall time (measured elsewhere: no CPU time) to `phase`.
    pub fn add(&mut self, phase: &'static str, d: Duration) {
        self.add_peak(phase, d, 0, Duration::ZERO);
    }

    fn add_peak(&mut self, phase: &'static str, d: Duration, kb: u64, cpu: Duration) {
        match self.phases.iter_mut().find(|(p, ..)| *p == phase) {
            Some((_, t, k, c)) => {
                *t += d;
                *k += kb;
                *c += cpu;
            }
            None => self.phases.push((phase, d, kb, cpu)),
        }
    }

    /// Run `f`, adding its time (and, when on, the peak RSS growth across it) to `phase`.
    pub fn time<T>(&mut self, phase: &'static str, f: impl FnOnce() -> T) -> T {
        let peak = || match self.on {
            true => peak_rss_kb().unwrap_or(0),
            false => 0,
        };
        let cpu = || match self.on {
            true => cpu_time(),
            false => Duration::ZERO,
        };
        let (t0, p0, c0) = (Instant::now(), peak(), cpu());
        let r = f();
        let grew = peak().saturating_sub(p0);
        let used = cpu().saturating_sub(c0);
        self.add_peak(phase, t0.elapsed(), grew, used);
        r
    }

    /// The end of the run: the table on stderr, when on. Called once the run loop is through, so that
    /// a run ending early (an error, a panic) prints no partial table; [`Drop`] then only stops the
    /// sampler.
    pub fn finish(mut self) {
        if !self.on {
            return;
        }
        let sampled = self.sampler.take().map(Sampler::finish);
        let wall = self.start.elapsed().as_secs_f64();
        eprintln!(
            "mla-diff: profile (seconds, summed over layers; the reference overlaps the rest; process CPU seconds and cores busy while the phase ran; peak RSS growth)"
        );
        for (p, d, kb, c) in &self.phases {
            let s = d.as_secs_f64();
            let mb = match kb {
                0 => String::new(),
                kb => format!("  +{} MB", kb / 1024),
            };
            let cpu = match c.is_zero() {
                true => String::new(),
                false => format!(
                    "  cpu {:>8.2} ({:.1} cores)",
                    c.as_secs_f64(),
                    c.as_secs_f64() / s.max(1e-9)
                ),
            };
            eprintln!(
                "  {p:<28} {s:>9.2}  {:>5.1}%{cpu}{mb}",
                100.0 * s / wall.max(1e-9)
            );
        }
        let peak = peak_rss_kb().map_or(String::new(), |kb| format!("  peak RSS {} MB", kb / 1024));
        let cpu = self.loop_cpu().as_secs_f64();
        eprintln!(
            "  {:<28} {wall:>9.2}  cpu {cpu:>8.2} ({:.1} cores){peak}",
            "wall (run loop)",
            cpu / wall.max(1e-9)
        );
        if let Some(s) = sampled {
            let mb = |kb: u64| kb / 1024;
            eprintln!(
                "  resident set, MB (sampled every 10 ms): at the loop's start {} (anon {}, file {}, shmem {}); largest sample {} (anon {}, file {}, shmem {}) at {:.1} s",
                mb(s.first.total),
                mb(s.first.anon),
                mb(s.first.file),
                mb(s.first.shmem),
                mb(s.peak.total),
                mb(s.peak.anon),
                mb(s.peak.file),
                mb(s.peak.shmem),
                s.at.as_secs_f64()
            );
            if crate::alloc::installed() {
                let mb = |b: usize| b >> 20;
                eprintln!(
                    "  live heap, MB (counted): at the loop's start {}; at the largest resident sample {}; peak {}",
                    mb(s.heap_first),
                    mb(s.heap_at_peak),
                    mb(crate::alloc::peak())
                );
            }
        }
    }
}

impl Drop for Profile {
    /// A run that ends early (an error) stops its sampler too.
    fn drop(&mut self) {
        if let Some(s) = &self.sampler {
            s.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A profile made after the process has worked counts only its own CPU time (a split run's second
    /// pass once printed the whole process's, and cores busy from it).
    #[test]
    fn the_loop_counts_its_own_cpu_time() {
        let mut x = 0u64;
        while cpu_time() < Duration::from_millis(150) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let p = Profile::new(true);
        let before = cpu_time();
        assert!(before >= Duration::from_millis(100), "{before:?}");
        assert!(
            p.loop_cpu() < before / 2,
            "{:?} of {before:?}",
            p.loop_cpu()
        );
    }
}
