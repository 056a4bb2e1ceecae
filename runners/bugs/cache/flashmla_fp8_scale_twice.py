#!/usr/bin/env python3
"""Planted bug (issue #38 item 6): runners/flashmla.py over the per-tensor `fp8` cache passing the
layer's scale twice (`descale_k` = scale², as a caller that folds a scale the writer already applied
into the descale), so FlashMLA's dense fp8 decode reads every key as e4m3·s·s.

Only with `run --kv-cache-dtype fp8`; otherwise runners/flashmla.py unchanged. mla-diff must catch it at
attn_latent@runner and lse[decode]@runner (exit 1); `lint --kv-cache-dtype fp8` names the convention.
Needs what runners/flashmla.py needs (an SM90 GPU, torch, sgl-flash-mla's dense fp8 decode).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import flashmla  # noqa: E402
import protocol  # noqa: E402


class FlashMLAFp8ScaleTwice(flashmla.FlashMLA):
    def fp8_inputs(self, q, cache, meta):
        q8, k8, kw = super().fp8_inputs(q, cache, meta)
        kw["descale_k"] = kw["descale_k"] * kw["descale_k"]
        return q8, k8, kw


if __name__ == "__main__":
    protocol.main(FlashMLAFp8ScaleTwice)
