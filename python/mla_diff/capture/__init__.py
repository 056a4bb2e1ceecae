"""Capture what an MLA serving engine computed, one line per tensor (docs/captures.md).

    from mla_diff import capture

    with capture.session("cap/", model_file="model.gguf", engine="my-engine", dtype="bf16"):
        rid = capture.request(tokens=prompt_ids, prefill=len(prompt_ids))
        capture.step("prefill", rows=[(rid, p) for p in range(len(prompt_ids))])
        ...                                        # inside the engine's layer L:
        capture.tap("x", hidden_states, layer=L)   # torch or numpy, bf16 included
        capture.tap("q_pe", q_pe, layer=L)

`tap` copies the tensor to host memory when it is called (after the op that produced it) and never
writes to it, so the engine computes exactly what it computes without the tap; with no session open it
does nothing, so taps can stay in an engine's code. Tensors of one layer and step are buffered and
written as `layer{L}/step{S}.safetensors` when the next step starts or the session closes; the manifest
is written last, so a folder with a manifest is complete.

bf16: numpy has no bfloat16, so host copies of bf16 tensors are `ml_dtypes.bfloat16` arrays (the bits
untouched: a torch bf16 tensor is copied as its 16-bit pattern and viewed as ml_dtypes' type), which
`safetensors.numpy` writes as BF16 by dtype name. The alternative, raw uint16 bits, would need
safetensors' private serialization structures (they changed in 0.8) or a hand-written header.

Storage types (format version 2): each tap records its tensor's own type (torch or numpy bf16, f16,
f32), and the manifest's `stage_dtypes` names every stage whose type is not the session's `dtype` (an
engine's f16 cache next to its f32 projections), so `mla-diff run --capture` bounds each stage by its
own precision. A stage tapped in several types is recorded in the coarsest; float8 (widened on the
copy) and f64 record nothing; `tap(..., dtype=)` and `session(stage_dtypes=)` say it explicitly.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .. import __version__, gguf_identity

FORMAT = "mla-diff-capture"
VERSION = 2

#: The stage names a step file may hold (docs/captures.md, "Stages in a step file").
STAGES = (
    "x",
    "attn_in",
    "q_nope",
    "q_pe",
    "kv_latent",
    "k_pe",
    "cache_rows",
    "kv_cache",
    "slot_mapping",
    "q_absorbed",
    "attn_latent",
    "lse",
    "attn_heads",
    "attn_out",
    "topk",
)
#: Stages whose values are indices, not activations.
INDEX_STAGES = ("slot_mapping", "topk")
#: Stages that are not per row of the step (no `.rows` companion, not merged by rows).
WHOLE_STAGES = ("kv_cache",)

DTYPES = ("bf16", "fp16", "f32")
#: Coarsest first: a stage tapped in several types is bounded by the coarsest.
_COARSE = ("bf16", "fp16", "f32")


def storage_dtype(tensor: Any) -> Optional[str]:
    """The storage type of `tensor` as the format names it (`bf16`, `fp16`, `f32`), or None for a type
    the format has no name for (f64, float8, integers)."""
    name = str(getattr(tensor, "dtype", ""))
    name = name.rsplit(".", 1)[-1]  # torch.bfloat16 -> bfloat16
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "f32"}.get(name)

__all__ = [
    "FORMAT",
    "VERSION",
    "STAGES",
    "Session",
    "session",
    "request",
    "step",
    "tap",
    "active",
    "to_host",
    "storage_dtype",
]


class CaptureError(ValueError):
    """A misuse of the capture API (unknown stage, a tap outside a step, a shape that cannot be)."""


def to_host(tensor: Any) -> np.ndarray:
    """A host copy of `tensor` (torch, numpy, or anything `np.array` takes) that shares no memory with
    it. torch bf16 and ml_dtypes bf16 keep their bits (as an `ml_dtypes.bfloat16` array); torch float8
    is widened to float32 (exact). The source is never written.
    """
    if _is_torch(tensor):
        import torch

        t = tensor.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            # .cpu() waits for the op that produced it; the int16 view moves the bits, not values.
            bits = t.to("cpu").contiguous().view(torch.int16).numpy()
            return np.array(bits, copy=True).view(ml_dtypes.bfloat16)
        if t.dtype in _torch_float8():
            t = t.to(torch.float32)
        return np.array(t.to("cpu").contiguous().numpy(), copy=True)
    return np.array(tensor, copy=True)


def _is_torch(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach")


def _torch_float8():
    import torch

    return tuple(
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    )


def _storable(a: np.ndarray, name: str) -> np.ndarray:
    """Check a host copy's dtype against what the format allows for `name`."""
    kind = a.dtype.kind
    if name in INDEX_STAGES:
        if kind not in "iu":
            raise CaptureError(f"tap {name!r}: indices must be integers, got {a.dtype}")
        return a.astype(np.int64) if a.dtype != np.int32 else a
    if a.dtype.name == "bfloat16" or a.dtype in (np.float16, np.float32, np.float64):
        return a
    if a.dtype.name.startswith("float8"):
        return a.astype(np.float32)
    raise CaptureError(f"tap {name!r}: values must be float (f64/f32/f16/bf16), got {a.dtype}")


