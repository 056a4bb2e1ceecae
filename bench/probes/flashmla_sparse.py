#!/usr/bin/env python3
"""FlashMLA's sparse prefill alone on the H200 (`bash bench/gpu-check.sh dsa_flashmla`, before the mla-diff runs): what the
runner relies on, checked directly against float64 numpy, and its time at GLM-5's shapes.

1. A small case (s_q 96, 64 heads, s_kv 400 with NaN in every slot no index names, topk 128 with −1
   padding, one query with a single key): out and lse against float64 over the valid indices; the LSE
   is compared as natural log and as base 2, so the base is measured, not assumed.
2. Timing: flash_mla_sparse_fwd at s_q 1024, 64 heads, s_kv 3200, topk 2048 (every index valid),
   CUDA events, 3 warm-ups then the median of 20.
Needs torch, flash_mla on PYTHONPATH (sgl-flash-mla 1.0.0: use_legacy=True on SM90).
"""
import inspect
import math
import sys

import numpy as np
import torch
import flash_mla

kw = {"use_legacy": True} if "use_legacy" in inspect.signature(flash_mla.flash_mla_sparse_fwd).parameters else {}
dev = torch.device("cuda")
print("flash_mla", getattr(flash_mla, "__version__", "?"), kw, torch.cuda.get_device_name(), "torch", torch.__version__)
rng = np.random.default_rng(0)


def bf16(a):
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(dev).to(torch.bfloat16)


# --- 1. correctness ---
s_q, h, s_kv, topk, d, dv = 96, 64, 400, 128, 576, 512
scale = 0.0625 * 1.3
kv = rng.standard_normal((s_kv, 1, d)).astype(np.float32)
q = rng.standard_normal((s_q, h, d)).astype(np.float32)
idx = np.full((s_q, 1, topk), -1, np.int32)
used = set()
for i in range(s_q):
    n = 1 if i == 0 else int(rng.integers(2, topk + 1))
    sel = rng.choice(300, size=n, replace=False)
    idx[i, 0, :n] = sel
    used.update(sel.tolist())
unused = np.array(sorted(set(range(s_kv)) - used))
kv[unused] = np.nan
tq, tkv, ti = bf16(q), bf16(kv), torch.from_numpy(idx).to(dev)
out, maxl, lse = flash_mla.flash_mla_sparse_fwd(tq, tkv, ti, scale, d_v=dv, **kw)
torch.cuda.synchronize()
out = out.float().cpu().numpy().astype(np.float64)
lse = lse.float().cpu().numpy().astype(np.float64)
q64 = tq.float().cpu().numpy().astype(np.float64)
kv64 = tkv.float().cpu().numpy().astype(np.float64)
ref_o, ref_l = np.zeros((s_q, h, dv)), np.zeros((s_q, h))
for i in range(s_q):
    v = idx[i, 0][idx[i, 0] >= 0]
    k = kv64[v, 0]
    s = q64[i] @ k.T * scale
    m = s.max(1, keepdims=True)
    e = np.exp(s - m)
    ref_o[i] = (e / e.sum(1, keepdims=True)) @ k[:, :dv]
    ref_l[i] = (m + np.log(e.sum(1, keepdims=True)))[:, 0]
rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
print(f"out shape {out.shape}, lse shape {lse.shape}, NaN in out: {bool(np.isnan(out).any())}, in lse: {bool(np.isnan(lse).any())}")
print(f"out rel-L2 vs fp64: {rel(out, ref_o):.3e} (bf16 output rounding ~1.6e-3)")
print(f"lse rel-L2 vs fp64, read as natural log: {rel(lse, ref_l):.3e}; as base 2 (x ln2): {rel(lse * math.log(2), ref_l):.3e}")

# --- 2. timing at GLM-5's shapes ---
s_q, s_kv, topk = 1024, 3200, 2048
tq = torch.randn(s_q, h, d, device=dev).to(torch.bfloat16)
tkv = torch.randn(s_kv, 1, d, device=dev).to(torch.bfloat16)
ti = torch.stack([torch.randperm(s_kv, device=dev)[:topk] for _ in range(s_q)]).to(torch.int32).view(s_q, 1, topk)
for _ in range(3):
    flash_mla.flash_mla_sparse_fwd(tq, tkv, ti, scale, d_v=dv, **kw)
ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    flash_mla.flash_mla_sparse_fwd(tq, tkv, ti, scale, d_v=dv, **kw)
    b.record()
    b.synchronize()
    ts.append(a.elapsed_time(b))
ts.sort()
flops = 2 * s_q * h * topk * (d + dv)
print(f"timing s_q {s_q} h {h} s_kv {s_kv} topk {topk}: median {ts[10]:.3f} ms, min {ts[0]:.3f} ms, {flops / ts[10] / 1e9:.1f} TFLOP/s")
sys.exit(0)
