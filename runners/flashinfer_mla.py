#!/usr/bin/env python3
"""flashinfer_mla: FlashInfer's paged MLA decode as a mla-diff runner (protocol 1, docs/runners.md).

What it runs: `flashinfer.mla.BatchMLAPagedAttentionWrapper`, planned and run once per request the way
SGLang's FlashInfer MLA backend uses it:
- the caches are strided views of mla-diff's `[pages, page, 576]` cache: ckv = `[..., :512]`,
  kpe = `[..., 512:]` (no copy);
- pages in CSR form: `kv_indptr` (B+1) and `kv_indices` = each entry's first ceil(L/page) block-table
  slots; `kv_len_arr` = cache_seqlens; `qo_indptr` = b * q_len;
- `plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, H, 512, 64, page_size, causal=q_len > 1,
  sm_scale=meta softmax_scale, q dtype, kv dtype)` (the positional form every version since 0.2
  takes; 0.7 warns that it is deprecated), then `run(q_nope=[T,H,512], q_pe=[T,H,64], ckv_cache,
  kpe_cache, return_lse=True)` plus `return_lse_base_on_e=True` where `run` takes it.
  Causal with q_len > 1 is FlashInfer's bottom-right alignment: query i sees L - q_len + i + 1 keys.
- backend: env MLA_DIFF_FLASHINFER_BACKEND (default "auto": fa3 on SM90, fa2 elsewhere).

Conventions: `attn_latent` [B, q_len, H, 512] in the input dtype; `lse` [T, H] float32 reshaped to
[B, q_len, H] (`token_head`); LSE base e when `return_lse_base_on_e` exists (FlashInfer >= 0.2.x
with that flag), else FlashInfer's default base 2 (describe says which, mla-diff multiplies by ln 2).
Supports bf16/fp16, kv_lora_rank 512 + rope 64, any page size, any head count, any q_len.

Needs: a CUDA GPU, torch, safetensors, flashinfer-python, and either FlashInfer's precompiled kernels
(flashinfer-jit-cache / flashinfer-cubin) or nvcc + ninja for its JIT, which compiles the MLA module on
first use (minutes). flashinfer-python 0.7.4 is a 101 MB wheel (716 MB unpacked) that needs
apache-tvm-ffi, nvidia-cutlass-dsl, cuda-tile, nccl4py and more, and `import flashinfer` imports all
of its submodules: it does not fit the 64 MiB the GPU machine here can be sent, so there this
runner exits 3 with the import error (see runners/fetch_peers.sh, FLASHINFER=1, for the numbers).
"""

import inspect
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402

