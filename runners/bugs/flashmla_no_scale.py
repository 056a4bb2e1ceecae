#!/usr/bin/env python3
"""Planted bug: runners/flashmla.py calling `flash_mla_with_kvcache` without `softmax_scale`, so FlashMLA
uses its default q.shape[-1]^-0.5 = 576^-0.5 (DeepSeek needs 192^-0.5 * mscale^2, GLM-5 256^-0.5).

mla-diff must catch it at the runner's stage: attn_latent and lse[decode], end to end and @runner.
Needs what runners/flashmla.py needs (an SM90 GPU, torch, FlashMLA's dense decode).
"""
# selfcheck-expect: decode.attn_latent decode.lse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashmla  # noqa: E402
import protocol  # noqa: E402


class FlashMLANoScale(flashmla.FlashMLA):
    def decode(self, x, meta):
        call = self.fm.flash_mla_with_kvcache

        def without_scale(*args, **kw):
            kw.pop("softmax_scale", None)
            return call(*args, **kw)

        self.fm.flash_mla_with_kvcache = without_scale
        try:
            return super().decode(x, meta)
        finally:
            self.fm.flash_mla_with_kvcache = call


if __name__ == "__main__":
    protocol.main(FlashMLANoScale)
