#!/usr/bin/env python3
"""selfcheck: drives a runner through its real protocol (docs/runners.md) without mla-diff and
compares what it returns with float64 attention computed from exactly the tensors it was given.

What it runs: `RUNNER --describe`, then one `RUNNER --serve` process fed decode and prefill requests
built here for a few model shapes:
  deepseek  128 heads, kv_lora 512 + rope 64 (decode), qk 192 / v 128 (prefill), page 64
  glm5       64 heads, kv_lora 512 + rope 64 (decode), qk 256 (192+64) / v 256 (prefill), page 64
  minicpm3    4 heads, kv_lora 256 + rope 32, qk 96 / v 64, page 16
  tiny        3 heads, kv_lora 16 + rope 8, qk 16 / v 12, page 3, 3 query tokens per decode entry
  glm5-next  16 heads, kv_lora 512 + rope 0 (NoPE), qk 256 / v 256, page 64, 2-token sparse_decode
  v4-dims    16 heads, kv_lora 448 + rope 64 (DeepSeek-V4's 512-wide row), qk 192 / v 128, page 16, MTP
(the last two are the rows of the formats no other case fits; run without --cases only with a
--kv-cache-dtype that fits them)
Each decode request holds several entries of different lengths (one of length 1), every cache row
not holding a token of its entry is NaN, pages are shuffled and unused block-table slots point at
a NaN page; deepseek also has a 2-token (MTP) decode, and each prefill chunk has cached context
(minicpm3 also one chunk with none); deepseek, glm5, glm5-next and v4-dims also have sparse_prefill
requests (DSA: the absorbed query, the flat NaN-poisoned cache with shuffled pages, index rows of random
visible keys −1 padded to a top_k that is not a multiple of 128) and sparse_decode requests (the
absorbed decode query of several entries, 1 or 2 tokens each, their own shuffled pages with NaN where no token is, index rows of
random visible keys as page·page_size + offset, −1 padded; a runner whose describe says `kv_cache:
fp8_v32` is judged against float64 over FlashMLA's fp8 cache as its format stores the rows, quantized here
independently of the runner). Cases a runner's describe rules out (dtype, page size, dims, q_len) are
listed as unsupported without being sent, as mla-diff does.

With `--kv-cache-dtype FMT`, every format mla-diff writes (docs/cache-formats.md):
  fp8              e4m3 over the whole row, one scale in `meta.cache.scale` (any dims)
  fp8_ds_mla       DeepSeek-V3.2's 656 bytes: 512 e4m3 + 4 float32 tile scales + 64 bf16 rope (512 + 64:
                   deepseek, glm5)
  fp8_ds_mla_nope  the same 656 bytes without rope, the last 128 reserved (512 + 0: glm5-next)
  fp8_v41          FlashMLA V4.1's 528 bytes: 512 e4m3 (rope included) + 16 ue8m0 scales of 32 columns
                   (a 512-wide row: v4-dims, glm5-next)
  fp4_v41          FlashMLA V4.1's 288 bytes: 512 e2m1 two per byte + 32 e4m3 scales of 16 columns (same)
the ops that read the latent cache (decode, sparse_prefill, sparse_decode) are sent it as mla-diff `run
--kv-cache-dtype` sends it: u8 rows in the format's bytes (0xff where no token is) with `meta.cache`,
written here independently of the runner SDK's reader (the same bytes as mla-diff's codec:
tests/it/selfcheck_cache.rs), and judged against float64 over the values those bytes hold. A runner
whose `supports.cache_formats` does not list FMT is unsupported there, and so is a case whose dims the
format does not fit (the reason names the dims it needs and the case that has them).

Comparison (the `@runner` check of docs/runners.md): each output, after converting a base-2 LSE
(`·ln 2`) and a `head_token` layout, against the float64 result on the stored inputs:
rel-L2 <= 4u and every |d| <= 16u·rms(ref) + 4u·|ref|, u the unit roundoff of the coarser of the
run's dtype and the dtype returned (bf16 2^-8, fp16 2^-11, f32 2^-18 here, not the protocol's 2^-24:
see F32_UNIT). −inf entries (empty splits) must match exactly; a NaN fails.

Usage:
  python3 runners/selfcheck.py --runner 'python3 runners/numpy_mla.py' [--dtypes bf16,fp16,f32]
        [--cases deepseek,glm5,minicpm3,tiny,glm5-next,v4-dims] [--ops decode,prefill,sparse_prefill,sparse_decode]
        [--kv-cache-dtype fp8|fp8_ds_mla|fp8_ds_mla_nope|fp8_v41|fp4_v41] [--json FILE] [--keep DIR]
  python3 runners/selfcheck.py --bugs     # numpy_mla must pass; every runners/bugs/*.py must be
                                          # caught at the checks its `selfcheck-expect:` line names
Exit 0 when every check that ran passed (--bugs: when the clean runner passed and every bug was
caught), 1 otherwise; the last line reads 'N passed, N failed'. Unsupported cases count as neither.

Needs: Python 3.8+, numpy. (The runner under test needs whatever it needs.)
"""

import argparse
import glob
import json
import math
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import protocol  # noqa: E402

UNIT = {"bf16": 2.0**-8, "fp16": 2.0**-11, "f32": 2.0**-24}
ST_UNIT = {"BF16": UNIT["bf16"], "F16": UNIT["fp16"], "F32": UNIT["f32"], "F64": 2.0**-53}
# The unit used for float32 in the bounds. docs/runners.md says 2^-24, but a kernel that
# accumulates in float32 cannot meet 4u = 2.4e-7 rel-L2: numpy's own float32 path lands at 1e-7 to
# 7e-7 rel-L2 and up to 26x the elementwise bound on these shapes (the rounding of 512-576-term dot
# products, exp and the key sums, none of it in the storage). 2^-18 (64 float32 ulps) leaves that
# accumulation noise room and is still ~500x below the fp16 bound. --f32-unit sets it.
F32_UNIT = 2.0**-18

