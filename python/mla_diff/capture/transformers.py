"""Capture a Hugging Face `transformers` MLA model's forward passes (docs/captures.md, "transformers").

    from mla_diff.capture import transformers as tfcap

    with tfcap.capture(model, "cap/", model_file="model.gguf"):
        model.generate(input_ids, max_new_tokens=8, do_sample=False)

    mla-diff run model.gguf --capture cap/

Every call of the model inside the block is one forward step of the capture (prefill when it feeds more
than one token per sequence, decode otherwise; chunked prefill is several prefill steps), every
sequence of the batch one request. The families the goldens cover are supported: DeepSeek-V2
(complex rope), DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash (interleaved rope), DeepSeek-V3.2 and GLM-5
(`GlmMoeDsa`, with the DSA indexer's top-k), MiniCPM3 (NeoX rope).

What is tapped, per decoder layer (`names` in the manifest says the same):

| stage | taken from |
|---|---|
| `x` | the decoder layer's input (forward pre-hook) |
| `attn_in` | `input_layernorm`'s output |
| `q_nope` | `q_b_proj` (or `q_proj`)'s output, the first `qk_nope_head_dim` of each head |
| `q_pe`, `k_pe` | the outputs of the modeling module's rope function (`apply_rotary_pos_emb_interleave`, `apply_rotary_emb`, `apply_rotary_pos_emb`), called by the attention (not by the DSA indexer) |
| `kv_latent` | `kv_a_layernorm`'s output |
| `cache_rows` | what the cache holds for the step's tokens after `cache.update(latent, k_rot, layer)`: its return value's last rows, read back (transformers 5 caches the MLA latent and the roped key) |
| `attn_heads` | `o_proj`'s input (heads × v_head_dim, flat) |
| `attn_out` | `o_proj`'s output |
| `topk` | DSA: the indexer's output; picks past the row's own position (masked by the causal mask, so not attended) are written as −1 |

Hooks only copy (after the op, through `mla_diff.capture.tap`): the model computes what it computes
without them. Forward hooks and pre-hooks are PyTorch's; the rope function and the cache's `update`
are wrapped for the duration of the block (the wrapper calls the original and copies its result) and
restored on exit.

Positions come from the cache, not from the model's `position_ids`: a sequence's tokens are at
0, 1, 2, … in the order they enter its cache (left padding, from the 2-D attention mask, is skipped), so
a model that ropes a token at the wrong position is caught instead of believed.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator, Optional

import numpy as np

from . import CaptureError, session as _open_session

__all__ = ["capture", "generate", "attention_layers", "rope_order_of"]

#: Rope functions of transformers' MLA modeling modules, and the order of the rope dims they return
#: relative to the GGUF file's (docs/conventions.md): the interleaved variant de-interleaves
#: (`[even…, odd…]`, "halves"); DeepSeek-V2's complex rope keeps the pairs adjacent, as the file does;
#: the NeoX one (MiniCPM3) rotates halves, which is the file's order for a NeoX architecture.
ROPE_FUNCTIONS = {
    "apply_rotary_pos_emb_interleave": "halves",
    "apply_rotary_emb": "file",
    "apply_rotary_pos_emb": "file",
}


def attention_layers(model) -> list:
    """The decoder layers of an MLA causal LM (or its base model), checked to be MLA attention."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise CaptureError(f"{type(model).__name__}: no .layers (expected a transformers causal LM)")
    out = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "kv_a_proj_with_mqa") or not hasattr(attn, "kv_b_proj"):
            raise CaptureError(f"{type(model).__name__}: layer without MLA attention (kv_a_proj_with_mqa, kv_b_proj)")
        out.append(layer)
    return out


