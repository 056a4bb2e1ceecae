//! The stage-local view of a DSA layer (docs/dsa.md): the path attended over a selection
//! (`LayerCtx::selection`), so each of its attentions is recomputed over the same keys: the decode
//! splits and the decompressed prefill (own chunk + context, merged) are the dense view's with the
//! unselected keys left out (`local::compute_with`). A prefill in the absorbed form (CUDA's
//! `sparse_attn`, `Judging::sparse_prefill_absorbed`) is not modelled: its shared q_abs rounding moves
//! every score of a row together, which the view's per-key noise does not carry.

use crate::reference::sparse::Selection;

/// What a sparse layer's path attended over.
#[derive(Debug, Clone, Copy)]
pub struct Sparse<'a> {
    /// The selection the optimized path was given (shadow mode: the reference's; the DSA check's
    /// own-selection path: its own indexer's).
    pub selection: &'a Selection,
}
