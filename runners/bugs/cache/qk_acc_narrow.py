#!/usr/bin/env python3
"""Planted bug (issue #38): the decode's fp8 QKᵀ accumulator keeps 9 fraction bits while the runner
declares 13 (`conventions.qk_acc: "e8m13"`): 16× the truncation the declaration allows, as a kernel
that drops bits of its running sum (or a tensor core narrower than the one named).

Run it with `MLA_DIFF_NUMPY_Q_FP8=1 MLA_DIFF_NUMPY_P_FP8=1 MLA_DIFF_NUMPY_QK_ACC=32:13` and
`run --kv-cache-dtype fp8`: it sums with NB = 9 and declares the environment's 13. mla-diff must fail
it at lse[decode]@runner.
Needs: numpy.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class QkAccNarrow(numpy_mla.NumpyMLA):
    name = "numpy-bug-qk-acc-narrow"

    def qk_acc(self):
        acc = super().qk_acc()
        return None if acc is None else (acc[0], 9)

    def declares_qk_acc(self):
        acc = super().qk_acc()
        return None if acc is None else f"e8m{acc[1]}"


if __name__ == "__main__":
    protocol.main(QkAccNarrow)
