#!/usr/bin/env python3
"""Planted bug (sparse decode, fp8 cache): the kernel multiplies the latent by its tile's scale twice —
a port of FlashMLA's fp8 read that dequantizes on load and again in the epilogue. Scales are ~2⁻⁷ on a
unit-scale latent, so the values read shrink a hundredfold and more.

Otherwise runners/flashmla_sparse.py with its numpy stand-in (MLA_DIFF_FLASHMLA_STANDIN=numpy is
implied). mla-diff must catch it at the runner (attn_latent@runner, lse[decode]@runner, against fp64
over the fp8 cache as FlashMLA's format defines it) and end to end at the decode stages.
Needs: numpy.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
os.environ["MLA_DIFF_FLASHMLA_STANDIN"] = "numpy"
import flashmla_fp8 as f8  # noqa: E402
import flashmla_sparse  # noqa: E402
import numpy as np  # noqa: E402
import protocol  # noqa: E402


class ScaleTwice(flashmla_sparse.FlashMLASparse):
    name = "flashmla_sparse-bug-fp8-scale-twice"

    def dequantize(self, cache):
        rows = f8.unpack(cache).reshape(-1, f8.D_NOPE + f8.D_ROPE)
        flat = cache.reshape(-1, f8.BYTES)
        scales = flat[:, f8.D_NOPE:f8.D_NOPE + 4 * f8.TILES].copy().view("<f4")
        rows[:, : f8.D_NOPE] *= np.repeat(scales, f8.TILE, axis=1)
        return rows


if __name__ == "__main__":
    protocol.main(ScaleTwice)
