#!/usr/bin/env python3
"""flashmla_sparse: FlashMLA's sparse MLA prefill and decode (DSA: DeepSeek-V3.2, GLM-5) as a mla-diff
runner (protocol 1, ops `sparse_prefill` and `sparse_decode`, docs/runners.md and docs/dsa.md).

What it runs: `flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512)` as SGLang and vLLM
call it for DSA prefill: the absorbed query q = [W_UKᵀ·q_nope | q_pe] `[s_q, h_q, 576]` bf16, the
latent cache viewed flat `[s_kv, 1, 576]` (a slot is `page·page_size + offset`), the selected keys'
slots `[s_q, 1, topk]` int32 (−1: none), `sm_scale` = meta softmax_scale (YaRN mscale² included).
It returns the latent attention output `[s_q, h_q, 512]` and the LSE `[s_q, h_q]` (natural log).

Decode (`sparse_decode`): `flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, None,
softmax_scale, causal=False, is_fp8_kvcache=True, indices=...)` as SGLang and vLLM call it for DSA decode:
q `[b, s_q, h_q, 576]` bf16, the cache in FlashMLA's fp8 format (`[pages, page, 1, 656]`, flashmla_fp8.py:
the runner writes it from the rows it is sent, as an engine's cache writer would; the describe says so,
`kv_cache: fp8_v32`), the selected slots `[b, s_q, topk]` (−1: none). It returns the latent output and
the LSE (FlashMLA's `[b, h_q, s_q]`, sent as token_head). Heads and topk are padded as for prefill.

With `run --kv-cache-dtype fp8_ds_mla` (`supports.cache_formats`; FlashMLA's 656-byte cache is that
format, docs/cache-formats.md) mla-diff sends the cache itself, as an engine's cache writer left it:
`sparse_decode` gets `kv_cache` u8 `[pages, page, 656]` and hands those bytes to the kernel unchanged
(viewed as float8_e4m3fn `[pages, page, 1, 656]`, as FlashMLA's tests/quant.py writes them), instead of
packing the rows itself; `sparse_prefill` gets `kv` u8 `[slots, 1, 656]`, which it dequantizes to the
bf16 rows `flash_mla_sparse_fwd` takes (the kernel reads no fp8 cache; an engine upconverts the
selected fp8 rows before it, as vLLM's FLASHMLA_SPARSE does for an fp8_ds_mla cache). The dequantized
values (e4m3 times a power-of-two scale, bf16 rope) are exact in bf16.

Constraints of the kernel (sgl-flash-mla 1.0.0; SM90 through its legacy extension, `use_legacy=True`;
the kernel's features HEAD_64 / HEAD_128 and HEAD_DIM_576, `topk % B_TOPK == 0`), and how they are met
as engines meet them:
- h_q must be 64 or 128: fewer heads are padded with zero queries to 64 (≤ 64) or 128 (≤ 128), and the
  padding heads' outputs dropped (vLLM pads to 128 for this kernel); more than 128 heads: unsupported.
- topk must be a multiple of the kernel's B_TOPK (64 for 64 heads, 128 for 128): the index rows are
  padded with −1 to a multiple of 128 (vLLM's alignment for this kernel; −1 is "no key").
- bf16 only, kv_lora_rank 512 + rope 64 (d_qk 576, d_v 512), h_kv 1. Anything else: "unsupported".
Unsupported at start (exit 3): no torch / safetensors, no CUDA GPU, not SM90, no importable flash_mla,
or a flash_mla without the legacy (SM90) extension.

Stand-in: with `MLA_DIFF_FLASHMLA_STANDIN=numpy` the kernel calls are replaced by a numpy float32
implementation of their definition (FlashMLA's tests/ref.py: invalid indices masked, a max-subtracted
softmax over the valid ones, the bf16 output; decode over the fp8 cache's bytes read back); everything
else (padding, shapes, the fp8 cache's bytes, the protocol) is this runner's own code. That is what CI runs (no GPU); describe's version says so.
`MLA_DIFF_RUNNER_TIME=1` (GPU only) also times each request's kernel call: one warm-up, then the
median of 5 launches between CUDA events, logged on stderr (`flashmla_sparse: time …`); any other
value but 0 is a file the line is appended to (mla-diff shows a runner's stderr only when it fails).

Needs: an SM90 GPU, torch, safetensors, numpy, and flash_mla (`sgl-flash-mla` 1.0.0: runners/
fetch_peers.sh packs its wheel into .carry/peers/sgl_flash_mla.tar.xz; unpack it onto PYTHONPATH).
The stand-in needs numpy only.
"""

