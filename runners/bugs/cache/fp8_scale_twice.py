#!/usr/bin/env python3
"""Planted bug (issue #38 item 4): reading an `fp8_ds_mla` cache, the tile scale is applied twice
(q·s·s instead of q·s), as a reader that multiplies by a scale its writer already folded in; reading
the per-tensor `fp8` cache, the layer's scale likewise (numpy's copy of
runners/bugs/cache/flashmla_fp8_scale_twice.py, `descale_k` = s², for the CPU: with
`MLA_DIFF_NUMPY_Q_FP8=1 MLA_DIFF_NUMPY_P_FP8=1 MLA_DIFF_NUMPY_NO_SPLITS=1` it reads as FlashMLA's dense
fp8 decode does, bug included).

Decode only, and only with a quantized cache (`run --kv-cache-dtype fp8_ds_mla` or `fp8`); otherwise
runners/numpy_mla.py unchanged. mla-diff must catch it at attn_latent@runner (lse[decode]@runner,
split_out@runner); end to end at attn_latent and what follows.
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class ScaleTwice(numpy_mla.NumpyMLA):
    name = "numpy-bug-fp8-scale-twice"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        if fmt == "fp8" and scale is not None:
            return super().dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, float(scale) * float(scale))
        latent, scales, rope = protocol.ds_mla_parts(cache, qk_rope)
        s = np.repeat(scales, 128, axis=-1)
        return np.concatenate([latent * s * s, rope], axis=-1).astype(np.float32)


if __name__ == "__main__":
    protocol.main(ScaleTwice)
