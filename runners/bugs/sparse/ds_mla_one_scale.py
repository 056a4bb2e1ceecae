#!/usr/bin/env python3
"""Planted bug (issue #38, the sparse ops over a quantized cache): reading an `fp8_ds_mla` cache, every
latent column is multiplied by the FIRST tile's scale: the reader ignores the per-128 scale groups (one
scale per token, as a per-token fp8 layout would have it). The scales are powers of two from each tile's
own amax, so the values of a tile whose amax falls in another binade than tile 0's are read 2× (or ½×,
or more) off.

Both sparse ops (`sparse_prefill`, `sparse_decode`; the dense decode reads through the same hook, but
a DSA run past top_k sends only the sparse ops), only with `run --kv-cache-dtype fp8_ds_mla` or its
NoPE variant `fp8_ds_mla_nope` (the same 656-byte ABI and tiles, a reader shared by both); otherwise
runners/numpy_mla.py unchanged. `runners/selfcheck.py --kv-cache-dtype fp8_ds_mla_nope --cases
glm5-next` catches it at every cache op, the dense decode too (tests/it/selfcheck_cache.rs). A run catches it at the runner's stages (lse[prefill]@runner /
attn_heads[prefill]@runner, attn_latent@runner / lse[decode]@runner) with everything upstream clean;
`lint --runner ... --kv-cache-dtype fp8_ds_mla` does not see it (its probe row has one scale in every
tile).
Needs: numpy.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class OneScale(numpy_mla.NumpyMLA):
    name = "numpy-bug-ds-mla-one-scale"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        rows = protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)
        if fmt not in ("fp8_ds_mla", "fp8_ds_mla_nope"):
            return rows
        latent, scales, _ = protocol.ds_mla_parts(cache, qk_rope)
        rows[..., :kv_lora_rank] = latent * scales[..., :1]
        return rows.astype(np.float32)


if __name__ == "__main__":
    protocol.main(OneScale)
