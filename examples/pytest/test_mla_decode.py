"""A kernel author's test file (docs/pytest.md): two MLA decode kernels checked by the mla-diff pytest
plugin on cases from a real model's weights.

    pytest examples/pytest --mla-diff-model fixtures/deepseek-v3-yarn-q4_k.gguf

`MLA_DIFF_EXAMPLE_BUG=scale` plants a bug in both kernels: the softmax scale FlashMLA defaults to,
q.shape[-1] ** -0.5 (576 ** -0.5), in place of the model's (YaRN mscale included).
"""

import os

import numpy as np
import pytest

import mla_diff


def softmax_scale(x, meta):
    if os.environ.get("MLA_DIFF_EXAMPLE_BUG") == "scale":
        return (x["q_nope"].shape[-1] + x["q_pe"].shape[-1]) ** -0.5
    return meta["softmax_scale"]


def gather(cache, table_row, length, page):
    """The first `length` rows of one sequence through its block table (the rest of the cache is NaN)."""
    t = np.arange(length)
    return cache.reshape(-1, cache.shape[-1])[table_row[t // page] * page + t % page]


def numpy_decode(x, meta):
    """The reference decode: float32 softmax over the paged latent cache. Returns (attn_latent [B, s_q,
    H, Lkv], lse [B, s_q, H])."""
    qn, qp, cache = x["q_nope"], x["q_pe"], x["kv_cache"]
    b_n, s_q, heads, r = qn.shape
    q = np.concatenate([qn, qp], -1).astype(np.float32)
    out = np.zeros((b_n, s_q, heads, r), np.float32)
    lse = np.zeros((b_n, s_q, heads), np.float32)
    for b in range(b_n):
        length = int(x["cache_seqlens"][b])
        rows = gather(cache, x["block_table"][b].astype(np.int64), length, meta["page_size"]).astype(np.float32)
        s = np.einsum("shd,kd->shk", q[b], rows) * np.float32(softmax_scale(x, meta))
        # Query i of an s_q-token step sees length - s_q + i + 1 keys (MTP).
        visible = np.arange(length)[None, :] < (length - s_q + np.arange(s_q) + 1)[:, None]
        s = np.where(visible[:, None, :], s, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        z = p.sum(-1, keepdims=True)
        out[b] = (p / z) @ rows[:, :r]
        lse[b] = (m + np.log(z))[..., 0]
    return out, lse


def sdpa_decode(x, meta):
    """torch's scaled_dot_product_attention per sequence, the latent as value (absorbed MLA)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    t = {k: torch.as_tensor(np.asarray(v)) for k, v in x.items()}
    b_n, s_q, heads, r = t["q_nope"].shape
    q = torch.cat([t["q_nope"], t["q_pe"]], -1).float()
    outs, lses = [], []
    for b in range(b_n):
        length = int(t["cache_seqlens"][b])
        rows = torch.as_tensor(gather(x["kv_cache"], np.asarray(x["block_table"][b]).astype(np.int64), length,
                                      meta["page_size"])).float()
        visible = torch.arange(length)[None, :] < (length - s_q + torch.arange(s_q) + 1)[:, None]
        qb = q[b].transpose(0, 1)  # [H, s_q, D]
        k, v = rows[None].expand(heads, -1, -1), rows[None, :, :r].expand(heads, -1, -1)
        scale = softmax_scale(x, meta)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=visible, scale=scale)
        s = (qb @ k.transpose(-1, -2)) * scale
        lses.append(torch.logsumexp(s.masked_fill(~visible, float("-inf")), -1).transpose(0, 1))
        outs.append(o.transpose(0, 1))
    return torch.stack(outs).to(torch.bfloat16 if meta["dtype"] == "bf16" else torch.float16 if meta["dtype"] == "fp16"
                                else torch.float32), torch.stack(lses)


KERNELS = {"numpy": numpy_decode, "torch-sdpa": sdpa_decode}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_decode(mla_decode_case, kernel):
    out, lse = KERNELS[kernel](mla_decode_case.inputs, mla_decode_case.meta)
    # The kernels store attn_latent in the run's dtype, as an engine's does (numpy: rounded by the check);
    # kernel= answers the layer's serving batch (mixed lengths, padded rows) that the run also sends.
    mla_diff.assert_mla_close(mla_decode_case, out=out, lse=lse, out_dtype=mla_decode_case.dtype,
                              kernel=KERNELS[kernel])
