#!/usr/bin/env python3
"""flashmla: FlashMLA's dense bf16/fp16 MLA decode as a mla-diff runner (protocol 1, docs/runners.md).

What it runs: `flash_mla.flash_mla_with_kvcache` on the paged latent cache, as vLLM and SGLang call
it: q = [q_nope | q_pe] `[B, s_q, H, 576]`, the cache viewed `[pages, 64, 1, 576]`, the block table
and cache_seqlens as given, head_dim_v 512, `softmax_scale` = meta softmax_scale (**always passed**:
FlashMLA's default, q.shape[-1]^-0.5 = 576^-0.5, is wrong for every MLA model) and `causal=True`
when s_q > 1 (MTP: query i sees cache_seqlens - s_q + i + 1 keys, the protocol's rule).

Interfaces handled (detected with inspect.signature, not by version numbers):
- `get_mla_metadata`: the old one, `get_mla_metadata(cache_seqlens, s_q*h_q//h_kv, h_kv)` ->
  (tile_scheduler_metadata, num_splits), both passed on; or the new one (FlashMLA 2026-01, PR #150;
  sgl-flash-mla 1.0.0), no arguments -> (FlashMLASchedMeta, None), num_splits must be None. A fresh
  metadata object per request: it may only be reused while shapes and seqlens stay the same.
- `use_legacy=True` where flash_mla_with_kvcache takes it (sgl-flash-mla 1.0.0, whose dense decode
  lives only in the legacy SM90 extension; `flash_mla.has_legacy()` must be true).

Conventions: outputs `attn_latent` [B, s_q, H, 512] in the input dtype, `lse` FlashMLA's
[B, H, s_q] float32 natural log (`lse_layout: head_token`). No split partials (FlashMLA's split
schedule is its own). Supports bf16/fp16, page size 64, kv_lora_rank 512 + rope 64 (the dense kernel's
only shape), any head count, any q_len. Unsupported (exit 3 at start) without an SM90 GPU or
without an importable flash_mla; a request with another page size, dims or dtype gets "unsupported".

With an fp8 cache (`run --kv-cache-dtype fp8`; `supports.cache_formats`): the decode's `kv_cache` comes
as u8 bytes of the per-tensor `fp8` format, `meta.cache.scale` the layer's scale. They go to FlashMLA's
dense fp8 decode (`flash_mla_with_kvcache(..., is_fp8_kvcache=True, use_legacy=True, descale_q=,
descale_k=)`, the legacy SM90 `fwd_kvcache_mla_fp8`, PR #54's kernel) unchanged, viewed as
float8_e4m3fn, with the scale as `descale_k` (shape (1,), float32); its scheduler comes from
`get_mla_decoding_metadata(seqlens, s_q*h_q, 1, is_fp8_kvcache=True, use_legacy=True)` assigned onto a
FlashMLASchedMeta. That kernel takes q in e4m3 too (its check: "query and key must have the same
dtype") with a one-element `descale_q`, so the runner declares `conventions.q_fp8: "fp8"`: mla-diff
then sends q on the e4m3 grid of a power-of-two scale, `meta.q_scale`, and the cast here is exact
(checked: a q off that grid is an error). Without `meta.q_scale` (a lint probe) the same rule's scale is
taken over the q sent. Its P·V is an fp8 MMA too: P = exp2(s·scale − running max) is converted to
e4m3 as is (no scale; `convert_type_out(tOrP_acc, tOrP)` in `compute_attn_1rowblock_splitkv_mla`,
csrc/extension/sm90/dense_fp8/flash_fwd_mla_kernel.h), multiplied by the raw e4m3 cache, and the sum
is divided by the row sum of P unrounded times `descale_k` (softmax.h `normalize_softmax_lse`; the LSE
from that unrounded sum), so the runner declares `conventions.p_fp8: "fp8"` too. Its QKᵀ is one fp8
WGMMA per 64-key block over the 576 columns (`TiledMma` of e4m3 × e4m3 into float, `flash::gemm` in
utils.h issuing its 18 k-steps of 32 into one register accumulator, no promotion to f32 between them;
the descales enter afterwards, in `scale_softmax_log2`), and Hopper's fp8 MMA accumulates in an
e8m13-like register (products exact, each k-step aligned to its largest exponent and truncated to 13
fraction bits), so the runner declares `conventions.qk_acc: "e8m13"`. Its output is bf16 only: an fp16
request with the fp8 cache is unsupported.

Needs: an SM90 GPU (H100/H200/H800), torch, safetensors, and flash_mla: `sgl-flash-mla` 1.0.0
(runners/fetch_peers.sh packs its wheel's contents into .carry/peers/sgl_flash_mla.tar.xz; unpack
it onto PYTHONPATH), vLLM's vendored copy, or a FlashMLA build with the dense kernel.
"""

