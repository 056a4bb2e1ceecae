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
        total = np.zeros(p.shape[:-1] + values.shape[-1:], np.float32)
        for j0 in range(0, values.shape[0], self.chunk):
            acc = np.zeros(total.shape, np.float16)
            for j in range(j0, min(j0 + self.chunk, values.shape[0])):
                term = p[..., j : j + 1].astype(np.float16) * values[j].astype(np.float16)
                acc = (acc + term).astype(np.float16)
            total += acc.astype(np.float32)
        return total


if __name__ == "__main__":
    protocol.main(PvFp16Accum)
