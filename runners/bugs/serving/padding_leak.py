#!/usr/bin/env python3
"""Planted bug (issue #32 items 7, 8): the decode op subtracts one max per head taken over the whole
batch (a reduction over every entry instead of each request's own) before its softmax. The result is
mathematically the same, so a batch of real requests passes; but a padded entry (a CUDA graph's: NaN
query) makes the shared max NaN and every real row with it (vLLM PR #37442, flashinfer#2883), and a
request's output depends on its batch by rounding.

Prefill is runners/numpy_mla.py's; no split partials. `MLA_DIFF_TEST_DECLARE_INVARIANT=1` makes it
declare `batch_invariant` (the test of the batch-invariance verdict).
mla-diff must fail the padding check; batch invariance is reported (a failure only when declared).
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class PaddingLeak(numpy_mla.NumpyMLA):
    name = "numpy-bug-padding-leak"

    def describe(self):
        d = super().describe()
        d["ops"]["decode"] = {"outputs": ["attn_latent", "lse"]}
        d["batch_invariant"] = os.environ.get("MLA_DIFF_TEST_DECLARE_INVARIANT") == "1"
        return d

    def decode(self, x, meta):
        q_nope, q_pe, cache = x["q_nope"], x["q_pe"], x["kv_cache"]
        table, seqlens = x["block_table"], x["cache_seqlens"]
        b_n, s_q, heads, r = q_nope.shape
        rope = q_pe.shape[-1]
        scale = np.float32(self.softmax_scale(meta))
        page = self.page_size(meta, cache)
        q = np.concatenate([q_nope, q_pe], axis=-1).astype(np.float32)
        per_entry = []
        for b in range(b_n):
            length = int(seqlens[b])
            scores, latent = self.entry_scores(q[b], cache, table[b], length, page, r, rope, scale)
            per_entry.append((scores, latent))
        # THE BUG: one max per head over the whole batch (NaN from a padded entry reaches everyone).
        maxes = [s.max(axis=(0, 2)) for s, _ in per_entry if s.shape[-1] > 0]
        gmax = np.max(np.stack(maxes), axis=0) if maxes else np.zeros(heads, np.float32)
        out = np.zeros((b_n, s_q, heads, r), np.float32)
        lse = np.full((b_n, s_q, heads), -np.inf, np.float32)
        for b, (scores, latent) in enumerate(per_entry):
            if scores.shape[-1] == 0:
                continue
            e = np.exp(scores - gmax[None, :, None]).astype(np.float32)
            z = e.sum(axis=-1)
            out[b] = numpy_mla.matmul(e, latent) / z[..., None]
            lse[b] = gmax[None, :] + np.log(z)
        return {"attn_latent": protocol.storage(out, meta["dtype"]), "lse": lse}


if __name__ == "__main__":
    protocol.main(PaddingLeak)
