//! Sparse MLA (DSA): each query attends only to the keys its indexer selected.
//!
//! A `Selection` holds, per query token `t`, the key tokens it keeps: the top `min(top_k, t+1)` of its
//! causal index scores (`reference::indexer`). Attention is the dense layer's with every other key
//! masked to −inf before the softmax (transformers' eager path adds the index mask to the causal mask;
//! FlashMLA's sparse kernels read the same keys through an index list). While every query sees at most
//! `top_k` keys the selection is all of them and sparse equals dense exactly.

use ndarray::Array2;
use serde::Serialize;

/// Per query token, the key tokens it attends to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Selection {
    pub top_k: usize,
    /// `keys[t]`: ascending key tokens, all `≤ t`.
    pub keys: Vec<Vec<u32>>,
    /// `[T, T]` membership, `mask[[t, j]]` ⇔ `j ∈ keys[t]` (the attention loops test it per score).
    #[serde(skip)]
    mask: Array2<bool>,
}

impl Selection {
    /// From per-query key lists (sorted here; out-of-range or non-causal keys are a caller's bug).
    pub fn new(top_k: usize, mut keys: Vec<Vec<u32>>) -> Selection {
        let t = keys.len();
        let mut mask = Array2::from_elem((t, t), false);
        for (q, ks) in keys.iter_mut().enumerate() {
            ks.sort_unstable();
            ks.dedup();
            for &j in ks.iter() {
                assert!((j as usize) <= q, "query {q} selects a future key {j}");
                mask[[q, j as usize]] = true;
            }
        }
        Selection { top_k, keys, mask }
    }

    /// Every visible key of every query (what dense attention sees).
    pub fn dense(top_k: usize, t: usize) -> Selection {
        Selection::new(top_k, (0..t).map(|q| (0..=q as u32).collect()).collect())
    }

    /// The width of the `-1`-padded index rows a sparse kernel takes for `queries`: their widest
    /// selection, at least `top_k` (the kernels' fixed row), at least 1.
    pub fn index_width(&self, queries: std::ops::Range<usize>) -> usize {
        queries
            .map(|t| self.keys[t].len())
            .max()
            .unwrap_or(0)
            .max(self.top_k)
            .max(1)
    }

    pub fn n_queries(&self) -> usize {
        self.keys.len()
    }

    /// Whether query `t` attends to key `j`.
    #[inline]
    pub fn allows(&self, t: usize, j: usize) -> bool {
        self.mask.get((t, j)).copied().unwrap_or(false)
    }

    /// The query tokens that drop at least one visible key (where sparse and dense differ).
    pub fn sparse_queries(&self) -> usize {
        self.keys
            .iter()
            .enumerate()
            .filter(|(t, k)| k.len() < t + 1)
            .count()
    }
}

/// Set the scores of the keys query `t` drops to −inf (`row`: its scores over keys `0..row.len()`).
pub fn mask_row(sel: &Selection, t: usize, row: &mut [f64]) {
    for (j, v) in row.iter_mut().enumerate() {
        if !sel.allows(t, j) {
            *v = f64::NEG_INFINITY;
        }
    }
}

/// The indices FlashMLA's sparse interface takes for one query (`indices [.., topk]` int32):
/// `page · page_size + offset` of each selected key's cache row through the block table, in key order,
/// padded to `top_k` with −1 (the only value its kernels treat as invalid).
pub fn flashmla_indices(
    keys: &[u32],
    top_k: usize,
    block_table: &[usize],
    page: usize,
) -> Vec<i32> {
    let mut out: Vec<i32> = keys
        .iter()
        .map(|&j| {
            let j = j as usize;
            (block_table[j / page] * page + j % page) as i32
        })
        .collect();
    out.resize(top_k.max(keys.len()), -1);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_selection_allows_exactly_the_causal_keys() {
        let s = Selection::dense(8, 5);
        assert_eq!(s.sparse_queries(), 0);
        for t in 0..5 {
            for j in 0..5 {
                assert_eq!(s.allows(t, j), j <= t);
            }
        }
    }

    #[test]
    fn indices_go_through_the_block_table_and_pad_with_minus_one() {
        // Page 4: logical page 0 → physical 2, 1 → 0.
        let idx = flashmla_indices(&[1, 5], 4, &[2, 0], 4);
        assert_eq!(idx, vec![9, 1, -1, -1]);
    }
}
