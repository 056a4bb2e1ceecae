#!/usr/bin/env python3
"""Planted bug (issue #38, FlashMLA V4.1's fp4 cache): reading an `fp4_v41` row, column 2k is taken
from the HIGH nibble of byte k and column 2k+1 from the low one: the other nibble order (mla-diff
writes torch's `float4_e2m1fn_x2`, column 2k in the low nibble; docs/cache-formats.md notes FlashMLA's
order as unverified). Every pair of neighbouring columns is swapped, scales right.

Every op that reads the cache (decode, sparse_prefill, sparse_decode; all go through
`dequantize_cache`), only with `--kv-cache-dtype fp4_v41`; otherwise runners/numpy_mla.py unchanged.
`runners/selfcheck.py --kv-cache-dtype fp4_v41 --cases v4-dims` catches it at every cache op
(tests/it/selfcheck_cache.rs).
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class NibblesSwapped(numpy_mla.NumpyMLA):
    name = "numpy-bug-v41-fp4-nibbles-swapped"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        if fmt != "fp4_v41":
            return protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)
        cache = np.ascontiguousarray(cache, dtype=np.uint8)
        packed = cache[..., :256]
        codes = np.stack([packed >> 4, packed & 0xF], axis=-1).reshape(cache.shape[:-1] + (512,))
        s = protocol.e4m3_to_f32(cache[..., 256:288])
        return (protocol.e2m1_to_f32(codes) * np.repeat(s, 16, axis=-1)).astype(np.float32)


if __name__ == "__main__":
    protocol.main(NibblesSwapped)
