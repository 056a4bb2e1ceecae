#!/usr/bin/env python3
"""numpy_own_splits: runners/numpy_mla.py choosing its own split partition, as FlashMLA does (its
split count and boundaries come from its scheduler metadata, not from the harness's `num_splits`).

It declares its geometry in describe (`ops.decode.geometry`: 64-key tiles, a query at a time,
`split_partition: own`) and splits every entry into 3 ranges aligned to its 64-key tiles (the last
ones empty for short entries), so mla-diff checks its partials by merge consistency (their merge must
give its attn_latent and lse) rather than against vLLM's partition. An example of describe's geometry
for runner authors (docs/runners.md, "Tile geometry"), and the clean half of the own-partition test.

`MLA_DIFF_TEST_BUG=lse_base2`: its split LSEs in base 2 (the merged LSE still base e): the partials no
longer merge to its output (the planted half).
Needs: numpy.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402

SPLITS, TILE = 3, 64


class OwnSplits(numpy_mla.NumpyMLA):
    name = "numpy-own-splits"

    def describe(self):
        d = super().describe()
        d["name"] = self.name
        d["ops"]["decode"]["geometry"] = {"key_tile": TILE, "row_tile": 1, "split_partition": "own"}
        return d

    def split_count(self, meta):
        return SPLITS

    def split_bounds(self, length, n_splits):
        per = -(-length // n_splits) if length else 0
        per = -(-per // TILE) * TILE
        return [(min(k * per, length), min((k + 1) * per, length)) for k in range(n_splits)]

    def decode(self, x, meta):
        out = super().decode(x, meta)
        if os.environ.get("MLA_DIFF_TEST_BUG") == "lse_base2":
            out["split_lse"] = out["split_lse"] / math.log(2.0)
        return out


if __name__ == "__main__":
    protocol.main(OwnSplits)
