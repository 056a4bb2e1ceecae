#!/usr/bin/env python3
"""Planted bug (issue #38 item 6): with the `fp8` cache the decode reads q in e4m3 (as FlashMLA's dense
fp8 decode does: q cast to fp8 with a `descale_q`) but the runner's describe does not say so (no
`conventions.q_fp8`), so mla-diff sends q as computed, and the runner quantizes it on its own grid.

Decode only, and only with `run --kv-cache-dtype fp8`; otherwise runners/numpy_mla.py unchanged.
mla-diff must catch it at attn_latent@runner: its yardstick is over q as sent, which the kernel did not
read. (Declared, `MLA_DIFF_NUMPY_Q_FP8=1 numpy_mla.py`, the same reading passes.)
Needs: numpy.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class QUndeclared(numpy_mla.NumpyMLA):
    name = "numpy-bug-fp8-q-undeclared"

    def q_fp8(self):
        return True

    def declares_q_fp8(self):
        return False


if __name__ == "__main__":
    protocol.main(QUndeclared)
