#!/usr/bin/env python3
"""Planted bug (sparse prefill): the −1 padding of the index rows is not masked, so numpy's negative
indexing reads the last row of the flat cache for every padded slot — what a port of FlashMLA's
sparse kernel that forgets its validity mask does (the last cache row is another sequence's token,
or an unwritten, NaN-poisoned one).

Otherwise runners/flashmla_sparse.py with its numpy stand-in (MLA_DIFF_FLASHMLA_STANDIN=numpy is
implied). mla-diff must catch it at the runner: lse[prefill]@runner and attn_heads[prefill]@runner,
and end to end at the prefill stages, on every layer past top_k whose queries hold padding.
Needs: numpy.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
os.environ["MLA_DIFF_FLASHMLA_STANDIN"] = "numpy"
import flashmla_sparse  # noqa: E402
import numpy as np  # noqa: E402
import protocol  # noqa: E402


class MinusOneWraps(flashmla_sparse.FlashMLASparse):
    name = "flashmla_sparse-bug-minus-one-wraps"

    def kernel(self, q, kv, indices, scale):
        s_q, h_q, _ = q.shape
        out = np.zeros((s_q, h_q, flashmla_sparse.KV_LORA), np.float32)
        lse = np.zeros((s_q, h_q), np.float32)
        for i in range(s_q):
            # The padded width is the kernel's (a multiple of 128); the −1s wrap to the last row.
            k = kv[indices[i, 0].astype(np.int64), 0].astype(np.float32)
            s = (q[i] @ k.T) * np.float32(scale)
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - m)
            z = e.sum(axis=1, keepdims=True)
            out[i] = (e / z) @ k[:, : flashmla_sparse.KV_LORA]
            lse[i] = (m + np.log(z))[:, 0]
        return protocol.round_to(out, "bf16"), lse


if __name__ == "__main__":
    protocol.main(MinusOneWraps)
