#!/usr/bin/env python3
"""Planted bug (issue #38): with the `fp8` cache the decode rounds P (exp(s − max), ≤ 1) to e4m3 before
P·V (as FlashMLA's dense fp8 decode does) but the runner's describe does not say so (no
`conventions.p_fp8`), so mla-diff models P's rounding in the run's dtype.

Decode only, and only with `run --kv-cache-dtype fp8`; otherwise runners/numpy_mla.py unchanged.
mla-diff must fail it at the runner's stage (split_out@runner / attn_latent@runner). (Declared,
`MLA_DIFF_NUMPY_P_FP8=1 numpy_mla.py`, the same reading passes.)
Needs: numpy.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class PFp8Undeclared(numpy_mla.NumpyMLA):
    name = "numpy-bug-p-fp8-undeclared"

    def p_fp8(self):
        return True

    def declares_p_fp8(self):
        return False


if __name__ == "__main__":
    protocol.main(PFp8Undeclared)
