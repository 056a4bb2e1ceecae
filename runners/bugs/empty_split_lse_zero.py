#!/usr/bin/env python3
"""Planted bug: an empty split's `split_lse` is written as 0 (an accumulator initialised to 0 and
stored as is), not −inf. Its `split_out` is 0, so a merge by these LSEs gives that empty split a
weight e^(0 − lse_max): in any row whose LSE is small it takes a share of the output.

Decode only; prefill is runners/numpy_mla.py's, unchanged.
`mla-diff lint` must catch it at runner.decode.empty_split; `run` at split_lse.
Needs: numpy.
"""
# selfcheck-expect: decode.split_lse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class EmptySplitLseZero(numpy_mla.NumpyMLA):
    name = "numpy-bug-empty-split-lse-zero"

    def decode(self, x, meta):
        out = super().decode(x, meta)
        sl = np.asarray(out["split_lse"], dtype=np.float32)
        out["split_lse"] = np.where(np.isfinite(sl), sl, np.float32(0))
        return out


if __name__ == "__main__":
    protocol.main(EmptySplitLseZero)
