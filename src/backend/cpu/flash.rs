//! Flash-style attention of one query: online softmax over key tiles, and the log-sum-exp merges that
//! combine partial results (prefill context + chunk, decode splits).

use crate::precision::Dtype;
use std::ops::Range;

/// Keys per tile of the online softmax.
pub const TILE: usize = 64;

/// One query's attention over a set of keys: output `acc / l` in f32 (not rounded) and
/// `lse = m + ln l`. No key: output 0 and lse −inf.
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    pub out: Vec<f32>,
    pub lse: f32,
}

impl Partial {
    pub fn empty(dim: usize) -> Partial {
        Partial {
            out: vec![0.0; dim],
            lse: f32::NEG_INFINITY,
        }
    }
    /// The output as a kernel stores it.
    pub fn rounded(mut self, dt: Dtype) -> Partial {
        self.out.iter_mut().for_each(|v| *v = dt.round(*v));
        self
    }
}

/// Online softmax over `keys` (all visible; the caller cuts causal ranges), tiles of `TILE` from
/// `keys.start`. `score(j)` is the scaled f32 score, `value(j)` the stored value row. Per tile:
/// `m' = max(m, max s)`, rescale `l` and `acc` by `exp(m − m')`, `p = exp(s − m')` in f32,
/// `l += p` (unrounded), `acc += round(p) · v` (P is stored in the dtype for the P·V product).
pub fn attend<'a>(
    keys: Range<usize>,
    dim: usize,
    dt: Dtype,
    score: impl Fn(usize) -> f32,
    value: impl Fn(usize) -> &'a [f32],
) -> Partial {
    if keys.is_empty() {
        return Partial::empty(dim);
    }
    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
    let mut acc = vec![0f32; dim];
    let mut s = Vec::with_capacity(TILE);
    let mut k0 = keys.start;
    while k0 < keys.end {
        let tile = k0..(k0 + TILE).min(keys.end);
        s.clear();
        s.extend(tile.clone().map(&score));
        let m_new = s.iter().copied().fold(m, f32::max);
        // A tile whose keys are all masked (DSA: none selected) adds nothing; skipping it keeps
        // exp(−inf − −inf) = NaN out of the rescale. A NaN score still flows (it is not −inf).
        if m_new == f32::NEG_INFINITY && s.iter().all(|&v| v == f32::NEG_INFINITY) {
            k0 = tile.end;
            continue;
        }
        let alpha = (m - m_new).exp();
        l *= alpha;
        acc.iter_mut().for_each(|a| *a *= alpha);
        for (j, &sj) in tile.clone().zip(&s) {
            let p = (sj - m_new).exp();
            l += p;
            let pr = dt.round(p);
            for (a, &v) in acc.iter_mut().zip(value(j)) {
                *a += pr * v;
            }
        }
        m = m_new;
        k0 = tile.end;
    }
    if m == f32::NEG_INFINITY && l == 0.0 {
        return Partial::empty(dim);
    }
    Partial {
        out: acc.iter().map(|a| a / l).collect(),
        lse: m + l.ln(),
    }
}

/// `attend` as `attn_wgmma_pairs` runs it with the `pairs_handover_stale` fault
/// (kernels/sm90/decode/attn_wgmma_pairs.cuh): `TILE`-key tiles from `keys.start` rounded down to a tile,
/// the even ones (A) summed into warpgroup 0's row sum, the odd ones (B) into warpgroup 1's; each holds
/// half of the value columns of every tile. At the hand-over after a B tile warpgroup 0 takes the new
/// running max without rescaling its half and its sum (warpgroup 1 rescales as it should); the sums
/// are added at the end.
pub fn attend_handover_stale<'a>(
    keys: Range<usize>,
    dim: usize,
    dt: Dtype,
    score: impl Fn(usize) -> f32,
    value: impl Fn(usize) -> &'a [f32],
) -> Partial {
    if keys.is_empty() {
        return Partial::empty(dim);
    }
    let half = dim / 2;
    let (mut m, mut l) = (f32::NEG_INFINITY, [0f32; 2]);
    let mut acc = vec![0f32; dim];
    let mut k0 = keys.start / TILE * TILE;
    for i in 0.. {
        if k0 >= keys.end {
            break;
        }
        let tile = k0.max(keys.start)..(k0 + TILE).min(keys.end);
        let s: Vec<f32> = tile.clone().map(&score).collect();
        let m_new = s.iter().copied().fold(m, f32::max);
        let mu = if m_new == f32::NEG_INFINITY {
            0.0
        } else {
            m_new
        };
        let alpha = (m - mu).exp();
        // Tile B (odd): warpgroup 0 keeps its half and its sum at the old max (the fault).
        let (b, from) = (i % 2, if i % 2 == 1 { half } else { 0 });
        if b == 0 {
            l[0] *= alpha;
        }
        l[1] *= alpha;
        acc[from..].iter_mut().for_each(|a| *a *= alpha);
        for (j, &sj) in tile.zip(&s) {
            let p = (sj - mu).exp();
            l[b] += p;
            let pr = dt.round(p);
            for (a, &v) in acc.iter_mut().zip(value(j)) {
                *a += pr * v;
            }
        }
        m = m_new;
        k0 += TILE;
    }
    let l = l[0] + l[1];
    if m == f32::NEG_INFINITY && l == 0.0 {
        return Partial::empty(dim);
    }
    Partial {
        out: acc.iter().map(|a| a / l).collect(),
        lse: m + l.ln(),
    }
}

/// Combine partial results over disjoint key sets by their lse (vLLM `merge_attn_states` for two,
/// the Triton decode stage 2 for the splits), in f32: `m = max lse`, weights `exp(lse − m)` (0 for an
/// empty part, lse −inf), `out = Σ w·o / Σ w`, `lse = m + ln Σ w`. The output is not rounded here.
pub fn merge(parts: &[Partial]) -> Partial {
    merge_in_base(parts, f32::exp, f32::ln)
}

/// `merge` with base-2 weights and log: right for base-2 lse values, wrong for the natural-log ones the
/// partials carry (the `lse_log2_merge` fault).
pub fn merge_log2(parts: &[Partial]) -> Partial {
    merge_in_base(parts, f32::exp2, f32::log2)
}

fn merge_in_base(parts: &[Partial], exp: fn(f32) -> f32, ln: fn(f32) -> f32) -> Partial {
    let dim = parts.first().map_or(0, |p| p.out.len());
    let m = parts
        .iter()
        .map(|p| p.lse)
        .fold(f32::NEG_INFINITY, f32::max);
    // f32::max skips NaN: a NaN part must poison the result, not vanish from it.
    if parts.iter().any(|p| p.lse.is_nan()) {
        return Partial {
            out: vec![f32::NAN; dim],
            lse: f32::NAN,
        };
    }
    if m == f32::NEG_INFINITY {
        return Partial::empty(dim);
    }
    let w: Vec<f32> = parts
        .iter()
        .map(|p| {
            if p.lse == f32::NEG_INFINITY {
                0.0
            } else {
                exp(p.lse - m)
            }
        })
        .collect();
    let total: f32 = w.iter().sum();
    let mut out = vec![0f32; dim];
    for (p, &wk) in parts.iter().zip(&w) {
        if wk == 0.0 {
            continue;
        }
        let scale = wk / total;
        for (o, &v) in out.iter_mut().zip(&p.out) {
            *o += v * scale;
        }
    }
    Partial {
        out,
        lse: m + ln(total),
    }
}
