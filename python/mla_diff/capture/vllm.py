"""Capture vLLM's MLA layer on real requests (docs/captures.md, "vLLM").

    # in the process that runs the model (offline LLM with VLLM_ENABLE_V1_MULTIPROCESSING=0), or in
    # every worker through the plugin below:
    from mla_diff.capture import vllm as vcap
    vcap.install("cap/", model_file="model.gguf")
    llm = LLM("model.gguf", enforce_eager=True, enable_prefix_caching=False, compilation_config=0)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    vcap.close()                       # writes manifest.json (also at process exit)

    mla-diff run model.gguf --capture cap/rank0

Written against vLLM 0.33.0; `TARGETS` lists every function wrapped, with the parameters it is called
with, and python/tests/engines/test_engine_targets.py checks them against the released wheel's source (with
`ast`, without importing vLLM). What is wrapped, and what it gives:

| vLLM function | stages |
|---|---|
| `GPUModelRunner.execute_model(scheduler_output, …)` | the step: its requests in batch order (`input_batch.req_ids`), their token ids and prompt lengths |
| `DeepseekV2DecoderLayer.forward(positions, hidden_states, residual, …)` | the rows' positions; `x` = `hidden_states` when `residual` is None (first layer), else `input_layernorm`'s returned residual (the fused add's result, read from a forward hook on the norm) |
| `MultiHeadLatentAttentionWrapper.forward(positions, hidden_states, …)` | `attn_in` (its input), `attn_out` (its output; TP world 1 only: with TP it is already all-reduced, not the rank's partial sum) |
| `MLAAttention.forward_impl(q, k_c_normed, k_pe, kv_cache, attn_metadata, output, …)` | `q_nope`, `q_pe` (q is roped), `kv_latent`, `k_pe`; after it: `attn_heads` (`output`) and `cache_rows` (the paged cache read back at `forward_context.slot_mapping[layer_name]`; not for fp8 caches) |
| `MLACommonBaseImpl.forward_mha(…)` / `_compute_prefill_context(…)` | the prefill path, and whether a chunk had context (`has_context`): counted in the engine detail |
| `<Backend>Impl.forward_mqa(q, kv_cache, attn_metadata, layer)` | `attn_latent` of the decode rows (the first `num_decode_tokens` of the batch) |

Requirements (checked where they can be): eager mode without CUDA graphs or torch.compile
(`enforce_eager=True`, `compilation_config=0`: a graph replay runs no Python, and Dynamo would trace the
taps), no prefix caching (a cached prefix was never computed in the capture, and the reference needs
every token's layer input), one sequence per request (no beam search), no speculative decoding.
Not run end to end on this project's CPU-only CI: see docs/captures.md for the GPU recipe.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import threading
from typing import Optional

from . import CaptureError, session as _open_session

__all__ = ["install", "close", "plugin", "TARGETS"]

# (module, Class.function, leading parameters as the released source declares them)
TARGETS = [
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model",
     ["self", "scheduler_output", "intermediate_tensors"]),
    ("vllm.model_executor.models.deepseek_v2", "DeepseekV2DecoderLayer.forward",
     ["self", "positions", "hidden_states", "residual"]),
    ("vllm.model_executor.layers.mla", "MultiHeadLatentAttentionWrapper.forward",
     ["self", "positions", "hidden_states"]),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention.forward_impl",
     ["self", "q", "k_c_normed", "k_pe", "kv_cache", "attn_metadata", "output"]),
    ("vllm.model_executor.layers.attention.mla_attention", "MLACommonBaseImpl.forward_mha",
     ["self", "q", "kv_c_normed", "k_pe", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale", "output"]),
    ("vllm.model_executor.layers.attention.mla_attention", "MLACommonBaseImpl._compute_prefill_context",
     ["self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale"]),
    ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLAImpl.forward_mqa",
     ["self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"]),
    ("vllm.v1.attention.backends.mla.flashmla", "FlashMLAImpl.forward_mqa",
     ["self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"]),
    ("vllm.v1.attention.backends.mla.flashinfer_mla", "FlashInferMLAImpl.forward_mqa",
     ["self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"]),
    ("vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLAImpl.forward_mqa",
     ["self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"]),
]

_state: dict = {}
_lock = threading.Lock()


def _layer_index(name: str) -> int:
    """`model.layers.7.self_attn.attn` → 7."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    raise CaptureError(f"vLLM capture: no layer index in {name!r}")


