"""Capture llama.cpp running a GGUF itself (docs/captures.md, "llama.cpp").

    python -m mla_diff.capture.llama_cpp model.gguf --out cap/ --prompt-ids 1,2,3,4 --decode 4
    mla-diff run model.gguf --capture cap/

llama.cpp is driven through llama-cpp-python's low-level binding (`llama_cpp.llama_cpp`): the model and a
context are created with `cb_eval` set, a prompt is decoded (split into ubatches of `n_ubatch` tokens,
llama.cpp's own chunked prefill: one capture step per ubatch), then tokens are generated greedily, one
decode step each. ggml's scheduler calls `cb_eval` twice per graph node: once to ask whether we want the
node (we say yes for the attention tensors below), and once when it has been computed, when we copy it.

Why llama-cpp-python: it is the maintained binding, it builds the vendored llama.cpp from its sdist with
CMake (no prebuilt binary to trust), and its context parameters already carry `cb_eval`. What it lacks
are ggml's tensor accessors; those are exported by its `libggml-base` and bound here with ctypes
(`ggml_get_name`, `ggml_op_desc`, `ggml_nbytes`, `ggml_backend_tensor_get`), and `struct ggml_tensor`'s
leading fields (`type`, `ne`, `nb`, `op`, …, `src`, `view_src`) are declared from ggml.h: checked at
every node against `ggml_get_name` and `ggml_nelements`, so a layout change fails loudly instead of
reading garbage. A Rust binding (llama-cpp-2) would need the same accessors and a second build of
llama.cpp; nothing would be gained.

Tensors of the `deepseek2` graph (src/models/deepseek2.cpp, per layer L) and the stages they give:

| llama.cpp node | stage |
|---|---|
| `embd` (layer 0), `l_out-{L-1}` | `x` |
| `attn_norm-L` | `attn_in` |
| `q_nope-L` (a view of q: read through its strides) | `q_nope` |
| `q_pe-L` whose op is ROPE (the view before rope has the same name) | `q_pe` |
| `kv_cmpr-L` after its norm (op MUL; the view before it has the same name) | `kv_latent` |
| `k_pe-L` whose op is ROPE | `k_pe` |
| the SET_ROWS node writing `Kcur-L` into the K cache, read back at its row indices | `cache_rows` (f16 by default, as stored) |
| with flash attention over an f32 cache: FLASH_ATTN_EXT's K operand (the f16 cast it reads), at those rows | `cache_rows` |
| FLASH_ATTN_EXT's output (flash attention) or `kqv-L` (without), decode steps | `attn_latent` |
| `kqv_out-L` | `attn_heads` (flat, heads × v) |
| the MUL_MAT of `attn_output.weight` with `kqv_out-L` | `attn_out` |

Precision: llama.cpp computes the projections in f32; its K cache is f16 unless `type_k="f32"`, and
its attention reads it in that type (CPU flash attention converts Q to K's type and sums P·V in V's;
without flash attention the KQ and KQV products convert their f32 operand to the cache's type). The
capture's `dtype` is `f32`, and each stage is tapped with the ggml type of the node it was read from
(`GGML_DTYPES`): the cache rows in the K cache's type, every other node f32. Flash attention reads an
f32 cache through a cast to f16 (llama-graph.cpp, `build_attn_mha`): the cache rows are then taken
from that cast, as the attention read them, in f16. The manifest's
`stage_dtypes` then says `cache_rows: fp16` where the cache is f16, and `mla-diff run --capture` bounds
the cache (an exact copy after rounding to f16) and the attention that reads it at f16, the projections
at f32 (docs/captures.md, "llama.cpp"). `flash_attn=False, type_k="f32"` is f32 throughout.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
from typing import Callable, Optional, Sequence

import numpy as np

from . import CaptureError, session as _open_session

__all__ = ["run", "Ggml", "main"]

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
GGML_TYPE_I64 = 27
_NP = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_I32: np.int32, GGML_TYPE_I64: np.int64}
#: The capture format's name of each ggml value type a tapped node may have (`stage_dtypes`).
GGML_DTYPES = {GGML_TYPE_F32: "f32", GGML_TYPE_F16: "fp16"}

# ggml.h: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64.
class GgmlTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class Ggml:
    """ggml's tensor accessors from llama-cpp-python's bundled libggml-base."""

    def __init__(self):
        import llama_cpp

        lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        names = [n for n in os.listdir(lib_dir) if re.match(r"libggml-base\.(so|dylib)", n) or n == "ggml-base.dll"]
        if not names:
            raise CaptureError(f"llama.cpp capture: no libggml-base in {lib_dir}")
        lib = ctypes.CDLL(os.path.join(lib_dir, sorted(names)[0]))
        vp = ctypes.c_void_p
        for fn, res, args in (
            ("ggml_get_name", ctypes.c_char_p, [vp]),
            ("ggml_op_desc", ctypes.c_char_p, [vp]),
            ("ggml_nbytes", ctypes.c_size_t, [vp]),
            ("ggml_nelements", ctypes.c_int64, [vp]),
            ("ggml_backend_tensor_get", None, [vp, vp, ctypes.c_size_t, ctypes.c_size_t]),
        ):
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
        self.lib = lib

    def struct(self, t: int) -> GgmlTensor:
        s = GgmlTensor.from_address(t)
        name = self.lib.ggml_get_name(t)
        if s.name != name or int(np.prod(list(s.ne))) != self.lib.ggml_nelements(t):
            raise CaptureError("llama.cpp capture: struct ggml_tensor's layout differs from ggml.h's (this ggml is "
                               "not the one mla_diff.capture.llama_cpp was written for)")
        return s

    def name(self, t: int) -> str:
        return self.lib.ggml_get_name(t).decode("utf-8", "replace")

    def op(self, t: int) -> str:
        return self.lib.ggml_op_desc(t).decode()

    def read(self, t: int) -> np.ndarray:
        """The tensor as numpy, axes reversed to row-major ([ne3, ne2, ne1, ne0]), read through its strides."""
        s = self.struct(t)
        dt = _NP.get(s.type)
        if dt is None:
            raise CaptureError(f"llama.cpp capture: {self.name(t)} has ggml type {s.type}, not f32/f16/i32/i64")
        n = self.lib.ggml_nbytes(t)
        buf = (ctypes.c_uint8 * n)()
        self.lib.ggml_backend_tensor_get(t, ctypes.addressof(buf), 0, n)
        raw = np.frombuffer(buf, dtype=np.uint8)
        ne = [int(v) for v in s.ne][::-1]
        nb = [int(v) for v in s.nb][::-1]
        view = np.lib.stride_tricks.as_strided(raw, shape=ne + [np.dtype(dt).itemsize], strides=nb + [1])
        return np.ascontiguousarray(view).view(dt).reshape(ne)


_LAYER = re.compile(r"^(?P<base>[A-Za-z_]+)-(?P<il>\d+)$")
# Named nodes we take, and the op each must have (None: any). Same-named nodes before the op are skipped.
WANT = {
    "embd": None,
    "l_out": None,
    "attn_norm": None,
    "q_nope": None,
    "q_pe": "ROPE",
    "kv_cmpr": "MUL",
    "k_pe": "ROPE",
    "kqv": None,
    "kqv_out": None,
}

NAMES = {
    "embd | l_out-{L-1}": "x",
    "attn_norm-{L}": "attn_in",
    "q_nope-{L}": "q_nope",
    "q_pe-{L} (ROPE)": "q_pe",
    "kv_cmpr-{L} (after attn_kv_a_norm)": "kv_latent",
    "k_pe-{L} (ROPE)": "k_pe",
    "SET_ROWS(cache_k_l{L}, Kcur-{L}) read back": "cache_rows",
    "FLASH_ATTN_EXT | kqv-{L}": "attn_latent",
    "kqv_out-{L}": "attn_heads",
    "MUL_MAT(blk.{L}.attn_output.weight, kqv_out-{L})": "attn_out",
}


class _Graph:
    """The cb_eval callback: picks the nodes, copies them, taps them into the session."""

    def __init__(self, sess, ggml: Ggml, n_layer: int):
        self.sess = sess
        self.g = ggml
        self.n_layer = n_layer
        self.pending: list = []  # (rid, pos) of the current llama_decode's tokens, in order
        self.kind = "prefill"
        self.layer = -1
        self.kqv_out: dict = {}  # address → layer
        self.error: Optional[BaseException] = None
        self.rows = 0
        # Cache rows written this step whose type the attention does not read them in (flash attention
        # over an f32 cache reads an f16 cast): layer -> the cells written, taken at FLASH_ATTN_EXT.
        self.cast_rows: dict = {}
        self.flash_attn = False

    def want(self, t: int) -> Optional[tuple]:
        name = self.g.name(t)
        op = self.g.op(t)
        if name == "embd":
            return ("x", 0)
        m = _LAYER.match(name)
        if m:
            base, il = m.group("base"), int(m.group("il"))
            if base not in WANT:
                if base in ("Kcur", "Qcur"):
                    self.layer = il
                return None
            need = WANT[base]
            if need is not None and op != need:
                return None
            self.layer = il
            stage = {"l_out": "x", "attn_norm": "attn_in", "q_nope": "q_nope", "q_pe": "q_pe", "kv_cmpr": "kv_latent",
                     "k_pe": "k_pe", "kqv": "attn_latent", "kqv_out": "attn_heads"}[base]
            if base == "l_out":
                return ("x", il + 1) if il + 1 < self.n_layer else None
            if base == "kqv" and self.kind != "decode":
                return None
            return (stage, il)
        s = self.g.struct(t)
        if op == "SET_ROWS" and s.src[0]:
            src = self.g.struct(s.src[0])
            named = self.g.name(src.view_src) if src.view_src else self.g.name(s.src[0])
            m = _LAYER.match(named)
            if m and m.group("base") == "Kcur":
                return ("cache_rows", int(m.group("il")))
        if op == "FLASH_ATTN_EXT" and self.layer >= 0:
            return ("attn_latent", self.layer)
        if op == "MUL_MAT" and s.src[1] in self.kqv_out:
            return ("attn_out", self.kqv_out[s.src[1]])
        return None

    def begin_step(self, t: int) -> None:
        n = int(self.g.struct(t).ne[1])
        if n > len(self.pending):
            raise CaptureError(f"llama.cpp capture: a ubatch of {n} tokens, {len(self.pending)} left in the batch")
        rows, self.pending = self.pending[:n], self.pending[n:]
        self.sess.step(self.kind, [list(r) for r in rows])
        self.rows = n

    def take(self, t: int, stage: str, layer: int) -> None:
        if stage == "attn_latent" and self.g.op(t) == "FLASH_ATTN_EXT":
            self.attention_read(t, layer)
            if self.kind != "decode":
                return
        a = self.g.read(t)
        # The node's own ggml type: for cache_rows the SET_ROWS destination's, the K cache's.
        gtype = self.g.struct(t).type
        if gtype not in GGML_DTYPES:
            raise CaptureError(f"llama.cpp capture: {self.g.name(t)} has ggml type {gtype}, not f32/f16")
        n = self.rows
        if stage == "cache_rows":
            s = self.g.struct(t)
            idx = self.g.read(s.src[1]).reshape(-1).astype(np.int64)
            if self.flash_attn and gtype != GGML_TYPE_F16:
                # Flash attention casts K to f16 (llama-graph.cpp, build_attn_mha): the rows it read
                # are the cast's, taken from its K operand (`attention_read`).
                self.cast_rows[layer] = idx
                return
            cache = a.reshape(-1, a.shape[-1])
            a = cache[idx]
        elif stage == "attn_latent" and self.g.op(t) == "MUL_MAT":
            a = np.swapaxes(a.reshape(a.shape[-3], n, a.shape[-1]), 0, 1)  # kqv: [H, T, L] → [T, H, L]
        elif stage in ("q_nope", "q_pe", "attn_latent"):
            a = a.reshape(n, a.shape[-2], a.shape[-1])  # [T, H, D]
        else:
            a = a.reshape(n, -1)  # x, attn_in, kv_latent, k_pe, attn_heads (flat heads × v), attn_out
        if stage == "attn_heads":
            self.kqv_out[self._addr] = layer
        self.sess.tap(stage, a, layer=layer, dtype=GGML_DTYPES[gtype])

    def attention_read(self, t: int, layer: int) -> None:
        """At FLASH_ATTN_EXT: the cache rows written this step as its K operand holds them, where that is
        not the cache itself (a cast of an f32 cache)."""
        idx = self.cast_rows.pop(layer, None)
        if idx is None:
            return
        k = self.g.struct(t).src[1]
        ks = self.g.struct(k)
        if self.g.op(k) != "CPY" or ks.type not in GGML_DTYPES:
            raise CaptureError(f"llama.cpp capture: layer {layer}'s flash attention reads an f32 cache through "
                               f"{self.g.op(k)} of ggml type {ks.type}, not a cast to f16")
        rows = self.g.read(k)
        self.sess.tap("cache_rows", rows.reshape(-1, rows.shape[-1])[idx], layer=layer, dtype=GGML_DTYPES[ks.type])

    def callback(self, t, ask, _ud) -> bool:
        if self.error is not None:
            return False  # aborts the graph; run() raises the error
        try:
            t = int(t)
            w = self.want(t)
            if ask:
                return w is not None
            if w is None:
                return True
            stage, layer = w
            if stage == "x" and layer == 0:
                self.begin_step(t)
            self._addr = t
            self.take(t, stage, layer)
            return True
        except BaseException as e:  # an exception must not cross the C callback
            self.error = e
            return False


def run(model_file, directory, *, prompt: Sequence[int], n_decode: int = 4, n_ubatch: int = 512,
        flash_attn: bool = True, type_k: str = "f16", n_threads: int = 2, overwrite: bool = False,
        quiet: bool = True) -> list:
    """Run llama.cpp on `model_file` (a GGUF): decode `prompt` (token ids; ubatches of `n_ubatch`), then
    `n_decode` tokens greedily, capturing every step into `directory`. Returns the generated token ids.

    The capture's dtype is f32 (llama.cpp's activations); each stage's own ggml type goes into the
    manifest's `stage_dtypes` (with llama.cpp's defaults, f16 K cache and flash attention: `cache_rows`
    fp16, read by an attention computed in f16). `flash_attn=False, type_k="f32"` runs llama.cpp in f32
    throughout."""
    import llama_cpp
    from llama_cpp import llama_cpp as L

    if type_k not in ("f16", "f32"):
        raise CaptureError(f"llama.cpp capture: type_k must be f16 or f32, got {type_k!r}")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise CaptureError("llama.cpp capture: an empty prompt")
    if quiet:
        _silence(L)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(os.fspath(model_file).encode(), mp)
    if not model:
        raise CaptureError(f"llama.cpp could not load {model_file}")
    ctx = None
    try:
        n_layer = L.llama_model_n_layer(model)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        detail = f"llama-cpp-python {llama_cpp.__version__}, CPU, flash_attn={'on' if flash_attn else 'off'}, type_k={type_k}"
        dtype = "f32"
        sess = _open_session(directory, model_file=model_file, engine="llama.cpp", engine_version=llama_cpp.__version__,
                             engine_detail=detail, dtype=dtype, rope_order="file", names=dict(NAMES), overwrite=overwrite)
        graph = _Graph(sess, Ggml(), n_layer)
        graph.flash_attn = flash_attn
        cb = L.ggml_backend_sched_eval_callback(graph.callback)
        cp = L.llama_context_default_params()
        cp.n_ctx = max(64, len(prompt) + n_decode + 8)
        cp.n_batch = max(len(prompt), 1)
        cp.n_ubatch = min(n_ubatch, cp.n_batch)
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k = cp.type_v = GGML_TYPE_F16 if type_k == "f16" else GGML_TYPE_F32
        cp.cb_eval = cb
        cp.cb_eval_user_data = None
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise CaptureError("llama.cpp could not create a context")
        with sess:
            rid = sess.request(prompt, prefill=len(prompt))
            out = []
            toks, pos0 = prompt, 0
            for i in range(n_decode + 1):
                graph.kind = "prefill" if i == 0 else "decode"
                graph.pending = [(rid, pos0 + j) for j in range(len(toks))]
                _decode(L, ctx, toks, pos0)
                if graph.error is not None:
                    raise graph.error
                if graph.pending:
                    raise CaptureError(f"llama.cpp capture: {len(graph.pending)} tokens of a batch were never seen by cb_eval")
                if i == n_decode:
                    break
                logits = L.llama_get_logits_ith(ctx, -1)
                nxt = int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))
                out.append(nxt)
                sess.extend(rid, [nxt])
                pos0 += len(toks)
                toks = [nxt]
        return out
    finally:
        if ctx:
            L.llama_free(ctx)
        L.llama_model_free(model)


def _decode(L, ctx, toks: Sequence[int], pos0: int) -> None:
    n = len(toks)
    batch = L.llama_batch_init(n, 0, 1)
    try:
        batch.n_tokens = n
        for j, t in enumerate(toks):
            batch.token[j] = t
            batch.pos[j] = pos0 + j
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = 0
            batch.logits[j] = 1  # every row an output: the last layer then keeps all rows (no get_rows)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise CaptureError(f"llama_decode returned {rc}")
    finally:
        L.llama_batch_free(batch)


_LOG_CB = None


def _silence(L) -> None:
    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = L.llama_log_callback(lambda level, text, ud: None)
    L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_diff.capture.llama_cpp", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the GGUF file llama.cpp runs")
    ap.add_argument("--out", required=True, help="capture folder to write")
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids of the prompt")
    ap.add_argument("--decode", type=int, default=4, help="tokens to generate greedily (default 4)")
    ap.add_argument("--ubatch", type=int, default=512, help="llama.cpp's n_ubatch: prompt chunk size (default 512)")
    ap.add_argument("--no-flash-attn", action="store_true")
    ap.add_argument("--type-k", choices=("f16", "f32"), default="f16", help="K cache type (default f16, llama.cpp's)")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        prompt = [int(x) for x in a.prompt_ids.split(",") if x.strip()]
        gen = run(a.model, a.out, prompt=prompt, n_decode=a.decode, n_ubatch=a.ubatch, flash_attn=not a.no_flash_attn,
                  type_k=a.type_k, overwrite=a.overwrite)
    except (CaptureError, OSError, ValueError) as e:
        print(f"mla_diff.capture.llama_cpp: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out} (generated {gen})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
