#!/usr/bin/env python3
"""Planted bug (issue #38 item 4): reading an `fp8_ds_mla` cache, the tile scale is used as a divisor
(q/s instead of q·s), as a reader of the inverse-scale convention (x·scale_inv) handed a cache written
with vLLM's (x/scale).

Decode only, and only with a quantized ds_mla cache (`run --kv-cache-dtype fp8_ds_mla`); otherwise
runners/numpy_mla.py unchanged. `mla-diff lint --runner ... --kv-cache-dtype fp8_ds_mla` names the
convention (runner.decode.cache_scale: "the scale as a divisor"); a run catches it at
attn_latent@runner (lse[decode]@runner, split_out@runner) and end to end from split_out on.
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class ScaleDivisor(numpy_mla.NumpyMLA):
    name = "numpy-bug-fp8-scale-divisor"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        if not fmt.startswith("fp8_ds_mla"):
            return protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)
        latent, scales, rope = protocol.ds_mla_parts(cache, qk_rope)
        s = np.repeat(scales, 128, axis=-1)
        return np.concatenate([latent / s, rope], axis=-1).astype(np.float32)


if __name__ == "__main__":
    protocol.main(ScaleDivisor)
