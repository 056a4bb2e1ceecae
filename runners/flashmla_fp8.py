"""FlashMLA's fp8 KV cache for DeepSeek-V3.2-style sparse decode (its `V32_FP8Sparse` layout), in numpy.

656 bytes per token, as FlashMLA's tests/quant.py (`quantize_k_cache`) writes it and its sparse decode
reads it (`flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`):
- bytes [0, 512): the 512 latent values in float8 e4m3fn, in 4 tiles of 128 columns;
- bytes [512, 528): 4 float32 scales (little endian), one per tile;
- bytes [528, 656): the 64 rope values in bfloat16 (little endian), not quantized.
A tile's scale is amax/448 rounded UP to a power of two (`_cast_scale_inv_to_ue8m0`: 2^ceil(log2(max(
amax/448, 1e-4)))), its stored values round(x / scale) to e4m3 (nearest, ties to even; |x/scale| ≤ 448
so nothing saturates), and the kernel reads value·scale.

numpy has no e4m3: the rounding and encoding are written out here, the decoding is the runner SDK's
(`protocol.e4m3_to_f32`, `protocol.dequantize_cache`) (tested against known
values: tests/it/runners_sparse.rs; on the GPU, bench/probes/flashmla_sparse_decode.py compares the
bytes with torch's own e4m3fn cast).
The same convention is mla-diff's (`src/backend/runner/fp8_cache.rs`), which computes the fp64 yardstick
over the dequantized cache from it; with `run --kv-cache-dtype fp8_ds_mla` mla-diff sends the cache as
these bytes itself (`kv_format::Codec`, equal to `pack` byte for byte: tests/it/runner_cache_sparse.rs)
and the runner packs nothing.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402  (the runner SDK, this checkout's)

D_NOPE, D_ROPE, TILE = 512, 64, 128
TILES = D_NOPE // TILE
BYTES = D_NOPE + 4 * TILES + 2 * D_ROPE  # 656
E4M3_MAX = 448.0
SCALE_FLOOR = np.float32(1e-4)


def e4m3_round(y):
    """Nearest float8 e4m3fn value of each |y| ≤ 448 (ties to even), as float64. 3 mantissa bits:
    the spacing in the binade [2^e, 2^e+1) is 2^(e−3); below 2^−6 (subnormal) it is 2^−9."""
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    _, e = np.frexp(a)  # a = m·2^e, m in [0.5, 1): floor(log2 a) = e − 1
    step = np.ldexp(1.0, np.maximum(e - 4, -9))
    return np.copysign(np.rint(a / step) * step, y)


def e4m3_bits(v):
    """The e4m3fn byte of each value `v` that is one already (e4m3_round's output); NaN → 0x7F."""
    v = np.asarray(v, np.float64)
    a = np.abs(np.nan_to_num(v, nan=0.0))
    _, e = np.frexp(a)
    exp = e - 1
    normal = a >= 2.0**-6
    field = np.where(normal, exp + 7, 0)
    mant = np.where(normal, a / np.ldexp(1.0, np.where(normal, exp, 0)) * 8 - 8, a / 2.0**-9)
    bits = (np.signbit(v).astype(np.int64) << 7) | (field.astype(np.int64) << 3) | np.rint(mant).astype(np.int64)
    return np.where(np.isnan(v), 0x7F, bits).astype(np.uint8)


def e4m3_value(b):
    """The value of each e4m3fn byte (float64; S.1111.111 is NaN, e4m3fn has no infinity): the runner
    SDK's decoder (`protocol.e4m3_to_f32`), widened."""
    return protocol.e4m3_to_f32(np.asarray(b).astype(np.uint8)).astype(np.float64)


def tile_scales(latent):
    """`latent` [..., 512] (bf16 values as float32) → the 4 per-tile scales [..., 4] float32."""
    t = np.asarray(latent, np.float32).reshape(latent.shape[:-1] + (TILES, TILE))
    s = np.maximum(np.abs(t).max(axis=-1) / np.float32(E4M3_MAX), SCALE_FLOOR)  # float32 arithmetic
    m, e = np.frexp(s)
    e = np.where(m == 0.5, e - 1, e)  # an exact power of two is its own ceiling
    return np.ldexp(np.float32(1.0), e).astype(np.float32)


def pack(rows):
    """Cache rows [..., 576] (latent | rope, bf16 values as float32; a row with a NaN is an unwritten
    slot) → bytes [..., 656] uint8. An unwritten slot is written NaN throughout (e4m3 0x7F, NaN scales,
    NaN rope), so a kernel that reads it shows NaN."""
    rows = np.asarray(rows, np.float32)
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, D_NOPE + D_ROPE)
    bad = ~np.isfinite(flat).all(axis=1)
    clean = np.where(bad[:, None], 0.0, flat).astype(np.float32)
    scales = tile_scales(clean[:, :D_NOPE])  # [n, 4]
    x = clean[:, :D_NOPE].reshape(-1, TILES, TILE) / scales[:, :, None]  # exact: power-of-two scales
    out = np.empty((flat.shape[0], BYTES), np.uint8)
    out[:, :D_NOPE] = e4m3_bits(e4m3_round(x)).reshape(-1, D_NOPE)
    out[:, D_NOPE:D_NOPE + 4 * TILES] = scales.astype("<f4").view(np.uint8)
    rope = clean[:, D_NOPE:].astype("<f4").view("<u4")
    # bf16 by rounding to nearest even (the rows are bf16 values already in a bf16 run: then exact).
    rope16 = ((rope + 0x7FFF + ((rope >> 16) & 1)) >> 16).astype("<u2")
    out[:, D_NOPE + 4 * TILES:] = rope16.view(np.uint8)
    out[bad, :D_NOPE] = 0x7F
    out[bad, D_NOPE:D_NOPE + 4 * TILES] = np.full((bad.sum(), TILES), np.nan, "<f4").view(np.uint8)
    out[bad, D_NOPE + 4 * TILES:] = np.full((bad.sum(), D_ROPE), 0x7FC0, "<u2").view(np.uint8)
    return out.reshape(lead + (BYTES,))


def unpack(b):
    """Bytes [..., 656] → the rows the kernel reads [..., 576] float32: e4m3 value × its tile's scale
    (exact: a power of two), rope as stored. The runner SDK's reader of mla-diff's `fp8_ds_mla`, the
    same layout (`protocol.dequantize_cache`)."""
    return protocol.dequantize_cache(np.asarray(b, np.uint8), "fp8_ds_mla", D_NOPE, D_ROPE)
