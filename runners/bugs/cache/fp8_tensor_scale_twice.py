#!/usr/bin/env python3
"""Planted bug (issue #38): reading the per-tensor `fp8` cache, the layer's scale is applied twice
(e4m3·s·s), numpy's copy of runners/bugs/cache/flashmla_fp8_scale_twice.py (`descale_k` = s²) for the
CPU: with `MLA_DIFF_NUMPY_Q_FP8=1 MLA_DIFF_NUMPY_P_FP8=1 MLA_DIFF_NUMPY_NO_SPLITS=1` it reads as
FlashMLA's dense fp8 decode does, bug included.

Decode only, and only with `run --kv-cache-dtype fp8`; otherwise runners/numpy_mla.py unchanged.
mla-diff must catch it at attn_latent@runner (and lse[decode]@runner).
Needs: numpy.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class Fp8TensorScaleTwice(numpy_mla.NumpyMLA):
    name = "numpy-bug-fp8-tensor-scale-twice"

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        if fmt == "fp8" and scale is not None:
            scale = float(scale) * float(scale)
        return super().dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)


if __name__ == "__main__":
    protocol.main(Fp8TensorScaleTwice)
