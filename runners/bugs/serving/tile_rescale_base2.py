#!/usr/bin/env python3
"""Planted bug (issue #32 item 5): the decode op as vLLM's Triton split-KV decode computes it — each
split by an online softmax over 64-key tiles, the splits then merged by their LSEs — with the running
sum and accumulator rescaled by `exp2(m_old - m_new)` where every other exponential is base e (the bug
measured on the H200 in vLLM's own kernel). A split of at most one tile never rescales, so the bug
is invisible on the classic schedule (at most 16 keys per split); a split holding a second tile is off
by hundreds of times the noise.

Prefill is runners/numpy_mla.py's, unchanged. mla-diff must catch it at split_out (and attn_latent)
on the default runner schedule, and pass it on the classic one.
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402

TILE = 64


def online_softmax(scores, values):
    """[s_q, H, n] scores (-inf masked), [n, D] values -> (out [s_q, H, D], lse [s_q, H]), tile by tile."""
    s_q, heads, n = scores.shape
    m = np.full((s_q, heads), -np.inf, np.float32)
    l = np.zeros((s_q, heads), np.float32)
    acc = np.zeros((s_q, heads, values.shape[1]), np.float32)
    for t0 in range(0, n, TILE):
        s = scores[:, :, t0 : t0 + TILE]
        m_new = np.maximum(m, s.max(axis=-1))
        safe = np.where(np.isfinite(m_new), m_new, np.float32(0))
        with np.errstate(invalid="ignore"):
            # THE BUG: base 2 here, base e everywhere else.
            alpha = np.where(np.isfinite(m), np.exp2(m - safe), np.float32(0)).astype(np.float32)
        p = np.exp(s - safe[..., None]).astype(np.float32)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + numpy_mla.matmul(p, values[t0 : t0 + TILE])
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(l[..., None] > 0, acc / l[..., None], np.float32(0))
        lse = np.where(l > 0, m + np.log(l), -np.inf)
    return out.astype(np.float32), lse.astype(np.float32)


class TileRescaleBase2(numpy_mla.NumpyMLA):
    name = "numpy-bug-tile-rescale-base2"

    def decode(self, x, meta):
        q_nope, q_pe, cache = x["q_nope"], x["q_pe"], x["kv_cache"]
        table, seqlens = x["block_table"], x["cache_seqlens"]
        b_n, s_q, heads, r = q_nope.shape
        rope = q_pe.shape[-1]
        scale = np.float32(self.softmax_scale(meta))
        page = self.page_size(meta, cache)
        n_splits = self.split_count(meta)
        q = np.concatenate([q_nope, q_pe], axis=-1).astype(np.float32)
        out = np.zeros((b_n, s_q, heads, r), np.float32)
        lse = np.full((b_n, s_q, heads), -np.inf, np.float32)
        split_out = np.zeros((b_n, s_q, heads, n_splits, r), np.float32)
        split_lse = np.full((b_n, s_q, heads, n_splits), -np.inf, np.float32)
        for b in range(b_n):
            length = int(seqlens[b])
            scores, latent = self.entry_scores(q[b], cache, table[b], length, page, r, rope, scale)
            for k, (lo, hi) in enumerate(self.split_bounds(length, n_splits)):
                if hi > lo:
                    split_out[b, :, :, k], split_lse[b, :, :, k] = online_softmax(scores[:, :, lo:hi], latent[lo:hi])
            # Stage 2: the splits merged by their LSEs (an empty split, lse -inf, weighs 0).
            m = split_lse[b].max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, np.float32(0))
            w = np.exp(split_lse[b] - m)
            z = w.sum(axis=-1)
            with np.errstate(divide="ignore", invalid="ignore"):
                out[b] = np.where(z[..., None] > 0, np.einsum("qhs,qhsd->qhd", w, split_out[b]) / z[..., None], 0)
                lse[b] = np.where(z > 0, m[..., 0] + np.log(z), -np.inf)
        return {
            "attn_latent": protocol.storage(out, meta["dtype"]),
            "lse": lse,
            "split_out": split_out,
            "split_lse": split_lse,
        }


if __name__ == "__main__":
    protocol.main(TileRescaleBase2)
