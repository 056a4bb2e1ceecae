#!/usr/bin/env python3
"""FlashMLA's sparse decode over its fp8 cache alone on the H200 (`bash bench/gpu-check.sh dsa_flashmla`, before the mla-diff
runs): what runners/flashmla_sparse.py's `sparse_decode` relies on, checked directly.

1. The cache bytes: runners/flashmla_fp8.py's numpy quantizer against torch's own e4m3fn cast of the
   same x/scale (FlashMLA's tests/quant.py convention), byte for byte; and its unpack against the
   bytes' float8 values × scale as torch reads them.
2. A small case (b 4, s_q 1 and 2, 64 and 128 heads, 40 pages of 64 with NaN-poisoned slots no index
   names, topk 256 with −1 padding, one query with a single key): out and lse against float64 over the
   dequantized rows (the LSE read as natural log and as base 2: the base is measured), and the rel-L2 of
   float64 over the dequantized rows against float64 over the bf16 rows (the fp8 cache's own effect).
3. Timing at the GLM-5 run's decode shape and DeepSeek-V3.2's (b 4 and 64, s_q 1, 64 / 128 heads, topk
   2048 of 3072 / 32768 keys): CUDA events, 3 warm-ups then the median of 20.
Needs torch, numpy, flash_mla on PYTHONPATH (sgl-flash-mla 1.0.0: use_legacy=True on SM90), and
runners/ next to this file or in $RUNNERS.
"""
import inspect
import math
import os
import sys

import numpy as np
import torch
import flash_mla

sys.path.insert(0, os.environ.get("RUNNERS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "runners")))
import flashmla_fp8 as f8  # noqa: E402

kw = {"use_legacy": True} if "use_legacy" in inspect.signature(flash_mla.flash_mla_with_kvcache).parameters else {}
dev = torch.device("cuda")
print("flash_mla", getattr(flash_mla, "__version__", "?"), kw, torch.cuda.get_device_name(), "torch", torch.__version__)
rng = np.random.default_rng(0)
rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bf16_np(a):
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).float().numpy()


def decode(q, cache, idx, scale):
    tq = torch.from_numpy(np.ascontiguousarray(q, np.float32)).to(dev).to(torch.bfloat16)
    tk = torch.from_numpy(cache[:, :, None, :]).to(dev).view(torch.float8_e4m3fn)
    ti = torch.from_numpy(idx).to(dev)
    call = lambda: flash_mla.flash_mla_with_kvcache(tq, tk, None, None, 512, flash_mla.get_mla_metadata()[0], None,
                                                    softmax_scale=scale, causal=False, is_fp8_kvcache=True,
                                                    indices=ti, **kw)
    try:
        return call()
    except RuntimeError as e:  # as the runner: name the format if this build wants it named
        if "kv_format" not in str(e) or "kv_format" in kw:
            raise
        print(f"retrying with kv_format='V32' after: {e}")
        kw["kv_format"] = "V32"
        return call()


# --- 1. the bytes against torch's cast ---
x = bf16_np(rng.standard_normal((4096, 576)) * np.exp(rng.uniform(-6, 3, (4096, 1))))
mine = f8.pack(x)
sc = f8.tile_scales(x[:, :512])
tx = torch.from_numpy(x[:, :512].reshape(-1, 4, 128)) / torch.from_numpy(sc)[:, :, None]
theirs = tx.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, 512).numpy()
print(f"fp8 bytes: {int((mine[:, :512] != theirs).sum())} of {theirs.size} differ from torch's e4m3fn cast")
back = torch.from_numpy(mine[:, :512].copy()).view(torch.float8_e4m3fn).float().reshape(-1, 4, 128) * torch.from_numpy(sc)[:, :, None]
print(f"unpack vs torch's read: max |diff| {float(np.abs(f8.unpack(mine)[:, :512] - back.reshape(-1, 512).numpy()).max()):.3e}; "
      f"rope exact: {bool((f8.unpack(mine)[:, 512:] == x[:, 512:]).all())}")

