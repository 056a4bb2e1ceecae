#!/usr/bin/env python3
"""Planted bug: returns the LSE in base 2 (log2 of the softmax denominator, FlashInfer's default)
while describe still declares `lse_base: "e"`, so mla-diff reads it as a natural log.

Otherwise runners/numpy_mla.py unchanged: attn_latent, attn_heads and the split partials are right.
mla-diff must catch it at lse[decode]@runner and lse[prefill]@runner (and end to end at the lse stages),
while attn_latent@runner passes.
Needs: numpy.
"""
# selfcheck-expect: decode.lse prefill.lse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class LseBase2(numpy_mla.NumpyMLA):
    name = "numpy-bug-lse-base2"

    def lse_out(self, lse):
        return lse / math.log(2.0)


if __name__ == "__main__":
    protocol.main(LseBase2)