class _VllmCapture:
    def __init__(self, directory, model_file, dtype):
        self.args = (os.fspath(directory), model_file, dtype)
        self.sess = None
        self.tp_world = 1
        self.runner = None
        self.sched = None
        self.step_open = False
        self.rows = 0
        self.req_of: dict = {}  # vLLM request id → capture request id
        self.context_chunks = 0
        self.hooked: set = set()

    # -- steps -------------------------------------------------------------------------------------

    def begin(self, positions) -> None:
        """Start the step on the first layer's call: rows = the batch's requests in order, each with its
        scheduled tokens, at the positions the model is given."""
        if self.step_open or self.runner is None:
            return
        if self.sess is None:
            self.open()
        ib = self.runner.input_batch
        pos = positions.detach().to("cpu").tolist()
        rows, k = [], 0
        for req_id in ib.req_ids:
            n = int(self.sched.num_scheduled_tokens.get(req_id, 0))
            if n == 0:
                continue
            idx = ib.req_id_to_index[req_id]
            ps = pos[k:k + n]
            toks = [int(ib.token_ids_cpu[idx, p]) for p in ps]
            rid = self.req_of.get(req_id)
            if rid is None:
                if ps[0] != 0:
                    raise CaptureError(f"vLLM capture: request {req_id} starts at position {ps[0]} "
                                       "(prefix caching? disable it: the reference needs every token's layer input)")
                rid = self.sess.request(toks, positions=ps, prefill=int(ib.num_prompt_tokens[idx]))
                self.req_of[req_id] = rid
            else:
                self.sess.extend(rid, toks)
            rows.extend([rid, p] for p in ps)
            k += n
        # Rows past the scheduled tokens: CUDA-graph padding (eager mode has none).
        rows.extend([None] * (len(pos) - k))
        self.sess.step(_kind(rows, self.sess), rows)
        self.rows = len(rows)
        self.step_open = True

    def open(self) -> None:
        """The session, on the first step: by then vLLM's TP group exists and says this process's rank."""
        import vllm
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        directory, model_file, dtype = self.args
        rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        cfg = self.runner.model_config.hf_config
        n_head = int(cfg.num_attention_heads)
        heads = [rank * n_head // world, (rank + 1) * n_head // world] if world > 1 else None
        self.tp_world = world
        self.sess = _open_session(os.path.join(directory, f"rank{rank}"), model_file=model_file, engine="vllm",
                                  engine_version=vllm.__version__, engine_detail="MLA layer", dtype=dtype,
                                  rope_order="file", tp_rank=rank, tp_world_size=world, heads=heads,
                                  names=dict(NAMES))

    def tap(self, name, t, layer, rows=None) -> None:
        if self.sess is not None and self.step_open:
            self.sess.tap(name, t, layer=layer, rows=rows)


def _kind(rows, sess) -> str:
    phases = set()
    for r in rows:
        if r is None:
            continue
        req = sess.requests[r[0]]
        phases.add("prefill" if r[1] - req["positions"][0] < req["prefill"] else "decode")
    return phases.pop() if len(phases) == 1 else "mixed"


def _wrap(module: str, qual: str, make):
    mod = importlib.import_module(module)
    cls_name, fn = qual.split(".")
    cls = getattr(mod, cls_name)
    orig = cls.__dict__[fn]
    cls_wrapped = make(orig)
    functools.update_wrapper(cls_wrapped, orig)
    setattr(cls, fn, cls_wrapped)
    _state.setdefault("restore", []).append((cls, fn, orig))


NAMES = {
    "DeepseekV2DecoderLayer.forward:hidden_states (layer 0) | input_layernorm:out[1]": "x",
    "MultiHeadLatentAttentionWrapper.forward:hidden_states": "attn_in",
    "MLAAttention.forward_impl:q[..., :qk_nope_head_dim]": "q_nope",
    "MLAAttention.forward_impl:q[..., qk_nope_head_dim:]": "q_pe",
    "MLAAttention.forward_impl:k_c_normed": "kv_latent",
    "MLAAttention.forward_impl:k_pe": "k_pe",
    "kv_cache[slot_mapping[layer_name]] after forward_impl": "cache_rows",
    "<Backend>Impl.forward_mqa:out[0]": "attn_latent",
    "MLAAttention.forward_impl:output": "attn_heads",
    "MultiHeadLatentAttentionWrapper.forward:out": "attn_out",
}


def install(directory, *, model_file, dtype: str = "bf16") -> None:
    """Patch vLLM's MLA path to capture into `directory`/rank{R} (R: this process's TP rank, known at
    the first step). `dtype`: the model's activation dtype (bf16, fp16, f32)."""
    with _lock:
        if "cap" in _state:
            raise CaptureError("vLLM capture: already installed")
        cap = _VllmCapture(directory, model_file, dtype)
        _state["cap"] = cap
    _install_wrappers(cap)
    atexit.register(close)


def _install_wrappers(cap: _VllmCapture) -> None:
    def execute_model(orig):
        def f(self, scheduler_output, *a, **kw):
            cap.runner, cap.sched, cap.step_open = self, scheduler_output, False
            try:
                return orig(self, scheduler_output, *a, **kw)
            finally:
                cap.runner = cap.sched = None
        return f

    def decoder_forward(orig):
        def f(self, positions, hidden_states, residual, *a, **kw):
            cap.begin(positions)
            layer = self.layer_idx
            if residual is None:
                cap.tap("x", hidden_states, layer)
            elif id(self) not in cap.hooked:
                # The fused add+norm returns (normed, residual = hidden + residual): x as the engine has it.
                def hook(mod, args, out, layer=layer):
                    if isinstance(out, tuple) and cap.step_open:
                        cap.tap("x", out[1], layer)
                self.input_layernorm.register_forward_hook(hook)
                cap.hooked.add(id(self))
            return orig(self, positions, hidden_states, residual, *a, **kw)
        return f

    def mla_wrapper_forward(orig):
        def f(self, positions, hidden_states, *a, **kw):
            layer = _layer_index(self.mla_attn.layer_name)
            cap.tap("attn_in", hidden_states, layer)
            out = orig(self, positions, hidden_states, *a, **kw)
            if cap.tp_world == 1:
                cap.tap("attn_out", out, layer)
            return out
        return f

    def forward_impl(orig):
        def f(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *a, **kw):
            out = orig(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *a, **kw)
            if attn_metadata is None:  # the profile run
                return out
            layer = _layer_index(self.layer_name)
            n = int(attn_metadata.num_actual_tokens)
            p = self.qk_nope_head_dim
            qq = q[:n].reshape(n, -1, p + self.qk_rope_head_dim)
            cap.tap("q_nope", qq[..., :p], layer)
            cap.tap("q_pe", qq[..., p:], layer)
            cap.tap("kv_latent", k_c_normed[:n], layer)
            cap.tap("k_pe", k_pe[:n].reshape(n, -1), layer)
            cap.tap("attn_heads", output[:n].reshape(n, -1), layer)
            if not str(self.kv_cache_dtype).startswith("fp8") and kv_cache is not None and kv_cache.numel():
                from vllm.forward_context import get_forward_context

                slots = get_forward_context().slot_mapping
                slots = slots.get(self.layer_name) if isinstance(slots, dict) else None
                if slots is not None:
                    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
                    cap.tap("cache_rows", flat[slots[:n].long()], layer)
            return out
        return f

    def forward_mqa(orig):
        def f(self, q, kv_cache, attn_metadata, layer, *a, **kw):
            out = orig(self, q, kv_cache, attn_metadata, layer, *a, **kw)
            lat = out[0] if isinstance(out, tuple) else out
            nd = int(attn_metadata.num_decode_tokens)
            heads = getattr(layer, "num_heads", lat.shape[1])
            cap.tap("attn_latent", lat[:nd, :heads], _layer_index(layer.layer_name), rows=range(nd))
            return out
        return f

    def prefill_context(orig):
        def f(self, *a, **kw):
            cap.context_chunks += 1
            if cap.sess is not None:
                cap.sess.engine["detail"] = f"MLA layer; prefill chunks with context (has_context): {cap.context_chunks}"
            return orig(self, *a, **kw)
        return f

    makers = {
        "GPUModelRunner.execute_model": execute_model,
        "DeepseekV2DecoderLayer.forward": decoder_forward,
        "MultiHeadLatentAttentionWrapper.forward": mla_wrapper_forward,
        "MLAAttention.forward_impl": forward_impl,
        "MLACommonBaseImpl._compute_prefill_context": prefill_context,
    }
    for module, qual, _ in TARGETS:
        if qual.endswith(".forward_mqa"):
            try:
                _wrap(module, qual, forward_mqa)
            except (ImportError, AttributeError, KeyError):
                pass  # a backend this build of vLLM lacks (CUDA-arch specific imports)
        elif qual in makers:
            _wrap(module, qual, makers[qual])


def close() -> None:
    """Write the capture (manifest last) and remove the wrappers."""
    with _lock:
        cap = _state.pop("cap", None)
        for cls, fn, orig in reversed(_state.pop("restore", [])):
            setattr(cls, fn, orig)
    if cap is not None and cap.sess is not None and not cap.sess.closed:
        cap.sess.close()


def plugin() -> None:
    """vLLM general plugin (entry point `vllm.general_plugins`: mla_diff_capture): every vLLM process,
    TP workers included, calls it at start; with MLA_DIFF_CAPTURE_DIR and MLA_DIFF_CAPTURE_MODEL set it
    installs the capture (one folder per rank), otherwise it does nothing."""
    d, m = os.environ.get("MLA_DIFF_CAPTURE_DIR"), os.environ.get("MLA_DIFF_CAPTURE_MODEL")
    if d and m:
        install(d, model_file=m, dtype=os.environ.get("MLA_DIFF_CAPTURE_DTYPE", "bf16"))