CASES = {
    # name: dims, decode schedules (page, splits, s_q, seqlens), prefill chunks (n, context_len)
    "deepseek": dict(
        heads=128, kv_lora_rank=512, qk_rope=64, qk_nope=128, v_head_dim=128, scale=0.1352337788608801,
        decode=[dict(page=64, splits=4, s_q=1, seqlens=[1, 70, 200, 129]), dict(page=64, splits=4, s_q=2, seqlens=[65, 130])],
        prefill=[dict(n=24, context=40)],
        sparse=[dict(n=20, context=90, topk=48, page=64)],
        sparse_decode=[dict(page=64, s_q=1, topk=40, seqlens=[1, 70, 200]), dict(page=64, s_q=2, topk=130, seqlens=[131, 300])],
    ),
    "glm5": dict(
        heads=64, kv_lora_rank=512, qk_rope=64, qk_nope=192, v_head_dim=256, scale=0.0625,
        decode=[dict(page=64, splits=3, s_q=1, seqlens=[1, 100, 257])],
        prefill=[dict(n=16, context=33)],
        sparse=[dict(n=12, context=0, topk=8, page=64), dict(n=16, context=150, topk=130, page=16)],
        sparse_decode=[dict(page=64, s_q=1, topk=16, seqlens=[9, 100, 257])],
    ),
    "minicpm3": dict(
        heads=4, kv_lora_rank=256, qk_rope=32, qk_nope=64, v_head_dim=64, scale=0.10206207261596575,
        decode=[dict(page=16, splits=4, s_q=1, seqlens=[1, 40, 77])],
        prefill=[dict(n=9, context=0), dict(n=9, context=20)],
    ),
    "tiny": dict(
        heads=3, kv_lora_rank=16, qk_rope=8, qk_nope=8, v_head_dim=12, scale=0.3,
        decode=[dict(page=3, splits=5, s_q=3, seqlens=[3, 10, 17])],
        prefill=[dict(n=5, context=7)],
    ),
    # The rows of the per-row formats no case above fits (FORMAT_DIMS), run by default only with a
    # --kv-cache-dtype that fits them: a NoPE row (glm5-next's 512 + 0, fp8_ds_mla_nope) and DeepSeek-V4's
    # 448 + 64 (fp8_v41, fp4_v41); heads cut to keep them cheap.
    "glm5-next": dict(
        heads=16, kv_lora_rank=512, qk_rope=0, qk_nope=256, v_head_dim=256, scale=0.0625,
        decode=[dict(page=64, splits=3, s_q=1, seqlens=[1, 70, 130])],
        prefill=[dict(n=8, context=20)],
        sparse=[dict(n=10, context=40, topk=24, page=64)],
        sparse_decode=[dict(page=64, s_q=2, topk=20, seqlens=[9, 100])],
    ),
    "v4-dims": dict(
        heads=16, kv_lora_rank=448, qk_rope=64, qk_nope=128, v_head_dim=128, scale=0.07216878364870323,
        decode=[dict(page=16, splits=4, s_q=2, seqlens=[2, 40, 97])],
        prefill=[dict(n=8, context=20)],
        sparse=[dict(n=10, context=30, topk=20, page=16)],
        sparse_decode=[dict(page=16, s_q=1, topk=24, seqlens=[1, 50, 97])],
    ),
}
FORMAT_CASES = ("glm5-next", "v4-dims")


def default_cases(fmt):
    """The cases run without --cases: all but FORMAT_CASES, and those of them `fmt` fits."""
    fit = [c for c in FORMAT_CASES if fmt and cache_fits(fmt, CASES[c]["kv_lora_rank"], CASES[c]["qk_rope"]) is None]
    return [c for c in CASES if c not in FORMAT_CASES] + fit


# ----------------------------------------------------------------------------------------------
# inputs


def stored(x, dtype):
    """Round to the storage dtype; returns (value as float64, array to write)."""
    w = protocol.storage(x, dtype)
    return protocol.round_to(x, dtype).astype(np.float64), w


