//! The next layer's weights read and dequantized on a thread of their own while the run loop finishes
//! the current layer (#39).
//!
//! A layer's load does not need the residual stream, only the file: nothing orders it after the
//! previous layer but memory. The next layer is started once the current one's weights are let go
//! (into its buffers, which the load writes over): its load then overlaps the loop's tail (the oldest judge collected, the judge spawned, the freed
//! memory handed back), and only one layer's weights are alive at a time; what may be alive beside the
//! load in addition is one more judge of a classic layer (its traces: tens of MB at GLM-5's dims). A
//! layer's tensors load in parallel (`LayerWeights::load`), so the load is short next to that tail.
//! (Starting it as soon as the current layer was loaded instead, `MLA_DIFF_LOAD_AHEAD=layer` until
//! 2026-12-05, hid the whole load for one more layer's weights alive: 0.66 GB at GLM-5's dims, over
//! #39's 3 GB on the CUDA host; removed with the parallel load.) A layer that runs alone
//! (`footprint.rs`) keeps its strict order: nothing is read ahead of it or beside it. Every layer is
//! loaded by the same code from the same file either way, and the rest of the loop is unchanged, so
//! the reports are the same byte for byte.

use super::layers::load_layer;
use super::profile::Profile;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::{LayerWeights, MlaConfig};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

type Loaded = (Result<LayerWeights>, Duration);

/// The next layer's load in flight, if one was started.
#[derive(Default)]
pub(super) struct Ahead<'scope> {
    next: Option<(usize, ScopedJoinHandle<'scope, Loaded>)>,
}

impl<'scope> Ahead<'scope> {
    /// Layer `l`'s weights: the load started ahead for it, waited for (the wait profiled), or read now.
    /// Its own time is profiled as "load + dequantize" either way.
    pub(super) fn take(
        &mut self,
        file: &GgufFile,
        cfg: &MlaConfig,
        l: usize,
        prof: &mut Profile,
    ) -> Result<LayerWeights> {
        let (w, took) = match self.next.take() {
            Some((n, h)) if n == l => {
                let t0 = Instant::now();
                let made = h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
                prof.add("waiting for loaded weights", t0.elapsed());
                made
            }
            _ => load_layer(file, cfg, l, Vec::new()),
        };
        prof.add("load + dequantize", took);
        w
    }

    /// Let the current layer's weights `done` go, and start layer `next`'s load (if there is a next
    /// layer) on a thread of `scope`, unless the layers run alone. The load writes over `done`'s
    /// buffers (`LayerWeights::load_reusing`): the same memory, handed on instead of freed and faulted
    /// in again (a lone layer's are freed: its judge, the run's peak, runs before the next load).
    pub(super) fn start<'env>(
        &mut self,
        alone: bool,
        next: Option<usize>,
        scope: &'scope Scope<'scope, 'env>,
        (file, cfg): (&'env GgufFile, &'env MlaConfig),
        done: LayerWeights,
    ) {
        match next.filter(|_| !alone && self.next.is_none()) {
            Some(n) => {
                let spare = done.into_buffers();
                self.next = Some((n, scope.spawn(move || load_layer(file, cfg, n, spare))));
            }
            None => drop(done),
        }
    }
}