import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402

PAGE = 64
KV_LORA, ROPE = 512, 64


class FlashMLA(protocol.TorchRunner):
    def environment_problem(self):
        try:
            import torch
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            return f"flashmla needs torch and safetensors: {e}"
        if not torch.cuda.is_available():
            return "FlashMLA's dense decode needs an SM90 GPU; torch.cuda.is_available() is False"
        self.device = torch.device("cuda")
        cap = torch.cuda.get_device_capability(self.device)
        if cap != (9, 0):
            return f"FlashMLA's dense decode needs an SM90 GPU (H100/H200/H800); this one is sm_{cap[0]}{cap[1]} ({torch.cuda.get_device_name(self.device)})"
        try:
            import flash_mla
        except Exception as e:  # noqa: BLE001
            return (
                f"cannot import flash_mla ({type(e).__name__}: {e}); pip install sgl-flash-mla, or unpack "
                ".carry/peers/sgl_flash_mla.tar.xz (runners/fetch_peers.sh) onto PYTHONPATH"
            )
        self.fm = flash_mla
        params = inspect.signature(flash_mla.get_mla_metadata).parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.new_metadata = not positional  # new: get_mla_metadata(*args, **kwargs) -> (meta, None)
        self.legacy_kw = {}
        if "use_legacy" in inspect.signature(flash_mla.flash_mla_with_kvcache).parameters:
            self.legacy_kw["use_legacy"] = True
            has_legacy = getattr(flash_mla, "has_legacy", None)
            if callable(has_legacy) and not has_legacy():
                reason = getattr(getattr(flash_mla, "_loader", None), "_LEGACY_UNAVAILABLE", None)
                return f"this flash_mla has no legacy (SM90 dense) extension: {reason or 'has_legacy() is False'}"
        params = inspect.signature(flash_mla.flash_mla_with_kvcache).parameters
        # The dense fp8 decode: sgl-flash-mla's legacy `fwd_kvcache_mla_fp8` and its own scheduler.
        self.fp8 = bool(self.legacy_kw and "descale_q" in params and "is_fp8_kvcache" in params
                    and hasattr(flash_mla, "get_mla_decoding_metadata"))
        return None

    def describe(self):
        import torch

        v = getattr(self.fm, "__version__", None)
        dist = "flash_mla"
        try:
            from importlib.metadata import PackageNotFoundError, version

            for name in ("sgl-flash-mla", "flash-mla", "flash_mla"):
                try:
                    dist, v = name, version(name)
                    break
                except PackageNotFoundError:
                    continue
        except ImportError:
            pass
        iface = ("get_mla_metadata() -> (FlashMLASchedMeta, None)" if self.new_metadata else "get_mla_metadata(seqlens, s_q*h_q, 1) -> (meta, num_splits)")
        legacy = ", use_legacy=True (SM90 dense)" if self.legacy_kw else ""
        legacy += "; fp8 cache: is_fp8_kvcache=True, descale_q/descale_k, get_mla_decoding_metadata" if self.fp8 else ""
        return {
            "protocol": protocol.PROTOCOL,
            "name": "flashmla",
            "version": (
                f"{dist} {v or '?'} ({os.path.dirname(self.fm.__file__)}): flash_mla_with_kvcache{legacy}, {iface}; "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(self.device)}"
            ),
            # Its SM90 dense decode: 64 (query, head) rows by 64-key tiles per CTA, splits chosen by
            # get_mla_metadata from the batch (not batch-invariant, and need not be).
            "ops": {
                "decode": {
                    "outputs": ["attn_latent", "lse"],
                    "geometry": {"key_tile": 64, "row_tile": 64, "split_partition": "own"},
                }
            },
            "supports": {
                "dtypes": ["bf16", "fp16"],
                "page_sizes": [PAGE],
                "heads": None,
                "kv_lora_rank": [KV_LORA],
                "qk_rope": [ROPE],
                "qk_head_dim": None,
                "v_head_dim": None,
                "max_q_len": None,
                **({"cache_formats": ["fp8"]} if self.fp8 else {}),
            },
            "conventions": {"lse_base": "e", "lse_layout": "head_token", **({"q_fp8": "fp8", "p_fp8": "fp8", "qk_acc": "e8m13"} if self.fp8 else {})},
        }

    def decode_kernel(self, x, meta):
        """The decode as a launch on prepared buffers (`run`) and the outputs it leaves (`collect`):
        what `mla-diff bench --peers` times (the scheduling metadata is made once, as an engine does per
        step for all layers)."""
        import torch

        q_nope, q_pe, cache = x["q_nope"], x["q_pe"], x["kv_cache"]
        b_n, s_q, heads, lkv = q_nope.shape
        rope = q_pe.shape[-1]
        page = int(meta.get("page_size") or cache.shape[1])
        if page != PAGE or cache.shape[1] != PAGE:
            raise protocol.Unsupported(f"page size {page}: FlashMLA's dense decode takes page 64 only")
        if (lkv, rope) != (KV_LORA, ROPE):
            raise protocol.Unsupported(f"latent {lkv} + rope {rope}: FlashMLA's dense decode takes 512 + 64 only")
        if q_nope.dtype not in (torch.bfloat16, torch.float16):
            raise protocol.Unsupported(f"dtype {q_nope.dtype}: FlashMLA's dense decode takes bf16/fp16")
        scale = float(meta["softmax_scale"])
        q = torch.cat([q_nope, q_pe], dim=-1).contiguous()  # [B, s_q, H, 576]
        k_cache = cache.unsqueeze(2)  # [pages, 64, 1, 576]
        table = x["block_table"].to(torch.int32).contiguous()
        seqlens = x["cache_seqlens"].to(torch.int32).contiguous()
        h_kv = 1
        fp8 = {}
        if (meta.get("cache") or {}).get("format") is not None:
            q, k_cache, fp8 = self.fp8_inputs(q, cache, meta)
            sched, splits = self.fm.get_mla_metadata()
            sched.tile_scheduler_metadata, sched.num_splits = self.fm.get_mla_decoding_metadata(
                seqlens, s_q * heads // h_kv, h_kv, is_fp8_kvcache=True, use_legacy=True)
        elif self.new_metadata:
            sched, splits = self.fm.get_mla_metadata()
        else:
            sched, splits = self.fm.get_mla_metadata(seqlens, s_q * heads // h_kv, h_kv)
        res = {}

        def run():
            res["out"], res["lse"] = self.fm.flash_mla_with_kvcache(
                q, k_cache, table, seqlens, KV_LORA, sched, splits,
                softmax_scale=scale, causal=s_q > 1, **self.legacy_kw, **fp8,
            )

        def collect():
            # lse [B, H, s_q] (head_token)
            return {"attn_latent": res["out"].contiguous(), "lse": res["lse"].float().contiguous()}

        return run, collect

    def fp8_inputs(self, q, cache, meta):
        """The `fp8` cache's request as the dense fp8 kernel takes it: q `[B, s_q, H, 576]` in e4m3 on the
        grid of `meta.q_scale`, the cache's u8 bytes viewed as e4m3 `[pages, 64, 1, 576]` (no copy,
        nothing written), and the kwargs with the two one-element descales."""
        import numpy as np
        import torch

        cm = meta["cache"]
        if cm.get("format") != "fp8" or not self.fp8:
            raise protocol.Unsupported(
                f"cache format {cm.get('format')}: this FlashMLA's dense decode reads the per-tensor fp8 cache only"
                + ("" if self.fp8 else " (and this flash_mla has no dense fp8 decode)"))
        if q.dtype != torch.bfloat16:
            raise protocol.Unsupported(f"dtype {q.dtype} with the fp8 cache: FlashMLA's dense fp8 decode returns bf16 only")
        if cache.dtype != torch.uint8 or cache.shape[-1] != KV_LORA + ROPE:
            raise ValueError(f"kv_cache {tuple(cache.shape)} {cache.dtype}: an fp8 cache is u8 [pages, 64, 576]")
        qf = q.float()
        sent = meta.get("q_scale")
        s = float(sent) if sent is not None else protocol.q_fp8_scale([np.array([float(qf.abs().max())], np.float32)])
        q8 = (qf / s).to(torch.float8_e4m3fn)
        # A padded entry's NaN q (as a CUDA graph's batch pads) is NaN in e4m3 too: on the grid.
        if sent is not None and not torch.allclose(q8.float() * s, qf, rtol=0, atol=0, equal_nan=True):
            raise ValueError(f"q is not on the e4m3 grid of meta.q_scale {s}: the cast to the kernel's fp8 q would round it")
        dev = q.device
        kw = {"is_fp8_kvcache": True,
              "descale_q": torch.tensor([s], dtype=torch.float32, device=dev),
              "descale_k": torch.tensor([float(cm["scale"])], dtype=torch.float32, device=dev)}
        return q8.contiguous(), cache.view(torch.float8_e4m3fn).unsqueeze(2), kw

    def decode(self, x, meta):
        import torch

        with torch.no_grad():
            run, collect = self.decode_kernel(x, meta)
            run()
            torch.cuda.synchronize(self.device)
            return collect()

if __name__ == "__main__":
    r = FlashMLA()
    protocol.serve(decode=r.decode, describe=r.describe, environment=r.environment_problem, codec=r,
                   kernels={"decode": r.decode_kernel})
