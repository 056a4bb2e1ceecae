#!/usr/bin/env python3
"""vllm_triton: vLLM's TRITON_MLA attention as a mla-diff runner (protocol 1, docs/runners.md).

What it runs:
- decode: `decode_attention_fwd` from `vllm.v1.attention.ops.triton_decode_attention`, called the
  way `TritonMLAImpl.forward_mqa` (vllm/v1/attention/backends/mla/triton_mla.py, 0.33.0) calls it:
  q = [q_nope | q_pe] `[B, H, Lkv+rope]`, the cache viewed `[pages, page, 1, Lkv+rope]` with
  v = its first Lkv columns, `o` zeroed in q's dtype, **`lse` allocated in q's dtype** (bf16/fp16,
  as TritonMLAImpl does; the report records it), scratch `attn_logits [B, H, S, Lkv+1]` float32,
  `num_kv_splits` = meta `num_splits` (vLLM picks its own from the longest sequence), page size =
  meta `page_size`, `sm_scale` = meta `softmax_scale`, `is_mla=True` where the function takes it.
  The split partials come back from `attn_logits` (each split's normalised output and its natural-log
  LSE in the last slot; vLLM's partition is the protocol's). The scratch is filled with 0 / −inf
  first, so the splits the kernel skips (empty ones) read as the protocol wants.
  One query per request (q_len 1): decode_attention_fwd has no causal mask. (vLLM 0.33's forward_mqa
  does run MTP by flattening each request's q_len rows to single-query rows with per-row lengths,
  but the split partitions of those rows are not the protocol's, so it is not offered here.)
- prefill: the decompressed chunk as `forward_mha` computes it: context part (non-causal) and chunk
  part (causal) by torch SDPA (runners/torch_sdpa.py's `sdpa_part`; vLLM itself uses its
  FlashAttention build here), merged by vLLM's `merge_attn_states` (LSE layout [H, T], natural log).
  When vLLM's compiled `vllm._C` is not importable (always with the extracted modules), the merge
  is its Triton kernel from `vllm.v1.attention.ops.triton_merge_attn_states`, the one vLLM's
  dispatcher falls back to; describe's version says which.

fp8 cache (`run --kv-cache-dtype fp8`; `supports.cache_formats`, where decode_attention_fwd takes
`k_scale`): the decode's `kv_cache` comes as u8 bytes of the per-tensor `fp8` format, handed to the
kernel unchanged as a float8_e4m3fn view (vLLM's CUDA fp8 cache dtype) with `meta.cache.scale` as a
0-dim float32 `k_scale` and `v_scale` both (TritonMLAImpl passes the layer's `_k_scale` for both: the
latent is K and V). The kernel multiplies e4m3·ks in float32 and rounds the product to q's dtype before
its dots, the nope and the rope columns alike (`_fwd_grouped_kernel_stage1`: `k = (k.to(tl.float32) *
ks).to(q.dtype)`, `kpe = (kpe.to(tl.float32) * ks).to(qpe.dtype)`), and with `is_mla` its V is those
same rounded rows (`v = tl.trans(k)`), so the runner declares `conventions.cache_dequant: "dtype"`:
mla-diff judges it over the rows so rounded. q stays in the run's dtype.

Conventions: lse_base e, lse_layout head_token (decode [B, H, 1], prefill [H, n]); decode LSE in
q's dtype, prefill LSE float32; outputs in the input dtype; split partials float32.
Supports bf16/fp16 (TritonMLABackend's dtypes), latent 512 + rope 64 (DeepSeek, GLM-5, Kimi) and
256 + 32 (MiniCPM3), which the kernel tiles exactly; any page size (vLLM itself asks for multiples
of 16), any head count.

Needs: a CUDA GPU, torch, triton, safetensors, packaging, and vLLM -- installed, or just the modules
runners/fetch_peers.sh extracts from the vllm 0.33.0 wheel into .carry/peers (on PYTHONPATH), with
small shims for vllm.platforms and vllm.triton_utils. When the import fails the runner exits 3
(unsupported) naming the failure.
"""

