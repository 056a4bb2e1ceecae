#!/usr/bin/env python3
"""Planted bug (issue #38 item 4): reading an `fp8_ds_mla` cache, the bf16 rope part is treated as
quantized: multiplied by the last latent tile's scale, as a tile loop run on over the row's 64 rope
columns (the reader's side of vLLM PR #42956's class: a scale applied to the rope part that carries
none).

Decode only, and only with `run --kv-cache-dtype fp8_ds_mla`; otherwise runners/numpy_mla.py unchanged.
`mla-diff lint --runner ... --kv-cache-dtype fp8_ds_mla` names the convention (runner.decode.cache_rope:
"the rope read with a scale"); a run catches it at attn_latent@runner and lse[decode]@runner (every
score's rope part is off) and end to end from split_out on.
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class RopeScaled(numpy_mla.NumpyMLA):
    name = "numpy-bug-fp8-rope-scaled"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        rows = protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)
        if fmt != "fp8_ds_mla":
            return rows
        _, scales, _ = protocol.ds_mla_parts(cache, qk_rope)
        rows[..., kv_lora_rank:] *= scales[..., -1:]
        return rows.astype(np.float32)


if __name__ == "__main__":
    protocol.main(RopeScaled)
