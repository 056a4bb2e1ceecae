#!/usr/bin/env python3
"""numpy_sparse: numpy_mla's sparse ops alone, as a mla-diff runner (protocol 1, ops `sparse_prefill`
and `sparse_decode`; docs/runners.md, docs/dsa.md): DSA attention past the indexer's top_k, each query
over the cache slots its index row names, in float32 (runners/numpy_mla.py `sparse_attend`).

The plain numpy counterpart of runners/flashmla_sparse.py, with no kernel constraint: any dims, heads,
top_k, page size, dtypes bf16/fp16/f32, and every quantized cache format mla-diff writes
(`supports.cache_formats`; `run --kv-cache-dtype FMT` sends both ops the cache as the format's bytes,
read here through the runner SDK's `dequantize_cache`). It declares no dense op: on a dense layer (a
model without an indexer, or a schedule within top_k) a run refuses it, as FlashMLA's sparse runner.

Its hooks are numpy_mla's (`dequantize_cache`, `softmax_scale`, `pv`, `lse_out`): the planted-bug
copies in runners/bugs/sparse/ override them.

Needs: Python 3.8+, numpy.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class NumpySparse(numpy_mla.NumpyMLA):
    name = "numpy_sparse"

    def describe(self):
        d = super().describe()
        d["version"] = d["version"].replace("numpy_mla.py", "numpy_sparse.py")
        d["ops"] = {
            "sparse_prefill": {"outputs": ["attn_latent", "lse"]},
            "sparse_decode": {"outputs": ["attn_latent", "lse"]},
        }
        return d


if __name__ == "__main__":
    protocol.main(NumpySparse)
