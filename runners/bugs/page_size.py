#!/usr/bin/env python3
"""Planted bug: addresses the paged cache with twice the given page size (token t read from
block_table[t // 2P] * 2P + t % 2P of the flattened cache), as a kernel compiled for one page size
and handed another would. It reads other entries' tokens and NaN rows.

Decode only; prefill is runners/numpy_mla.py's, unchanged.
mla-diff must catch it at attn_latent@runner (NaN or wrong values; also lse[decode]@runner), end to
end at attn_latent.
Needs: numpy.
"""
# selfcheck-expect: decode.attn_latent decode.lse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class PageSize(numpy_mla.NumpyMLA):
    name = "numpy-bug-page-size"

    def page_size(self, meta, cache):
        return 2 * int(meta.get("page_size") or cache.shape[1])


if __name__ == "__main__":
    protocol.main(PageSize)
