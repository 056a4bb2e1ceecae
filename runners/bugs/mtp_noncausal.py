#!/usr/bin/env python3
"""Planted bug: with several queries per decode step (MTP, q_len > 1) every query sees every key of
its entry, the later queries' own keys included (no causal mask within the step).

Decode only; prefill is runners/numpy_mla.py's, unchanged. A q_len-1 step cannot show it.
`mla-diff lint` must catch it at runner.decode.mtp_causal; `run` at attn_latent with q_len > 1.
Needs: numpy.
"""
# selfcheck-expect: decode.attn_latent decode.lse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class MtpNonCausal(numpy_mla.NumpyMLA):
    name = "numpy-bug-mtp-noncausal"

    def entry_scores(self, q_b, cache, table_row, length, page, r, rope, scale):
        rows = self.gather_rows(cache, table_row, length, page).astype(np.float32)
        latent, k_pe = self.split_cache_rows(rows, r, rope)
        keys = np.concatenate([latent, k_pe], axis=-1)
        return (numpy_mla.matmul(q_b, keys.T) * scale).astype(np.float32), latent


if __name__ == "__main__":
    protocol.main(MtpNonCausal)