def rope_order_of(model) -> str:
    """The capture's `rope_order` for this model: which rope function its attention calls."""
    attn = attention_layers(model)[0].self_attn
    mod = sys.modules[type(attn).__module__]
    cls = type(attn).__name__
    if hasattr(mod, "apply_rotary_emb") and "DeepseekV2" in cls:
        return "file"
    if hasattr(mod, "apply_rotary_pos_emb_interleave") and getattr(attn.config, "rope_interleave", True):
        # DeepSeek-V3 / V3.2, Kimi-K2, GLM-4.7-Flash (rope_interleave), GLM-5 (always interleaved).
        if "MiniCPM3" not in cls:
            return "halves"
    return "file"


def _dtype_name(model) -> str:
    import torch

    dt = next(model.parameters()).dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, "f32")


class _Capture:
    """The hooks of one capture; `capture()` installs and removes them."""

    def __init__(self, model, sess):
        self.model = model
        self.sess = sess
        self.base = getattr(model, "model", model)
        self.layers = attention_layers(model)
        attn0 = self.layers[0].self_attn
        self.nope = int(attn0.qk_nope_head_dim)
        self.rope = int(attn0.qk_rope_head_dim)
        self.mod = sys.modules[type(attn0).__module__]
        self.local = threading.local()
        self.handles: list = []
        self.restore: list = []
        self.rid_of_batch: dict = {}
        # Per batch row: the logical position of each cache index (−1: padding), the current step's
        # rows and cache indices.
        self.pos_table: list = []
        self.rows_shape = (0, 0)
        self.step_cache_start = 0
        # The order rope_order_of() gave the session; a rope function returning the other one is refused.
        self.rope_order = sess.conventions["rope_order"]

    # -- helpers -----------------------------------------------------------------------------------

    def _layer(self) -> Optional[int]:
        if getattr(self.local, "in_indexer", False):
            return None
        return getattr(self.local, "layer", None)

    def _rows(self, t):
        """[B, S, …] → [B·S, …] (the step's rows, batch-major)."""
        b, s = self.rows_shape
        return t.reshape(b * s, *t.shape[2:])

    def tap(self, name: str, t, layer: int) -> None:
        self.sess.tap(name, t, layer=layer)

    # -- steps -------------------------------------------------------------------------------------

    def on_model_pre(self, module, args, kwargs):
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise CaptureError("transformers capture: the model was called without input_ids (inputs_embeds is not supported)")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = int(cache.get_seq_length()) if cache is not None else 0
        b, s = ids.shape
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] != past + s):
            mask = None  # a prepared 4-D mask: no padding information we can read; assume none
        if past == 0:
            self.pos_table = [[] for _ in range(b)]
        elif len(self.pos_table) != b:
            raise CaptureError("transformers capture: the batch size changed between steps")
        rows = []
        ids_np = ids.detach().to("cpu").numpy()
        for i in range(b):
            tab = self.pos_table[i]
            if len(tab) != past:
                raise CaptureError(f"transformers capture: sequence {i} has {len(tab)} tokens in its cache, the model {past}")
            mine = []  # (row index in `rows`, position) of this element's real tokens
            for j in range(s):
                if mask is not None and int(mask[i, past + j]) == 0:
                    tab.append(-1)
                    rows.append(None)
                    continue
                p = max(tab, default=-1) + 1
                tab.append(p)
                mine.append((len(rows), p, int(ids_np[i, j])))
                rows.append(None)
            if not mine:
                continue
            rid = self.rid_of_batch.get(i)
            if rid is None:
                rid = self.sess.request([t for _, _, t in mine], positions=[p for _, p, _ in mine])
                self.rid_of_batch[i] = rid
            else:
                self.sess.extend(rid, [t for _, _, t in mine])
            for r, p, _ in mine:
                rows[r] = [rid, p]
        kind = "prefill" if s > 1 or past == 0 else "decode"
        self.sess.step(kind, rows)
        self.rows_shape = (b, s)
        self.step_cache_start = past

    # -- layer hooks -------------------------------------------------------------------------------

    def layer_hooks(self, idx: int, layer) -> None:
        attn = layer.self_attn
        cap = self

        def decoder_pre(mod, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            cap.tap("x", cap._rows(hs), idx)

        def attn_pre(mod, args, kwargs):
            cap.local.layer = idx
            cap.local.in_indexer = False

        def attn_post(mod, args, kwargs, out):
            cap.local.layer = None

        def norm_post(mod, args, out):
            cap.tap("attn_in", cap._rows(out), idx)

        def q_post(mod, args, out):
            b, s = cap.rows_shape
            q = out.reshape(b * s, -1, cap.nope + cap.rope)
            cap.tap("q_nope", q[..., : cap.nope], idx)

        def kv_norm_post(mod, args, out):
            cap.tap("kv_latent", cap._rows(out.reshape(*cap.rows_shape, -1)), idx)

        def o_pre(mod, args):
            cap.tap("attn_heads", cap._rows(args[0]), idx)

        def o_post(mod, args, out):
            cap.tap("attn_out", cap._rows(out), idx)

        def idx_pre(mod, args, kwargs):
            cap.local.in_indexer = True

        def idx_post(mod, args, kwargs, out):
            cap.local.in_indexer = False
            cap.tap_topk(out, idx)

        h = self.handles
        h.append(layer.register_forward_pre_hook(decoder_pre, with_kwargs=True))
        h.append(attn.register_forward_pre_hook(attn_pre, with_kwargs=True))
        h.append(attn.register_forward_hook(attn_post, with_kwargs=True))
        h.append(layer.input_layernorm.register_forward_hook(norm_post))
        qproj = attn.q_b_proj if getattr(attn, "q_b_proj", None) is not None else attn.q_proj
        h.append(qproj.register_forward_hook(q_post))
        h.append(attn.kv_a_layernorm.register_forward_hook(kv_norm_post))
        h.append(attn.o_proj.register_forward_pre_hook(o_pre))
        h.append(attn.o_proj.register_forward_hook(o_post))
        indexer = getattr(attn, "indexer", None)
        if indexer is not None:
            h.append(indexer.register_forward_pre_hook(idx_pre, with_kwargs=True))
            h.append(indexer.register_forward_hook(idx_post, with_kwargs=True))

    def tap_topk(self, sel, idx: int) -> None:
        """DSA top-k ([B, S, k] cache indices) as key positions; picks the causal mask hides → −1."""
        b, s = self.rows_shape
        a = sel.detach().to("cpu").numpy().astype(np.int64).reshape(b, s, -1)
        out = np.full_like(a, -1)
        for i in range(b):
            tab = np.asarray(self.pos_table[i], dtype=np.int64)
            for j in range(s):
                c = self.step_cache_start + j
                if tab[c] < 0:
                    continue
                keys = a[i, j]
                ok = (keys >= 0) & (keys <= c)
                pos = np.where(ok, tab[np.clip(keys, 0, len(tab) - 1)], -1)
                out[i, j] = np.where(pos >= 0, pos, -1)
        self.tap("topk", out.reshape(b * s, -1), idx)

    # -- wrapped functions -------------------------------------------------------------------------

    def wrap_rope(self) -> None:
        cap = self
        for fname, order in ROPE_FUNCTIONS.items():
            orig = getattr(self.mod, fname, None)
            if orig is None:
                continue

            def wrapper(q, k, *a, _orig=orig, _order=order, _name=fname, **kw):
                qo, ko = _orig(q, k, *a, **kw)
                layer = cap._layer()
                if layer is not None:
                    if cap.rope_order != _order:
                        raise CaptureError(f"transformers capture: {_name} returns rope dims in {_order!r} order, "
                                           f"earlier calls in {cap.rope_order!r}")
                    b, s = cap.rows_shape
                    # q: [B, H, S, R] → [B·S, H, R]; k: [B, 1, S, R] → [B·S, R]
                    cap.tap("q_pe", qo.transpose(1, 2).reshape(b * s, -1, qo.shape[-1]), layer)
                    cap.tap("k_pe", ko.transpose(1, 2).reshape(b * s, ko.shape[-1]), layer)
                return qo, ko

            setattr(self.mod, fname, wrapper)
            self.restore.append((self.mod, fname, orig))

    def wrap_cache(self, cache_cls) -> None:
        cap = self
        orig = cache_cls.update

        def update(self_, key_states, value_states, layer_idx, *a, **kw):
            out = orig(self_, key_states, value_states, layer_idx, *a, **kw)
            layer = cap._layer()
            if layer is not None and layer == layer_idx:
                lat, kr = out
                b, s = cap.rows_shape
                # The step's tokens are the last S entries of the returned cache ([B, 1, T, ·]).
                rows = __import__("torch").cat([lat[:, 0, -s:], kr[:, 0, -s:]], dim=-1)
                cap.tap("cache_rows", rows.reshape(b * s, -1), layer)
            return out

        cache_cls.update = update
        self.restore.append((cache_cls, "update", orig))

    def install(self) -> None:
        from transformers import cache_utils

        self.handles.append(self.base.register_forward_pre_hook(self.on_model_pre, with_kwargs=True))
        for i, layer in enumerate(self.layers):
            self.layer_hooks(i, layer)
        self.wrap_rope()
        self.wrap_cache(cache_utils.Cache)
        # DynamicCache and its siblings may override update: wrap each class that defines its own.
        for name in dir(cache_utils):
            cls = getattr(cache_utils, name)
            if isinstance(cls, type) and issubclass(cls, cache_utils.Cache) and cls is not cache_utils.Cache \
                    and "update" in cls.__dict__:
                self.wrap_cache(cls)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for owner, name, orig in reversed(self.restore):
            setattr(owner, name, orig)
        self.restore.clear()


NAMES = {
    "model.layers.{L}:in": "x",
    "model.layers.{L}.input_layernorm:out": "attn_in",
    "model.layers.{L}.self_attn.q_b_proj:out[:, :, :qk_nope_head_dim]": "q_nope",
    "apply_rotary_*:out[0]": "q_pe",
    "apply_rotary_*:out[1]": "k_pe",
    "model.layers.{L}.self_attn.kv_a_layernorm:out": "kv_latent",
    "cache.update(latent, k_rot, L):out[last S rows]": "cache_rows",
    "model.layers.{L}.self_attn.o_proj:in": "attn_heads",
    "model.layers.{L}.self_attn.o_proj:out": "attn_out",
    "model.layers.{L}.self_attn.indexer:out": "topk",
}


@contextlib.contextmanager
def capture(model, directory, *, model_file, dtype: Optional[str] = None, overwrite: bool = False,
            engine_detail: Optional[str] = None) -> Iterator[Any]:
    """Capture every forward of `model` inside the block into `directory` (a capture folder), for the
    GGUF file `model_file` (the converter's output of the same checkpoint). `dtype`: the model's
    activation precision (default from its parameters: bf16, fp16, else f32)."""
    import transformers

    attention_layers(model)  # refuse a non-MLA model before writing anything
    impl = getattr(model.config, "_attn_implementation", None)
    detail = engine_detail or f"{type(model).__name__}, attn_implementation={impl}"
    sess = _open_session(
        directory,
        model_file=model_file,
        engine="transformers",
        engine_version=transformers.__version__,
        engine_detail=detail,
        dtype=dtype or _dtype_name(model),
        rope_order=rope_order_of(model),
        names=dict(NAMES),
        overwrite=overwrite,
    )
    cap = _Capture(model, sess)
    cap.install()
    try:
        with sess:
            yield sess
    finally:
        cap.remove()


def generate(model, input_ids, directory, *, model_file, max_new_tokens: int = 4, **kwargs):
    """One call: `model.generate(input_ids, …)` (greedy unless kwargs say otherwise) captured into
    `directory`. Returns generate's output."""
    import torch

    kwargs.setdefault("do_sample", False)
    with torch.no_grad(), capture(model, directory, model_file=model_file,
                                  overwrite=kwargs.pop("overwrite", False)):
        return model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)
