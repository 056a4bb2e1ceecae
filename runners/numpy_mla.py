#!/usr/bin/env python3
"""numpy_mla: a plain numpy MLA runner for mla-diff (protocol 1, docs/runners.md).

What it runs:
- decode: absorbed MLA over the paged latent cache, per batch entry: gathers the entry's rows
  through its block table, scores `[q_nope | q_pe] · [latent | k_pe]ᵀ · softmax_scale` in float32,
  a max-subtracted softmax, and the weighted sum of the latent rows. It also returns the split-KV
  partials with vLLM's partition (`split_out`, `split_lse`): the `num_splits` splits of an entry
  cover keys `[k·⌈L/S⌉, (k+1)·⌈L/S⌉)` of its `L = cache_seqlens[b]` keys, each restricted to the keys
  its query sees (query `i` of `s_q` sees `L − s_q + i + 1` keys); a split without a visible key
  has out 0 and lse −inf (the same partition mla-diff's reference uses).
- prefill: decompressed attention of one chunk: query `i` sees keys `0 .. context_len + i + 1`.

Quantized caches (`run --kv-cache-dtype FMT`, every format mla-diff writes: fp8, fp8_ds_mla,
fp8_ds_mla_nope, fp8_v41, fp4_v41; `supports.cache_formats`): the decode op's `kv_cache` then holds the
format's bytes, dequantized here in numpy (`protocol.dequantize_cache`: each value q·s in float32 with
its group's scale, or fp8's layer scale from `meta.cache.scale`; ds_mla's rope as stored) before the
same attention.

Sparse ops (DSA past top_k, docs/dsa.md; a layer that runs sparse gets only these, a dense layer only
the dense ones, each with the checks of its own ops):
`sparse_prefill` and `sparse_decode` attend each query over the cache slots its index row names (−1:
none), FlashMLA's definition (its tests/ref.py) in float32: `q = [q_absorbed | q_pe]` against the rows,
the latent part as the value. With a quantized cache the `kv` / `kv_cache` bytes are read through the
same `dequantize_cache` hook as the decode op's.

Conventions: float32 arithmetic on the given inputs (BF16/FP16 widened exactly); `attn_latent` and
`attn_heads` rounded to the run's dtype (meta `dtype`); `lse`, `split_out`, `split_lse` float32;
natural-log LSE, `token_head` layout. Any dims, dtypes bf16/fp16/f32, any page size, any q_len.
Only rows holding visible tokens are read, so the NaN-poisoned rest of the cache never matters.

Hook methods (`softmax_scale`, `page_size`, `split_cache_rows`, `lse_out`, `split_count`,
`split_bounds`, `prefill_visible`, `pv`) are what the planted-bug copies in runners/bugs/ and
numpy_own_splits.py override.

Batch-invariant (each entry computed alone, the same way whatever its batch), and it says so
(`batch_invariant`: mla-diff then fails a request whose output changes with its batch).

Switches for tests (environment; a correct kernel either way, each a shape real kernels take):
- `MLA_DIFF_NUMPY_DTYPES="decode.attn_latent=f32,decode.split_lse=bf16,…"`: the dtype each output is
  returned in (`decode.attn_latent|lse|split_out|split_lse`, `prefill.attn_heads|lse`; `bf16`, `fp16`,
  `f32`). Defaults: `attn_latent`/`attn_heads` in the run's dtype, the rest f32.
- `MLA_DIFF_NUMPY_EMPTY_SPLITS=nan`: an empty split's `split_out` is left NaN (a `torch.empty` buffer a
  kernel never writes), and `attn_latent` is the LSE merge of the partials with empty splits masked out;
  `=nan-naive-merge` merges them as `Σ w·out` without the mask, so 0·NaN poisons the merge (a bug).
- `MLA_DIFF_NUMPY_CACHE_IN_DTYPE=1`: with a quantized cache the decode rounds the dequantized rows
  (q·s in float32) to the run's dtype before attending, as vLLM's Triton decode does over the fp8 cache
  (`(k.to(float32) * ks).to(q.dtype)`, nope and rope; MLA's V is the same rounded rows), and says so
  (`conventions.cache_dequant: "dtype"`).
- `MLA_DIFF_NUMPY_P_FP8=1`: with the `fp8` cache the decode rounds P = exp(s − max) (≤ 1, unscaled) to
  e4m3 before P·V and divides by the sum of P unrounded, as FlashMLA's dense fp8 decode does, and says
  so (`conventions.p_fp8: "fp8"`).
- `MLA_DIFF_NUMPY_Q_FP8=1`: with the `fp8` cache the decode reads q in e4m3 too, on the grid of
  `meta.q_scale` (FlashMLA's dense fp8 decode), and says so (`conventions.q_fp8: "fp8"`).

- `MLA_DIFF_NUMPY_NO_SPLITS=1`: the decode returns `attn_latent` and `lse` only, as FlashMLA does (its
  split partials stay inside the kernel): mla-diff's stage-local view then merges splits of its own.

- `MLA_DIFF_NUMPY_QK_ACC=G:NB`: with `MLA_DIFF_NUMPY_Q_FP8=1` and the `fp8` cache the decode's q·k is
  summed over the e4m3 codes as Hopper's fp8 tensor core is modelled (`tc_dot`: groups of G products,
  NB fraction bits, truncating; `32:13` is FlashMLA's dense fp8 decode), then times both scales in
  float32, and says so (`conventions.qk_acc: "e8mNB"`; the group size is not declared: mla-diff's model
  is FlashMLA's k-step of 32).

Needs: Python 3.8+, numpy (no safetensors: protocol.py reads and writes the files itself).
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402


def matmul(a, b):
    """`a [..., K] @ b [K, N]` as one 2-D GEMM over `a`'s leading dims flattened. numpy's stacked
    matmul calls BLAS once per leading index; with OpenBLAS threads on a busy machine each call pays
    the threads' hand-off, measured 30-50x slower than one GEMM for a [132, 64, 576] · [576, 395]."""
    a = np.ascontiguousarray(a)
    rows = int(np.prod(a.shape[:-1]))  # not -1: a padded entry has no keys (K = 0)
    return np.matmul(a.reshape(rows, a.shape[-1]), b).reshape(a.shape[:-1] + b.shape[-1:])


