"""Capture SGLang's DeepSeek MLA attention (docs/captures.md, "SGLang").

    MLA_DIFF_CAPTURE_DIR=cap MLA_DIFF_CAPTURE_MODEL=model.gguf python serve.py   # the plugin installs it
    # or, where the model runs in this process:
    from mla_diff.capture import sglang as scap
    scap.install("cap/", model_file="model.gguf"); ...; scap.close()

SGLang with CUDA graphs and the radix cache off, TP 1.

Written against SGLang 0.5.23; `TARGETS` lists what is wrapped, checked against the released wheel by
python/tests/engines/test_engine_targets.py. Taps:

| SGLang function | stages |
|---|---|
| `DeepseekV2DecoderLayer.forward(positions, hidden_states, forward_batch, zero_allocator, …)` | the step (rows from `forward_batch`: requests `req_pool_indices`, `positions`); marks the layer whose attention boundary is read next |
| `StageBoundary._prepare_attention(hidden_states, stream, forward_batch, …, capture, …)` | `x`, through the boundary's own `capture` callback (below) |
| `DeepseekV2AttentionMLA.forward(positions, hidden_states, forward_batch, zero_allocator, …)` | `attn_in`, `attn_out` (TP 1) |
| `DeepseekMLAForwardMixin.forward_absorb_core(q_pe, k_pe, q_nope_out, k_nope, forward_batch, …)` | `q_pe`, `k_pe`, `q_absorbed` (`q_nope_out`, already `W_UKᵀ q_nope`), `kv_latent` (`k_nope`) |
| `DeepseekMHAForwardMixin.forward_normal_core(q, k, v, forward_batch, …)` | `q_nope`, `q_pe` (q is roped) |

`x`, the layer input before `attn_norm`: SGLang 0.5.23 keeps the residual stream in its layer-boundary
objects (`sglang.srt.layers.layer_boundary`), which fuse the residual add into the norm, so no tensor
argument is the layer input. The attention boundary's `prepare` takes a `capture` callback for exactly
this value — SGLang's own EAGLE3 aux-hidden-state capture passes it (`glm4.py`, `glm4_moe.py`:
`attn_boundary.prepare(hidden_states, forward_batch, capture=…)`) — and `_prepare_attention` calls it with
the embeddings at the first layer and with the stream's updated residual (the sum the fused add+norm
wrote) at every other: the layer input. DeepSeek's decoder layer passes no `capture`, so the wrapper
adds one for the boundary of the layer being run (chained before any the engine passed). With a
`capture`, SGLang completes a pending TP all-reduce before the norm rather than inside it (its comment:
the add+norm kernel and its f32 accumulation are kept); at TP 1 nothing is pending. Read from the
wheel's source, not run here (no GPU).
"""

from __future__ import annotations

import atexit
import importlib
import os
import threading

from . import CaptureError, session as _open_session

__all__ = ["install", "close", "plugin", "TARGETS"]

