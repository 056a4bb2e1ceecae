#!/usr/bin/env python3
"""Planted bug (sparse decode, fp8 cache): each 128-column tile of the latent is read with the NEXT
tile's scale (tile 3 with tile 0's) — an off-by-one in the scale index. The scales are powers of two
from each tile's own amax, so the bug shows only on rows whose tiles' amax fall in different binades:
there the values read are 2× (or ½×, or more) what was stored.

Otherwise runners/flashmla_sparse.py with its numpy stand-in (MLA_DIFF_FLASHMLA_STANDIN=numpy is
implied). mla-diff must catch it at the runner (attn_latent@runner) wherever such rows are selected.
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


class WrongTile(flashmla_sparse.FlashMLASparse):
    name = "flashmla_sparse-bug-fp8-wrong-tile"

    def dequantize(self, cache):
        flat = np.ascontiguousarray(cache.reshape(-1, f8.BYTES)).copy()
        sc = flat[:, f8.D_NOPE:f8.D_NOPE + 4 * f8.TILES].reshape(-1, f8.TILES, 4)
        flat[:, f8.D_NOPE:f8.D_NOPE + 4 * f8.TILES] = np.roll(sc, -1, axis=1).reshape(-1, 4 * f8.TILES)
        return f8.unpack(flat)


if __name__ == "__main__":
    protocol.main(WrongTile)
