#!/usr/bin/env python3
"""Planted bug (issue #38, FlashMLA V4.1's fp8 cache): reading an `fp8_v41` row (512 e4m3 values, 16
ue8m0 scales of 32 columns each), column i takes scale i // 128 instead of i // 32: DeepSeek-V3.2's
656-byte tile of 128 columns, a reader ported from `fp8_ds_mla` to V4.1's bytes without its group
width. Columns 32..127 of the row read with group 0's scale (the group of the outlier channels), the
rest with scales of groups 1..3; only scales 0..3 are ever read.

Every op that reads the cache (decode, sparse_prefill, sparse_decode; all go through
`dequantize_cache`), only with `--kv-cache-dtype fp8_v41`; otherwise runners/numpy_mla.py unchanged.
`runners/selfcheck.py --kv-cache-dtype fp8_v41 --cases v4-dims` catches it at every cache op
(tests/it/selfcheck_cache.rs).
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class Tile128(numpy_mla.NumpyMLA):
    name = "numpy-bug-v41-fp8-tile128"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        if fmt != "fp8_v41":
            return protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)
        cache = np.ascontiguousarray(cache, dtype=np.uint8)
        q = protocol.e4m3_to_f32(cache[..., :512])
        s = protocol.ue8m0_to_f32(cache[..., 512:528])
        return (q * np.repeat(s[..., :4], 128, axis=-1)).astype(np.float32)


if __name__ == "__main__":
    protocol.main(Tile128)
