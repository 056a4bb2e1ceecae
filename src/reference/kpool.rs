//! glm5-next's k-pool DSA indexer in f64, as transformers 5.24.0's `Glm5NextTextIndexer` computes it
//! (docs/dsa.md, "glm5-next"):
//!
//! - `q = W_q_b · q_lora_latent` per head, `k = LayerNorm(W_k · attn_in) · k_norm + k_norm_bias` (eps
//!   1e-6), `w = W_proj · attn_in · Hi^-0.5` — GLM-5's indexer without rope (glm5-next is NoPE);
//! - gate scores `g = attn_in · gateᵀ` (`[T, Di]`);
//! - pools of `kpool` consecutive tokens from the first real token (token 0 here: mla-diff's sequences
//!   are unpadded); a pool is complete when all its tokens exist;
//! - per pool and channel `c`, a softmax over the pool's slots `s` of `g[tok_s, c] + ape[s, c]`, and the
//!   pool key `K[p, c] = Σ_s prob[s, c] · k[tok_s, c]`;
//! - pool score `S[t, p] = Σ_h w[t, h] · ReLU(q[t, h] · K[p] · Di^-0.5)`;
//! - a pool is a candidate of query `t` when its last token is `≤ t`; the top `min(top_k / kpool, n)`
//!   candidates (ties to the lower pool) are expanded to their tokens;
//! - with `select_tail`, the visible tail past the last complete pool (`t + 1 − (t + 1) mod kpool ..= t`)
//!   is appended.
//!
//! While `t + 1 ≤ top_k` every visible pool is chosen and, with the tail, every key: dense exactly.
//! transformers computes the pool softmax and the scores in float32 (`.float()`); that is precision (the
//! selection's near-ties), not semantics.

use super::front::linear;
use super::sparse::Selection;
use crate::model::MlaConfig;
use crate::model::{KpoolIndexer, KpoolLayer, KpoolWeights, LayerWeights};
use ndarray::{s, Array2, Array3, ArrayView2};

/// Deliberate misreadings of the k-pool indexer (the golden test shows each moves the output).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reading {
    /// The per-slot APE left out of the pool softmax.
    pub no_ape: bool,
    /// The pool softmax over the channels of each slot instead of over the slots of each channel.
    pub softmax_over_channels: bool,
    /// The visible tail past the last complete pool not appended (`select_tail` ignored).
    pub no_tail: bool,
    /// Pool boundaries counted from slot 0 of a batch left-padded by this many tokens instead of from
    /// the first real token (transformers' `first_key`): the grid starts `pad` tokens early, and pools
    /// reaching into the padding are incomplete. 0: the model.
    pub pools_from_slot_zero: usize,
}

/// The k-pool indexer's tensors and result for one layer.
#[derive(Debug, Clone)]
pub struct KpoolOut {
    /// `[T, Hi, Di]`
    pub q: Array3<f64>,
    /// `[T, Di]`, normed.
    pub k: Array2<f64>,
    /// `[T, Di]`: LayerNorm's input `W_k · attn_in` and its gain (`reference::indexer::IndexerOut`).
    pub k_lin: Array2<f64>,
    pub k_gain: Array2<f64>,
    /// `[T, Hi]`, scaled by `Hi^-0.5`.
    pub weights: Array2<f64>,
    /// `[T, Hi]`: `Σ_m (W_proj[h, m]·attn_in[t, m])²`, scaled alike (the noise model's).
    pub weights_sq: Array2<f64>,
    /// The hidden size E and the q-LoRA rank (the noise model's f32 sums over them).
    pub in_dims: (usize, usize),
    /// `[T, Di]`: the gate scores `attn_in · gateᵀ`, and `Σ_m (gate[c, m]·attn_in[t, m])²`.
    pub gate: Array2<f64>,
    pub gate_sq: Array2<f64>,
    /// `[n_pools, kpool, Di]`: the pool softmax, per pool, slot and channel.
    pub probs: Array3<f64>,
    /// The complete pools' first tokens, one per pool key.
    pub pool_start: Vec<usize>,
    /// `[n_pools, Di]`
    pub pool_keys: Array2<f64>,
    /// `[T, n_pools]`, over all pools (`select` keeps each query's candidates).
    pub pool_scores: Array2<f64>,
    /// Per query, the chosen pools (indices into `pool_start`), best first.
    pub pools: Vec<Vec<u32>>,
    pub selection: Selection,
}

/// The pool keys of complete pools: per channel, the softmax over the pool's slots of gate + APE
/// weighs the slots' keys. `start[p]` is pool `p`'s first token.
pub fn pool_keys(
    k: &Array2<f64>,
    gate: &Array2<f64>,
    pw: &KpoolWeights,
    start: &[usize],
    r: Reading,
) -> Array2<f64> {
    weigh(k, &pool_probs(gate, pw, start, r), start)
}