class Session:
    """One capture folder being written. Use `session(...)`; the module-level `request`, `step` and
    `tap` act on the innermost open session of the process."""

    def __init__(
        self,
        directory,
        *,
        model_file=None,
        model: Optional[dict] = None,
        engine: str = "unknown",
        engine_version: Optional[str] = None,
        engine_detail: Optional[str] = None,
        dtype: str = "bf16",
        rope_order: str = "file",
        lse_base: str = "e",
        tp_rank: int = 0,
        tp_world_size: int = 1,
        heads: Optional[Sequence[int]] = None,
        names: Optional[dict] = None,
        stage_dtypes: Optional[dict] = None,
        overwrite: bool = False,
    ):
        if (model_file is None) == (model is None):
            raise CaptureError("session: give model_file= (the GGUF the engine runs) or model=")
        if dtype not in DTYPES:
            raise CaptureError(f"session: dtype must be one of {DTYPES}, got {dtype!r}")
        if rope_order not in ("file", "halves"):
            raise CaptureError(f"session: rope_order must be 'file' or 'halves', got {rope_order!r}")
        if lse_base not in ("e", "2"):
            raise CaptureError(f"session: lse_base must be 'e' or '2', got {lse_base!r}")
        if not (0 <= tp_rank < tp_world_size):
            raise CaptureError(f"session: tp rank {tp_rank} outside world size {tp_world_size}")
        if heads is not None:
            heads = [int(heads[0]), int(heads[1])]
            if not heads[0] < heads[1]:
                raise CaptureError(f"session: heads {heads} is not a range [A, B) with A < B")
        for k, v in (stage_dtypes or {}).items():
            if k not in STAGES or k in INDEX_STAGES:
                raise CaptureError(f"session: stage_dtypes[{k!r}]: not a stage with values")
            if v not in DTYPES:
                raise CaptureError(f"session: stage_dtypes[{k!r}] must be one of {DTYPES}, got {v!r}")
        for k, v in (names or {}).items():
            if v not in STAGES:
                raise CaptureError(f"session: names[{k!r}] = {v!r} is not a stage ({', '.join(STAGES)})")
        self.dir = os.fspath(directory)
        if os.path.exists(os.path.join(self.dir, "manifest.json")) and not overwrite:
            raise CaptureError(f"session: {self.dir} already holds a capture (overwrite=True replaces it)")
        os.makedirs(self.dir, exist_ok=True)
        self.model = dict(model) if model is not None else gguf_identity(model_file)
        self.engine = {"name": engine, "version": engine_version}
        if engine_detail is not None:
            self.engine["detail"] = engine_detail
        self.dtype = dtype
        self.conventions = {"rope_order": rope_order, "lse_base": lse_base}
        self.tp = {"rank": tp_rank, "world_size": tp_world_size, "heads": heads}
        self.names = dict(names or {})
        # Declared per-stage storage types (session(stage_dtypes=)) and those the taps observed.
        self.declared = dict(stage_dtypes or {})
        self.observed: dict = {}
        self.requests: dict = {}
        self.steps: list = []
        self.files: list = []
        # (layer, step) -> {name: [(rows or None, array), ...]}
        self._buf: dict = {}
        self._written: set = set()
        self._lock = threading.Lock()
        self.closed = False

    # -- requests and steps ------------------------------------------------------------------------

    def request(
        self,
        tokens: Iterable[int],
        *,
        positions: Optional[Iterable[int]] = None,
        prefill: Optional[int] = None,
        id: Optional[int] = None,
    ) -> int:
        """Register a sequence: its token ids, their positions (default 0, 1, …) and how many of its
        first tokens are the prompt (default: those that appear in `prefill` steps). Returns its id."""
        tokens = [int(t) for t in tokens]
        if positions is None:
            positions = list(range(len(tokens)))
        else:
            positions = [int(p) for p in positions]
        if len(positions) != len(tokens):
            raise CaptureError(f"request: {len(tokens)} tokens but {len(positions)} positions")
        with self._lock:
            rid = len(self.requests) if id is None else int(id)
            if rid in self.requests:
                raise CaptureError(f"request: id {rid} already used")
            self.requests[rid] = {"id": rid, "tokens": tokens, "positions": positions, "prefill": prefill}
        return rid

    def extend(self, rid: int, tokens: Iterable[int]) -> None:
        """Append generated tokens to request `rid` (positions continue from its last one)."""
        r = self._request(rid)
        for t in tokens:
            r["tokens"].append(int(t))
            r["positions"].append(r["positions"][-1] + 1 if r["positions"] else 0)

    def step(self, kind: str, rows: Iterable[Optional[Sequence[int]]], *, step: Optional[int] = None) -> int:
        """Start forward step `step` (default: the next integer): `kind` is prefill, decode or mixed;
        `rows` gives each row of the batch as `(request_id, position)`, or None for padding. Layers
        of the previous steps are written to disk now."""
        if kind not in ("prefill", "decode", "mixed"):
            raise CaptureError(f"step: kind must be prefill, decode or mixed, got {kind!r}")
        norm = []
        for r in rows:
            if r is None:
                norm.append(None)
                continue
            rid, pos = int(r[0]), int(r[1])
            self._request(rid)
            norm.append([rid, pos])
        with self._lock:
            s = (self.steps[-1]["step"] + 1 if self.steps else 0) if step is None else int(step)
            if any(x["step"] == s for x in self.steps):
                raise CaptureError(f"step: step {s} already started")
            self.steps.append({"step": s, "kind": kind, "rows": norm})
        self._flush(keep=s)
        return s

    def _request(self, rid: int) -> dict:
        r = self.requests.get(int(rid))
        if r is None:
            raise CaptureError(f"unknown request id {rid} (capture.request registers one)")
        return r

    # -- taps --------------------------------------------------------------------------------------

    def tap(self, name: str, tensor: Any, *, layer: int, step: Optional[int] = None, rows=None,
            dtype: Optional[str] = None) -> None:
        """Copy `tensor` to host as stage `name` of `layer` in `step` (default: the current step).
        `rows`: which rows of the step it holds (default all); taps of one stage with disjoint rows
        are merged. `dtype`: the type the engine stored the stage in, where the tensor handed over is
        not in it; by default the tensor's own (`storage_dtype`)."""
        if dtype is not None and dtype not in DTYPES:
            raise CaptureError(f"tap {name!r}: dtype must be one of {DTYPES}, got {dtype!r}")
        if name not in STAGES:
            raise CaptureError(f"tap: unknown stage {name!r} (stages: {', '.join(STAGES)})")
        if not self.steps:
            raise CaptureError("tap: no step started (capture.step(kind, rows) first)")
        s = self.steps[-1]["step"] if step is None else int(step)
        st = next((x for x in self.steps if x["step"] == s), None)
        if st is None:
            raise CaptureError(f"tap: step {s} was never started")
        key = (int(layer), s)
        if key in self._written:
            raise CaptureError(f"tap: layer {layer} step {s} was already written (a later step started)")
        stored = None if name in INDEX_STAGES else (dtype or storage_dtype(tensor))
        a = _storable(to_host(tensor), name)
        n = len(st["rows"])
        if rows is not None:
            if name in WHOLE_STAGES:
                raise CaptureError(f"tap {name!r}: not per row, rows= does not apply")
            rows = np.asarray(list(rows), dtype=np.int64).reshape(-1)
            if a.ndim == 0 or a.shape[0] != len(rows):
                raise CaptureError(f"tap {name!r}: {len(rows)} rows given but the tensor's first axis is {a.shape[:1]}")
            if rows.size and (rows.min() < 0 or rows.max() >= n):
                raise CaptureError(f"tap {name!r}: rows outside the step's {n} rows")
        elif name not in WHOLE_STAGES and (a.ndim == 0 or a.shape[0] != n):
            raise CaptureError(f"tap {name!r} layer {layer} step {s}: first axis {a.shape[:1]} but the step has {n} rows")
        with self._lock:
            parts = self._buf.setdefault(key, {}).setdefault(name, [])
            if parts and (rows is None or parts[0][0] is None):
                raise CaptureError(f"tap {name!r}: layer {layer} step {s} already has it")
            parts.append((rows, a))
            if stored is not None:
                was = self.observed.get(name, stored)
                self.observed[name] = min(was, stored, key=_COARSE.index)

    # -- writing -----------------------------------------------------------------------------------

    def _flush(self, keep: Optional[int] = None) -> None:
        from safetensors.numpy import save_file

        with self._lock:
            keys = sorted(k for k in self._buf if keep is None or k[1] != keep)
            pending = [(k, self._buf.pop(k)) for k in keys]
            self._written.update(keys)
        for (layer, s), stages in pending:
            tensors = {}
            for name, parts in stages.items():
                if parts[0][0] is None:
                    tensors[name] = np.ascontiguousarray(parts[0][1])
                    continue
                rows = np.concatenate([r for r, _ in parts])
                if len(np.unique(rows)) != len(rows):
                    raise CaptureError(f"tap {name!r}: layer {layer} step {s} has a row twice")
                tensors[name] = np.ascontiguousarray(np.concatenate([a for _, a in parts]))
                tensors[name + ".rows"] = rows
            rel = f"layer{layer}/step{s}.safetensors"
            os.makedirs(os.path.join(self.dir, f"layer{layer}"), exist_ok=True)
            save_file(tensors, os.path.join(self.dir, rel))
            self.files.append({"layer": layer, "step": s, "file": rel, "stages": sorted(stages, key=STAGES.index)})

    def stage_dtypes(self) -> dict:
        """The stages whose storage type is not the session's dtype: declared, else as tapped."""
        both = dict(self.observed, **self.declared)
        return {k: both[k] for k in sorted(both, key=STAGES.index) if both[k] != self.dtype}

    def manifest(self) -> dict:
        requests = []
        for rid in sorted(self.requests):
            r = dict(self.requests[rid])
            if r["prefill"] is None:
                seen = {
                    row[1]
                    for st in self.steps
                    if st["kind"] == "prefill"
                    for row in st["rows"]
                    if row is not None and row[0] == rid
                }
                r["prefill"] = len(seen)
            requests.append(r)
        stage_dtypes = self.stage_dtypes()
        return {
            "format": FORMAT,
            "version": VERSION,
            "writer": {"name": "mla_diff.capture", "version": __version__},
            "engine": self.engine,
            "model": self.model,
            "dtype": self.dtype,
            **({"stage_dtypes": stage_dtypes} if stage_dtypes else {}),
            "conventions": self.conventions,
            "tp": self.tp,
            "requests": requests,
            "steps": self.steps,
            "layers": sorted(self.files, key=lambda f: (f["layer"], f["step"])),
            "names": self.names,
        }

    def close(self) -> None:
        """Write the remaining step files, then `manifest.json` (atomically: a folder with a manifest is
        a complete capture)."""
        if self.closed:
            return
        self._flush()
        path = os.path.join(self.dir, "manifest.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.manifest(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        self.closed = True
        _pop(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            # An engine error mid-capture: no manifest, so the folder is not mistaken for a capture.
            _pop(self)


_stack: list = []
_stack_lock = threading.Lock()


def _pop(s: Session) -> None:
    with _stack_lock:
        if s in _stack:
            _stack.remove(s)


def session(directory, **kwargs) -> Session:
    """Open a capture folder (see `Session`); a context manager, and the target of `tap` until it
    closes."""
    s = Session(directory, **kwargs)
    with _stack_lock:
        _stack.append(s)
    return s


def active() -> Optional[Session]:
    """The innermost open session, or None."""
    with _stack_lock:
        return _stack[-1] if _stack else None


def request(tokens, **kwargs) -> int:
    s = active()
    if s is None:
        raise CaptureError("request: no capture session open")
    return s.request(tokens, **kwargs)


def step(kind: str, rows, **kwargs) -> Optional[int]:
    s = active()
    return None if s is None else s.step(kind, rows, **kwargs)


def tap(name: str, tensor: Any, *, layer: int, step: Optional[int] = None, rows=None,
        dtype: Optional[str] = None) -> None:
    """Capture `tensor` as stage `name` of `layer` (see `Session.tap`); nothing when no session is open."""
    s = active()
    if s is not None:
        s.tap(name, tensor, layer=layer, step=step, rows=rows, dtype=dtype)
