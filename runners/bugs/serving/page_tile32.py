#!/usr/bin/env python3
"""Planted bug (issue #35 item 2): the decode op reads a page of more than 32 rows through a 32-key tile
box anchored at the page's first row (token t read from block_table[t // P] * P + t % P % 32), as a TMA
tile descriptor built for pages of one tile and handed pages of several would (attn_small's 32-key
boxes). Pages of at most 32 rows read right, so a run at the default page (16) passes every stage
check and its serving batch; only a batch aimed at a multi-tile page (page 64 on the 8-head
fixtures: `backend::serving::aims`, run through the runner within its supports) reads wrong keys.

Prefill is runners/numpy_mla.py's, unchanged. mla-diff must fail `variant_batch` in runner_checks on
a fixture whose production variants include a multi-tile page, with the stage checks passing.
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402

TILE = 32


class PageTile32(numpy_mla.NumpyMLA):
    name = "numpy-bug-page-tile32"

    def gather_rows(self, cache, table_row, length, page):
        flat = cache.reshape(-1, cache.shape[-1])
        t = np.arange(length)
        idx = table_row[t // page].astype(np.int64) * page + t % page % TILE
        return flat[idx % flat.shape[0]]


if __name__ == "__main__":
    protocol.main(PageTile32)
