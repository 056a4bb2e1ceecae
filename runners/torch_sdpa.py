#!/usr/bin/env python3
"""torch_sdpa: the decompressed MLA prefill that vLLM's `forward_mha` runs with FLASH_ATTN, through
torch's scaled-dot-product attention kernels (mla-diff runner protocol 1, docs/runners.md).

What it runs (prefill only): the chunk's queries against the cached context, non-causal, and against
the chunk itself, causal (top-left aligned on the square n x n block: query i sees chunk keys 0..i),
each by one SDPA kernel call that also returns the log-sum-exp, then the two partial results merged
by their LSEs (`merge_states`: the arithmetic of vLLM's `merge_attn_states`, float32, written here
in torch). With no context the chunk part is the answer.

The kernel (env MLA_DIFF_SDPA_BACKEND, default `flash`):
- `flash`: torch.ops.aten._scaled_dot_product_flash_attention (CUDA, bf16/fp16) or
  _scaled_dot_product_flash_attention_for_cpu (CPU, any float dtype). Flash kernels need one head
  dim for q, k and v, so v is zero-padded to the qk head dim and the output sliced back, which is
  what vLLM does for FlashAttention builds without different-head-dim support (GLM-5: qk 256 = v
  256 needs no pad; DeepSeek: qk 192, v 128 padded). On CUDA with f32 inputs, `efficient` is used.
- `efficient`: _scaled_dot_product_efficient_attention (CUDA; any head dims, f32 too).
- `cudnn`: _scaled_dot_product_cudnn_attention (CUDA, bf16/fp16; any head dims).
- `math`: float32 matmuls and an explicit logsumexp (any device; a reference, not a kernel).
All return a natural-log LSE in float32.

Conventions: softmax scale = meta `softmax_scale` (passed explicitly; SDPA's default 1/sqrt(qk) is
wrong whenever YaRN's mscale applies); outputs `attn_heads` [n, H, v_head_dim] in the input dtype
and `lse` [n, H] float32 natural log (`token_head`). q/k head dim (qk_nope + qk_rope) may differ from
v_head_dim. Device: CUDA when available, else CPU (env MLA_DIFF_DEVICE=cpu|cuda overrides).

`sdpa_part` and `merge_states` are imported by runners/vllm_triton.py.

Needs: torch (2.1+; tested with 2.11), safetensors.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402

BACKENDS = ("flash", "efficient", "cudnn", "math")


def pick_device():
    import torch

    want = os.environ.get("MLA_DIFF_DEVICE")
    if want:
        return torch.device(want)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sdpa_part(q, k, v, scale, causal, backend="flash"):
    """One attention call. q [1,H,n,D], k [1,H,S,D], v [1,H,S,Dv] -> (out [1,H,n,Dv] in q's dtype,
    lse [1,H,n] float32 natural log). `causal` is top-left aligned (query i sees keys 0..i)."""
    import torch

    aten = torch.ops.aten
    dv, dqk = v.shape[-1], q.shape[-1]
    if backend == "flash" and q.is_cuda and q.dtype == torch.float32:
        backend = "efficient"
    if backend == "flash":
        vp = v if dv == dqk else torch.nn.functional.pad(v, (0, dqk - dv)) if dv < dqk else None
        if vp is None:
            raise protocol.Unsupported(f"flash: v head dim {dv} > qk head dim {dqk} cannot be padded")
        if q.is_cuda:
            r = aten._scaled_dot_product_flash_attention(q, k, vp, 0.0, causal, False, scale=scale)
        else:
            r = aten._scaled_dot_product_flash_attention_for_cpu(q, k, vp, 0.0, causal, scale=scale)
        out, lse = r[0][..., :dv], r[1]
    elif backend == "efficient":
        r = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        out, lse = r[0], r[1]
    elif backend == "cudnn":
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        out, lse = r[0], r[1]
    elif backend == "math":
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if causal:
            n, kk = s.shape[-2], s.shape[-1]
            mask = torch.ones(n, kk, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    else:
        raise ValueError(f"unknown SDPA backend {backend!r} (one of {BACKENDS})")
    n = q.shape[-2]
    while lse.dim() > 3:  # cuDNN's softmax stats may come as [B, H, n, 1]
        lse = lse.squeeze(-1)
    # Some kernels pad the LSE's token axis (the efficient kernel to a multiple of 32 in older torch).
    return out, lse[..., :n].float()


def merge_states(o1, l1, o2, l2, out_dtype):
    """Merge two partial attentions by their LSEs, float32 (vLLM's merge_attn_states arithmetic).
    o [n,H,Dv], l [H,n] natural log -> (out [n,H,Dv] out_dtype, lse [H,n] float32)."""
    import torch

    l1, l2 = l1.float(), l2.float()
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    z = w1 + w2
    out = (o1.float() * (w1 / z).transpose(0, 1).unsqueeze(-1) + o2.float() * (w2 / z).transpose(0, 1).unsqueeze(-1)).to(out_dtype)
    return out, m + torch.log(z)


def prefill_parts(x, meta, backend):
    """The two SDPA calls of a chunk with context. Returns (context (out [n,H,Dv], lse [H,n]) or None,
    chunk (out, lse)), outputs in the input dtype, LSEs float32."""
    q, k, v = x["q"], x["k"], x["v"]
    n = q.shape[0]
    ctx = int(meta.get("context_len", k.shape[0] - n))
    if ctx + n != k.shape[0]:
        raise ValueError(f"k has {k.shape[0]} rows, expected context_len {ctx} + {n}")
    scale = float(meta["softmax_scale"])

    def heads_first(t):
        return t.permute(1, 0, 2).unsqueeze(0).contiguous()

    qh = heads_first(q)
    parts = []
    for lo, hi, causal in ((0, ctx, False), (ctx, ctx + n, True)):
        if hi <= lo:
            parts.append(None)
            continue
        o, l = sdpa_part(qh, heads_first(k[lo:hi]), heads_first(v[lo:hi]), scale, causal, backend)
        parts.append((o[0].permute(1, 0, 2).contiguous(), l[0].contiguous()))
    return parts[0], parts[1]


def version_line(extra=""):
    import torch

    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    return f"torch {torch.__version__}{cuda}{extra}"


class TorchSdpa(protocol.TorchRunner):
    def __init__(self):
        self.backend = os.environ.get("MLA_DIFF_SDPA_BACKEND", "flash")

    def environment_problem(self):
        try:
            import torch  # noqa: F401
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            return f"torch_sdpa needs torch and safetensors: {e}"
        if self.backend not in BACKENDS:
            return f"MLA_DIFF_SDPA_BACKEND={self.backend} is not one of {', '.join(BACKENDS)}"
        self.device = pick_device()
        if self.backend in ("efficient", "cudnn") and self.device.type != "cuda":
            return f"SDPA backend {self.backend} needs CUDA (device is {self.device})"
        return None

    def describe(self):
        dev = self.device
        if dev.type == "cuda":
            import torch

            dev = f"{torch.cuda.get_device_name(dev)}"
        return {
            "protocol": protocol.PROTOCOL,
            "name": "torch-sdpa",
            "version": version_line(f", SDPA backend {self.backend} on {dev}, LSE merge in float32"),
            "ops": {"prefill": {"outputs": ["attn_heads", "lse"]}},
            "supports": {
                "dtypes": ["bf16", "fp16", "f32"],
                "page_sizes": None,
                "heads": None,
                "kv_lora_rank": None,
                "qk_rope": None,
                "qk_head_dim": None,
                "v_head_dim": None,
                "max_q_len": None,
            },
            "conventions": {"lse_base": "e", "lse_layout": "token_head"},
        }

    def prefill_kernel(self, x, meta):
        """A whole causal prompt (no context) as one SDPA launch on prepared heads-first buffers (`run`)
        and its outputs (`collect`): what `mla-diff bench prefill --peers torch` times."""
        if int(meta.get("context_len", 0)) != 0:
            raise protocol.Unsupported("bench: prefill_kernel times a chunk without context only")
        scale = float(meta["softmax_scale"])

        def heads_first(t):
            return t.permute(1, 0, 2).unsqueeze(0).contiguous()

        q, k, v = heads_first(x["q"]), heads_first(x["k"]), heads_first(x["v"])
        res = {}

        def run():
            res["o"], res["l"] = sdpa_part(q, k, v, scale, True, self.backend)

        def collect():
            return {"attn_heads": res["o"][0].permute(1, 0, 2).contiguous(), "lse": res["l"][0].transpose(0, 1).contiguous()}

        return run, collect

    def prefill(self, x, meta):
        import torch

        with torch.no_grad():
            ctx, chunk = prefill_parts(x, meta, self.backend)
            if ctx is None:
                out, lse = chunk
            else:
                out, lse = merge_states(ctx[0], ctx[1], chunk[0], chunk[1], x["q"].dtype)
        return {"attn_heads": out, "lse": lse.transpose(0, 1).contiguous()}


if __name__ == "__main__":
    r = TorchSdpa()
    protocol.serve(prefill=r.prefill, describe=r.describe, environment=r.environment_problem, codec=r,
                   kernels={"prefill": r.prefill_kernel})
