#!/usr/bin/env python3
"""Planted bug (issue #38, FlashMLA V4.1's fp4 cache): reading an `fp4_v41` row (512 e2m1 codes, 32
e4m3 scales of 16 columns each), column i takes scale i // 32 instead of i // 16: the group width of
V4.1's fp8 row, a reader shared by the two V4.1 formats that keeps the fp8 one's. Only scales 0..15
are read, for the whole row: group g of 16 columns is read with group g // 2's scale (right for
group 0 only).

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


class Group32(numpy_mla.NumpyMLA):
    name = "numpy-bug-v41-fp4-group32"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        if fmt != "fp4_v41":
            return protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)
        cache = np.ascontiguousarray(cache, dtype=np.uint8)
        packed = cache[..., :256]
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(cache.shape[:-1] + (512,))
        s = protocol.e4m3_to_f32(cache[..., 256:288])
        return (protocol.e2m1_to_f32(codes) * np.repeat(s[..., :16], 32, axis=-1)).astype(np.float32)


if __name__ == "__main__":
    protocol.main(Group32)
