"""FlashMLA's dense decode (flash_mla_with_kvcache) checked by the mla-diff pytest plugin on the GPU
(docs/pytest.md, "On the H200"). The kernel is called exactly as runners/flashmla.py calls it (that
runner's own code, imported), on case tensors that live on the GPU; the check copies the outputs to
the host. Skips without an SM90 GPU or without flash_mla.

    pytest examples/pytest/test_flashmla_h200.py --mla-diff-model fixtures/glm-5-q4_0.gguf \\
        --mla-diff-device cuda --mla-diff-schedule page_size=64,decode_steps=4
"""

import os
import sys

import pytest

import mla_diff

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "runners"))


@pytest.fixture(scope="module")
def flashmla():
    import flashmla as runner  # runners/flashmla.py

    r = runner.FlashMLA()
    problem = r.environment_problem()
    if problem:
        pytest.skip(problem)
    return r


@pytest.mark.mla_diff_sm90
@pytest.mark.mla_diff_dtype("bf16", "fp16")
def test_flashmla_dense_decode(mla_decode_case, flashmla):
    x = mla_decode_case.tensors(device="cuda")
    meta = mla_decode_case.meta
    if meta["page_size"] != 64 or x["q_nope"].shape[-1] != 512:
        pytest.skip("FlashMLA's dense decode takes page 64 and a 512 + 64 latent only")
    def kernel(inputs, m):
        o = flashmla.decode(inputs, m)
        return o["attn_latent"], o["lse"]

    out, lse = kernel(x, meta)
    # FlashMLA's LSE is [B, H, s_q]; kernel= answers the layer's serving batch.
    mla_diff.assert_mla_close(mla_decode_case, out=out, lse=lse, lse_layout="head_token", kernel=kernel)