def softmax_rows(s):
    """Row softmax of float32 scores with -inf for masked keys. Returns (p normalised, lse); a row
    with no finite score (or no key at all: a padded batch entry of length 0) gets p 0 and lse -inf."""
    if s.shape[-1] == 0:
        return np.zeros(s.shape, np.float32), np.full(s.shape[:-1], -np.inf, np.float32)
    m = np.max(s, axis=-1, keepdims=True)
    empty = ~np.isfinite(m)
    m = np.where(empty, np.float32(0), m)
    e = np.exp(s - m)
    z = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / z, np.float32(0))
        lse = np.where(empty, -np.inf, m + np.log(z))
    return p.astype(np.float32), lse[..., 0].astype(np.float32)


def out_dtype(key, x, default):
    """`x` to be written in the dtype `MLA_DIFF_NUMPY_DTYPES` names for `key`, else in `default`."""
    pairs = [kv.split("=", 1) for kv in os.environ.get("MLA_DIFF_NUMPY_DTYPES", "").split(",") if kv]
    return protocol.storage(x, dict(pairs).get(key, default))


def _trunc_bits(x, nb):
    """`x` (float64) truncated toward zero to `nb` fraction bits of its own binade."""
    _, e = np.frexp(x)  # x = m·2^e, m in [0.5, 1)
    q = np.ldexp(1.0, e - 1 - nb)
    return np.trunc(x / q) * q


def tc_dot(a, b, g, nb):
    """`a [M, K] · b [N, K]ᵀ` (float64 values exact in e4m3) summed as a Hopper fp8 tensor core is
    modelled to: products exact; each group of `g` products and the running sum aligned to the largest
    exponent among them, each term truncated to `nb` fraction bits there, summed, and the sum truncated
    to `nb` fraction bits (e8m13 for nb = 13)."""
    m, k = a.shape
    acc = np.zeros((m, b.shape[0]), np.float64)
    for k0 in range(0, k, g):
        prods = a[:, None, k0 : k0 + g] * b[None, :, k0 : k0 + g]
        terms = np.concatenate([acc[..., None], prods], axis=-1)
        top = np.max(np.abs(terms), axis=-1, keepdims=True)
        _, e = np.frexp(np.where(top > 0, top, 1.0))
        quantum = np.ldexp(1.0, e - 1 - nb)
        acc = _trunc_bits(np.sum(np.trunc(terms / quantum) * quantum, axis=-1), nb)
    return acc


