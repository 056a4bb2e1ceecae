//! A counting global allocator over another one: live bytes and their peak, for `MLA_DIFF_PROFILE`'s
//! heap figures (the `mla-diff` binary counts over mimalloc) and for the fuzz driver, which also sets a
//! hard per-execution limit. A request past the limit is refused (null), so the process aborts with the
//! standard "memory allocation failed" message right at the offending call site, after one stderr line
//! from us naming the sizes; the supervisor records that as an over-allocation finding.
//!
//! A binary installs it: `#[global_allocator] static A: CountingAlloc = CountingAlloc(System);`.
//! The binary also installs the allocator's release hook ([`set_release`]): the library does not know
//! which allocator it runs over.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

/// Counts what goes through the allocator `A`.
pub struct CountingAlloc<A: GlobalAlloc = System>(pub A);

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Absolute cap on `LIVE` while armed (`usize::MAX` when not).
static CAP: AtomicUsize = AtomicUsize::new(usize::MAX);
static INSTALLED: AtomicBool = AtomicBool::new(false);

impl<A: GlobalAlloc> CountingAlloc<A> {
    fn admit(n: usize) -> bool {
        INSTALLED.store(true, Relaxed);
        let live = LIVE.fetch_add(n, Relaxed).saturating_add(n);
        let cap = CAP.load(Relaxed);
        if live > cap {
            LIVE.fetch_sub(n, Relaxed);
            report(n, live - n, cap);
            return false;
        }
        PEAK.fetch_max(live, Relaxed);
        true
    }
}

/// One stderr line without allocating (we are inside the allocator).
fn report(request: usize, live: usize, cap: usize) {
    let mut buf = [0u8; 160];
    let mut len = 0;
    let mut put = |s: &[u8]| {
        let n = s.len().min(buf.len() - len);
        buf[len..len + n].copy_from_slice(&s[..n]);
        len += n;
    };
    let num = |mut v: usize| {
        let mut d = [0u8; 20];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                return (d, i);
            }
        }
    };
    let (d, i) = num(request);
    put(b"fuzz: over-allocation: request of ");
    put(&d[i..]);
    let (d, i) = num(live);
    put(b" bytes with ");
    put(&d[i..]);
    let (d, i) = num(cap);
    put(b" live exceeds the cap of ");
    put(&d[i..]);
    put(b" bytes\n");
    // SAFETY: writing a stack buffer to fd 2.
    unsafe { libc::write(2, buf.as_ptr().cast(), len) };
}

impl<A: GlobalAlloc> CountingAlloc<A> {
    /// `get` (the inner allocation) counted: refused past the cap, uncounted again when it fails.
    fn counted(n: usize, get: impl FnOnce() -> *mut u8) -> *mut u8 {
        if !Self::admit(n) {
            return std::ptr::null_mut();
        }
        let p = get();
        if p.is_null() {
            LIVE.fetch_sub(n, Relaxed);
        }
        p
    }
}

unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAlloc<A> {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        Self::counted(l.size(), || self.0.alloc(l))
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        Self::counted(l.size(), || self.0.alloc_zeroed(l))
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        self.0.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Relaxed);
    }
    // Counted as the size change: the system realloc may grow in place (mremap for large blocks).
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let old = l.size();
        if new > old && !Self::admit(new - old) {
            return std::ptr::null_mut();
        }
        let q = self.0.realloc(p, l, new);
        if q.is_null() {
            if new > old {
                LIVE.fetch_sub(new - old, Relaxed);
            }
        } else if new < old {
            LIVE.fetch_sub(old - new, Relaxed);
        }
        q
    }
}

/// Whether the process allocates through `CountingAlloc` (nothing is measured otherwise).
pub fn installed() -> bool {
    drop(std::hint::black_box(Box::new(0u64)));
    INSTALLED.load(Relaxed)
}

/// Bytes live now (all threads).
pub fn live() -> usize {
    LIVE.load(Relaxed)
}

/// The largest live bytes since the start (or the last [`arm`]).
pub fn peak() -> usize {
    PEAK.load(Relaxed)
}

/// Start an execution: the peak restarts at the current live bytes, and at most `extra` more may be live.
pub fn arm(extra: usize) -> usize {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    CAP.store(base.saturating_add(extra), Relaxed);
    base
}

/// Raise (or lower) the allowance of the running execution, relative to its base.
pub fn set_allowance(base: usize, extra: usize) {
    CAP.store(base.saturating_add(extra), Relaxed);
}

/// End an execution: the limit is lifted; returns the peak bytes above `base`.
pub fn disarm(base: usize) -> usize {
    CAP.store(usize::MAX, Relaxed);
    PEAK.load(Relaxed).saturating_sub(base)
}

/// The binary's "hand this thread's freed memory back to the system" (mimalloc's `mi_collect`).
static RELEASE: OnceLock<fn()> = OnceLock::new();

/// Install the allocator's release hook, once at start-up; a later call is ignored.
pub fn set_release(f: fn()) {
    let _ = RELEASE.set(f);
}

/// The installed release hook, if any.
pub fn release_hook() -> Option<fn()> {
    RELEASE.get().copied()
}