KV_LORA, ROPE = 512, 64
WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferMLA(protocol.TorchRunner):
    def __init__(self):
        self.backend = os.environ.get("MLA_DIFF_FLASHINFER_BACKEND", "auto")

    def environment_problem(self):
        try:
            import torch
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            return f"flashinfer_mla needs torch and safetensors: {e}"
        if not torch.cuda.is_available():
            return "flashinfer_mla needs a CUDA GPU; torch.cuda.is_available() is False"
        self.device = torch.device("cuda")
        try:
            import flashinfer
            from flashinfer.mla import BatchMLAPagedAttentionWrapper
        except Exception as e:  # noqa: BLE001
            return (
                f"cannot import flashinfer.mla ({type(e).__name__}: {e}); needs flashinfer-python and its "
                "dependencies (too large to carry to the GPU machine here: see runners/flashinfer_mla.py)"
            )
        self.fi = flashinfer
        self.wrapper_cls = BatchMLAPagedAttentionWrapper
        self.lse_on_e = "return_lse_base_on_e" in inspect.signature(BatchMLAPagedAttentionWrapper.run).parameters
        have_cache = any(_has_module(m) for m in ("flashinfer_jit_cache", "flashinfer_cubin"))
        nvcc = shutil.which("nvcc") or _cuda_home_nvcc()
        if not have_cache and not (nvcc and shutil.which("ninja")):
            return (
                "FlashInfer has no precompiled kernels here (flashinfer-jit-cache / flashinfer-cubin absent) and "
                f"cannot JIT-compile them (nvcc: {nvcc or 'not found'}, ninja: {shutil.which('ninja') or 'not found'})"
            )
        self.jit_note = "precompiled kernels" if have_cache else f"JIT with {nvcc}"
        self.workspace = None
        return None

    def describe(self):
        import torch

        return {
            "protocol": protocol.PROTOCOL,
            "name": "flashinfer-mla",
            "version": (
                f"flashinfer {getattr(self.fi, '__version__', '?')}: BatchMLAPagedAttentionWrapper backend={self.backend}, "
                f"{self.jit_note}; LSE {'base e (return_lse_base_on_e)' if self.lse_on_e else 'base 2 (default)'}; "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(self.device)}"
            ),
            "ops": {"decode": {"outputs": ["attn_latent", "lse"]}},
            "supports": {
                "dtypes": ["bf16", "fp16"],
                "page_sizes": None,
                "heads": None,
                "kv_lora_rank": [KV_LORA],
                "qk_rope": [ROPE],
                "qk_head_dim": None,
                "v_head_dim": None,
                "max_q_len": None,
            },
            "conventions": {"lse_base": "e" if self.lse_on_e else "2", "lse_layout": "token_head"},
        }

    def decode(self, x, meta):
        import torch

        q_nope, q_pe, cache = x["q_nope"], x["q_pe"], x["kv_cache"]
        b_n, s_q, heads, lkv = q_nope.shape
        rope = q_pe.shape[-1]
        if (lkv, rope) != (KV_LORA, ROPE):
            raise protocol.Unsupported(f"latent {lkv} + rope {rope}: this runner plans FlashInfer's MLA for 512 + 64")
        if q_nope.dtype not in (torch.bfloat16, torch.float16):
            raise protocol.Unsupported(f"dtype {q_nope.dtype}: FlashInfer's MLA runs bf16/fp16")
        page = int(meta.get("page_size") or cache.shape[1])
        if cache.shape[1] != page:
            raise ValueError(f"kv_cache page axis is {cache.shape[1]}, meta page_size {page}")
        dev = q_nope.device
        seqlens = x["cache_seqlens"].to(torch.int32)
        table = x["block_table"].to(torch.int32)
        n_pages = [(int(L) + page - 1) // page for L in seqlens.tolist()]
        kv_indices = torch.cat([table[b, :n] for b, n in enumerate(n_pages)]).contiguous()
        kv_indptr = torch.tensor([0] + n_pages, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
        qo_indptr = torch.arange(b_n + 1, dtype=torch.int32, device=dev) * s_q
        if self.workspace is None:
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        with torch.no_grad():
            w = self.wrapper_cls(self.workspace, backend=self.backend)
            try:
                w.plan(
                    qo_indptr, kv_indptr, kv_indices, seqlens.contiguous(), heads, KV_LORA, ROPE, page,
                    s_q > 1, float(meta["softmax_scale"]), q_nope.dtype, cache.dtype,
                )
            except Exception as e:  # noqa: BLE001 - a JIT build or a backend refusing the shape
                protocol.log(f"flashinfer plan failed: {type(e).__name__}: {e}")
                raise protocol.Unsupported(f"FlashInfer could not plan/build its MLA kernel: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            kw = {"return_lse_base_on_e": True} if self.lse_on_e else {}
            out, lse = w.run(
                q_nope=q_nope.reshape(b_n * s_q, heads, lkv).contiguous(),
                q_pe=q_pe.reshape(b_n * s_q, heads, rope).contiguous(),
                ckv_cache=cache[:, :, :KV_LORA],
                kpe_cache=cache[:, :, KV_LORA:],
                return_lse=True,
                **kw,
            )
            torch.cuda.synchronize(dev)
        return {
            "attn_latent": out.reshape(b_n, s_q, heads, lkv).contiguous(),
            "lse": lse.float().reshape(b_n, s_q, heads).contiguous(),
        }


def _has_module(name):
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cuda_home_nvcc():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


if __name__ == "__main__":
    r = FlashInferMLA()
    protocol.serve(decode=r.decode, describe=r.describe, environment=r.environment_problem, codec=r)
