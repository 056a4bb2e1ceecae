#!/usr/bin/env python3
"""Planted bug (issue #38): with the `fp8` cache and q in e4m3 the decode sums q·k in a truncating
e8m13 accumulator (`MLA_DIFF_NUMPY_QK_ACC=32:13`, as FlashMLA's dense fp8 decode's WGMMA does) but the
runner's describe does not say so (no `conventions.qk_acc`), so mla-diff models an f32 sum.

Run it with `MLA_DIFF_NUMPY_Q_FP8=1 MLA_DIFF_NUMPY_P_FP8=1 MLA_DIFF_NUMPY_QK_ACC=32:13` and
`run --kv-cache-dtype fp8`; otherwise runners/numpy_mla.py unchanged. mla-diff must fail it at
lse[decode]@runner. (Declared, the same environment on numpy_mla.py, it passes.)
Needs: numpy.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class QkAccUndeclared(numpy_mla.NumpyMLA):
    name = "numpy-bug-qk-acc-undeclared"

    def declares_qk_acc(self):
        return None


if __name__ == "__main__":
    protocol.main(QkAccUndeclared)
