"""Capture SGLang's DeepSeek MLA attention (docs/captures.md, "SGLang").

    from mla_diff.capture import sglang as scap
    scap.install("cap/", model_file="model.gguf")   # in the process that runs the model
    ... run SGLang's offline Engine with --disable-cuda-graph, --disable-radix-cache, tp 1 ...
    scap.close()

Written against SGLang 0.5.23; `TARGETS` lists what is wrapped, checked against the released wheel by
python/tests/engines/test_engine_targets.py. Taps:

| SGLang function | stages |
|---|---|
| `DeepseekV2AttentionMLA.forward(positions, hidden_states, forward_batch, zero_allocator, …)` | the step (rows from `forward_batch`: requests `req_pool_indices`, `positions`), `attn_in`, `attn_out` (TP 1) |
| `DeepseekMLAForwardMixin.forward_absorb_core(q_pe, k_pe, q_nope_out, k_nope, forward_batch, …)` | `q_pe`, `k_pe`, `q_absorbed` (`q_nope_out`, already `W_UKᵀ q_nope`), `kv_latent` (`k_nope`) |
| `DeepseekMHAForwardMixin.forward_normal_core(q, k, v, forward_batch, …)` | `q_nope`, `q_pe` (q is roped) |

Not yet captured: `x`, the layer input before `attn_norm`. SGLang 0.5.23 keeps the residual in its
layer-boundary objects (`sglang.srt.layers.layer_boundary`), which fuse the residual add into the norm;
reading it needs a run to confirm which object holds it, and none was possible here (no GPU). A capture
without `x` is refused by `run --capture` (the reference starts from it): see docs/captures.md.
"""

from __future__ import annotations

import atexit
import importlib
import os
import threading

from . import CaptureError, session as _open_session

__all__ = ["install", "close", "TARGETS"]

TARGETS = [
    ("sglang.srt.models.deepseek_v2", "DeepseekV2AttentionMLA.forward",
     ["self", "positions", "hidden_states", "forward_batch", "zero_allocator"]),
    ("sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla", "DeepseekMLAForwardMixin.forward_absorb_core",
     ["self", "q_pe", "k_pe", "q_nope_out", "k_nope", "forward_batch"]),
    ("sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha", "DeepseekMHAForwardMixin.forward_normal_core",
     ["self", "q", "k", "v", "forward_batch"]),
]

_state: dict = {}
_lock = threading.Lock()


class _SglCapture:
    def __init__(self, sess):
        self.sess = sess
        self.batch_id = None
        self.req_of: dict = {}

    def begin(self, forward_batch, layer: int) -> None:
        """A new step when layer 0 sees a new ForwardBatch: rows = its tokens, request by request."""
        if layer != 0 or forward_batch is self.batch_id:
            return
        self.batch_id = forward_batch
        pos = forward_batch.positions.detach().to("cpu").tolist()
        ids = forward_batch.input_ids.detach().to("cpu").tolist()
        reqs = forward_batch.req_pool_indices.detach().to("cpu").tolist()
        if forward_batch.forward_mode.is_decode():
            counts = [1] * len(reqs)
        else:
            counts = list(forward_batch.extend_seq_lens_cpu)
        rows, k = [], 0
        for slot, n in zip(reqs, counts):
            ps, toks = pos[k:k + n], ids[k:k + n]
            rid = self.req_of.get(slot)
            if rid is None or ps[0] == 0:
                if ps[0] != 0:
                    raise CaptureError(f"SGLang capture: a request starts at position {ps[0]} (disable the radix cache)")
                rid = self.sess.request(toks, positions=ps, prefill=len(toks))
                self.req_of[slot] = rid
            else:
                self.sess.extend(rid, toks)
            rows.extend([rid, p] for p in ps)
            k += n
        self.sess.step("decode" if forward_batch.forward_mode.is_decode() else "prefill", rows)


def _wrap(module, qual, make):
    mod = importlib.import_module(module)
    cls_name, fn = qual.split(".")
    cls = getattr(mod, cls_name)
    orig = cls.__dict__[fn]
    setattr(cls, fn, make(orig))
    _state.setdefault("restore", []).append((cls, fn, orig))


def install(directory, *, model_file, dtype: str = "bf16") -> None:
    import sglang

    with _lock:
        if "cap" in _state:
            raise CaptureError("SGLang capture: already installed")
        sess = _open_session(directory, model_file=model_file, engine="sglang", engine_version=sglang.__version__,
                             engine_detail="DeepseekV2AttentionMLA", dtype=dtype, rope_order="file")
        cap = _SglCapture(sess)
        _state["cap"] = cap

    def attn_forward(orig):
        def f(self, positions, hidden_states, forward_batch, zero_allocator, *a, **kw):
            cap.begin(forward_batch, self.layer_id)
            cap.sess.tap("attn_in", hidden_states, layer=self.layer_id)
            out = orig(self, positions, hidden_states, forward_batch, zero_allocator, *a, **kw)
            o = out[0] if isinstance(out, tuple) else out
            if getattr(self, "tp_size", 1) == 1:
                cap.sess.tap("attn_out", o, layer=self.layer_id)
            return out
        return f

    def absorb_core(orig):
        def f(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch, *a, **kw):
            n = q_pe.shape[0]
            cap.sess.tap("q_pe", q_pe, layer=self.layer_id)
            cap.sess.tap("k_pe", k_pe.reshape(n, -1), layer=self.layer_id)
            cap.sess.tap("q_absorbed", q_nope_out, layer=self.layer_id)
            cap.sess.tap("kv_latent", k_nope.reshape(n, -1), layer=self.layer_id)
            return orig(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch, *a, **kw)
        return f

    def normal_core(orig):
        def f(self, q, k, v, forward_batch, *a, **kw):
            p = self.qk_nope_head_dim
            qq = q.reshape(q.shape[0], -1, p + self.qk_rope_head_dim)
            cap.sess.tap("q_nope", qq[..., :p], layer=self.layer_id)
            cap.sess.tap("q_pe", qq[..., p:], layer=self.layer_id)
            return orig(self, q, k, v, forward_batch, *a, **kw)
        return f

    makers = [attn_forward, absorb_core, normal_core]
    for (module, qual, _), make in zip(TARGETS, makers):
        _wrap(module, qual, make)
    atexit.register(close)


def close() -> None:
    with _lock:
        cap = _state.pop("cap", None)
        for cls, fn, orig in reversed(_state.pop("restore", [])):
            setattr(cls, fn, orig)
    if cap is not None and not cap.sess.closed:
        cap.sess.close()