/// The pool softmax `[n_pools, kpool, Di]`: per pool and channel over its slots (over the channels of
/// each slot under the misreading), of gate + APE.
pub fn pool_probs(
    gate: &Array2<f64>,
    pw: &KpoolWeights,
    start: &[usize],
    r: Reading,
) -> Array3<f64> {
    let (kpool, di) = pw.ape.dim();
    let mut out = Array3::zeros((start.len(), kpool, di));
    let mut logit = Array2::<f64>::zeros((kpool, di));
    for (p, &s0) in start.iter().enumerate() {
        for s in 0..kpool {
            for c in 0..di {
                let ape = if r.no_ape { 0.0 } else { pw.ape[[s, c]] as f64 };
                logit[[s, c]] = gate[[s0 + s, c]] + ape;
            }
        }
        let prob = if r.softmax_over_channels {
            softmax_rows(logit.clone())
        } else {
            softmax_rows(logit.t().to_owned()).t().to_owned()
        };
        out.slice_mut(s![p, .., ..]).assign(&prob);
    }
    out
}

/// `K[p, c] = Σ_s probs[p, s, c] · k[start[p] + s, c]`.
fn weigh(k: &Array2<f64>, probs: &Array3<f64>, start: &[usize]) -> Array2<f64> {
    let (n, kpool, di) = probs.dim();
    let mut out = Array2::zeros((n, di));
    for (p, &s0) in start.iter().enumerate() {
        for s in 0..kpool {
            for c in 0..di {
                out[[p, c]] += probs[[p, s, c]] * k[[s0 + s, c]];
            }
        }
    }
    out
}

fn softmax_rows(mut x: Array2<f64>) -> Array2<f64> {
    for mut row in x.rows_mut() {
        let m = row.fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        row.mapv_inplace(|v| (v - m).exp());
        let z = row.sum();
        row.mapv_inplace(|v| v / z);
    }
    x
}

/// The first token of every complete pool of a `t`-token sequence (the grid shifted `pad` tokens early
/// under the slot-zero misreading; a pool reaching before token 0 is incomplete).
pub fn pool_starts(t: usize, kpool: usize, pad: usize) -> Vec<usize> {
    (0..)
        .map(|p| p * kpool)
        .take_while(|&s| s + kpool <= t + pad)
        .filter(|&s| s >= pad)
        .map(|s| s - pad)
        .collect()
}

/// Each query's chosen pools and selected keys from the pool scores.
pub fn select(
    scores: &Array2<f64>,
    start: &[usize],
    k: &KpoolIndexer,
    r: Reading,
) -> (Vec<Vec<u32>>, Selection) {
    let kpool = k.kp.kpool;
    let budget = k.ic.top_k / kpool;
    let tail = k.kp.select_tail && !r.no_tail;
    let mut pools = Vec::with_capacity(scores.nrows());
    let mut keys = Vec::with_capacity(scores.nrows());
    for t in 0..scores.nrows() {
        let end = start.iter().filter(|&&s| s + kpool <= t + 1).count();
        let row = scores.row(t);
        let row = row.as_slice().expect("contiguous");
        let chosen = super::indexer::top_keys(row, end, budget.min(end));
        let mut ks: Vec<u32> = chosen
            .iter()
            .flat_map(|&p| {
                let s0 = start[p as usize] as u32;
                s0..s0 + kpool as u32
            })
            .collect();
        if tail {
            // The visible count from the grid's origin, modulo kpool: the incomplete pool's tokens
            // (none when it is 0; under the slot-zero misreading those before token 0 are padding).
            let n = (t + 1 + r.pools_from_slot_zero) % kpool;
            ks.extend((t + 1 - n.min(t + 1)) as u32..=t as u32);
        }
        pools.push(chosen);
        keys.push(ks);
    }
    (pools, Selection::new(k.ic.top_k, keys))
}

/// The k-pool indexer of one full layer on `attn_in [T, E]` (the MLA's normed input).
pub fn run(
    cfg: &MlaConfig,
    k: &KpoolIndexer,
    kw: &KpoolLayer,
    w: &LayerWeights,
    attn_in: ArrayView2<f64>,
    r: Reading,
) -> KpoolOut {
    let (t, hi) = (attn_in.nrows(), k.ic.heads);
    let h = super::indexer::heads(cfg, &k.ic, &kw.index, w, attn_in);
    let gate = linear(attn_in, kw.pool.gate.view());
    let weights = h.w_lin * (hi as f64).powf(-0.5);
    let start = pool_starts(t, k.kp.kpool, r.pools_from_slot_zero);
    let probs = pool_probs(&gate, &kw.pool, &start, r);
    let keys = weigh(&h.k, &probs, &start);
    let scores = pool_scores(&h.q, &keys, &weights);
    let (pools, selection) = select(&scores, &start, k, r);
    KpoolOut {
        q: h.q,
        k_gain: h.k_gain,
        k_lin: h.k_lin,
        k: h.k,
        weights_sq: h.w_sq / hi as f64,
        weights,
        in_dims: h.in_dims,
        gate_sq: super::indexer::squares(attn_in, &kw.pool.gate),
        gate,
        probs,
        pool_start: start,
        pool_keys: keys,
        pool_scores: scores,
        pools,
        selection,
    }
}

