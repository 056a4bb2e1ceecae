#!/usr/bin/env python3
"""Planted bug: the softmax scale defaults to (kv_lora_rank + qk_rope)^-0.5 (576^-0.5 for DeepSeek)
instead of meta `softmax_scale` -- FlashMLA's `softmax_scale=None` default, wrong for every MLA model
(DeepSeek needs 192^-0.5 * mscale^2, GLM-5 256^-0.5).

Otherwise runners/numpy_mla.py unchanged (same describe, conventions and outputs).
mla-diff must catch it at the runner: attn_latent@runner and lse[decode]@runner (decode), attn_heads@runner
and lse[prefill]@runner (prefill); end to end at attn_latent / attn_heads.
Needs: numpy.
"""
# selfcheck-expect: decode.attn_latent decode.lse prefill.attn_heads prefill.lse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_mla  # noqa: E402
import protocol  # noqa: E402


class ScaleDefault(numpy_mla.NumpyMLA):
    name = "numpy-bug-scale-default"

    def softmax_scale(self, meta):
        return (int(meta["kv_lora_rank"]) + int(meta["qk_rope"])) ** -0.5


if __name__ == "__main__":
    protocol.main(ScaleDefault)
