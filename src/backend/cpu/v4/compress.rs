//! DeepSeek-V4's compressors at the engine's precision, fed one forward pass at a time: the carried
//! state (the projections of the unclosed window's tokens, and CSA's previous-window Ca half) lives
//! here between passes, and each window closed in a pass becomes one stored entry.

use super::{rope_row, to32, Rope32};
use crate::backend::cpu::ops;
use crate::faults::{Active, Fault};
use crate::model::v4::{CompressorWeights, LayerKind};
use crate::precision::Dtype;
use ndarray::{Array2, ArrayView2};

/// One compressor's weights in the dtype and its state across forward passes.
pub struct Compressor {
    kind: LayerKind,
    d: usize,
    eps: f64,
    dt: Dtype,
    faults: Active,
    /// `round(attn_in · W_kvᵀ)`, `round(attn_in · W_gateᵀ)` of every token (row-wise: a pass computes
    /// its own tokens' rows, the same bits).
    kv: Array2<f32>,
    gate: Array2<f32>,
    ape: Array2<f32>,
    norm: ndarray::Array1<f32>,
    /// The carried state: the tokens of the window not yet closed (position, its slot).
    pending: Vec<(usize, usize)>,
    /// CSA: the last closed window's tokens (their Ca halves pool into the next entry), with slots.
    prev: Vec<(usize, usize)>,
    /// The stored entries, in closing order, each with the position of the token that closed it.
    pub entries: Vec<(Vec<f32>, usize)>,
}

impl Compressor {
    pub fn new(
        w: &CompressorWeights,
        kind: LayerKind,
        d: usize,
        attn_in: ArrayView2<f32>,
        eps: f64,
        dt: Dtype,
        faults: Active,
    ) -> Compressor {
        let st = |a: &ndarray::Array2<f64>| ops::stored(&to32(a), dt);
        Compressor {
            kind,
            d,
            eps,
            dt,
            faults,
            kv: ops::linear(attn_in, st(&w.kv).view(), dt),
            gate: ops::linear(attn_in, st(&w.gate).view(), dt),
            ape: st(&w.ape),
            norm: ops::stored(
                &ndarray::Array1::from_iter(w.norm.iter().map(|&v| v as f32)),
                dt,
            ),
            pending: Vec::new(),
            prev: Vec::new(),
            entries: Vec::new(),
        }
    }

    /// Token `t`'s slot in its window and whether it closes the window. Fault
    /// `compress_group_off_by_one`: the groups start one token early.
    fn slot(&self, t: usize) -> (usize, bool) {
        let m = self.kind.ratio();
        let u = match self.faults.on(Fault::CompressGroupOffByOne) {
            true => t + 1,
            false => t,
        };
        (u % m, u % m == m - 1)
    }

    /// A forward pass starts: the state carried from the last one stays. Fault
    /// `compressor_state_dropped` (llama.cpp #26509's class): it is dropped.
    pub fn begin_pass(&mut self) {
        if self.faults.on(Fault::CompressorStateDropped) {
            self.pending.clear();
            self.prev.clear();
        }
    }

    /// Feed the pass's tokens `ts` in order; each window they close is pooled into a stored entry.
    pub fn feed(&mut self, ts: std::ops::Range<usize>, rope: &Rope32) {
        for t in ts {
            let (slot, closes) = self.slot(t);
            self.pending.push((t, slot));
            if closes {
                let e = self.pool(rope);
                self.entries.push((e, t));
                self.prev = std::mem::take(&mut self.pending);
            }
        }
    }

    /// The entry of the window just closed: per dim a softmax in f32 over its slots' gate + ape (CSA:
    /// the previous window's Ca halves first, then this window's Cb halves), the stored kv pooled with
    /// it, RMS-normed, roped at the window's first position.
    fn pool(&self, rope: &Rope32) -> Vec<f32> {
        let (d, csa) = (self.d, self.kind == LayerKind::Csa);
        let half = if csa { d } else { 0 };
        let mut row = vec![0f32; d];
        let mut slots: Vec<(f32, f32)> = Vec::with_capacity(2 * self.kind.ratio());
        for (dim, o) in row.iter_mut().enumerate() {
            slots.clear();
            if csa {
                for &(t, j) in &self.prev {
                    slots.push((self.gate[[t, dim]] + self.ape[[j, dim]], self.kv[[t, dim]]));
                }
            }
            for &(t, j) in &self.pending {
                let c = half + dim;
                slots.push((self.gate[[t, c]] + self.ape[[j, c]], self.kv[[t, c]]));
            }
            let mx = slots.iter().map(|s| s.0).fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = slots.iter().map(|s| (s.0 - mx).exp()).sum();
            *o = slots.iter().map(|s| (s.0 - mx).exp() * s.1).sum::<f32>() / z;
        }
        let x = Array2::from_shape_vec((1, d), row).expect("one row");
        let mut row = ops::rms_norm(x.view(), &self.norm, self.eps, self.dt)
            .into_raw_vec_and_offset()
            .0;
        let first = self.entries.len() * self.kind.ratio();
        rope_row(&mut row, rope, first, 1.0, self.dt);
        row
    }

    /// The entries as `[n, d]` f64.
    pub fn stored(&self) -> Array2<f64> {
        let mut a = Array2::zeros((self.entries.len(), self.d));
        for (i, (e, _)) in self.entries.iter().enumerate() {
            a.row_mut(i)
                .iter_mut()
                .zip(e)
                .for_each(|(o, &v)| *o = v as f64);
        }
        a
    }

    /// How many entries query `t` may see: those closed at or before it.
    pub fn visible(&self, t: usize) -> usize {
        self.entries.iter().take_while(|e| e.1 <= t).count()
    }
}
