#!/usr/bin/env python3
"""Planted bug (issue #38): with a quantized cache the decode rounds the dequantized rows to the run's
dtype before attending (as vLLM's Triton decode does over the `fp8` cache) but the runner's describe
does not say so (no `conventions.cache_dequant`), so mla-diff judges it over the rows as the format
decodes them.

Decode only, and only with `run --kv-cache-dtype FMT`; otherwise runners/numpy_mla.py unchanged.
mla-diff must fail it at the runner's stage (GLM-5 fp8 bf16, prompt 160, 2 decode steps, 2 splits:
split_lse@runner at ~10⁵ times the predicted noise). (Declared, `MLA_DIFF_NUMPY_CACHE_IN_DTYPE=1
numpy_mla.py`, the same reading passes.)
Needs: numpy.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class CacheInDtypeUndeclared(numpy_mla.NumpyMLA):
    name = "numpy-bug-cache-in-dtype-undeclared"

    def cache_in_dtype(self):
        return True

    def declares_cache_dequant(self):
        return False


if __name__ == "__main__":
    protocol.main(CacheInDtypeUndeclared)
