"""mla_diff.cases / check / assert_mla_close: mla-diff in a kernel author's test suite (docs/pytest.md).

Every case and every verdict comes from the `mla-diff` program itself, run in this process through the
native module (`mla_diff._native`, crates/mla-diff-py): `cases()` runs `mla-diff run MODEL --runner
inproc:…` with a recorder in the runner's place and keeps each request (the tensors and meta a runner is
given); `check()` runs the same command again with the kernel's outputs as the runner's answer and
reads the verdict off the report. So a check here is `run --runner` — same schedule, same error model
(docs/runners.md: end to end and `STAGE@runner`), same verdict — without a subprocess or tensor files.
The one file is the run's JSON report, in a temporary folder removed at once (`keep=` keeps it).

Only the top-5 listing of an assertion message is computed here (numpy, fp64, from the case's own
inputs): it says where the output is worst, the verdict does not depend on it.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass, field

from mla_diff.runner import _ST_TO_NP, _np, bf16_bits_to_f32, to_bf16_bits

# Outputs an op must (first two) or may return, as runs/runners.md lists them.
OUTPUTS = {
    "decode": ("attn_latent", "lse", "split_out", "split_lse"),
    "prefill": ("attn_heads", "lse"),
}
# The run is shadow mode: one request per layer and op (free mode would send a second, drifted one).
_MODE = "shadow"
# Every verdict `check` gave in this process (the pytest plugin's end-of-session summary).
RESULTS = []
_SCHEDULE_FLAGS = ("prompt_len", "decode_steps", "q_len", "chunk", "page_size", "num_splits")


def _native():
    try:
        from mla_diff import _native
    except ImportError as e:  # a plain checkout without the built extension
        raise ImportError(
            "mla_diff's native module is not built: pip install the mla-diff wheel "
            "(docs/pytest.md), or `maturin develop -m crates/mla-diff-py/Cargo.toml`"
        ) from e
    return _native


# ------------------------------------------------------------------------------------------------
# tensors: the protocol's (dtype, shape, bytes) triples <-> numpy / torch


def _to_array(dt, shape, raw, device):
    """One input as a torch tensor on `device` (torch installed and device given) or numpy (BF16
    widened to float32 exactly)."""
    np = _np()
    if device is not None:
        import torch

        tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
               "I32": torch.int32, "I64": torch.int64}[dt]
        t = torch.frombuffer(bytearray(raw), dtype=tdt).reshape(shape)
        return t.to(device)
    if dt == "BF16":
        return bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2")).reshape(shape)
    return np.frombuffer(raw, dtype=_ST_TO_NP[dt]).reshape(shape).copy()


def _from_tensor(name, t, dtype_hint=None):
    """An output (torch on any device — copied to host here —, numpy, or anything np.asarray takes) as
    (safetensors dtype, shape, bytes). Floats keep their own dtype; a numpy float32 output is stored as
    bf16 with `dtype_hint='bf16'` (rounded to nearest even, as the numpy runner stores it)."""
    np = _np()
    if hasattr(t, "detach") and hasattr(t, "dtype") and "torch" in type(t).__module__:
        import torch

        t = t.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            return "BF16", list(t.shape), t.view(torch.int16).numpy().tobytes()
        t = t.numpy()
    a = np.ascontiguousarray(np.asarray(t))
    if a.dtype.name == "bfloat16":  # ml_dtypes
        return "BF16", list(a.shape), a.view(np.uint16).astype("<u2").tobytes()
    if dtype_hint == "bf16" and a.dtype == np.float32:
        return "BF16", list(a.shape), to_bf16_bits(a).astype("<u2").tobytes()
    if dtype_hint in ("fp16", "f16") and a.dtype == np.float32:
        a = a.astype(np.float16)
    st = {"float16": "F16", "float32": "F32", "float64": "F64"}.get(a.dtype.name)
    if st is None:
        raise TypeError(f"output {name}: dtype {a.dtype} (outputs are bf16, fp16, f32 or f64)")
    return st, list(a.shape), a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


# ------------------------------------------------------------------------------------------------
# cases


@dataclass
class Case:
    """One request a runner would get: `op` ("decode" or "prefill") of `layer`, its tensors (`inputs`:
    q_nope, q_pe, kv_cache, block_table, cache_seqlens for decode; q, k, v for prefill) and `meta`
    (softmax_scale, page_size, num_splits, q_len, dtype, …, docs/runners.md), with the error model the
    run applies to it (`bounds`: each check's rel-L2 bound) and what reproduces it (`argv`)."""

    model: str
    layer: int
    op: str
    dtype: str
    seed: int
    schedule: dict
    meta: dict
    inputs: dict
    bounds: dict
    argv: list
    raw: dict = field(repr=False, default_factory=dict)
    arch: str = ""
    device: object = None

    @property
    def id(self) -> str:
        """`glm5-L3-decode-q2-splits4-page64` (pytest's id for it)."""
        m = self.meta
        name = _model_name(self.model)
        if self.op == "decode":
            rest = f"q{m.get('q_len', 1)}-splits{m.get('num_splits', 1)}-page{m.get('page_size')}"
        else:
            rest = f"n{m.get('n', self.inputs_shape('q')[0])}-ctx{m.get('context_len', 0)}"
        return f"{name}-L{self.layer}-{self.op}-{rest}-{self.dtype}"

    def inputs_shape(self, name):
        return self.raw[name][1]

    def reproduce(self) -> str:
        """The command that runs this case's layer and schedule through `run --runner` (a runner of
        yours in place of RUNNER)."""
        return " ".join(shlex.quote(a) for a in ["mla-diff"] + self.argv + ["--runner", "RUNNER"])

    def reference(self):
        """fp64 attention from exactly these inputs (numpy): decode -> (attn_latent [B,s_q,H,Lkv], lse
        [B,s_q,H]); prefill -> (attn_heads [n,H,Dv], lse [n,H]). What `STAGE@runner` compares with."""
        np = _np()
        x = {k: _to_array(*v, None).astype(np.float64) if v[0] not in ("I32", "I64") else _to_array(*v, None)
             for k, v in self.raw.items()}
        scale = float(self.meta["softmax_scale"])
        if self.op == "decode":
            return _decode_ref(x, scale, int(self.meta.get("page_size") or x["kv_cache"].shape[1]))
        return _prefill_ref(x, scale)

    def tensors(self, device=None):
        """The inputs again, as torch tensors on `device` or numpy (device None)."""
        return {k: _to_array(*v, device) for k, v in self.raw.items()}


def _model_name(path):
    """`glm-5-q4_0.gguf` -> `glm5`: the file's base name without its weight type, dashes dropped."""
    import re

    words = os.path.basename(path).rsplit(".gguf", 1)[0].lower().split("-")
    while len(words) > 1 and re.fullmatch(r"(i?q\d.*|t?q\d.*|bf16|f16|f32|fp8|mxfp4|nvfp4|\d+-of-\d+)", words[-1]):
        words.pop()
    return "".join(re.sub(r"[^a-z0-9.]", "", w) for w in words) or "model"


def _softmax(s):
    np = _np()
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(z > 0, e / z, 0.0), (m + np.log(z))[..., 0]


def _decode_rows(x, b, page):
    np = _np()
    cache = x["kv_cache"]
    flat = cache.reshape(-1, cache.shape[-1])
    L = int(x["cache_seqlens"][b])
    t = np.arange(L)
    return flat[x["block_table"][b][t // page].astype(np.int64) * page + t % page]


def _decode_ref(x, scale, page):
    np = _np()
    qn, qp = x["q_nope"], x["q_pe"]
    B, S, H, R = qn.shape
    q = np.concatenate([qn, qp], -1)
    out = np.zeros((B, S, H, R))
    lse = np.full((B, S, H), -np.inf)
    for b in range(B):
        rows = _decode_rows(x, b, page)
        L = rows.shape[0]
        s = np.einsum("shd,kd->shk", q[b], rows) * scale
        vis = np.arange(L)[None, :] < (L - S + np.arange(S) + 1)[:, None]
        s = np.where(vis[:, None, :], s, -np.inf)
        p, l = _softmax(s)
        out[b] = p @ rows[:, :R]
        lse[b] = l
    return out, lse


def _prefill_ref(x, scale):
    np = _np()
    q, k, v = x["q"], x["k"], x["v"]
    n, S = q.shape[0], k.shape[0]
    ctx = S - n
    s = np.einsum("nhd,shd->hns", q, k) * scale
    vis = np.arange(S)[None, :] < (ctx + np.arange(n) + 1)[:, None]
    s = np.where(vis[None], s, -np.inf)
    p, l = _softmax(s)
    return np.einsum("hns,shd->nhd", p, v), l.T


class _Recorder:
    """The runner `cases()` puts in the run: it records each request and answers zeros (the run's own
    verdict is not used; its report gives the bounds)."""

    def __init__(self, ops):
        self.ops = ops
        self.requests = []

    def describe_json(self):
        return json.dumps({
            "protocol": 1, "name": "mla_diff.cases", "version": "recorder",
            "ops": {op: {"outputs": list(OUTPUTS[op])} for op in self.ops},
        })

    def call(self, op, layer, meta_json, inputs):
        meta = json.loads(meta_json)
        self.requests.append((op, layer, meta, dict(inputs)))
        np = _np()
        if op == "decode":
            B, S, H, R = inputs["q_nope"][1]
            n = int(meta.get("num_splits") or 1)
            shapes = {"attn_latent": [B, S, H, R], "lse": [B, S, H], "split_out": [B, S, H, n, R],
                      "split_lse": [B, S, H, n]}
        else:
            n, H, _ = inputs["q"][1]
            shapes = {"attn_heads": [n, H, inputs["v"][1][-1]], "lse": [n, H]}
        return {k: ("F32", s, np.zeros(s, np.float32).tobytes()) for k, s in shapes.items()}


def _argv(model, layers, schedule, dtype, seed, backend):
    spec = "all" if layers is None else ",".join(str(l) for l in layers)
    a = ["run", os.fspath(model), "--layers", spec, "--dtype", dtype,
         "--seed", str(seed), "--mode", _MODE, "--backend", backend, "--quiet"]
    for k, v in (schedule or {}).items():
        if k not in _SCHEDULE_FLAGS and k != "no_shuffle":
            raise ValueError(f"schedule key {k!r}: one of {', '.join(_SCHEDULE_FLAGS)}, no_shuffle")
        if k == "no_shuffle":
            if v:
                a.append("--no-shuffle")
            continue
        a += ["--" + k.replace("_", "-"), str(int(v))]
    return a


def _run(argv, runner, keep=None):
    """`mla-diff ARGV --runner inproc:… --json REPORT` in this process -> (exit code, report dict or None,
    error line)."""
    nat = _native()
    folder = keep or tempfile.mkdtemp(prefix="mla-diff-")
    path = os.path.join(folder, "report.json")
    try:
        code, err = nat.run_inproc(["mla-diff"] + list(argv) + ["--json", path, "--runner", "inproc:py"], "py", runner)
        report = None
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
        return code, report, err
    finally:
        if keep is None:
            try:
                os.remove(path)
            except OSError:
                pass
            os.rmdir(folder)


def _layer_checks(report, layer):
    for m in report.get("modes", []):
        for l in m.get("layers", []):
            if l.get("layer") == layer:
                return l
    return None


def cases(model_file, layers=None, schedule=None, dtype="bf16", seed=0, ops=("decode", "prefill"),
          device=None, backend="cpu"):
    """Yield the decode and prefill cases of `model_file`'s `layers` (all by default) on `schedule` (a
    dict of `run`'s schedule options — prompt_len, decode_steps, q_len, chunk, page_size, num_splits,
    no_shuffle —, or a list of such dicts; None: the schedule `run --runner` uses), built from the
    model's real weights by `mla-diff run` itself. Tensors are torch on `device` (e.g. "cuda", "cpu") when
    given, numpy otherwise."""
    model_file = os.fspath(model_file)
    scheds = schedule if isinstance(schedule, (list, tuple)) else [schedule]
    if layers is not None:
        layers = [int(l) for l in ([layers] if isinstance(layers, int) else layers)]
    for sched in scheds:
        # One run per layer: a case must be what `run --layers L` sends (a layer's shadow input depends on
        # the layers run before it), so that check() reruns exactly it.
        todo, n_layer, i = list(layers) if layers is not None else [0], None, 0
        while i < len(todo):
            layer = todo[i]
            i += 1
            argv = _argv(model_file, [layer], sched, dtype, seed, backend)
            rec = _Recorder(ops)
            code, report, err = _run(argv, rec)
            if report is None:
                raise RuntimeError(f"mla-diff {' '.join(argv)}: {err or f'exit {code}, no report'}")
            if layers is None and n_layer is None:
                n_layer = int(report["config"]["n_layer"])
                todo += range(1, n_layer)
            lc = _layer_checks(report, layer) or {}
            seen = set()
            for op, _layer, meta, raw in rec.requests:
                # The op's first request is the case; the rest are its serving batch (check's kernel=).
                if op in seen:
                    continue
                seen.add(op)
                bounds = {c["check"]: c.get("tolerance", {}).get("rel_l2") for c in lc.get("checks", [])
                          if c.get("check", "").split("@")[0].split("[")[0] in OUTPUTS[op]}
                yield Case(model=model_file, layer=layer, op=op, dtype=dtype, seed=seed,
                           schedule=dict(sched or {}), meta=meta,
                           inputs={k: _to_array(*v, device) for k, v in raw.items()}, bounds=bounds,
                           argv=argv, raw=raw, arch=report.get("file", {}).get("architecture", ""),
                           device=device)


# ------------------------------------------------------------------------------------------------
# check


class _Answer:
    """The runner `check()` puts in the run: the kernel's outputs for the case's request; the run's other
    requests of that op (the serving batch, padded rows, the batch-invariance rerun: docs/runners.md,
    "Reaching the cases where MLA kernels break") go to `kernel` on their own inputs."""

    def __init__(self, case, outputs, lse_layout, kernel, out_dtype):
        self.case, self.outputs, self.lse_layout = case, outputs, lse_layout
        self.kernel, self.out_dtype, self.first = kernel, out_dtype, True

    def describe_json(self):
        return json.dumps({
            "protocol": 1, "name": "kernel", "version": "mla_diff.check",
            "ops": {self.case.op: {"outputs": sorted(self.outputs)}},
            "conventions": {"lse_base": "e", "lse_layout": self.lse_layout},
        })

    def call(self, op, layer, meta_json, inputs):
        c = self.case
        if (op, layer) != (c.op, c.layer):
            raise RuntimeError(f"check: the run asked for layer {layer} {op}, the case is layer {c.layer} {c.op}")
        if self.first:
            self.first = False
            for k, v in inputs.items():
                if k not in c.raw or bytes(v[2]) != bytes(c.raw[k][2]):
                    raise RuntimeError(f"check: the run's {op} input {k} differs from the case's (not the same run?)")
            return self.outputs
        if self.kernel is None:
            raise RuntimeError(
                f"check: the run also sends this layer's {op} as a serving batch (mixed lengths, padded rows; "
                "the runner checks of docs/runners.md): pass kernel=fn to check()/assert_mla_close() so it can answer")
        meta = json.loads(meta_json)
        got = self.kernel({k: _to_array(*v, c.device) for k, v in inputs.items()}, meta)
        return _outputs(c, got, self.out_dtype, set(self.outputs))


def _outputs(case, got, out_dtype, names=None):
    """A kernel's answer — (out, lse), (out, lse, split_out, split_lse) or a dict — as protocol triples."""
    main = OUTPUTS[case.op][0]
    if isinstance(got, dict):
        given = dict(got)
    else:
        given = dict(zip((main, "lse", "split_out", "split_lse"), got))
    if names is not None:
        given = {k: v for k, v in given.items() if k in names}
    return {k: _from_tensor(k, v, out_dtype if k == main else None) for k, v in given.items()}


@dataclass
class Verdict:
    """What `run --runner` says of one case: `passed`, the first failing check (`first_check`), the
    run's one-line `message`, each check of the layer (`checks`: name, pass, rel_l2, bound, local)."""

    case: Case
    passed: bool
    exit_code: int
    message: str
    first_check: str | None
    checks: list
    outputs: dict = field(repr=False, default_factory=dict)

    def __bool__(self):
        return self.passed

    def failing(self):
        return [c for c in self.checks if not c["pass"]]

    def explain(self, top=5) -> str:
        """An `assert_close`-style account: the stage, rel-L2 vs bound, the worst elements with where
        they sit, and how to reproduce."""
        c = self.case
        lines = [f"MLA {c.op} output is not close: {c.id} (layer {c.layer}, {c.dtype}, seed {c.seed})"]
        lines.append(f"mla-diff: {self.message}")
        at_kernel = [ch["check"] for ch in self.failing() if "@runner" in ch["check"]]
        lines.append(f"Attribution: the kernel ({', '.join(at_kernel)} off fp64 from its own inputs)" if at_kernel
                     else "Attribution: upstream of the kernel (its @runner checks pass)")
        for ch in self.failing():
            where = ("the kernel's own error: fp64 from the tensors it was given" if "@runner" in ch["check"]
                     else "end to end: fp64 from the layer input")
            rel, tol = ch.get("rel_l2"), ch.get("bound")
            lines.append(f"  stage {ch['check']}: rel-L2 {_g(rel)} vs bound {_g(tol)} ({where})"
                         + ("" if not ch.get("reasons") else f"; {'; '.join(ch['reasons'])}"))
        lines += self._worst(top)
        sched = ", ".join(f"{k}={v}" for k, v in sorted(c.schedule.items())) or "run --runner's default"
        lines.append(f"Schedule: {sched}; meta: q_len {c.meta.get('q_len')}, num_splits {c.meta.get('num_splits')}, "
                     f"page_size {c.meta.get('page_size')}, softmax_scale {c.meta.get('softmax_scale')}")
        lines.append(f"Reproduce: {c.reproduce()}")
        return "\n".join(lines)

    def _worst(self, top):
        np = _np()
        c = self.case
        name = "attn_latent" if c.op == "decode" else "attn_heads"
        if name not in self.outputs:
            return []
        dt, shape, raw = self.outputs[name]
        got = _to_array(dt, shape, raw, None).astype(np.float64)
        ref = c.reference()[0]
        d = np.abs(got - ref)
        d = np.where(np.isnan(d), np.inf, d)
        idx = np.argsort(d.ravel())[::-1][:top]
        out = [f"Worst {len(idx)} elements (|out - fp64 from the case's inputs|):"]
        for flat in idx:
            pos = np.unravel_index(flat, d.shape)
            out.append("  " + _where(c, pos) + f": out {got[pos]:.6g}, ref {ref[pos]:.6g}, |d| {d[pos]:.3g}")
        return out


def _g(v):
    return "n/a" if v is None else f"{v:.3e}"


def _where(c, pos):
    """(token, head, key range/split, page) of an output element."""
    if c.op == "decode":
        b, i, h, col = (int(p) for p in pos)
        S = c.raw["q_nope"][1][1]
        seqlens = _to_array(*c.raw["cache_seqlens"], None)
        table = _to_array(*c.raw["block_table"], None)
        page = int(c.meta.get("page_size") or c.raw["kv_cache"][1][1])
        L = int(seqlens[b])
        vis = L - S + i + 1
        n = int(c.meta.get("num_splits") or 1)
        per = -(-L // n) if L else 0
        splits = [k for k in range(n) if k * per < vis]
        pages = sorted({int(table[b][t // page]) for t in (0, vis - 1)}) if vis else []
        return (f"token (entry {b}, query {i}), head {h}, col {col}: keys 0..{vis} "
                f"(splits {splits[0]}..{splits[-1]} of {n}, {per} keys each), pages {pages[0]}..{pages[-1]} "
                f"(physical, first and last)" if vis else f"token (entry {b}, query {i}), head {h}: no key")
    t, h, col = (int(p) for p in pos)
    n = c.raw["q"][1][0]
    S = c.raw["k"][1][0]
    return f"token {t} of the chunk, head {h}, col {col}: keys 0..{S - n + t + 1}"


def check(case, out=None, lse=None, split_out=None, split_lse=None, lse_layout="token_head", keep=None,
          out_dtype=None, kernel=None):
    """Run `case` through `mla-diff run --runner` with these outputs as the kernel's answer; returns the
    `Verdict` (truthy when it passes). `out` is attn_latent [B, s_q, H, Lkv] (decode) or attn_heads
    [n, H, Dv] (prefill); `lse` natural log, [B, s_q, H] / [n, H] (`lse_layout="head_token"`: [B, H,
    s_q] / [H, n]); split partials optional (decode). torch tensors on any device or numpy.
    `kernel=fn(inputs, meta) -> (out, lse[, split_out, split_lse])` answers the run's further requests
    of the layer (its serving batch: mixed lengths, padded rows), and the case itself when `out` is None.
    `out_dtype="bf16"` stores a numpy float32 `out` as bf16 (numpy has no bf16; torch tensors and
    ml_dtypes arrays carry their own dtype). `keep=DIR` keeps the run's JSON report there."""
    if out is None and kernel is not None:
        got = kernel(case.inputs, case.meta)
        outputs = _outputs(case, got, out_dtype)
    elif out is None or lse is None:
        raise TypeError("check(case, out=..., lse=...) or check(case, kernel=fn): the outputs are needed")
    else:
        names = OUTPUTS[case.op]
        given = {names[0]: out, "lse": lse}
        if split_out is not None or split_lse is not None:
            if case.op != "decode" or split_out is None or split_lse is None:
                raise TypeError("split_out and split_lse go together, with a decode case")
            given.update(split_out=split_out, split_lse=split_lse)
        outputs = _outputs(case, given, out_dtype)
    code, report, err = _run(case.argv, _Answer(case, outputs, lse_layout, kernel, out_dtype), keep)
    if report is None:
        raise RuntimeError(f"mla-diff {' '.join(case.argv)}: {err or f'exit {code}, no report'}")
    lc = _layer_checks(report, case.layer) or {"checks": []}
    checks = []
    for ch in lc.get("checks", []):
        m = ch.get("metrics") or {}
        loc = ch.get("local") or {}
        checks.append({"check": ch["check"], "pass": bool(ch.get("pass")), "rel_l2": m.get("rel_l2"),
                       "bound": (ch.get("tolerance") or {}).get("rel_l2"), "local": loc or None,
                       "reasons": ch.get("reasons") or []})
    v = report.get("verdict", {})
    verdict = Verdict(case=case, passed=bool(v.get("pass")) and code == 0, exit_code=code,
                   message=v.get("message") or err, first_check=v.get("first_check"), checks=checks,
                   outputs=outputs)
    RESULTS.append(verdict)
    return verdict


def assert_mla_close(case, out=None, lse=None, **kw):
    """`check`, raising AssertionError with `Verdict.explain()` when the run does not pass."""
    v = check(case, out=out, lse=lse, **kw)
    if not v.passed:
        raise AssertionError(v.explain())
    return v
