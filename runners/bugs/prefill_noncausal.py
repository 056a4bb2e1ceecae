#!/usr/bin/env python3
"""Planted bug: in prefill every query of the chunk attends to all the chunk's keys (the chunk part
run with causal=False), not just those at or before its position. The context part is right.

Prefill only; decode is runners/numpy_mla.py's, unchanged.
mla-diff must catch it at attn_heads@runner and lse[prefill]@runner (end to end at attn_heads,
attn_out); a chunk of one token cannot show it.
Needs: numpy.
"""
# selfcheck-expect: prefill.attn_heads prefill.lse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class PrefillNonCausal(numpy_mla.NumpyMLA):
    name = "numpy-bug-prefill-noncausal"

    def prefill_visible(self, n, s, context_len):
        return np.ones((n, s), dtype=bool)


if __name__ == "__main__":
    protocol.main(PrefillNonCausal)