TARGETS = [
    ("sglang.srt.models.deepseek_v2", "DeepseekV2DecoderLayer.forward",
     ["self", "positions", "hidden_states", "forward_batch", "zero_allocator"]),
    ("sglang.srt.layers.layer_boundary.stage", "StageBoundary._prepare_attention",
     ["self", "hidden_states", "stream", "forward_batch", "capture_gathered", "post_residual_addition",
      "quant_format", "capture"]),
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
    def __init__(self, directory, model_file, dtype):
        self.args = (os.fspath(directory), model_file, dtype)
        self.sess = None
        self.batch_id = None
        self.req_of: dict = {}
        # The decoder layer being run, per thread: its attention boundary's input is that layer's `x`.
        self.layer = threading.local()

    def begin(self, forward_batch, layer: int) -> None:
        """A new step when layer 0 sees a new ForwardBatch: rows = its tokens, request by request."""
        if layer != 0 or forward_batch is self.batch_id:
            return
        if self.sess is None:
            self.open()
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

    def open(self) -> None:
        """The session, on the first step, in the process that runs the model (SGLang's scheduler
        process, when the plugin installed the wrappers in every process): the others write nothing."""
        import sglang
        from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        world = get_tensor_model_parallel_world_size()
        if world != 1:
            raise CaptureError(f"SGLang capture: TP 1 only (this process is rank "
                               f"{get_tensor_model_parallel_rank()} of {world}); run with tp_size=1")
        directory, model_file, dtype = self.args
        self.sess = _open_session(directory, model_file=model_file, engine="sglang",
                                  engine_version=sglang.__version__, engine_detail="DeepseekV2AttentionMLA",
                                  dtype=dtype, rope_order="file")

    def tap(self, name, t, layer) -> None:
        if self.sess is not None:
            self.sess.tap(name, t, layer=layer)


def _wrap(module, qual, make):
    mod = importlib.import_module(module)
    cls_name, fn = qual.split(".")
    cls = getattr(mod, cls_name)
    orig = cls.__dict__[fn]
    setattr(cls, fn, make(orig))
    _state.setdefault("restore", []).append((cls, fn, orig))


def install(directory, *, model_file, dtype: str = "bf16") -> None:
    """Wrap SGLang's MLA layer in this process. The capture opens at the first step (the process that runs
    the model); an offline `sglang.Engine` runs the model in its scheduler process: use `plugin`."""
    with _lock:
        if "cap" in _state:
            raise CaptureError("SGLang capture: already installed")
        cap = _SglCapture(directory, model_file, dtype)
        _state["cap"] = cap

    def decoder_forward(orig):
        def f(self, positions, hidden_states, forward_batch, zero_allocator, *a, **kw):
            cap.begin(forward_batch, self.layer_id)
            outer = getattr(cap.layer, "current", None)
            cap.layer.current = self
            try:
                return orig(self, positions, hidden_states, forward_batch, zero_allocator, *a, **kw)
            finally:
                cap.layer.current = outer
        return f

    # _prepare_attention's parameters after forward_batch (SGLang 0.5.23; TARGETS checks them).
    after = ("capture_gathered", "post_residual_addition", "quant_format", "capture", "read_context")

    def prepare_attention(orig):
        def f(self, hidden_states, stream, forward_batch, *a, **kw):
            layer = getattr(cap.layer, "current", None)
            if layer is None or getattr(layer, "attn_boundary", None) is not self or len(a) > len(after):
                return orig(self, hidden_states, stream, forward_batch, *a, **kw)
            kw = {**dict(zip(after, a)), **kw}
            theirs = kw.get("capture")

            def capture(value, owned=False):
                cap.tap("x", value, layer=layer.layer_id)   # copied to the host here
                if theirs is not None:
                    theirs(value, owned=owned)
            kw["capture"] = capture
            return orig(self, hidden_states, stream, forward_batch, **kw)
        return f

    def attn_forward(orig):
        def f(self, positions, hidden_states, forward_batch, zero_allocator, *a, **kw):
            cap.begin(forward_batch, self.layer_id)
            cap.tap("attn_in", hidden_states, layer=self.layer_id)
            out = orig(self, positions, hidden_states, forward_batch, zero_allocator, *a, **kw)
            o = out[0] if isinstance(out, tuple) else out
            if getattr(self, "tp_size", 1) == 1:
                cap.tap("attn_out", o, layer=self.layer_id)
            return out
        return f

    def absorb_core(orig):
        def f(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch, *a, **kw):
            n = q_pe.shape[0]
            cap.tap("q_pe", q_pe, layer=self.layer_id)
            cap.tap("k_pe", k_pe.reshape(n, -1), layer=self.layer_id)
            cap.tap("q_absorbed", q_nope_out, layer=self.layer_id)
            cap.tap("kv_latent", k_nope.reshape(n, -1), layer=self.layer_id)
            return orig(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch, *a, **kw)
        return f

    def normal_core(orig):
        def f(self, q, k, v, forward_batch, *a, **kw):
            p = self.qk_nope_head_dim
            qq = q.reshape(q.shape[0], -1, p + self.qk_rope_head_dim)
            cap.tap("q_nope", qq[..., :p], layer=self.layer_id)
            cap.tap("q_pe", qq[..., p:], layer=self.layer_id)
            return orig(self, q, k, v, forward_batch, *a, **kw)
        return f

    makers = [decoder_forward, prepare_attention, attn_forward, absorb_core, normal_core]
    for (module, qual, _), make in zip(TARGETS, makers):
        _wrap(module, qual, make)
    atexit.register(close)


def close() -> None:
    with _lock:
        cap = _state.pop("cap", None)
        for cls, fn, orig in reversed(_state.pop("restore", [])):
            setattr(cls, fn, orig)
    if cap is not None and cap.sess is not None and not cap.sess.closed:
        cap.sess.close()


def plugin() -> None:
    """SGLang general plugin (entry point `sglang.srt.plugins`: mla_diff_capture): SGLang calls it at the
    start of every process it runs, its scheduler (which runs the model) included; with
    MLA_DIFF_CAPTURE_DIR and MLA_DIFF_CAPTURE_MODEL set it installs the capture, otherwise nothing."""
    d, m = os.environ.get("MLA_DIFF_CAPTURE_DIR"), os.environ.get("MLA_DIFF_CAPTURE_MODEL")
    if d and m:
        install(d, model_file=m, dtype=os.environ.get("MLA_DIFF_CAPTURE_DTYPE", "bf16"))