import importlib.util
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402


def _vllm_version():
    try:
        import vllm

        v = getattr(vllm, "__version__", "?")
        how = getattr(vllm, "MLA_DIFF_EXTRACTED", None)
        return f"vllm {v}" + (f" ({how})" if how else "")
    except Exception as e:  # noqa: BLE001
        return f"vllm (version unknown: {e})"


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class VllmTriton(protocol.TorchRunner):
    def __init__(self):
        self.sdpa_backend = os.environ.get("MLA_DIFF_SDPA_BACKEND", "flash")

    def environment_problem(self):
        try:
            import torch
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            return f"vllm_triton needs torch and safetensors: {e}"
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"vllm_triton needs triton: {e}"
        from torch_sdpa import pick_device

        self.device = pick_device()
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            # (TRITON_INTERPRET=1 MLA_DIFF_DEVICE=cpu runs the Triton kernels in Triton's CPU
            # interpreter: slow, for checking this runner's plumbing without a GPU.)
            return "vllm_triton needs a CUDA GPU (torch.cuda.is_available() is False)"
        try:
            from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
        except Exception as e:  # noqa: BLE001
            return (
                "cannot import vllm.v1.attention.ops.triton_decode_attention "
                f"({type(e).__name__}: {e}); install vllm or put runners/fetch_peers.sh's .carry/peers on PYTHONPATH"
            )
        self.decode_fwd = decode_attention_fwd
        self.decode_kwargs = {}
        params = inspect.signature(decode_attention_fwd).parameters
        if "is_mla" in params:
            self.decode_kwargs["is_mla"] = True
        self.fp8 = "k_scale" in params and "v_scale" in params
        try:
            if importlib.util.find_spec("vllm._C") is not None:
                from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

                self.merge_name = "merge_attn_states (vllm._C CUDA kernel or vLLM's own dispatch)"
            else:
                from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states

                self.merge_name = "triton_merge_attn_states (vllm._C absent)"
        except Exception as e:  # noqa: BLE001
            return f"cannot import vLLM's merge_attn_states ({type(e).__name__}: {e})"
        self.merge = merge_attn_states
        return None

    def describe(self):
        import torch
        import triton

        from torch_sdpa import version_line

        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "Triton interpreter on CPU"
        return {
            "protocol": protocol.PROTOCOL,
            "name": "vllm-triton-mla",
            "version": (
                f"{_vllm_version()}: decode_attention_fwd{' is_mla' if self.decode_kwargs else ''}"
                f"{' (fp8 cache: k_scale/v_scale)' if self.fp8 else ''}; prefill torch SDPA "
                f"({self.sdpa_backend}) + {self.merge_name}; {version_line()}, triton {triton.__version__}, "
                f"{dev}"
            ),
            "ops": {
                "decode": {"outputs": ["attn_latent", "lse", "split_out", "split_lse"]},
                "prefill": {"outputs": ["attn_heads", "lse"]},
            },
            "supports": {
                "dtypes": ["bf16", "fp16"],
                "page_sizes": None,
                "heads": None,
                "kv_lora_rank": [256, 512],
                "qk_rope": [32, 64],
                "qk_head_dim": None,
                "v_head_dim": None,
                "max_q_len": 1,
                **({"cache_formats": ["fp8"]} if self.fp8 else {}),
            },
            "conventions": {"lse_base": "e", "lse_layout": "head_token",
                            **({"cache_dequant": "dtype"} if self.fp8 else {})},
        }

    def decode_kernel(self, x, meta):
        """`decode_attention_fwd` as a launch on prepared buffers (`run`) and its outputs (`collect`):
        what `mla-diff bench --peers` times."""
        import torch

        q_nope, q_pe, cache = x["q_nope"], x["q_pe"], x["kv_cache"]
        b_n, s_q, heads, lkv = q_nope.shape
        if s_q != 1:
            raise protocol.Unsupported(f"q_len {s_q}: decode_attention_fwd takes one query per request")
        if q_nope.dtype not in (torch.bfloat16, torch.float16):
            raise protocol.Unsupported(f"dtype {q_nope.dtype}: TRITON_MLA runs bf16/fp16")
        page = int(meta["page_size"])
        if cache.shape[1] != page:
            raise ValueError(f"kv_cache page axis is {cache.shape[1]}, meta page_size {page}")
        n_splits = int(meta.get("num_splits") or 1)
        scale = float(meta["softmax_scale"])
        q = torch.cat([q_nope, q_pe], dim=-1)[:, 0].contiguous()  # [B, H, Lkv+rope]
        scales = {}
        cm = meta.get("cache") or {}
        if cm.get("format") is not None:
            if cm["format"] != "fp8" or not self.fp8:
                raise protocol.Unsupported(f"cache format {cm['format']}: this decode_attention_fwd reads the per-tensor fp8 cache only")
            if cache.dtype != torch.uint8 or cache.shape[-1] != q.shape[-1]:
                raise ValueError(f"kv_cache {tuple(cache.shape)} {cache.dtype}: an fp8 cache is u8 [pages, page, {q.shape[-1]}]")
            cache = cache.view(torch.float8_e4m3fn)  # the bytes as sent: no copy, nothing written
            ks = torch.tensor(float(cm["scale"]), dtype=torch.float32, device=q.device)
            scales = {"k_scale": ks, "v_scale": ks}
        kv = cache.unsqueeze(2)  # [pages, page, 1, Lkv+rope]
        v = kv[..., :lkv]
        o = torch.zeros(b_n, heads, lkv, dtype=q.dtype, device=q.device)
        lse = torch.zeros(b_n, heads, dtype=q.dtype, device=q.device)
        logits = torch.zeros(b_n, heads, n_splits, lkv + 1, dtype=torch.float32, device=q.device)
        logits[..., lkv] = float("-inf")
        table = x["block_table"].to(torch.int32).contiguous()
        seqlens = x["cache_seqlens"].to(torch.int32).contiguous()

        def run():
            self.decode_fwd(q, kv, v, o, lse, table, seqlens, logits, n_splits, scale, page, **scales,
                            **self.decode_kwargs)

        def collect():
            return {
                "attn_latent": o.unsqueeze(1),  # [B, 1, H, Lkv]
                "lse": lse.unsqueeze(-1),  # [B, H, 1] (head_token), q's dtype as vLLM stores it
                "split_out": logits[..., :lkv].unsqueeze(1).contiguous(),  # [B, 1, H, S, Lkv]
                "split_lse": logits[..., lkv].unsqueeze(1).contiguous(),  # [B, 1, H, S]
            }

        return run, collect

    def decode(self, x, meta):
        import torch

        with torch.no_grad():
            run, collect = self.decode_kernel(x, meta)
            run()
            _sync(x["q_nope"].device)
            return collect()

    def prefill(self, x, meta):
        import torch

        from torch_sdpa import prefill_parts

        if x["q"].dtype not in (torch.bfloat16, torch.float16):
            raise protocol.Unsupported(f"dtype {x['q'].dtype}: vLLM's MLA prefill runs bf16/fp16")
        with torch.no_grad():
            ctx, chunk = prefill_parts(x, meta, self.sdpa_backend)
            if ctx is None:
                out, lse = chunk
            else:
                n, heads, dv = chunk[0].shape
                out = torch.empty(n, heads, dv, dtype=x["q"].dtype, device=x["q"].device)
                lse = torch.empty(heads, n, dtype=torch.float32, device=x["q"].device)
                self.merge(out, ctx[0], ctx[1], chunk[0], chunk[1], lse)
            _sync(out.device)
        return {"attn_heads": out, "lse": lse.contiguous()}  # lse [H, n] (head_token)


if __name__ == "__main__":
    r = VllmTriton()
    protocol.serve(decode=r.decode, prefill=r.prefill, describe=r.describe, environment=r.environment_problem,
                   codec=r, kernels={"decode": r.decode_kernel})