import inspect
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashmla_fp8  # noqa: E402
import protocol  # noqa: E402

KV_LORA, ROPE = 512, 64
TOPK_ALIGN = 128
STANDIN_ENV = "MLA_DIFF_FLASHMLA_STANDIN"
TIME_ENV = "MLA_DIFF_RUNNER_TIME"


def padded_heads(h):
    """The head count the kernel runs for `h` query heads (64 or 128), or None."""
    for k in (64, 128):
        if h <= k:
            return k
    return None


def numpy_sparse_fwd(q, kv, indices, sm_scale, d_v):
    """flash_mla_sparse_fwd's definition in numpy float32: q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk],
    indices [s_q, 1, topk] (−1 or ≥ s_kv: no key). Only the rows indexed are read (the rest of the cache
    may be NaN). Returns (out [s_q, h_q, d_v] rounded to bf16, lse [s_q, h_q] natural log; −inf and out
    0 for a query without a key)."""
    s_q, h_q, _ = q.shape
    s_kv = kv.shape[0]
    out = np.zeros((s_q, h_q, d_v), np.float32)
    lse = np.full((s_q, h_q), -np.inf, np.float32)
    for i in range(s_q):
        idx = indices[i, 0]
        idx = idx[(idx >= 0) & (idx < s_kv)].astype(np.int64)
        if idx.size == 0:
            continue
        k = kv[idx, 0].astype(np.float32)  # [n, d_qk]
        s = (q[i].astype(np.float32) @ k.T) * np.float32(sm_scale)  # [h_q, n]
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        z = e.sum(axis=1, keepdims=True)
        out[i] = (e / z) @ k[:, :d_v]
        lse[i] = (m + np.log(z))[:, 0]
    return protocol.round_to(out, "bf16"), lse


