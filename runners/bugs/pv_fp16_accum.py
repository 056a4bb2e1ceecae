#!/usr/bin/env python3
"""Planted bug: P·V accumulated in fp16 (each key's product added to an fp16 running sum), as a
kernel does whose MMA accumulates in the input type instead of f32.

Otherwise runners/numpy_mla.py unchanged. In an fp16 run its `split_out` and `attn_latent` carry
fp16 accumulation's error, several times the noise the stage-local model allows: mla-diff must fail
`split_out` and `split_out@runner` (the runner's kernel), not blame upstream.
Needs: numpy.
"""
# selfcheck-expect: decode.attn_latent
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class PvFp16Accum(numpy_mla.NumpyMLA):
    name = "numpy-bug-pv-fp16-accum"

    # Keys per fp16 accumulation (a k-step's worth); the k-steps' sums are added in f32.
    chunk = int(os.environ.get("MLA_DIFF_BUG_PV_CHUNK", "8"))

    def pv(self, p, values):
        # Every k-step at once: key j of each chunk is added to that chunk's fp16 sum in turn (keys
        # padded with zero to whole chunks add nothing), then the chunk sums in f32.
        n, c = values.shape[0], self.chunk
        pad = -n % c
        p16 = np.concatenate([p, np.zeros(p.shape[:-1] + (pad,), p.dtype)], axis=-1).astype(np.float16)
        v16 = np.concatenate([values, np.zeros((pad,) + values.shape[1:], values.dtype)]).astype(np.float16)
        p16 = p16.reshape(p.shape[:-1] + (-1, c))  # [..., chunks, c]
        v16 = v16.reshape(-1, c, values.shape[-1])  # [chunks, c, D]
        acc = np.zeros(p16.shape[:-1] + values.shape[-1:], np.float16)  # [..., chunks, D]
        for j in range(c):
            acc = (acc + p16[..., j, None] * v16[:, j, :]).astype(np.float16)
        return acc.astype(np.float32).sum(axis=-2)


if __name__ == "__main__":
    protocol.main(PvFp16Accum)
