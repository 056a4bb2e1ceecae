#!/usr/bin/env python3
"""Planted bug: the split-KV partials use a floor partition (`⌊L/S⌋` keys a split, the last taking the
rest) instead of vLLM's `[k·⌈L/S⌉, (k+1)·⌈L/S⌉)`. Each partial is right for its own keys and the merged
output is exact, but an engine combining these partials with another kernel's, or a reader of the
partials, gets the wrong split boundaries.

Decode only; prefill is runners/numpy_mla.py's, unchanged.
`mla-diff lint` must catch it at runner.decode.split_partition; `run` at split_out and split_lse.
Needs: numpy.
"""
# selfcheck-expect: decode.split_out decode.split_lse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class SplitFloor(numpy_mla.NumpyMLA):
    name = "numpy-bug-split-floor"

    def split_bounds(self, length, n_splits):
        per = length // n_splits
        return [(k * per, (k + 1) * per if k < n_splits - 1 else length) for k in range(n_splits)]


if __name__ == "__main__":
    protocol.main(SplitFloor)
