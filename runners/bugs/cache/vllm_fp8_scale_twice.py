#!/usr/bin/env python3
"""Planted bug (issue #38 item 6): runners/vllm_triton.py over the per-tensor `fp8` cache passing the
layer's scale twice (`k_scale` = `v_scale` = scale²), so vLLM's Triton decode reads every latent and
rope value as e4m3·s·s.

Only with `run --kv-cache-dtype fp8`; otherwise runners/vllm_triton.py unchanged. mla-diff must catch it
at attn_latent@runner, lse[decode]@runner and split_out@runner (exit 1); `lint --kv-cache-dtype fp8` names
the convention. Needs what runners/vllm_triton.py needs (a CUDA GPU, torch, triton, vLLM's Triton decode).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import protocol  # noqa: E402
import vllm_triton  # noqa: E402


class VllmFp8ScaleTwice(vllm_triton.VllmTriton):
    def environment_problem(self):
        problem = super().environment_problem()
        if problem is None:
            fwd = self.decode_fwd

            def scale_twice(*args, k_scale=None, v_scale=None, **kw):
                if k_scale is not None:
                    k_scale, v_scale = k_scale * k_scale, v_scale * v_scale
                return fwd(*args, k_scale=k_scale, v_scale=v_scale, **kw)

            self.decode_fwd = scale_twice
        return problem


if __name__ == "__main__":
    protocol.main(VllmFp8ScaleTwice)