class FlashMLASparse(protocol.NumpyRunner):
    name = "flashmla_sparse"

    def __init__(self):
        self.standin = os.environ.get(STANDIN_ENV, "") == "numpy"
        self.fm = None
        self.kw = {}
        self.decode_kw = {}

    def environment_problem(self):
        if self.standin:
            return None
        try:
            import torch
            import safetensors  # noqa: F401
        except ImportError as e:
            return f"flashmla_sparse needs torch and safetensors: {e}"
        if not torch.cuda.is_available():
            return "FlashMLA's sparse prefill needs an SM90 GPU; torch.cuda.is_available() is False"
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return f"FlashMLA's sparse prefill here is the SM90 kernel (H100/H200/H800); this GPU is sm_{cap[0]}{cap[1]} ({torch.cuda.get_device_name()})"
        try:
            import flash_mla
        except Exception as e:  # noqa: BLE001
            return (
                f"cannot import flash_mla ({type(e).__name__}: {e}); pip install sgl-flash-mla, or unpack "
                ".carry/peers/sgl_flash_mla.tar.xz (runners/fetch_peers.sh) onto PYTHONPATH"
            )
        if not hasattr(flash_mla, "flash_mla_sparse_fwd"):
            return f"this flash_mla ({os.path.dirname(flash_mla.__file__)}) has no flash_mla_sparse_fwd"
        self.fm = flash_mla
        # sgl-flash-mla 1.0.0: the SM90 kernels live in the legacy extension.
        if "use_legacy" in inspect.signature(flash_mla.flash_mla_sparse_fwd).parameters:
            has_legacy = getattr(flash_mla, "has_legacy", None)
            if callable(has_legacy) and not has_legacy():
                reason = getattr(getattr(flash_mla, "_loader", None), "_LEGACY_UNAVAILABLE", None)
                return f"this flash_mla has no legacy (SM90) extension: {reason or 'has_legacy() is False'}"
            self.kw["use_legacy"] = True
        return None

    def describe(self):
        if self.standin:
            version = f"numpy {np.__version__} STAND-IN for flash_mla_sparse_fwd ({STANDIN_ENV}=numpy: not FlashMLA)"
        else:
            import torch

            v = getattr(self.fm, "__version__", "?")
            dist = "flash_mla"
            try:
                from importlib.metadata import PackageNotFoundError, version as dist_version

                for name in ("sgl-flash-mla", "flash-mla"):
                    try:
                        dist, v = name, dist_version(name)
                        break
                    except PackageNotFoundError:
                        continue
            except ImportError:
                pass
            legacy = ", use_legacy=True (SM90)" if self.kw else ""
            version = (
                f"{dist} {v} ({os.path.dirname(self.fm.__file__)}): flash_mla_sparse_fwd{legacy}; "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"
            )
        return {
            "protocol": protocol.PROTOCOL,
            "name": self.name,
            "version": version,
            "ops": {
                "sparse_prefill": {"outputs": ["attn_latent", "lse"]},
                # The decode kernel reads FlashMLA's fp8 cache only: the runner writes it from the rows
                # it is sent, and says so, so that mla-diff's yardsticks model it (docs/dsa.md).
                "sparse_decode": {"outputs": ["attn_latent", "lse"], "kv_cache": "fp8_v32"},
            },
            "supports": {
                "dtypes": ["bf16"],
                "page_sizes": None,
                "heads": None,
                "kv_lora_rank": [KV_LORA],
                "qk_rope": [ROPE],
                "qk_head_dim": None,
                "v_head_dim": None,
                "max_q_len": None,
                # FlashMLA's fp8 cache, sent as bytes by `run --kv-cache-dtype fp8_ds_mla`.
                "cache_formats": ["fp8_ds_mla"],
            },
            "conventions": {"lse_base": "e", "lse_layout": "token_head"},
        }

    def timed(self, run, label):
        """Run `run()` once (synchronised); with MLA_DIFF_RUNNER_TIME, time 5 more launches."""
        import torch

        with torch.no_grad():
            run()
            torch.cuda.synchronize()
            dest = os.environ.get(TIME_ENV, "")
            if dest in ("", "0"):
                return
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            times.sort()
            line = f"flashmla_sparse: time {label}: median {times[2]:.3f} ms, min {times[0]:.3f} ms (5 launches)"
            if dest == "1":
                protocol.log(line)
            else:  # a file to append to (mla-diff shows a runner's stderr only when it fails)
                with open(dest, "a") as f:
                    f.write(line + "\n")

    # -- the kernel call (a hook: runners/bugs/sparse/ overrides it) --------------------------------

    def kernel(self, q, kv, indices, scale):
        """q [s_q, hp, 576], kv [s_kv, 1, 576] float32 (bf16 values), indices [s_q, 1, topk_p] int32
        -> (out [s_q, hp, 512] float32, lse [s_q, hp] float32)."""
        if self.standin:
            return numpy_sparse_fwd(q, kv, indices, scale, KV_LORA)
        import torch

        dev = torch.device("cuda")
        tq = torch.from_numpy(q).to(dev).to(torch.bfloat16).contiguous()
        tkv = torch.from_numpy(kv).to(dev).to(torch.bfloat16).contiguous()
        ti = torch.from_numpy(indices).to(dev).contiguous()
        res = {}

        def run():
            res["out"], _, res["lse"] = self.fm.flash_mla_sparse_fwd(tq, tkv, ti, scale, d_v=KV_LORA, **self.kw)

        self.timed(run, f"s_q {q.shape[0]} h_q {q.shape[1]} s_kv {kv.shape[0]} topk {indices.shape[-1]}")
        return res["out"].float().cpu().numpy(), res["lse"].float().cpu().numpy()

    def dequantize(self, cache):
        """The stand-in's read of the fp8 cache [pages, page, 656] → rows [pages·page, 576] float32 (a
        hook: runners/bugs/sparse/ plants scale bugs here)."""
        return flashmla_fp8.unpack(cache).reshape(-1, KV_LORA + ROPE)

    def decode_kernel(self, q, cache, indices, scale):
        """q [b, s_q, hp, 576] float32 (bf16 values), cache [pages, page, 656] uint8 (flashmla_fp8),
        indices [b, s_q, topk_p] int32 -> (out [b, s_q, hp, 512] float32, lse [b, s_q, hp] float32)."""
        b, s_q, hp, d_qk = q.shape
        if self.standin:
            # flash_mla_with_kvcache's sparse definition (FlashMLA's tests/ref.py): attention over the
            # dequantized rows the indices name, −1 skipped; bf16 output.
            kv = self.dequantize(cache)[:, None, :]
            out, lse = numpy_sparse_fwd(
                q.reshape(b * s_q, hp, d_qk), kv, indices.reshape(b * s_q, 1, -1), scale, KV_LORA
            )
            return out.reshape(b, s_q, hp, KV_LORA), lse.reshape(b, s_q, hp)
        import torch

        dev = torch.device("cuda")
        tq = torch.from_numpy(q).to(dev).to(torch.bfloat16).contiguous()
        tk = torch.from_numpy(cache[:, :, None, :]).to(dev).view(torch.float8_e4m3fn).contiguous()
        ti = torch.from_numpy(indices).to(dev).contiguous()
        res = {}

        def run():
            meta, _ = self.fm.get_mla_metadata()
            res["out"], res["lse"] = self.fm.flash_mla_with_kvcache(
                tq, tk, None, None, KV_LORA, meta, None, softmax_scale=scale, causal=False,
                is_fp8_kvcache=True, indices=ti, **self.kw, **self.decode_kw,
            )

        try:
            run()
        except RuntimeError as e:
            # The legacy extension infers the format from the bytes per token; should a build want it
            # named, name it (its accepted values: V32, V32_NO_ROPE, V4, V41, V41_FP4).
            if "kv_format" not in str(e) or self.decode_kw or "use_legacy" not in self.kw:
                raise
            self.decode_kw = {"kv_format": "V32"}
            protocol.log(f"flashmla_sparse: retrying the decode with kv_format='V32' after: {e}")

        self.timed(run, f"decode b {b} s_q {s_q} h_q {hp} pages {cache.shape[0]} topk {indices.shape[-1]}")
        # FlashMLA's LSE is [b, h_q, s_q]: to this runner's token_head.
        return res["out"].float().cpu().numpy(), res["lse"].float().cpu().numpy().transpose(0, 2, 1)

    # -- the op ---------------------------------------------------------------------------------------

    def cache_format(self, meta):
        """The byte format the request's cache is in (`meta.cache.format`), None for rows; only
        FlashMLA's own fp8 cache (`fp8_ds_mla`) is taken."""
        fmt = (meta.get("cache") or {}).get("format")
        if fmt not in (None, "fp8_ds_mla"):
            raise protocol.Unsupported(f"cache format {fmt}: FlashMLA's sparse kernels read fp8_ds_mla (656 bytes) only")
        return fmt

    def sparse_prefill(self, x, meta):
        q, kv, indices = x["q"], x["kv"], x["indices"]
        if meta.get("dtype") != "bf16":
            raise protocol.Unsupported(f"dtype {meta.get('dtype')}: flash_mla_sparse_fwd takes bf16 only")
        if self.cache_format(meta):
            if kv.ndim != 3 or kv.shape[-1] != flashmla_fp8.BYTES:
                raise ValueError(f"kv {kv.shape}: an fp8_ds_mla cache is [slots, 1, {flashmla_fp8.BYTES}] bytes")
            # The kernel takes bf16 rows: the selected cache's rows upconverted first, as an engine does.
            kv = flashmla_fp8.unpack(kv).reshape(kv.shape[0], 1, KV_LORA + ROPE)
        if q.ndim != 3 or kv.ndim != 3 or indices.ndim != 3:
            raise ValueError(f"q {q.shape}, kv {kv.shape}, indices {indices.shape}: expected 3 dims each")
        s_q, heads, d_qk = q.shape
        lkv, rope = int(meta["kv_lora_rank"]), int(meta["qk_rope"])
        if (lkv, rope) != (KV_LORA, ROPE) or d_qk != KV_LORA + ROPE:
            raise protocol.Unsupported(f"latent {lkv} + rope {rope} (q rows {d_qk}): the kernel takes 512 + 64 only")
        if kv.shape[1] != 1:
            raise protocol.Unsupported(f"h_kv {kv.shape[1]}: the kernel takes one latent head (MQA)")
        if kv.shape[2] != d_qk or indices.shape[:2] != (s_q, 1):
            raise ValueError(f"q {q.shape}, kv {kv.shape}, indices {indices.shape} do not fit together")
        hp = padded_heads(heads)
        if hp is None:
            raise protocol.Unsupported(f"{heads} query heads: the kernel runs 64 or 128 (fewer are padded), not more")
        topk = indices.shape[-1]
        tp = -(-max(topk, 1) // TOPK_ALIGN) * TOPK_ALIGN
        qp = np.zeros((s_q, hp, d_qk), np.float32)
        qp[:, :heads] = q
        ip = np.full((s_q, 1, tp), -1, np.int32)
        ip[:, :, :topk] = indices
        out, lse = self.kernel(qp, np.ascontiguousarray(kv, np.float32), ip, float(meta["softmax_scale"]))
        return {
            "attn_latent": protocol.storage(out[:, :heads], "bf16"),
            "lse": np.ascontiguousarray(lse[:, :heads], np.float32),
        }

    def sparse_decode(self, x, meta):
        """FlashMLA's sparse decode over its fp8 cache: as sent (`meta.cache`), else written here from
        the rows sent (flashmla_fp8)."""
        q, kv, indices = x["q"], x["kv_cache"], x["indices"]
        if meta.get("dtype") != "bf16":
            raise protocol.Unsupported(f"dtype {meta.get('dtype')}: FlashMLA's sparse decode takes bf16 queries only")
        if q.ndim != 4 or kv.ndim != 3 or indices.ndim != 3:
            raise ValueError(f"q {q.shape}, kv_cache {kv.shape}, indices {indices.shape}: expected 4, 3 and 3 dims")
        b, s_q, heads, d_qk = q.shape
        lkv, rope = int(meta["kv_lora_rank"]), int(meta["qk_rope"])
        sent_bytes = self.cache_format(meta) is not None
        width = flashmla_fp8.BYTES if sent_bytes else d_qk
        if (lkv, rope) != (KV_LORA, ROPE) or d_qk != KV_LORA + ROPE or kv.shape[2] != width:
            raise protocol.Unsupported(f"latent {lkv} + rope {rope}: the fp8 cache (656 bytes) holds 512 + 64 only")
        if indices.shape[:2] != (b, s_q):
            raise ValueError(f"q {q.shape}, indices {indices.shape} do not fit together")
        hp = padded_heads(heads)
        if hp is None:
            raise protocol.Unsupported(f"{heads} query heads: the kernel runs 64 or 128 (fewer are padded), not more")
        topk = indices.shape[-1]
        tp = -(-max(topk, 1) // TOPK_ALIGN) * TOPK_ALIGN
        qp = np.zeros((b, s_q, hp, d_qk), np.float32)
        qp[:, :, :heads] = q
        ip = np.full((b, s_q, tp), -1, np.int32)
        ip[:, :, :topk] = indices
        # The cache as sent (run --kv-cache-dtype fp8_ds_mla), else written here from the rows.
        cache = np.ascontiguousarray(kv, np.uint8) if sent_bytes else flashmla_fp8.pack(kv)
        out, lse = self.decode_kernel(qp, cache, ip, float(meta["softmax_scale"]))
        return {
            "attn_latent": protocol.storage(out[:, :, :heads], "bf16"),
            "lse": np.ascontiguousarray(lse[:, :, :heads], np.float32),
        }


if __name__ == "__main__":
    r = FlashMLASparse()
    # decode_kernel here is the fp8 decode's launch helper, not a bench hook: no kernels= for bench.
    protocol.serve(sparse_prefill=r.sparse_prefill, sparse_decode=r.sparse_decode, describe=r.describe,
                   environment=r.environment_problem, codec=r)
