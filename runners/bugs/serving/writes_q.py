#!/usr/bin/env python3
"""Planted bug (issue #32 item 9): the decode op folds the softmax scale into its query in place
(`q_nope *= scale`, `q_pe *= scale`) and then scores with scale 1. Every output is right; the engine's
query buffer is not (a CUDA graph replay, an MTP draft or a second kernel reading q sees it scaled).

mla-diff must fail the run with an input mutation naming q_nope and q_pe, every stage check passing.
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class WritesQ(numpy_mla.NumpyMLA):
    name = "numpy-bug-writes-q"
    folded = False

    def softmax_scale(self, meta):
        return 1.0 if self.folded else float(meta["softmax_scale"])

    def decode(self, x, meta):
        s = np.float32(meta["softmax_scale"])
        x["q_nope"] *= s
        x["q_pe"] *= s
        self.folded = True
        try:
            return super().decode(x, meta)
        finally:
            self.folded = False


if __name__ == "__main__":
    protocol.main(WritesQ)