class NumpyMLA(protocol.NumpyRunner):
    name = "numpy"

    def describe(self):
        return {
            "protocol": protocol.PROTOCOL,
            "name": self.name,
            "version": f"numpy {np.__version__} (float32 accumulation), mla-diff runners/numpy_mla.py",
            "ops": {
                "decode": {"outputs": ["attn_latent", "lse"] + ([] if self.withholds_splits() else ["split_out", "split_lse"])},
                "prefill": {"outputs": ["attn_heads", "lse"]},
                "sparse_prefill": {"outputs": ["attn_latent", "lse"]},
                "sparse_decode": {"outputs": ["attn_latent", "lse"]},
            },
            "supports": {
                "dtypes": ["bf16", "fp16", "f32"],
                "page_sizes": None,
                "heads": None,
                "kv_lora_rank": None,
                "qk_rope": None,
                "qk_head_dim": None,
                "v_head_dim": None,
                "max_q_len": None,
                "cache_formats": list(protocol.CACHE_FORMATS),
            },
            "conventions": {"lse_base": "e", "lse_layout": "token_head",
                            **({"q_fp8": "fp8"} if self.declares_q_fp8() else {}),
                            **({"cache_dequant": "dtype"} if self.declares_cache_dequant() else {}),
                            **({"p_fp8": "fp8"} if self.declares_p_fp8() else {}),
                            **({"qk_acc": self.declares_qk_acc()} if self.declares_qk_acc() else {})},
            "batch_invariant": True,
        }

    # -- hooks -----------------------------------------------------------------------------------

    def softmax_scale(self, meta):
        return float(meta["softmax_scale"])

    def page_size(self, meta, cache):
        return int(meta.get("page_size") or cache.shape[1])

    def withholds_splits(self):
        """Whether the decode returns only `attn_latent` and `lse` (`MLA_DIFF_NUMPY_NO_SPLITS=1`)."""
        return os.environ.get("MLA_DIFF_NUMPY_NO_SPLITS") == "1"

    def q_fp8(self):
        """Whether the decode reads q in e4m3 with the `fp8` cache (`MLA_DIFF_NUMPY_Q_FP8=1`)."""
        return os.environ.get("MLA_DIFF_NUMPY_Q_FP8") == "1"

    def declares_q_fp8(self):
        return self.q_fp8()

    def cache_in_dtype(self):
        """Whether the decode rounds a quantized cache's dequantized rows to the run's dtype
        (`MLA_DIFF_NUMPY_CACHE_IN_DTYPE=1`)."""
        return os.environ.get("MLA_DIFF_NUMPY_CACHE_IN_DTYPE") == "1"

    def declares_cache_dequant(self):
        return self.cache_in_dtype()

    def p_fp8(self):
        """Whether the decode rounds P to e4m3 before P·V with the `fp8` cache (`MLA_DIFF_NUMPY_P_FP8=1`)."""
        return os.environ.get("MLA_DIFF_NUMPY_P_FP8") == "1"

    def declares_p_fp8(self):
        return self.p_fp8()

    def qk_acc(self):
        """(G, NB) of `MLA_DIFF_NUMPY_QK_ACC=G:NB` (with `MLA_DIFF_NUMPY_Q_FP8=1`), else None."""
        acc = os.environ.get("MLA_DIFF_NUMPY_QK_ACC", "")
        if not acc or not self.q_fp8():
            return None
        g, nb = (int(v) for v in acc.split(":"))
        return g, nb

    def declares_qk_acc(self):
        """`conventions.qk_acc`: the accumulator `qk_acc()` sums in, "e8mNB" (None: f32)."""
        acc = self.qk_acc()
        return None if acc is None else f"e8m{acc[1]}"

    def pv_read(self, p, values, fmt):
        """The decode's P·V as its kernel reads P: with `p_fp8()` and the `fp8` cache, P against the
        row's max (exp(s − m) ≤ 1) on the e4m3 grid, the product then divided by the sum of P unrounded
        (p is normalised: p / max(p) is exp(s − m), and max(p) is 1 / that sum); else `pv`."""
        if not self.p_fp8() or fmt != "fp8":
            return self.pv(p, values)
        top = np.max(p, axis=-1, keepdims=True) if p.shape[-1] else np.ones(p.shape[:-1] + (1,), np.float32)
        top = np.where(top > 0, top, np.float32(1))
        e = protocol.e4m3_round(p / top).astype(np.float32)
        return (self.pv(e, values) * top).astype(np.float32)

    def query(self, q, meta):
        """The decode's q `[..., r + rope]` float32 as its kernel reads it: with `q_fp8()` and the `fp8`
        cache, on the e4m3 grid of `meta.q_scale` (sent by mla-diff when declared), else of the SDK's
        rule for it over this q (a lint probe's q, 0 and 0.125, is on every power-of-two grid)."""
        if not self.q_fp8() or (meta.get("cache") or {}).get("format") != "fp8":
            return q
        s = meta.get("q_scale")
        return protocol.quantize_q_fp8(q, protocol.q_fp8_scale([q]) if s is None else float(s))

    def dequantize_cache(self, cache, fmt, kv_lora_rank, qk_rope, scale=None):
        """A quantized `kv_cache` (u8 bytes in `fmt`; `scale`: `fp8`'s layer scale) -> float32 rows
        `[..., kv_lora_rank + qk_rope]`."""
        return protocol.dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale)

    def split_cache_rows(self, rows, kv_lora_rank, qk_rope):
        """Cache rows `[latent | k_pe]` -> (latent, k_pe)."""
        return rows[:, :kv_lora_rank], rows[:, kv_lora_rank : kv_lora_rank + qk_rope]

    def lse_out(self, lse):
        """The LSE as returned (natural log)."""
        return lse

    def split_count(self, meta):
        """Splits per entry: the harness's `num_splits` (vLLM's partition)."""
        return int(meta.get("num_splits") or 1)

    def split_bounds(self, length, n_splits):
        """Key ranges of the splits: `[k·⌈L/S⌉, (k+1)·⌈L/S⌉)` (vLLM's partition)."""
        per = -(-length // n_splits) if length else 0
        return [(min(k * per, length), min((k + 1) * per, length)) for k in range(n_splits)]

    def qk(self, q_b, keys):
        """`q_b [s_q, H, K] · keys [L, K]ᵀ` in float32; with `MLA_DIFF_NUMPY_QK_ACC=G:NB` and the `fp8`
        cache, as an fp8 tensor core sums it (`tc_dot` over the e4m3 codes, then the two scales)."""
        acc = self.qk_acc()
        if acc is None or getattr(self, "_qk_scales", None) is None:
            return matmul(q_b, keys.T)
        g, nb = acc
        sq, sk = self._qk_scales
        a = protocol.e4m3_round(q_b.reshape(-1, q_b.shape[-1]) / np.float32(sq))
        b = protocol.e4m3_round(keys / np.float32(sk))
        d = tc_dot(a, b, g, nb).astype(np.float32)
        return (d * np.float32(sq * sk)).reshape(q_b.shape[:-1] + (keys.shape[0],)).astype(np.float32)

    def pv(self, p, values):
        """P·V: `p [..., L]` (float32, normalised) times `values [L, D]`, accumulated in float32."""
        return matmul(p, values)

    def prefill_visible(self, n, s, context_len):
        """[n, S] bool: query i sees keys 0 .. context_len + i + 1."""
        return np.arange(s)[None, :] < (context_len + np.arange(n) + 1)[:, None]

    # -- ops -------------------------------------------------------------------------------------

    def sparse_rows(self, kv, meta):
        """A sparse op's latent cache (`[..., lkv + rope]` floats, or u8 bytes in `meta.cache.format`)
        -> float32 rows `[slots, lkv + rope]`, a slot being page·page_size + offset."""
        lkv, rope = int(meta["kv_lora_rank"]), int(meta["qk_rope"])
        cm = meta.get("cache") or {}
        if cm.get("format"):
            kv = self.dequantize_cache(kv, cm["format"], lkv, rope, cm.get("scale"))
        if kv.shape[-1] != lkv + rope:
            raise ValueError(f"cache rows are {kv.shape[-1]} wide, expected {lkv} + {rope}")
        return np.asarray(kv, np.float32).reshape(-1, lkv + rope)

    def sparse_attend(self, q, rows, indices, meta):
        """q `[n, H, lkv + rope]` over the rows each index row `[n, topk]` names (−1: none): the latent
        output `[n, H, lkv]` and the LSE `[n, H]` (−inf, output 0, for a query without a key)."""
        n, heads, _ = q.shape
        lkv = int(meta["kv_lora_rank"])
        scale = np.float32(self.softmax_scale(meta))
        out = np.zeros((n, heads, lkv), np.float32)
        lse = np.full((n, heads), -np.inf, np.float32)
        for i in range(n):
            idx = indices[i]
            keys = rows[idx[idx >= 0].astype(np.int64)]  # [m, lkv + rope]
            if keys.shape[0] == 0:
                continue
            p, lse[i] = softmax_rows(matmul(q[i].astype(np.float32), keys.T) * scale)
            out[i] = self.pv(p, keys[:, :lkv])
        return out, lse

    def sparse_prefill(self, x, meta):
        q, indices = x["q"], x["indices"]
        n = q.shape[0]
        rows = self.sparse_rows(x["kv"], meta)
        out, lse = self.sparse_attend(q, rows, indices.reshape(n, -1), meta)
        return {
            "attn_latent": out_dtype("sparse_prefill.attn_latent", out, meta["dtype"]),
            "lse": out_dtype("sparse_prefill.lse", self.lse_out(lse), "f32"),
        }

    def sparse_decode(self, x, meta):
        q, indices = x["q"], x["indices"]
        b, s_q, heads, d = q.shape
        rows = self.sparse_rows(x["kv_cache"], meta)
        out, lse = self.sparse_attend(q.reshape(b * s_q, heads, d), rows, indices.reshape(b * s_q, -1), meta)
        return {
            "attn_latent": out_dtype("sparse_decode.attn_latent", out.reshape(b, s_q, heads, -1), meta["dtype"]),
            "lse": out_dtype("sparse_decode.lse", self.lse_out(lse).reshape(b, s_q, heads), "f32"),
        }

    def gather_rows(self, cache, table_row, length, page):
        """The first `length` token rows of one entry, through its block table."""
        flat = cache.reshape(-1, cache.shape[-1])
        t = np.arange(length)
        idx = table_row[t // page].astype(np.int64) * page + t % page
        return flat[idx % flat.shape[0]]

    def entry_scores(self, q_b, cache, table_row, length, page, r, rope, scale):
        """One entry's scores `[s_q, H, L]` (−inf where causality within the entry hides a key) and its
        latent rows `[L, r]`, from `q_b` `[s_q, H, r+rope]` float32."""
        rows = self.gather_rows(cache, table_row, length, page).astype(np.float32)
        latent, k_pe = self.split_cache_rows(rows, r, rope)
        keys = np.concatenate([latent, k_pe], axis=-1)  # [L, r+rope]
        scores = self.qk(q_b, keys) * scale
        s_q = q_b.shape[0]
        visible = np.arange(length)[None, :] < (length - s_q + np.arange(s_q) + 1)[:, None]
        return np.where(visible[:, None, :], scores, np.float32(-np.inf)).astype(np.float32), latent

    def decode(self, x, meta):
        q_nope, q_pe, cache = x["q_nope"], x["q_pe"], x["kv_cache"]
        table, seqlens = x["block_table"], x["cache_seqlens"]
        b_n, s_q, heads, r = q_nope.shape
        rope = q_pe.shape[-1]
        cm = meta.get("cache") or {}
        fmt = cm.get("format")
        dtype = meta["dtype"]
        if fmt:
            cache = self.dequantize_cache(cache, fmt, r, rope, cm.get("scale"))
            if self.cache_in_dtype():
                cache = protocol.round_to(cache, dtype)
        if cache.shape[-1] != r + rope:
            raise ValueError(f"kv_cache rows are {cache.shape[-1]} wide, expected {r} + {rope}")
        scale = np.float32(self.softmax_scale(meta))
        page = self.page_size(meta, cache)
        n_splits = self.split_count(meta)

        q = self.query(np.concatenate([q_nope, q_pe], axis=-1).astype(np.float32), meta)  # [B, s_q, H, r+rope]
        self._qk_scales = None
        if fmt == "fp8" and self.q_fp8():
            qs = meta.get("q_scale")
            self._qk_scales = (float(qs) if qs is not None else protocol.q_fp8_scale([q]), float(cm.get("scale")))
        out = np.zeros((b_n, s_q, heads, r), np.float32)
        lse = np.full((b_n, s_q, heads), -np.inf, np.float32)
        split_out = np.zeros((b_n, s_q, heads, n_splits, r), np.float32)
        split_lse = np.full((b_n, s_q, heads, n_splits), -np.inf, np.float32)
        for b in range(b_n):
            length = int(seqlens[b])
            scores, latent = self.entry_scores(q[b], cache, table[b], length, page, r, rope, scale)
            p, l = softmax_rows(scores)
            out[b] = self.pv_read(p, latent, fmt)
            lse[b] = l
            for k, (lo, hi) in enumerate(self.split_bounds(length, n_splits)):
                if hi <= lo:
                    continue
                ps, ls = softmax_rows(scores[:, :, lo:hi])
                split_out[b, :, :, k] = self.pv_read(ps, latent[lo:hi], fmt)
                split_lse[b, :, :, k] = ls
        empty = os.environ.get("MLA_DIFF_NUMPY_EMPTY_SPLITS", "")
        if empty:
            # A split no visible key falls in: its partial is never written (NaN, as torch.empty
            # leaves it); its lse is -inf, so its merge weight is 0.
            split_out[~np.isfinite(split_lse)] = np.nan
            m = np.max(split_lse, axis=-1, keepdims=True)
            w = np.exp(split_lse - m)[..., None]  # [B, s_q, H, S, 1]
            if empty == "nan-naive-merge":
                num = np.sum(w * split_out, axis=-2)  # 0·NaN = NaN: the merge is poisoned
            else:
                num = np.sum(np.where(w > 0, w * split_out, np.float32(0)), axis=-2)
            out = (num / np.sum(w, axis=-2)).astype(np.float32)
        res = {
            "attn_latent": out_dtype("decode.attn_latent", out, dtype),
            "lse": out_dtype("decode.lse", self.lse_out(lse), "f32"),
            "split_out": out_dtype("decode.split_out", split_out, "f32"),
            "split_lse": out_dtype("decode.split_lse", split_lse, "f32"),
        }
        if self.withholds_splits():
            del res["split_out"], res["split_lse"]
        return res

    def prefill(self, x, meta):
        q, k, v = x["q"], x["k"], x["v"]
        n, heads, _ = q.shape
        s = k.shape[0]
        context_len = int(meta.get("context_len", s - n))
        if context_len + n != s:
            raise ValueError(f"k has {s} rows, expected context_len {context_len} + {n}")
        dtype = meta["dtype"]
        scale = np.float32(self.softmax_scale(meta))
        visible = self.prefill_visible(n, s, context_len)
        out = np.zeros((heads, n, v.shape[-1]), np.float32)
        lse = np.zeros((heads, n), np.float32)
        step = max(1, (1 << 24) // max(1, n * s))  # heads per block: about 64 MB of float32 scores
        for h0 in range(0, heads, step):
            hs = slice(h0, min(heads, h0 + step))
            qh = np.transpose(q[:, hs], (1, 0, 2)).astype(np.float32)  # [h, n, D]
            kh = np.transpose(k[:, hs], (1, 2, 0)).astype(np.float32)  # [h, D, S]
            vh = np.transpose(v[:, hs], (1, 0, 2)).astype(np.float32)  # [h, S, Dv]
            scores = np.matmul(qh, kh) * scale  # [h, n, S]
            scores = np.where(visible[None], scores, np.float32(-np.inf)).astype(np.float32)
            p, lse[hs] = softmax_rows(scores)
            out[hs] = np.matmul(p, vh)
        return {
            "attn_heads": out_dtype("prefill.attn_heads", np.transpose(out, (1, 0, 2)), dtype),
            "lse": out_dtype("prefill.lse", self.lse_out(np.ascontiguousarray(lse.T)), "f32"),
        }


if __name__ == "__main__":
    r = NumpyMLA()
    protocol.serve(decode=r.decode, prefill=r.prefill, sparse_prefill=r.sparse_prefill,
                   sparse_decode=r.sparse_decode, describe=r.describe, codec=r)
