#!/usr/bin/env python3
"""Planted bug: decode reads one key past the end of each sequence (`cache_seqlens[b] + 1` keys: a
`<=` where `<` belongs), so it reads the row after the sequence, NaN-poisoned, and every answer is NaN.

Decode only; prefill is runners/numpy_mla.py's, unchanged.
`mla-diff lint` must give one finding for it (runner.decode.non_finite, naming rows outside the
sequence), not three about the scale, the LSE base and the value; `run` catches it at attn_latent.
Needs: numpy.
"""
# selfcheck-expect: decode.attn_latent decode.lse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class SeqlenPastEnd(numpy_mla.NumpyMLA):
    name = "numpy-bug-seqlen-past-end"

    def decode(self, x, meta):
        x = dict(x)
        x["cache_seqlens"] = x["cache_seqlens"] + 1
        return super().decode(x, meta)


if __name__ == "__main__":
    protocol.main(SeqlenPastEnd)