# --- 2. correctness ---
page, pages, topk = 64, 40, 256
for h, s_q in [(64, 1), (128, 2)]:
    b = 4
    scale = 576 ** -0.5
    kv = bf16_np(rng.standard_normal((pages, page, 576)))
    used = set()
    idx = np.full((b, s_q, topk), -1, np.int32)
    for i in range(b):
        for j in range(s_q):
            n = 1 if (i, j) == (0, 0) else int(rng.integers(2, topk + 1))
            sel = rng.choice(30 * page, size=n, replace=False)
            idx[i, j, :n] = sel
            used.update(sel.tolist())
    flat = kv.reshape(-1, 576)
    unused = np.array(sorted(set(range(pages * page)) - used))
    flat[unused] = np.nan
    cache = f8.pack(flat).reshape(pages, page, -1)
    q = bf16_np(rng.standard_normal((b, s_q, h, 576)))
    out, lse = decode(q, cache, idx, scale)
    torch.cuda.synchronize()
    out = out.float().cpu().numpy().astype(np.float64)
    lse = lse.float().cpu().numpy().astype(np.float64)  # [b, h, s_q]
    deq = f8.unpack(cache).reshape(-1, 576).astype(np.float64)
    ro, rl, so = np.zeros_like(out), np.zeros((b, h, s_q)), np.zeros_like(out)
    for i in range(b):
        for j in range(s_q):
            v = idx[i, j][idx[i, j] >= 0]
            for rows, o_, l_ in [(deq, ro, rl), (flat.astype(np.float64), so, None)]:
                k = rows[v]
                s = q[i, j].astype(np.float64) @ k.T * scale
                m = s.max(1, keepdims=True)
                e = np.exp(s - m)
                o_[i, j] = (e / e.sum(1, keepdims=True)) @ k[:, :512]
                if l_ is not None:
                    l_[i, :, j] = (m + np.log(e.sum(1, keepdims=True)))[:, 0]
    print(f"h {h} s_q {s_q}: out {out.shape} lse {lse.shape}; NaN in out {bool(np.isnan(out).any())}, lse {bool(np.isnan(lse).any())}")
    print(f"  out rel-L2 vs fp64 over the fp8 cache: {rel(out, ro):.3e} (bf16 output ~1.6e-3); "
          f"lse natural log {rel(lse, rl):.3e}, base 2 (x ln2) {rel(lse * math.log(2), rl):.3e}")
    print(f"  the fp8 cache's own effect (fp64 over fp8 rows vs over bf16 rows): out {rel(ro, so):.3e}; "
          f"the kernel vs fp64 over the bf16 rows: {rel(out, so):.3e}")

# --- 3. timing ---
for b, h, s_kv in [(4, 64, 3072), (64, 64, 3072), (64, 128, 32768)]:
    topk = 2048
    pages = -(-s_kv // page) * b
    cache = torch.randint(0, 256, (pages, page, 1, 656), dtype=torch.uint8, device=dev)
    cache.view(torch.uint8)[..., :512] &= 0x77  # finite e4m3 values
    cache[..., 512:528] = torch.tensor([1.0 / 64] * 4, dtype=torch.float32).view(torch.uint8).to(dev)
    cache[..., 528:] = 0
    ti = torch.stack([torch.randperm(pages * page, device=dev)[:topk] for _ in range(b)]).to(torch.int32).view(b, 1, topk)
    tq = torch.randn(b, 1, h, 576, device=dev).to(torch.bfloat16)
    tk = cache.view(torch.float8_e4m3fn)
    meta, _ = flash_mla.get_mla_metadata()
    run = lambda: flash_mla.flash_mla_with_kvcache(tq, tk, None, None, 512, meta, None, softmax_scale=0.05,
                                                   causal=False, is_fp8_kvcache=True, indices=ti, **kw)
    for _ in range(3):
        run()
    ts = []
    for _ in range(20):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        e.record()
        e.synchronize()
        ts.append(a.elapsed_time(e))
    ts.sort()
    print(f"timing decode b {b} h {h} s_kv {s_kv} topk {topk}: median {ts[10] * 1e3:.1f} us, min {ts[0] * 1e3:.1f} us")
sys.exit(0)
