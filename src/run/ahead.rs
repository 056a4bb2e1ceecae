//! The next layer's weights read and dequantized on a thread of their own while the run loop finishes
//! the current layer (#39).
//!
//! A layer's load does not need the residual stream, only the file: nothing orders it after the
//! previous layer but memory. By default the next layer is started once the current one's weights are
//! let go (`Ahead::Tail`): its load then overlaps the loop's tail (the oldest judge collected, the
//! judge spawned, the freed memory handed back), and only one layer's weights are alive at a time, as
//! before; what may be alive beside the load in addition is one more judge of a classic layer (its
//! traces: tens of MB at GLM-5's dims). `MLA_DIFF_LOAD_AHEAD=layer` starts it as soon as the current
//! layer is loaded (`Ahead::Layer`): the load then overlaps the whole layer, for one more layer's
//! weights alive (0.66 GB at GLM-5's dims: over #39's 3 GB on the CUDA host, so a measurement, not
//! the default). A layer that runs alone (`footprint.rs`) keeps its strict order: nothing is read
//! ahead of it or beside it. Every layer is loaded by the same code from the same file either way, and
//! the rest of the loop is unchanged, so the reports are the same byte for byte.

use super::layers::load_layer;
use super::profile::Profile;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::{LayerWeights, MlaConfig};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

/// When the next layer's load starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum When {
    /// Once the current layer's weights are let go.
    Tail,
    /// As soon as the current layer is loaded (two layers' weights alive).
    Layer,
}

impl When {
    /// `MLA_DIFF_LOAD_AHEAD=layer` for [`When::Layer`]; [`When::Tail`] otherwise.
    pub(super) fn from_env() -> When {
        match std::env::var("MLA_DIFF_LOAD_AHEAD").as_deref() {
            Ok("layer") => When::Layer,
            _ => When::Tail,
        }
    }
}

type Loaded = (Result<LayerWeights>, Duration);

/// The next layer's load in flight, if one was started.
pub(super) struct Ahead<'scope> {
    pub(super) when: When,
    next: Option<(usize, ScopedJoinHandle<'scope, Loaded>)>,
}

impl<'scope> Ahead<'scope> {
    pub(super) fn new(when: When) -> Ahead<'scope> {
        Ahead { when, next: None }
    }

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
            _ => load_layer(file, cfg, l),
        };
        prof.add("load + dequantize", took);
        w
    }

    /// Start layer `next`'s load (if there is a next layer) on a thread of `scope`, if `at` is when
    /// loads start and the layers do not run alone.
    pub(super) fn start<'env>(
        &mut self,
        at: When,
        alone: bool,
        next: Option<usize>,
        scope: &'scope Scope<'scope, 'env>,
        (file, cfg): (&'env GgufFile, &'env MlaConfig),
    ) {
        if let Some(n) = next.filter(|_| at == self.when && !alone && self.next.is_none()) {
            self.next = Some((n, scope.spawn(move || load_layer(file, cfg, n))));
        }
    }
}
