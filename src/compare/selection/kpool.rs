//! glm5-next's k-pool selections compared (docs/dsa.md, "glm5-next"): the optimized indexer ranks pools
//! of `kpool` keys, expands the chosen ones to their keys and appends the visible tail. Its key sets are
//! split back into that layout on the reference's pool grid: every key before the last complete visible
//! pool must belong to a whole pool, the keys after it must be exactly the visible tail (with
//! `select_tail`; none without). Anything else is a layout failure, deterministic and outside any noise
//! margin (pools counted from another origin, a tail dropped). The whole pools are then compared with
//! the reference's chosen pools tie-aware, as keys are (`compare_rows`), under the noise of the pool
//! scores (`ScoreNoise::kpool`): near-ties between pools may flip, one pool beyond the margin may not.

use super::*;
use crate::reference::kpool::KpoolOut;

/// The layout part of a k-pool selection check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolLayout {
    pub kpool: usize,
    /// Queries whose keys are not whole pools of the reference's grid plus the visible tail.
    pub layout_mismatch: usize,
    /// The first such query.
    pub first_query: Option<usize>,
}

impl PoolLayout {
    /// The summary's words after "selection PASS|FAIL".
    pub fn summary(&self) -> String {
        let first = self
            .first_query
            .map_or(String::new(), |q| format!(", the first query {q}"));
        format!(
            " (pools of {} keys; {} queries not whole pools plus the visible tail{first})",
            self.kpool, self.layout_mismatch
        )
    }
}

impl ScoreNoise {
    /// The noise of the optimized k-pool indexer's pool scores (`backend::cpu::kpool`): q and the
    /// weights as for token scores (`new`); each pooled key `K[p, c] = Σ_s prob_s · k_s` carries its
    /// slots' key roundings (prob_s² · var k_s), its gate scores' (a logit error δ_s moves K by
    /// `prob_s · (k_s − K) · δ_s`: the gate's storage rounding, attn_in's through the gate, the f32
    /// sum with the APE and the exp), its own storage rounding and the f32 sum over the slots. With fp8
    /// keys, q and the pooled keys go to the Hadamard basis and fp8 as token keys do.
    pub fn kpool(o: &KpoolOut, dt: Dtype, keys: KeyPrecision) -> ScoreNoise {
        let mut n = ScoreNoise::tokens(&parts_of!(o), dt);
        let u2 = dt.round_unit().powi(2) / 3.0;
        let sum_e = F32_OP * 5.0 / 3.0 * o.in_dims.0 as f64;
        let (np, kpool, di) = o.probs.dim();
        let mut vk = Array2::zeros((np, di));
        for (p, &s0) in o.pool_start.iter().enumerate() {
            for c in 0..di {
                let kp = o.pool_keys[[p, c]];
                let (mut v, mut terms) = (u2 * kp * kp, 0.0);
                for s in 0..kpool {
                    let (pr, t) = (o.probs[[p, s, c]], s0 + s);
                    let (k, g) = (o.k[[t, c]], o.gate[[t, c]]);
                    let vg = u2 * g * g
                        + (2.0 * u2 + sum_e) * o.gate_sq[[t, c]]
                        + F32_OP * g * g
                        + crate::compare::noise::EXP_REL_VAR;
                    v += pr * pr * (n.vk[[t, c]] + (k - kp).powi(2) * vg);
                    terms += (pr * k).powi(2);
                }
                vk[[p, c]] = v + F32_OP * kpool as f64 * terms;
            }
        }
        n.k = o.pool_keys.clone();
        n.vk = vk;
        if keys == KeyPrecision::Fp8 && di.is_power_of_two() {
            n.rotate_to_fp8();
        }
        n
    }
}

/// One query's keys split on the pool grid (`start[p] = p · kpool`, the first `visible` pools complete
/// and visible): the whole pools, and whether the rest is exactly the visible tail.
fn split(keys: &[u32], kpool: usize, visible: usize, tail: bool, t: usize) -> (Vec<u32>, bool) {
    let edge = visible * kpool;
    let mut count = vec![0usize; visible];
    let mut rest = Vec::new();
    for &j in keys {
        match (j as usize) < edge {
            true => count[j as usize / kpool] += 1,
            false => rest.push(j),
        }
    }
    let pools: Vec<u32> = (0..visible as u32)
        .filter(|&p| count[p as usize] == kpool)
        .collect();
    let whole = count.iter().all(|&c| c == 0 || c == kpool);
    let want: Vec<u32> = match tail {
        true => (edge as u32..=t as u32).collect(),
        false => Vec::new(),
    };
    (pools, whole && rest == want)
}

/// Compare the optimized k-pool selection `opt` (keys) with the reference's (`o`, fp64) under the pool
/// scores' noise: the layout per query, then the whole pools tie-aware (`compare_rows`). Counts of the
/// result are of pools; `sparse_queries` is of keys.
pub fn compare(
    o: &KpoolOut,
    noise: &ScoreNoise,
    kpool: usize,
    select_tail: bool,
    opt: &Selection,
) -> SelectionResult {
    let t = o.selection.n_queries();
    let visible = |q: usize| o.pool_start.iter().filter(|&&s| s + kpool <= q + 1).count();
    debug_assert!(o
        .pool_start
        .iter()
        .enumerate()
        .all(|(p, &s)| s == p * kpool));
    let reference = Selection::new(o.selection.top_k / kpool, o.pools.clone());
    let mut layout = PoolLayout {
        kpool,
        layout_mismatch: 0,
        first_query: None,
    };
    let pools: Vec<Vec<u32>> = (0..opt.n_queries().min(t))
        .map(|q| {
            let (pools, ok) = split(&opt.keys[q], kpool, visible(q), select_tail, q);
            if !ok {
                layout.layout_mismatch += 1;
                layout.first_query.get_or_insert(q);
            }
            pools
        })
        .collect();
    let mut r = compare_rows(
        &o.pool_scores,
        &visible,
        &|q, a, b| noise.sigma(q, a, Some(b)),
        &reference,
        &Selection::new(reference.top_k, pools),
    );
    if opt.n_queries() != t {
        r.count_mismatch = r.count_mismatch.max(t.abs_diff(opt.n_queries()));
        r.pass = false;
    }
    r.sparse_queries = o.selection.sparse_queries();
    r.pass &= layout.layout_mismatch == 0;
    r.pools = Some(layout);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_split_into_whole_pools_and_the_tail() {
        // kpool 4, query 10: pools 0 and 1 complete, tail 8..=10.
        let keys: Vec<u32> = vec![4, 5, 6, 7, 8, 9, 10];
        assert_eq!(split(&keys, 4, 2, true, 10), (vec![1], true));
        // The tail dropped, or kept where the model has none.
        assert_eq!(split(&keys[..4], 4, 2, true, 10), (vec![1], false));
        assert_eq!(split(&keys, 4, 2, false, 10), (vec![1], false));
        // Pools from another origin: 2..=5 is no whole pool of the grid.
        assert!(!split(&[2, 3, 4, 5, 8, 9, 10], 4, 2, true, 10).1);
    }
}
