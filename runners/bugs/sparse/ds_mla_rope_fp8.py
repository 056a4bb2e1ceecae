#!/usr/bin/env python3
"""Planted bug (issue #38, the sparse ops over a quantized cache): reading an `fp8_ds_mla` cache, the
rope part is read as fp8: its first 64 bytes (at 528) taken as e4m3 codes times the last latent tile's
scale, as a tile loop run on over the row — the layout of a format that quantizes the rope with the row
(FlashMLA V4.1's 528-byte fp8) applied to DeepSeek-V3.2's 656-byte row, whose rope is 64 bf16 values
(128 bytes) carrying no scale.

Both sparse ops (`sparse_prefill`, `sparse_decode`; the dense decode reads through the same hook, but
a DSA run past top_k sends only the sparse ops), only with `run --kv-cache-dtype fp8_ds_mla`; otherwise
runners/numpy_mla.py unchanged. A run catches it at the runner's stages (every score's rope part is
off); `lint --runner ... --kv-cache-dtype fp8_ds_mla` names it (runner.sparse_decode.cache_rope: the
rope read matches neither convention).
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class RopeFp8(numpy_mla.NumpyMLA):
    name = "numpy-bug-ds-mla-rope-fp8"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        rows = protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)
        if fmt != "fp8_ds_mla":
            return rows
        _, scales, _ = protocol.ds_mla_parts(cache, qk_rope)
        codes = np.ascontiguousarray(cache, dtype=np.uint8)[..., 528 : 528 + qk_rope]
        rows[..., kv_lora_rank:] = protocol.e4m3_to_f32(codes) * scales[..., -1:]
        return rows.astype(np.float32)


if __name__ == "__main__":
    protocol.main(RopeFp8)