def make_decode(rng, c, d, dtype):
    heads, r, rope = c["heads"], c["kv_lora_rank"], c["qk_rope"]
    page, s_q, seqlens = d["page"], d["s_q"], d["seqlens"]
    b_n = len(seqlens)
    # Query spread so that scaled scores have a std of about 2 (peaked, not one-hot).
    sigma = 2.0 / (c["scale"] * math.sqrt(r + rope))
    q_nope = rng.standard_normal((b_n, s_q, heads, r)) * sigma
    q_pe = rng.standard_normal((b_n, s_q, heads, rope)) * sigma
    pages = [-(-L // page) for L in seqlens]
    max_pages = max(pages) + 1  # one unused slot at the end of every row
    pool = sum(pages) + 2  # two spare (NaN) pages
    perm = rng.permutation(pool)
    nan_page = int(perm[-1])
    cache = np.full((pool, page, r + rope), np.nan)
    table = np.full((b_n, max_pages), nan_page, np.int32)
    nxt = 0
    for b, L in enumerate(seqlens):
        for i in range(pages[b]):
            phys = int(perm[nxt])
            nxt += 1
            table[b, i] = phys
            rows = min(page, L - i * page)
            cache[phys, :rows, :r] = rng.standard_normal((rows, r))
            cache[phys, :rows, r:] = rng.standard_normal((rows, rope))
            # a few large-magnitude latent channels, as real latents have
            cache[phys, :rows, :4] *= 8.0
    qn, qn_w = stored(q_nope, dtype)
    qp, qp_w = stored(q_pe, dtype)
    kv, kv_w = stored(cache, dtype)
    inputs = {
        "q_nope": qn_w,
        "q_pe": qp_w,
        "kv_cache": kv_w,
        "block_table": table,
        "cache_seqlens": np.asarray(seqlens, np.int32),
    }
    meta = dict(common_meta(c, dtype), page_size=page, num_splits=d["splits"])
    return inputs, meta, (qn, qp, kv, table, seqlens)


def make_prefill(rng, c, p, dtype):
    heads, nope, rope, dv = c["heads"], c["qk_nope"], c["qk_rope"], c["v_head_dim"]
    n, ctx = p["n"], p["context"]
    s = ctx + n
    sigma = 2.0 / (c["scale"] * math.sqrt(nope + rope))
    q = rng.standard_normal((n, heads, nope + rope)) * sigma
    k = np.empty((s, heads, nope + rope))
    k[:, :, :nope] = rng.standard_normal((s, heads, nope))
    k[:, :, nope:] = rng.standard_normal((s, 1, rope))  # k_pe shared by the heads
    v = rng.standard_normal((s, heads, dv))
    qv, q_w = stored(q, dtype)
    kv, k_w = stored(k, dtype)
    vv, v_w = stored(v, dtype)
    meta = dict(common_meta(c, dtype), context_len=ctx)
    return {"q": q_w, "k": k_w, "v": v_w}, meta, (qv, kv, vv, ctx)


def common_meta(c, dtype):
    return {
        "dtype": dtype,
        "softmax_scale": c["scale"],
        "heads": c["heads"],
        "kv_lora_rank": c["kv_lora_rank"],
        "qk_nope": c["qk_nope"],
        "qk_rope": c["qk_rope"],
        "v_head_dim": c["v_head_dim"],
        "causal": True,
    }


def make_sparse(rng, c, sp, dtype):
    """A sparse_prefill request (docs/runners.md): the chunk's absorbed queries, the flat latent cache
    (pages shuffled, every slot not holding a token of the chunk's sequence NaN) and each query's selected
    keys as cache slots, −1 padded to `topk` (query t = context + i sees keys 0..t; it keeps itself and at
    most topk − 1 others, drawn at random)."""
    heads, r, rope = c["heads"], c["kv_lora_rank"], c["qk_rope"]
    n, ctx, topk, page = sp["n"], sp["context"], sp["topk"], sp["page"]
    total = ctx + n
    pages = -(-total // page) + 2  # two spare NaN pages
    perm = rng.permutation(pages)
    slot = np.array([perm[t // page] * page + t % page for t in range(total)], np.int64)
    kv = np.full((pages * page, 1, r + rope), np.nan)
    kv[slot, 0, :] = rng.standard_normal((total, r + rope))
    kv[slot, 0, :4] *= 8.0
    sigma = 2.0 / (c["scale"] * math.sqrt(r + rope))
    q = rng.standard_normal((n, heads, r + rope)) * sigma
    idx = np.full((n, 1, topk), -1, np.int32)
    for i in range(n):
        t = ctx + i
        others = rng.permutation(t)[: min(topk, t + 1) - 1]
        keys = np.sort(np.concatenate([others, [t]]))
        idx[i, 0, : keys.size] = slot[keys]
    qv, q_w = stored(q, dtype)
    kvv, kv_w = stored(kv, dtype)
    meta = dict(common_meta(c, dtype), context_len=ctx, top_k=topk, d_v=r, page_size=page)
    return {"q": q_w, "kv": kv_w, "indices": idx}, meta, (qv, kvv, idx)


def make_sparse_decode(rng, c, sd, dtype):
    """A sparse_decode request (docs/runners.md): one batch entry per sequence, `s_q` query tokens each
    (the last ones of the sequence), the paged latent cache as the decode op sends it (pages shuffled, NaN
    where no token is, a NaN page spare) and each query's selected keys as page·page_size + offset through
    its entry's block table, in key order, −1 padded to `topk` (query t keeps itself and at most topk − 1
    of its visible keys, drawn at random)."""
    heads, r, rope = c["heads"], c["kv_lora_rank"], c["qk_rope"]
    page, s_q, topk, seqlens = sd["page"], sd["s_q"], sd["topk"], sd["seqlens"]
    b_n = len(seqlens)
    pages = [-(-L // page) for L in seqlens]
    pool = sum(pages) + 1
    perm = rng.permutation(pool)
    cache = np.full((pool, page, r + rope), np.nan)
    idx = np.full((b_n, s_q, topk), -1, np.int32)
    nxt = 0
    for b, L in enumerate(seqlens):
        table = [int(p) for p in perm[nxt:nxt + pages[b]]]
        nxt += pages[b]
        for i, phys in enumerate(table):
            rows = min(page, L - i * page)
            cache[phys, :rows] = rng.standard_normal((rows, r + rope))
            # a few large-magnitude latent channels, as real latents have (tile 0 of an fp8 cache)
            cache[phys, :rows, :4] *= 8.0
        for j in range(s_q):
            t = max(L - s_q + j, 0)
            others = rng.permutation(t)[: min(topk, t + 1) - 1]
            keys = np.sort(np.concatenate([others, [t]])).astype(np.int64)
            idx[b, j, : keys.size] = [table[k // page] * page + k % page for k in keys]
    sigma = 2.0 / (c["scale"] * math.sqrt(r + rope))
    q = rng.standard_normal((b_n, s_q, heads, r + rope)) * sigma
    qv, q_w = stored(q, dtype)
    kvv, kv_w = stored(cache, dtype)
    meta = dict(common_meta(c, dtype), page_size=page, num_splits=1, q_len=s_q, top_k=topk, d_v=r)
    return {"q": q_w, "kv_cache": kv_w, "indices": idx}, meta, (qv, kvv, idx)


# ----------------------------------------------------------------------------------------------
# FlashMLA's fp8 cache (`kv_cache: fp8_v32`), written independently of runners/flashmla_fp8.py: the
# float64 yardstick for a kernel that reads it is attention over the rows as that format stores them.

# The non-negative float8 e4m3fn values, ascending: position k has mantissa field k % 8 (exponent field
# 0 subnormal, bias 7; S.1111.111 is NaN, so 448 is the largest).
_E4M3 = np.array([m * 2.0**-9 for m in range(8)]
                 + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)][:-1])


def e4m3_code(x):
    """Each x to its nearest e4m3fn value, ties to the even mantissa field, saturating at ±448: (the
    byte codes, the values as float64)."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    i = np.clip(np.searchsorted(_E4M3, a), 1, _E4M3.size - 1)
    lo, hi = _E4M3[i - 1], _E4M3[i]
    up = (hi - a < a - lo) | ((hi - a == a - lo) & (i % 2 == 0))
    k = np.where(up, i, i - 1)
    codes = (k | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
    return codes, np.copysign(_E4M3[k], x)


def e4m3_nearest(x):
    """Each |x| ≤ 448 to its nearest e4m3fn value, ties to the even mantissa field."""
    return e4m3_code(x)[1]


def fp8_v32_rows(rows):
    """Cache rows [..., 512 + 64] (float64, the stored values) as FlashMLA's V32 fp8 cache gives them
    back: per tile of 128 latent columns a power-of-two scale 2^ceil(log2(max(amax/448, 1e-4))), the
    values round(x / scale) in e4m3 times the scale, the 64 rope values in bf16 (as stored)."""
    out = np.array(rows, np.float64)
    lat = out[..., :512].reshape(rows.shape[:-1] + (4, 128))
    amax = np.abs(lat).max(axis=-1, keepdims=True)
    scale = np.exp2(np.ceil(np.log2(np.maximum(amax.astype(np.float32) / np.float32(448.0), np.float32(1e-4)).astype(np.float64))))
    out[..., :512] = (e4m3_nearest(lat / scale) * scale).reshape(rows.shape[:-1] + (512,))
    return out


# ----------------------------------------------------------------------------------------------
# Quantized caches (`--kv-cache-dtype FMT`, as `mla-diff run --kv-cache-dtype`; docs/cache-formats.md):
# the cache rows a request carries are sent as the format's bytes with `meta.cache`, written here
# independently of the runner SDK's reader, and the float64 yardstick attends over the values those
# bytes hold (each q·s in float32), so a runner that misreads them (a scale, a group, the rope) fails.

# What selfcheck writes: every format of docs/cache-formats.md (those numpy_mla and the runner SDK read).
CACHE_FORMATS = ("fp8", "fp8_ds_mla", "fp8_ds_mla_nope", "fp8_v41", "fp4_v41")
CACHE_OPS = ("decode", "sparse_prefill", "sparse_decode")  # the ops that read the latent cache

# The dims each per-row format holds (kv_lora_rank, qk_rope), or the row width (an int) for the V4.1
# formats, which quantize the rope with the row; the case that has them, named in a refusal.
FORMAT_DIMS = {
    "fp8_ds_mla": ((512, 64), "DeepSeek-V3.2's row: cases deepseek, glm5"),
    "fp8_ds_mla_nope": ((512, 0), "a NoPE row, as glm5-next: case glm5-next"),
    "fp8_v41": (512, "DeepSeek-V4's 448 + 64: cases v4-dims, glm5-next"),
    "fp4_v41": (512, "DeepSeek-V4's 448 + 64: cases v4-dims, glm5-next"),
}


def cache_fits(fmt, r, rope):
    """None when `fmt` holds rows of r latent + rope columns, else why not (one line)."""
    if fmt not in FORMAT_DIMS:
        return None  # fp8: any row
    need, which = FORMAT_DIMS[fmt]
    if need == (r, rope) or need == r + rope:
        return None
    want = f"kv_lora_rank {need[0]} + qk_rope {need[1]}" if isinstance(need, tuple) else f"kv_lora_rank + qk_rope = {need}"
    return f"cache format {fmt} needs {want} ({which}), not {r} + {rope}"


def pow2_scales(groups):
    """Per group (last axis) 2^ceil(log2 max(amax / 448, 1e-4)), amax / 448 in float32: FlashMLA's
    tests/quant.py rule (ds_mla's float32 tile scales, V4.1 fp8's ue8m0 ones). float32 `[..., 1]`."""
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    floor = np.maximum(amax / np.float32(448.0), np.float32(1e-4)).astype(np.float64)
    return np.exp2(np.ceil(np.log2(floor))).astype(np.float32)


# The e2m1 (fp4) magnitudes by code (sign in bit 3).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_code(y):
    """Each y to its nearest e2m1 value, ties to the even code, saturating at ±6: (the 4-bit codes,
    the values as float64)."""
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    i = np.clip(np.searchsorted(_E2M1, a), 1, _E2M1.size - 1)
    lo, hi = _E2M1[i - 1], _E2M1[i]
    up = (hi - a < a - lo) | ((hi - a == a - lo) & (i % 2 == 0))
    k = np.where(up, i, i - 1)
    return (k | np.where(np.signbit(y), 8, 0)).astype(np.uint8), np.copysign(_E2M1[k], y)


def le_bytes(a, dtype):
    """`a` `[..., n]` as the little-endian bytes of `dtype` `[..., n · size]`."""
    a = np.ascontiguousarray(np.asarray(a).astype(dtype))
    return a.view(np.uint8).reshape(a.shape[:-1] + (-1,))


def quantize_ds_mla(x, rope):
    """fp8_ds_mla (rope 64) / fp8_ds_mla_nope (rope 0), 656 bytes: 512 e4m3 latent values, tile k of
    128 columns over its pow2 scale, the 4 scales as little-endian float32, then the rope in bf16 and
    zeros to byte 656 (_nope: all 128 reserved, zero). Returns (bytes, values)."""
    lead = x.shape[:-1]
    lat = x[..., :512].reshape(lead + (4, 128))
    sc = pow2_scales(lat)
    lc, q = e4m3_code((lat / sc).astype(np.float64))
    lat_vals = (q.astype(np.float32) * sc).astype(np.float64).reshape(lead + (512,))
    tail = np.zeros(lead + (128,), np.uint8)
    tail[..., : 2 * rope] = le_bytes(protocol.to_bf16_bits(x[..., 512:]), "<u2")
    codes = np.concatenate([lc.reshape(lead + (512,)), le_bytes(sc[..., 0], "<f4"), tail], axis=-1)
    vals = np.concatenate([lat_vals, protocol.round_to(x[..., 512:], "bf16").astype(np.float64)], axis=-1)
    return codes, vals


def quantize_v41(x, fmt):
    """FlashMLA V4.1's rows of 512 (rope included). fp8_v41, 528 bytes: 512 e4m3, group g of 32 columns
    over its pow2 scale, then the 16 scales as ue8m0 (the float32 exponent byte). fp4_v41, 288 bytes:
    512 e2m1 codes two per byte (column 2k in the low nibble), group g of 16 columns over its scale
    e4m3(amax / 6) (a zero scale: codes 0), then the 32 scales' e4m3 bytes. Returns (bytes, values)."""
    lead = x.shape[:-1]
    if fmt == "fp8_v41":
        g = x.reshape(lead + (16, 32))
        sc = pow2_scales(g)
        qc, q = e4m3_code((g / sc).astype(np.float64))
        ue8m0 = ((np.ascontiguousarray(sc[..., 0]).view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
        codes = np.concatenate([qc.reshape(lead + (512,)), ue8m0], axis=-1)
    else:
        g = x.reshape(lead + (32, 16))
        amax = np.abs(g).max(axis=-1, keepdims=True)
        scode, sv = e4m3_code((amax / np.float32(6.0)).astype(np.float64))
        sc = sv.astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            qc, q = e2m1_code(np.where(sc > 0, g / np.where(sc > 0, sc, 1), 0.0).astype(np.float64))
        qc = np.where(sc > 0, qc, 0).reshape(lead + (512,)).astype(np.uint8)
        codes = np.concatenate([qc[..., 0::2] | (qc[..., 1::2] << 4), scode[..., 0]], axis=-1)
    vals = (q.astype(np.float32) * sc).astype(np.float64).reshape(lead + (512,))
    return codes, vals


def quantize_cache(rows, fmt, r, rope):
    """Cache rows `[..., r + rope]` (float64 as stored; NaN where no token is) in `fmt`: (u8 bytes
    `[..., bytes_per_token]`, 0xff where no token is; float64 rows as the bytes give them back, each
    q·s in float32, NaN where no token is; `meta.cache`). Byte layouts: docs/cache-formats.md, the
    same as mla-diff's `Codec::encode` (tests/it/selfcheck_cache.rs holds them equal, byte for byte).

    - `fp8`: every column e4m3(x / s) (x / s in float32) with one scale s = max(amax / 448, 1e-4) over
      the written rows, sent as `meta.cache.scale`;
    - `fp8_ds_mla` / `fp8_ds_mla_nope`: `quantize_ds_mla`; `fp8_v41` / `fp4_v41`: `quantize_v41`."""
    rows = np.asarray(rows, np.float64)
    live = np.isfinite(rows).all(axis=-1)
    x = np.where(live[..., None], rows, 0.0).astype(np.float32)
    if fmt == "fp8":
        amax = np.float32(np.abs(x).max()) if x.size else np.float32(0.0)
        sc = np.maximum(amax / np.float32(448.0), np.float32(1e-4)).astype(np.float32)
        codes, q = e4m3_code((x / sc).astype(np.float64))
        vals = (q.astype(np.float32) * sc).astype(np.float64)
        meta = {"format": fmt, "bytes_per_token": r + rope, "scale": float(sc)}
    elif fmt in ("fp8_ds_mla", "fp8_ds_mla_nope"):
        codes, vals = quantize_ds_mla(x, rope)
        meta = {"format": fmt, "bytes_per_token": 656}
    else:
        codes, vals = quantize_v41(x, fmt)
        meta = {"format": fmt, "bytes_per_token": codes.shape[-1]}
    codes = np.where(live[..., None], codes, np.uint8(0xFF)).astype(np.uint8)
    vals = np.where(live[..., None], vals, np.nan)
    return codes, vals, meta


def quantize_request(op, inputs, meta, data, c, fmt):
    """A cache-reading request's float cache replaced by `fmt`'s bytes, its yardstick's rows by the values
    they hold: (inputs, meta, data)."""
    key, at = {"decode": ("kv_cache", 2), "sparse_prefill": ("kv", 1), "sparse_decode": ("kv_cache", 1)}[op]
    codes, vals, cm = quantize_cache(data[at], fmt, c["kv_lora_rank"], c["qk_rope"])
    data = data[:at] + (vals,) + data[at + 1:]
    return dict(inputs, **{key: codes}), dict(meta, cache=cm), data


# ----------------------------------------------------------------------------------------------
# float64 reference


def softmax64(s):
    m = np.max(s, axis=-1, keepdims=True)
    empty = ~np.isfinite(m)
    m = np.where(empty, 0.0, m)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / z, 0.0)
        lse = np.where(empty, -np.inf, m + np.log(z))[..., 0]
    return p, lse


def ref_decode(c, d, data):
    qn, qp, kv, table, seqlens = data
    r = c["kv_lora_rank"]
    page, s_q, ns = d["page"], d["s_q"], d["splits"]
    b_n, _, heads, _ = qn.shape
    q = np.concatenate([qn, qp], -1)
    out = np.zeros((b_n, s_q, heads, r))
    lse = np.zeros((b_n, s_q, heads))
    sout = np.zeros((b_n, s_q, heads, ns, r))
    slse = np.full((b_n, s_q, heads, ns), -np.inf)
    for b, L in enumerate(seqlens):
        rows = np.stack([kv[table[b, t // page], t % page] for t in range(L)])
        assert np.isfinite(rows).all()
        sc = np.einsum("shd,kd->shk", q[b], rows) * c["scale"]
        vis = np.arange(L)[None, :] < (L - s_q + np.arange(s_q) + 1)[:, None]
        sc = np.where(vis[:, None, :], sc, -np.inf)
        p, l = softmax64(sc)
        out[b] = p @ rows[:, :r]
        lse[b] = l
        per = -(-L // ns)
        for k in range(ns):
            lo, hi = min(k * per, L), min((k + 1) * per, L)
            if hi > lo:
                ps, ls = softmax64(sc[:, :, lo:hi])
                sout[b, :, :, k] = ps @ rows[lo:hi, :r]
                slse[b, :, :, k] = ls
    return {"attn_latent": out, "lse": lse, "split_out": sout, "split_lse": slse}


def ref_prefill(c, data):
    q, k, v, ctx = data
    n, s = q.shape[0], k.shape[0]
    sc = np.einsum("nhd,shd->hns", q, k) * c["scale"]
    vis = np.arange(s)[None, :] < (ctx + np.arange(n) + 1)[:, None]
    sc = np.where(vis[None], sc, -np.inf)
    p, lse = softmax64(sc)
    out = np.einsum("hns,shd->nhd", p, v)
    return {"attn_heads": out, "lse": lse.T}


def ref_sparse(c, data):
    q, kv, idx = data
    r = c["kv_lora_rank"]
    n, heads, _ = q.shape
    out, lse = np.zeros((n, heads, r)), np.zeros((n, heads))
    for i in range(n):
        rows = kv[idx[i, 0][idx[i, 0] >= 0], 0]
        assert np.isfinite(rows).all()
        p, lse[i] = softmax64(q[i] @ rows.T * c["scale"])
        out[i] = p @ rows[:, :r]
    return {"attn_latent": out, "lse": lse}


def ref_sparse_decode(c, data, fp8):
    """Attention of each decode query over the slots its index row names; over the fp8 cache's rows
    when the runner's describe says its kernel reads one."""
    q, kv, idx = data
    r = c["kv_lora_rank"]
    b_n, s_q, heads, _ = q.shape
    flat = kv.reshape(-1, kv.shape[-1])
    out, lse = np.zeros((b_n, s_q, heads, r)), np.zeros((b_n, s_q, heads))
    for b in range(b_n):
        for j in range(s_q):
            rows = flat[idx[b, j][idx[b, j] >= 0]]
            assert np.isfinite(rows).all()
            if fp8:
                rows = fp8_v32_rows(rows)
            p, lse[b, j] = softmax64(q[b, j] @ rows.T * c["scale"])
            out[b, j] = p @ rows[:, :r]
    return {"attn_latent": out, "lse": lse}


# ----------------------------------------------------------------------------------------------
# comparison


def normalise(name, arr, conv, op):
    if name in ("lse", "split_lse") and conv.get("lse_base") == "2":
        arr = arr * math.log(2.0)
    if name == "lse" and conv.get("lse_layout") == "head_token":
        arr = np.swapaxes(arr, -1, -2)  # decode [B,H,s_q] -> [B,s_q,H]; prefill [H,n] -> [n,H]
    return arr


def compare(name, got, got_dtype, ref, run_dtype):
    """Returns (ok, text, rel_l2)."""
    units = dict(UNIT, f32=F32_UNIT)
    st_units = dict(ST_UNIT, F32=F32_UNIT)
    u = max(units[run_dtype], st_units.get(got_dtype, UNIT["bf16"]))
    if got.shape != ref.shape:
        return False, f"shape {list(got.shape)} != expected {list(ref.shape)}", float("nan")
    got = got.astype(np.float64)
    if np.isnan(got).any():
        return False, f"{int(np.isnan(got).sum())} NaN", float("nan")
    ninf_ref, ninf_got = np.isneginf(ref), np.isneginf(got)
    if (ninf_ref != ninf_got).any():
        return False, f"-inf at {int((ninf_ref != ninf_got).sum())} places where the reference differs", float("nan")
    fin = ~ninf_ref
    if not np.isfinite(got[fin]).all():
        return False, "inf where the reference is finite", float("nan")
    d = got[fin] - ref[fin]
    rf = ref[fin]
    norm = np.linalg.norm(rf)
    rel = float(np.linalg.norm(d) / norm) if norm > 0 else float(np.linalg.norm(d))
    rms = float(np.sqrt(np.mean(rf**2))) if rf.size else 0.0
    bound = 16 * u * rms + 4 * u * np.abs(rf)
    worst = float(np.max(np.abs(d) / np.maximum(bound, 1e-300))) if d.size else 0.0
    ok = rel <= 4 * u and worst <= 1.0
    text = f"rel-L2 {rel:.2e} (<= {4 * u:.1e})  max|d|/bound {worst:.2f}  [{got_dtype}]"
    return ok, text, rel


# ----------------------------------------------------------------------------------------------
# the runner under test


class RunnerProcess:
    def __init__(self, cmd, workdir, timeout):
        self.cmd = cmd
        self.timeout = timeout
        self.err_path = os.path.join(workdir, "runner.stderr")
        self.err = open(self.err_path, "w")
        self.p = subprocess.Popen(cmd + ["--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1)
        self.next_id = 0

    def stderr_tail(self, n=1):
        self.err.flush()
        with open(self.err_path) as f:
            lines = [x for x in f.read().splitlines() if x.strip()]
        return "\n".join(lines[-n:])

    def request(self, op, inp, out, meta):
        self.next_id += 1
        rid = self.next_id
        req = {"id": rid, "op": op, "layer": 0, "input": inp, "output": out, "meta": meta}
        try:
            self.p.stdin.write(json.dumps(req) + "\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        deadline = time.time() + self.timeout
        while True:
            left = deadline - time.time()
            if left <= 0:
                return {"status": "error", "message": f"no reply in {self.timeout} s"}
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if ready:
                line = self.p.stdout.readline()
                if not line:
                    rc = self.p.wait()
                    if rc == 3:
                        return {"status": "unsupported", "reason": f"exit 3: {self.stderr_tail()}", "dead": True}
                    return {"status": "error", "message": f"runner exited {rc}: {self.stderr_tail(5)}", "dead": True}
                try:
                    rep = json.loads(line)
                except json.JSONDecodeError:
                    return {"status": "error", "message": f"stdout line is not JSON: {line[:200]!r}"}
                if rep.get("id") != rid:
                    return {"status": "error", "message": f"reply id {rep.get('id')} != request id {rid}"}
                return rep

    def close(self):
        try:
            self.p.stdin.close()
        except Exception:
            pass
        try:
            rc = self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        self.err.close()
        return rc


def describe(cmd, timeout):
    p = subprocess.run(cmd + ["--describe"], capture_output=True, text=True, timeout=timeout)
    if p.returncode == 3:
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        return None, "unsupported: " + (lines[-1] if lines else "(no reason)")
    if p.returncode != 0:
        return None, f"error: --describe exited {p.returncode}: {p.stderr.strip()[-2000:]}"
    try:
        return json.loads(p.stdout), None
    except json.JSONDecodeError:
        return None, f"error: --describe printed no JSON: {p.stdout[:300]!r}"


def describe_refuses(desc, op, c, dtype, sched, fmt=None):
    """The supports key that rules this case out, as mla-diff would report it, or None. `fmt`: the
    quantized cache the ops that read one are sent (`supports.cache_formats`: absent or null is none)."""
    if op not in desc.get("ops", {}):
        return f"op {op} not implemented"
    sup = desc.get("supports", {})
    if fmt and op in CACHE_OPS:
        fits = cache_fits(fmt, c["kv_lora_rank"], c["qk_rope"])
        if fits:
            return fits
        if fmt not in (sup.get("cache_formats") or []):
            return f"describe: cache_formats {sup.get('cache_formats')} does not list {fmt}"
    want = {
        "dtypes": dtype,
        "heads": c["heads"],
        "kv_lora_rank": c["kv_lora_rank"],
        "qk_rope": c["qk_rope"],
    }
    if op == "decode":
        want["page_sizes"] = sched["page"]
    elif op == "prefill":
        want["qk_head_dim"] = c["qk_nope"] + c["qk_rope"]
        want["v_head_dim"] = c["v_head_dim"]
    for key, val in want.items():
        allowed = sup.get(key)
        if allowed is not None and val not in allowed:
            return f"describe: {key} {val} not in {allowed}"
    if op == "decode" and sup.get("max_q_len") is not None and sched["s_q"] > sup["max_q_len"]:
        return f"describe: q_len {sched['s_q']} > max_q_len {sup['max_q_len']}"
    return None


def check_runner(cmd, cases, dtypes, workdir, timeout=600, seed=0, verbose=True, out=sys.stdout, fmt=None, ops=None):
    """Run every case through one runner (`fmt`: the quantized cache format the cache-reading ops are
    sent, `--kv-cache-dtype`; `ops`: only these ops, `--ops`). Returns a list of result dicts."""
    results = []

    def emit(res):
        results.append(res)
        if verbose:
            head = f"{res['case']:<9} {res['dtype']:<5} {res['op']:<7} {res['sched']:<28}"
            if res["status"] == "unsupported" and res.get("reason", "").endswith("not implemented"):
                pass  # an op the runner does not offer: counted, not listed
            elif res["status"] != "checked":
                print(f"  {head} {res['status'].upper()}: {res.get('reason', '')}", file=out)
            else:
                for name, (ok, text, _) in res["outputs"].items():
                    print(f"  {head} {name:<12} {'ok  ' if ok else 'FAIL'} {text}", file=out)
            out.flush()

    desc, problem = describe(cmd, timeout)
    if desc is None:
        print(f"  describe: {problem}", file=out)
        status = "unsupported" if problem.startswith("unsupported") else "error"
        results.append({"case": "*", "dtype": "*", "op": "*", "sched": "", "status": status, "reason": problem})
        return results, None
    conv = desc.get("conventions", {})
    print(f"  describe: {desc.get('name')} | {desc.get('version')} | ops {sorted(desc.get('ops', {}))} | {conv}", file=out)
    proc = RunnerProcess(cmd, workdir, timeout)
    dead = None
    rng = np.random.default_rng(seed)
    n = 0
    for cname in cases:
        c = CASES[cname]
        for dtype in dtypes:
            jobs = [("decode", d) for d in c["decode"]] + [("prefill", p) for p in c["prefill"]]
            jobs += [("sparse_prefill", sp) for sp in c.get("sparse", [])]
            jobs += [("sparse_decode", sd) for sd in c.get("sparse_decode", [])]
            jobs = [(op, sched) for op, sched in jobs if ops is None or op in ops]
            for op, sched in jobs:
                if op == "decode":
                    label = f"s_q {sched['s_q']} page {sched['page']} L {sched['seqlens']}"
                elif op == "sparse_decode":
                    label = f"s_q {sched['s_q']} L {sched['seqlens']} topk {sched['topk']}"
                elif op == "sparse_prefill":
                    label = f"n {sched['n']} context {sched['context']} topk {sched['topk']}"
                else:
                    label = f"n {sched['n']} context {sched['context']}"
                if fmt and op in CACHE_OPS:
                    label += f" {fmt}"
                res = {"case": cname, "dtype": dtype, "op": op, "sched": label}
                refusal = describe_refuses(desc, op, c, dtype, sched, fmt)
                if refusal:
                    emit(dict(res, status="unsupported", reason=refusal))
                    continue
                if dead:
                    emit(dict(res, status=dead["status"], reason=dead.get("reason") or dead.get("message")))
                    continue
                quantized = fmt and op in CACHE_OPS
                if op == "decode":
                    inputs, meta, data = make_decode(rng, c, sched, dtype)
                    if quantized:
                        inputs, meta, data = quantize_request(op, inputs, meta, data, c, fmt)
                    ref = ref_decode(c, sched, data)
                elif op == "sparse_prefill":
                    inputs, meta, data = make_sparse(rng, c, sched, dtype)
                    if quantized:
                        inputs, meta, data = quantize_request(op, inputs, meta, data, c, fmt)
                    ref = ref_sparse(c, data)
                elif op == "sparse_decode":
                    inputs, meta, data = make_sparse_decode(rng, c, sched, dtype)
                    # Sent the format's bytes, a runner writes no fp8 cache of its own (docs/runners.md).
                    own_fp8 = desc["ops"][op].get("kv_cache") == "fp8_v32" and not quantized
                    if quantized:
                        inputs, meta, data = quantize_request(op, inputs, meta, data, c, fmt)
                    ref = ref_sparse_decode(c, data, own_fp8)
                else:
                    inputs, meta, data = make_prefill(rng, c, sched, dtype)
                    ref = ref_prefill(c, data)
                n += 1
                inp = os.path.join(workdir, f"{n}.in.safetensors")
                outp = os.path.join(workdir, f"{n}.out.safetensors")
                protocol.write_numpy(inp, inputs)
                t0 = time.time()
                rep = proc.request(op, inp, outp, meta)
                dt = time.time() - t0
                if rep.get("dead"):
                    dead = rep
                if rep.get("status") != "ok":
                    emit(dict(res, status=rep.get("status", "error"), reason=rep.get("reason") or rep.get("message")))
                    continue
                got, got_dt, gmeta = protocol.read_numpy(outp)
                outs = {}
                for name in desc["ops"][op]["outputs"]:
                    if name not in got:
                        outs[name] = (False, "missing from the output file", float("nan"))
                        continue
                    arr = normalise(name, got[name], conv, op)
                    outs[name] = compare(name, arr, got_dt[name], ref[name], dtype)
                if gmeta.get("mla_diff_protocol") != "1":
                    outs["__metadata__"] = (False, f"output __metadata__ {gmeta!r} lacks mla_diff_protocol 1", float("nan"))
                emit(dict(res, status="checked", outputs=outs, seconds=round(dt, 3)))
    rc = proc.close()
    if rc not in (0, None) and not dead:
        print(f"  runner exited {rc} after stdin closed: {proc.stderr_tail(3)}", file=out)
        results.append({"case": "*", "dtype": "*", "op": "*", "sched": "", "status": "error", "reason": f"exit {rc} at close"})
    return results, desc


def tally(results):
    passed = failed = unsupported = 0
    failing = set()
    for r in results:
        if r["status"] == "checked":
            for name, (ok, _, _) in r["outputs"].items():
                if ok:
                    passed += 1
                else:
                    failed += 1
                    failing.add(f"{r['op']}.{name}")
        elif r["status"] == "unsupported":
            unsupported += 1
        else:
            failed += 1
            failing.add(f"{r['op']}.<{r['status']}>")
    return passed, failed, unsupported, failing


def jsonable(results):
    out = []
    for r in results:
        r = dict(r)
        if "outputs" in r:
            r["outputs"] = {k: {"ok": ok, "text": t, "rel_l2": (None if rel != rel else rel)} for k, (ok, t, rel) in r["outputs"].items()}
        out.append(r)
    return out


def codec_check(workdir):
    """protocol.py's own safetensors codec against the safetensors package (numpy; torch for BF16
    when torch is importable) and bfloat16 round-to-nearest-even on known bit patterns. Returns a
    list of failure texts."""
    fails = []
    # 1, 1+2^-8 (tie -> even 0x3F80), 1+3*2^-8 (tie -> even 0x3F82), 1+2^-8+2^-20 (above the tie),
    # -2.5, the largest float32 (rounds to inf), a NaN (stays a quiet NaN)
    vals = np.array([1.0, 1.00390625, 1.01171875, 1.0 + 2**-8 + 2**-20, -2.5, 3.4028235e38, np.nan], np.float32)
    want = [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F80, 0x7FC0]
    got = [int(x) for x in protocol.to_bf16_bits(vals)]
    if got != want:
        fails.append(f"bf16 rounding: {[hex(g) for g in got]} != {[hex(w) for w in want]}")
    rng = np.random.default_rng(1)
    arrays = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((4,)).astype(np.float16),
        "i32": rng.integers(-9, 9, (2, 3)).astype(np.int32),
        "f64": rng.standard_normal((2, 2)),
    }
    bf = rng.standard_normal((6, 7)).astype(np.float32)
    path = os.path.join(workdir, "codec.safetensors")
    protocol.write_numpy(path, dict(arrays, bf=protocol.BF16(bf)))
    back, dts, meta = protocol.read_numpy(path)
    if meta != protocol.METADATA:
        fails.append(f"metadata read back as {meta}")
    for k, a in arrays.items():
        if back[k].dtype != a.dtype or not np.array_equal(back[k], a):
            fails.append(f"own codec round trip of {k}")
    if dts["bf"] != "BF16" or not np.array_equal(back["bf"], protocol.round_to(bf, "bf16")):
        fails.append("own codec round trip of bf16")
    try:
        from safetensors.numpy import load_file, save_file
    except ImportError:
        fails.append("safetensors is not installed (pip install safetensors)")
    else:
        p2 = os.path.join(workdir, "codec-np.safetensors")
        save_file(arrays, p2, metadata=protocol.METADATA)
        theirs, _, meta2 = protocol.read_numpy(p2)
        p4 = os.path.join(workdir, "codec-nobf.safetensors")  # safetensors.numpy cannot open a file with BF16
        protocol.write_numpy(p4, arrays)
        mine_by_them = load_file(p4)
        for k, a in arrays.items():
            if not np.array_equal(theirs[k], a):
                fails.append(f"reading safetensors.numpy's {k}")
            if not np.array_equal(mine_by_them[k], a):
                fails.append(f"safetensors.numpy reading our {k}")
        if meta2 != protocol.METADATA:
            fails.append("metadata of safetensors.numpy's file")
    try:
        import torch
        from safetensors.torch import load_file as tload, save_file as tsave
    except ImportError:
        pass  # the BF16 cross-check needs torch; CI has none
    else:
        t = tload(path)
        if t["bf"].dtype != torch.bfloat16 or not np.array_equal(t["bf"].float().numpy(), protocol.round_to(bf, "bf16")):
            fails.append("safetensors.torch reading our bf16")
        p3 = os.path.join(workdir, "codec-t.safetensors")
        tsave({"bf": torch.from_numpy(bf).bfloat16()}, p3, metadata=protocol.METADATA)
        if not np.array_equal(protocol.read_numpy(p3)[0]["bf"], torch.from_numpy(bf).bfloat16().float().numpy()):
            fails.append("reading safetensors.torch's bf16")
    return fails


def bug_expectations(path):
    with open(path) as f:
        for line in f:
            m = re.match(r"#\s*selfcheck-expect:\s*(.+)", line)
            if m:
                return set(m.group(1).split())
    raise SystemExit(f"{path}: no '# selfcheck-expect:' line")


def main():
    global F32_UNIT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runner", action="append", default=[], help="runner command (repeatable), e.g. 'python3 runners/numpy_mla.py'")
    ap.add_argument("--bugs", action="store_true", help="check numpy_mla passes and every runners/bugs/*.py is caught")
    ap.add_argument("--cases", help="comma list of " + ",".join(CASES) + " (default: all but " + " and ".join(FORMAT_CASES) + ", each of which runs by default with a --kv-cache-dtype that fits it)")
    ap.add_argument("--dtypes", default="bf16,fp16,f32")
    ap.add_argument("--ops", help="comma list: only these ops (decode, prefill, sparse_prefill, sparse_decode)")
    ap.add_argument("--kv-cache-dtype", choices=CACHE_FORMATS, help="send the ops that read the latent cache (decode, sparse_prefill, sparse_decode) its rows in this byte format with meta.cache, as mla-diff run --kv-cache-dtype does, and judge them over the values those bytes hold; a runner whose supports.cache_formats does not list it is unsupported there")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per request")
    ap.add_argument("--f32-unit", type=float, default=F32_UNIT, help="unit roundoff used for float32 in the bounds (default 2^-18; the protocol's strict value is 2^-24 = 5.96e-8)")
    ap.add_argument("--json", help="write every result to this file")
    ap.add_argument("--keep", help="keep the request files in this directory")
    args = ap.parse_args()
    F32_UNIT = args.f32_unit
    cases = [c for c in args.cases.split(",") if c] if args.cases else default_cases(args.kv_cache_dtype)
    dtypes = [d for d in args.dtypes.split(",") if d]
    ops = [o for o in args.ops.split(",") if o] if args.ops else None
    for o in ops or []:
        if o not in ("decode", "prefill") + CACHE_OPS[1:]:
            ap.error(f"unknown op {o}")
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c}")
    for d in dtypes:
        if d not in UNIT:
            ap.error(f"unknown dtype {d}")
    py = shlex.quote(sys.executable)
    plan = [(r, None) for r in args.runner]
    if args.bugs:
        plan.append((f"{py} {shlex.quote(os.path.join(HERE, 'numpy_mla.py'))}", None))
        for b in sorted(glob.glob(os.path.join(HERE, "bugs", "*.py"))):
            if os.path.basename(b).startswith("_"):
                continue
            plan.append((f"{py} {shlex.quote(b)}", bug_expectations(b)))
    if not plan:
        ap.error("give --runner CMD or --bugs")

    all_json = []
    good = bad = 0
    if args.bugs:
        work = tempfile.mkdtemp(prefix="mla-diff-codec-")
        try:
            fails = codec_check(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print("== protocol.py codec (bf16 rounding, safetensors round trips): " + ("ok" if not fails else "FAIL: " + "; ".join(fails)))
        good += not fails
        bad += bool(fails)
    for cmd, expect in plan:
        print(f"== {cmd}" + (f"   (planted bug; must be caught at {' '.join(sorted(expect))})" if expect else ""))
        sys.stdout.flush()
        work = args.keep or tempfile.mkdtemp(prefix="mla-diff-selfcheck-")
        os.makedirs(work, exist_ok=True)
        try:
            results, desc = check_runner(shlex.split(cmd), cases, dtypes, work, timeout=args.timeout, seed=args.seed, fmt=args.kv_cache_dtype, ops=ops)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        passed, failed, unsupported, failing = tally(results)
        if expect is None and passed == 0 and failed == 0:
            ok, verdict = None, "UNSUPPORTED"
        elif expect is None:
            ok = failed == 0
            verdict = "PASS" if ok else "FAIL"
        elif passed == 0 and failed == 0:
            # A planted bug in a runner this machine cannot run (a GPU runner's): neither caught nor missed.
            ok, verdict = None, "UNSUPPORTED (cannot run here)"
        else:
            missed = expect - failing
            ok = not missed and not any(f.endswith(">") for f in failing)
            verdict = "CAUGHT" if ok else f"NOT CAUGHT at {' '.join(sorted(missed)) or '(runner errors)'}"
        print(f"   {verdict}: {passed} checks passed, {failed} failed, {unsupported} cases unsupported" + (f"; failing: {' '.join(sorted(failing))}" if failing else ""))
        good += ok is True
        bad += ok is False
        all_json.append({"runner": cmd, "describe": desc, "expect_caught": sorted(expect) if expect else None, "verdict": verdict, "ok": ok, "results": jsonable(results)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_json, f, indent=1)
    print(f"{good} passed, {bad} failed")
    sys.exit(0 if bad == 0 else 1)


if __name__ == "__main__":
    main()