/// `S[t, p] = Σ_h w[t, h] · ReLU(q[t, h] · K[p] · Di^-0.5)` over every pool.
pub fn pool_scores(q: &Array3<f64>, keys: &Array2<f64>, w: &Array2<f64>) -> Array2<f64> {
    let (t, hi, di) = q.dim();
    let sc = (di as f64).powf(-0.5);
    let mut out = Array2::zeros((t, keys.nrows()));
    for tt in 0..t {
        let per_head = q.slice(s![tt, .., ..]).dot(&keys.t());
        for p in 0..keys.nrows() {
            out[[tt, p]] = (0..hi)
                .map(|h| w[[tt, h]] * (per_head[[h, p]] * sc).max(0.0))
                .sum();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{IndexerConfig, KpoolConfig, RopePairing};

    fn kpool(top_k: usize, kpool: usize, select_tail: bool) -> KpoolIndexer {
        KpoolIndexer {
            ic: IndexerConfig {
                heads: 1,
                head_dim: 2,
                top_k,
                rope_dim: 0,
                rope: RopePairing::Norm,
            },
            kp: KpoolConfig {
                kpool,
                select_tail,
                full: None,
            },
        }
    }

    #[test]
    fn pools_start_at_the_first_token_and_only_complete_ones_count() {
        assert_eq!(pool_starts(10, 4, 0), vec![0, 4]);
        assert_eq!(pool_starts(12, 4, 0), vec![0, 4, 8]);
        // From slot 0 of a batch padded by 2: the first pool reaches into the padding.
        assert_eq!(pool_starts(10, 4, 2), vec![2, 6]);
    }

    /// 11 tokens, kpool 4, top_k 4 (one pool): pool 1 scores higher than pool 0.
    fn scored() -> (Array2<f64>, Vec<usize>) {
        let start = pool_starts(11, 4, 0);
        let scores = Array2::from_shape_fn((11, 2), |(_, p)| p as f64);
        (scores, start)
    }

    #[test]
    fn the_best_visible_pools_and_the_tail_are_selected() {
        let (scores, start) = scored();
        let (pools, sel) = select(&scores, &start, &kpool(4, 4, true), Reading::default());
        // Below top_k: every key (pool 0 once complete, the tail otherwise).
        for t in 0..4 {
            assert_eq!(sel.keys[t], (0..=t as u32).collect::<Vec<_>>());
        }
        // Query 6: pool 0 (the only visible one) and the tail 4..=6.
        assert_eq!(sel.keys[6], vec![0, 1, 2, 3, 4, 5, 6]);
        // Query 7: pool 1 is complete and wins; no tail.
        assert_eq!(
            (pools[7].clone(), sel.keys[7].clone()),
            (vec![1], vec![4, 5, 6, 7])
        );
        // Query 10: pool 1 and the tail 8..=10.
        assert_eq!(sel.keys[10], vec![4, 5, 6, 7, 8, 9, 10]);
        let (_, no_tail) = select(
            &scores,
            &start,
            &kpool(4, 4, true),
            Reading {
                no_tail: true,
                ..Default::default()
            },
        );
        assert_eq!(no_tail.keys[10], vec![4, 5, 6, 7]);
        assert_eq!(no_tail.keys[2], Vec::<u32>::new());
        let (_, off) = select(&scores, &start, &kpool(4, 4, false), Reading::default());
        assert_eq!(off, no_tail);
    }

    #[test]
    fn the_pool_softmax_runs_over_slots_per_channel() {
        // Two slots, two channels; slot 1 dominates channel 0 through the APE only.
        let k = Array2::from_shape_vec((2, 2), vec![1.0, 10.0, 3.0, 20.0]).unwrap();
        let gate = Array2::zeros((2, 2));
        let pw = KpoolWeights {
            gate: Array2::zeros((2, 2)),
            ape: Array2::from_shape_vec((2, 2), vec![0.0, 0.0, 50.0, 0.0]).unwrap(),
        };
        let r = Reading::default();
        let key = pool_keys(&k, &gate, &pw, &[0], r);
        assert!(
            (key[[0, 0]] - 3.0).abs() < 1e-12 && (key[[0, 1]] - 15.0).abs() < 1e-12,
            "{key}"
        );
        let no_ape = pool_keys(&k, &gate, &pw, &[0], Reading { no_ape: true, ..r });
        assert!((no_ape[[0, 0]] - 2.0).abs() < 1e-12, "{no_ape}");
        let by_channel = pool_keys(
            &k,
            &gate,
            &pw,
            &[0],
            Reading {
                softmax_over_channels: true,
                ..r
            },
        );
        // Slot 0: channels equal (1/2 each); slot 1: channel 0 takes it all.
        assert!(
            (by_channel[[0, 0]] - 3.5).abs() < 1e-12 && (by_channel[[0, 1]] - 5.0).abs() < 1e-12,
            "{by_channel}"
        );
    }
}
