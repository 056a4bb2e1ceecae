#!/usr/bin/env python3
"""Planted bug: reads the cache rows as [k_pe | latent] instead of [latent | k_pe] (the first
qk_rope columns taken as the rope key, the next kv_lora_rank as the latent, which also serves as V).

Decode only; prefill (decompressed k/v) is runners/numpy_mla.py's, unchanged.
mla-diff must catch it at attn_latent@runner (and lse[decode]@runner, split_out@runner); end to end at
attn_latent, attn_heads, attn_out.
Needs: numpy.
"""
# selfcheck-expect: decode.attn_latent decode.lse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class KpeLatentSwapped(numpy_mla.NumpyMLA):
    name = "numpy-bug-kpe-latent-swapped"

    def split_cache_rows(self, rows, kv_lora_rank, qk_rope):
        return rows[:, qk_rope : qk_rope + kv_lora_rank], rows[:, :qk_rope]


if __name__ == "__main__":
    protocol.main(KpeLatentSwapped)
