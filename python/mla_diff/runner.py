"""mla_diff.runner: the runner SDK — turn Python functions into a runner of mla-diff's subprocess
protocol, version 1 (docs/runners.md, docs/pytest.md).

    from mla_diff import runner

    def decode(x, meta):            # x: the request's tensors (numpy, or torch with codec="torch")
        ...
        return {"attn_latent": out, "lse": lse}

    if __name__ == "__main__":
        runner.serve(decode=decode, describe={"name": "mine", "version": "1",
                                              "ops": {"decode": {"outputs": ["attn_latent", "lse"]}}})

`serve` answers `--describe` and `--serve` (and exits); the shipped runners (runners/*.py) are written
on it. A runner may still be a class with `describe()`, optional `environment_problem()` and one
method per op: `main(RunnerClass)` serves it through `serve`.

Conventions:
- `RUNNER --describe` prints the describe JSON on stdout and exits 0; exits 3 (unsupported, reason as
  the last stderr line) when `environment` (a function) names a problem (a missing package, no GPU).
- `RUNNER --serve` answers JSON-line requests on stdin until it closes. Before anything else it
  moves the process's stdout (file descriptor 1) onto stderr, so prints from Python, torch, Triton
  or C libraries cannot corrupt the replies; replies go to a private duplicate of the original
  stdout. A request whose op the runner does not implement, or that an op refuses by raising
  `Unsupported`, gets status "unsupported"; any other exception gets status "error" with the
  exception's text (the traceback goes to stderr).
- Tensors travel in safetensors files. Two codecs:
  * numpy (`read_numpy` / `write_numpy`): the file format read and written directly (8-byte
    little-endian header length, JSON header, raw little-endian data), because safetensors'
    numpy loader has no bfloat16. BF16 is widened to float32 exactly (the 16 bits shifted into
    the top half); float32 is rounded to BF16 with round-to-nearest-even on write (`to_bf16_bits`).
    Arrays of dtype `BF16` (a numpy-side marker class) are written as BF16.
  * torch (`read_torch` / `write_torch`): safetensors.torch.
  Both write `__metadata__ {"mla_diff_protocol": "1"}`.
- Inputs stay observable: the numpy codec maps each input file read-write (its tensors, but for the
  widened BF16 ones, are views of the file), and after every op the serve loop stores the inputs back
  (`write_back`: the BF16 ones re-narrowed, torch tensors copied back from their device), so a kernel
  that writes into q or the cache changes the file, and mla-diff, which compares the file with what it
  sent, reports the tensor (docs/runners.md, "Input mutation").

Needs: Python 3.8+, numpy (the numpy codec), safetensors + torch (the torch codec only). Pure
Python: it runs from a plain checkout (runners/protocol.py puts python/ on sys.path) as well as from
the installed wheel.
"""

import json
import os
import struct
import sys
import traceback

PROTOCOL = 1
METADATA = {"mla_diff_protocol": "1"}


class Unsupported(Exception):
    """Raised by an op for a case it cannot take (a page size, a dtype, a head dim)."""


# ----------------------------------------------------------------------------------------------
# numpy codec


def _np():
    import numpy as np

    return np


_ST_TO_NP = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}
_NP_TO_ST = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class BF16:
    """A float32 array to be stored as bfloat16 (rounded to nearest even) by `write_numpy`."""

    def __init__(self, array):
        self.array = array


def bf16_bits_to_f32(bits):
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    np = _np()
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_bf16_bits(x):
    """float32 -> uint16 bfloat16 bit patterns, round to nearest even; NaN stays NaN."""
    np = _np()
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0) | ((u[nan] >> 16).astype(np.uint16) & np.uint16(0x8000))
    return rounded


# ----------------------------------------------------------------------------------------------
# quantized caches (`run --kv-cache-dtype`; docs/cache-formats.md for the byte layouts)

#: The cache formats `dequantize_cache` reads: every format `run --kv-cache-dtype` writes (a runner
#: lists those it takes in `supports.cache_formats`; the decode request then carries `kv_cache` as u8
#: bytes and `meta.cache`: `format`, `bytes_per_token`, and for `fp8` the layer's `scale`).
CACHE_FORMATS = ("fp8", "fp8_ds_mla", "fp8_ds_mla_nope", "fp8_v41", "fp4_v41")


def e4m3_to_f32(codes):
    """uint8 float8 e4m3fn codes -> float32 values (exact; 0x7f and 0xff are NaN)."""
    np = _np()
    b = np.asarray(codes, dtype=np.uint8)
    e = ((b >> 3) & 0xF).astype(np.float64)
    m = (b & 0x7).astype(np.float64)
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    v = np.where((b & 0x7F) == 0x7F, np.nan, v)
    return np.where(b & 0x80, -v, v).astype(np.float32)


def e4m3_round(y):
    """Nearest float8 e4m3fn value of each `y` (float64; ties to even, saturating at ±448; NaN stays
    NaN). 3 mantissa bits: the spacing in the binade [2^e, 2^(e+1)) is 2^(e-3), 2^-9 below 2^-6."""
    np = _np()
    y = np.asarray(y, np.float64)
    a = np.minimum(np.abs(y), 448.0)
    _, e = np.frexp(a)  # a = m·2^e, m in [0.5, 1)
    step = np.ldexp(1.0, np.maximum(e - 4, -9))
    return np.copysign(np.rint(a / step) * step, y)


def q_fp8_scale(q):
    """The scale of q on the e4m3 grid (describe's `conventions.q_fp8`; mla-diff sends it as
    `meta.q_scale`): 2^ceil(log2 max(amax / 448, 1e-4)) over the request's q (`q_nope` and `q_pe`
    together), amax / 448 in float32, as the `fp8` cache's scale but rounded up to a power of two, so
    that e4m3 values times it are exact in bf16 and fp16."""
    np = _np()
    amax = np.float32(max((float(np.nanmax(np.abs(np.asarray(t, np.float32)))) for t in q if np.size(t)), default=0.0))
    s = max(amax / np.float32(448.0), np.float32(1e-4))
    m, e = np.frexp(np.float32(s))
    return float(np.ldexp(1.0, int(e) - 1 if m == 0.5 else int(e)))


def quantize_q_fp8(q, scale):
    """`q` on the e4m3 grid of `scale`: e4m3(q / scale)·scale in float32, the values a kernel reading q
    as e4m3 codes with `descale_q = scale` computes with. Exact (the identity) on the q mla-diff sends
    with `meta.q_scale`."""
    np = _np()
    q = np.asarray(q, np.float32)
    return (e4m3_round(q / np.float32(scale)) * scale).astype(np.float32)


def e2m1_to_f32(codes):
    """4-bit e2m1 (fp4) codes (0..15, sign in bit 3) -> float32 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    np = _np()
    mags = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
    c = np.asarray(codes, dtype=np.uint8)
    v = mags[c & 7]
    return np.where(c & 8, -v, v).astype(np.float32)


def ue8m0_to_f32(codes):
    """uint8 ue8m0 scale bytes (an unsigned exponent) -> float32 2^(b - 127), by its bits (0xff: inf,
    0: 0, as mla-diff's reader)."""
    np = _np()
    b = np.asarray(codes, dtype=np.uint8).astype(np.uint32)
    return np.ascontiguousarray(b << np.uint32(23)).view(np.float32)


def ds_mla_parts(cache, qk_rope):
    """An `fp8_ds_mla` cache `[..., 656]` u8 -> (the 512 latent e4m3 values `[..., 512]`, the four
    float32 tile scales `[..., 4]`, the bf16 rope `[..., qk_rope]`), all float32, not yet scaled."""
    np = _np()
    cache = np.ascontiguousarray(cache, dtype=np.uint8)
    latent = e4m3_to_f32(cache[..., :512])
    scales = np.ascontiguousarray(cache[..., 512:528]).view("<f4")
    rope = bf16_bits_to_f32(np.ascontiguousarray(cache[..., 528 : 528 + 2 * qk_rope]).view("<u2"))
    return latent, scales, rope


#: (bytes per token, the kv_lora_rank + qk_rope it needs: (lkv, r) exactly, or a row width) per format.
_FITS = {
    "fp8_ds_mla": (656, (512, 64)),
    "fp8_ds_mla_nope": (656, (512, 0)),
    "fp8_v41": (528, 512),
    "fp4_v41": (288, 512),
}


def dequantize_cache(cache, fmt, kv_lora_rank, qk_rope, scale=None):
    """A decode request's `kv_cache` in the byte format `fmt` (`meta["cache"]["format"]`) -> float32
    rows `[..., kv_lora_rank + qk_rope]` as a kernel reads them, each quantized value q·s in float32
    (mla-diff's `Codec::decode`, bit for bit; layouts in docs/cache-formats.md):

    - `fp8`: every column e4m3 times the layer's scale `scale` (`meta["cache"]["scale"]`, required);
    - `fp8_ds_mla` / `_nope`: 512 e4m3 times their tile's float32 scale (4 tiles of 128), then the
      rope as stored (bf16; none for `_nope`);
    - `fp8_v41`: 512 e4m3 (rope included) times their group's ue8m0 scale (16 groups of 32);
    - `fp4_v41`: 512 e2m1 (two per byte, column 2k in the low nibble) times their group's e4m3 scale
      (32 groups of 16).

    Unwritten slots (0xff bytes) read as NaN."""
    np = _np()
    if fmt not in CACHE_FORMATS:
        raise Unsupported(f"cache format {fmt} (this SDK reads {', '.join(CACHE_FORMATS)})")
    cache = np.ascontiguousarray(cache, dtype=np.uint8)
    width = kv_lora_rank + qk_rope
    if fmt == "fp8":
        if scale is None:
            raise ValueError("cache format fp8 needs the layer's scale (meta['cache']['scale'])")
        if cache.shape[-1] != width:
            raise ValueError(f"an fp8 cache row is {width} bytes, got {cache.shape[-1]}")
        return (e4m3_to_f32(cache) * np.float32(scale)).astype(np.float32)
    n, need = _FITS[fmt]
    if (kv_lora_rank, qk_rope) != need and width != need:
        raise Unsupported(f"cache format {fmt} needs kv_lora_rank + qk_rope = {need}, got {kv_lora_rank} + {qk_rope}")
    if cache.shape[-1] != n:
        raise ValueError(f"a {fmt} cache row is {n} bytes, got {cache.shape[-1]}")
    lead = cache.shape[:-1]
    if fmt in ("fp8_ds_mla", "fp8_ds_mla_nope"):
        latent, scales, rope = ds_mla_parts(cache, qk_rope)
        latent = latent * np.repeat(scales, 128, axis=-1)
        return np.concatenate([latent, rope], axis=-1).astype(np.float32)
    if fmt == "fp8_v41":
        q = e4m3_to_f32(cache[..., :512])
        s = ue8m0_to_f32(cache[..., 512:528])
        return (q * np.repeat(s, 32, axis=-1)).astype(np.float32)
    packed = cache[..., :256]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(lead + (512,))
    s = e4m3_to_f32(cache[..., 256:288])
    return (e2m1_to_f32(codes) * np.repeat(s, 16, axis=-1)).astype(np.float32)


def round_to(x, dtype):
    """Round float32/float64 values to the storage dtype `dtype` ('bf16', 'fp16', 'f32') and return
    them as float32 (the value the runner would return)."""
    np = _np()
    if dtype == "bf16":
        return bf16_bits_to_f32(to_bf16_bits(x))
    if dtype == "fp16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    return np.asarray(x, dtype=np.float32)


def storage(x, dtype):
    """Wrap a float array for `write_numpy` so it is written in `dtype` ('bf16', 'fp16', 'f32')."""
    np = _np()
    if dtype == "bf16":
        return BF16(np.asarray(x, dtype=np.float32))
    if dtype == "fp16":
        return np.asarray(x, dtype=np.float32).astype(np.float16)
    return np.asarray(x, dtype=np.float32)


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n).decode("utf-8"))
    return header, 8 + n


def read_numpy(path, writable=False):
    """Read a safetensors file into numpy arrays. BF16 tensors come back as float32 (exact). Returns
    (tensors, dtypes, metadata): dtypes maps each name to its safetensors dtype string.

    `writable`: the file is mapped read-write and every tensor numpy holds as stored (all but BF16) is a
    view of the mapping, so a kernel that writes into its inputs writes into the file, where mla-diff
    sees it after the reply (`write_back_numpy` stores the widened BF16 ones back)."""
    np = _np()
    header, start = read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    if writable and os.path.getsize(path) > start:
        data = np.memmap(path, dtype=np.uint8, mode="r+")
    else:
        with open(path, "rb") as f:
            data = f.read()
    out, dtypes = {}, {}
    for name, info in header.items():
        dt, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
        raw = data[start + a : start + b]
        if dt == "BF16":
            arr = bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
        elif dt in _ST_TO_NP and isinstance(data, np.memmap):
            arr = raw.view(_ST_TO_NP[dt])
        elif dt in _ST_TO_NP:
            arr = np.frombuffer(raw, dtype=_ST_TO_NP[dt]).copy()
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {dt}, which this reader does not handle")
        out[name] = arr.reshape(shape)
        dtypes[name] = dt
    return out, dtypes, meta


def _write_back(path, name_to_bytes):
    """Store each input's bytes (as the op left the tensor) at its place in the file."""
    header, start = read_header(path)
    with open(path, "r+b") as f:
        for name, raw in name_to_bytes.items():
            a, b = header[name]["data_offsets"]
            if len(raw) != b - a:
                raise ValueError(f"input {name} changed size in place ({b - a} -> {len(raw)} bytes)")
            f.seek(start + a)
            f.write(raw)


def write_back_numpy(path, tensors):
    """After an op: flush the mapped inputs and store the BF16 ones (widened copies) back in BF16, so
    that the file holds the inputs as the op left them (mla-diff reports any change: a kernel must not
    write into its inputs)."""
    np = _np()
    header, _ = read_header(path)
    back = {}
    for name, arr in tensors.items():
        base = arr
        while isinstance(base, np.ndarray) and base.base is not None and not isinstance(base, np.memmap):
            base = base.base
        if isinstance(base, np.memmap):
            base.flush()
        elif header.get(name, {}).get("dtype") == "BF16":
            back[name] = to_bf16_bits(arr).tobytes()
    _write_back(path, back)


def write_numpy(path, tensors, metadata=None):
    """Write numpy arrays (or `BF16` wrappers) to a safetensors file."""
    np = _np()
    header = {"__metadata__": dict(metadata or METADATA)}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if isinstance(t, BF16):
            arr, dt = to_bf16_bits(t.array), "BF16"
            shape = list(t.array.shape)
        else:
            arr = np.ascontiguousarray(t)
            key = arr.dtype.name
            if key not in _NP_TO_ST:
                raise ValueError(f"tensor {name}: numpy dtype {key} cannot be written")
            dt, shape = _NP_TO_ST[key], list(arr.shape)
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        raw = arr.tobytes()
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# torch codec


def read_torch(path, device="cpu"):
    """Read a safetensors file with safetensors.torch; returns (tensors, dtypes, metadata)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    tensors = load_file(path, device=device)
    header, _ = read_header(path)
    dtypes = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return tensors, dtypes, meta


def write_back_torch(path, tensors):
    """After an op: store the inputs (on whatever device the op ran) back into the file, so that a
    kernel that wrote into them in place changes the file (mla-diff reports it)."""
    import torch

    back = {}
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            c = t.detach().contiguous().cpu()
            back[name] = c.view(torch.uint8).numpy().tobytes() if c.numel() else b""
    _write_back(path, back)


def write_torch(path, tensors, metadata=None):
    from safetensors.torch import save_file

    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    tmp = path + ".part"
    save_file(cpu, tmp, metadata=dict(metadata or METADATA))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# runner bases: the codec a runner reads its inputs and writes its outputs with


def _check_meta(path, meta):
    if (meta or {}).get("mla_diff_protocol") != "1":
        log(f"warning: {path}: __metadata__ has no mla_diff_protocol 1 ({meta!r})")


class NumpyRunner:
    """Inputs as numpy arrays (BF16 widened to float32); outputs numpy arrays or `BF16` wrappers."""

    def read(self, path):
        tensors, _, meta = read_numpy(path, writable=True)
        _check_meta(path, meta)
        return tensors

    def write(self, path, outputs):
        write_numpy(path, outputs)

    def write_back(self, path, tensors):
        write_back_numpy(path, tensors)


class TorchRunner:
    """Inputs as torch tensors on `self.device` (set by the subclass), outputs torch tensors."""

    device = "cpu"

    def read(self, path):
        tensors, _, meta = read_torch(path)
        _check_meta(path, meta)
        return {k: v.to(self.device) for k, v in tensors.items()}

    def write(self, path, outputs):
        write_torch(path, outputs)

    def write_back(self, path, tensors):
        write_back_torch(path, tensors)


# ----------------------------------------------------------------------------------------------
# serve loop


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def _redirect_stdout():
    """Keep the real stdout for replies; point fd 1 (and sys.stdout) at stderr."""
    sys.stdout.flush()
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(reply_fd, "w", buffering=1)


def _serve_loop(runner, stdin=None):
    replies = _redirect_stdout()
    stdin = stdin or sys.stdin
    ops = runner.describe().get("ops", {})

    def reply(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    for line in stdin:
        line = line.strip()
        if not line:
            continue
        rid = None
        try:
            req = json.loads(line)
            rid = req.get("id")
            op = req.get("op")
            if op not in ops or not hasattr(runner, op):
                reply({"id": rid, "status": "unsupported", "reason": f"op {op!r} is not implemented by this runner"})
                continue
            meta = req.get("meta") or {}
            tensors = runner.read(req["input"])
            if meta.get("bench"):
                outputs, timing = bench(runner, op, tensors, meta)
                runner.write(req["output"], outputs)
                reply({"id": rid, "status": "ok", "time_us": timing})
                continue
            outputs = getattr(runner, op)(tensors, meta)
            runner.write(req["output"], outputs)
            runner.write_back(req["input"], tensors)
            reply({"id": rid, "status": "ok"})
        except Unsupported as e:
            log(f"request {rid}: unsupported: {e}")
            reply({"id": rid, "status": "unsupported", "reason": str(e)})
        except Exception as e:  # noqa: BLE001 - every failure is reported to mla-diff
            traceback.print_exc(file=sys.stderr)
            msg = f"{type(e).__name__}: {e}".strip()
            reply({"id": rid, "status": "error", "message": msg.splitlines()[0][:2000] if msg else type(e).__name__})
    return 0


def bench(runner, op, tensors, meta):
    """`meta.bench = {warmup, iters, launches}` (mla-diff bench --peers): time the op's kernel launch alone
    (`<op>_kernel` gives it on prepared buffers) with CUDA events, like mla-diff's own bench: warm-up
    runs, then `iters` samples, each `launches` back-to-back launches between two events divided by
    `launches` (default 1: one launch after a synchronize, whose host dispatch latency is then counted;
    more keep the GPU's queue fed, as a graph replay would); returns the outputs of the last run and
    {median, min, iters, launches} in µs per launch."""
    make = getattr(runner, op + "_kernel", None)
    if make is None:
        raise Unsupported(f"this runner cannot time its {op} op (no {op}_kernel)")
    import torch

    b = meta["bench"]
    n = max(1, int(b.get("launches", 1)))
    with torch.no_grad():
        run, collect = make(tensors, meta)
        for _ in range(int(b.get("warmup", 5))):
            run()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(int(b.get("iters", 50))):
            start.record()
            for _ in range(n):
                run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3 / n)
        times.sort()
        return collect(), {"median": times[len(times) // 2], "min": times[0], "iters": len(times), "launches": n}


def unsupported_exit(reason):
    """Exit code 3: the runner cannot run here; the reason is the last line of stderr."""
    log(" ".join(str(reason).split()))
    sys.exit(3)


def _check_argv(argv):
    """The runner's arguments (default sys.argv[1:]): usage on stderr and exit 2 unless they start
    with --describe or --serve."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("--describe", "--serve"):
        log(f"usage: {os.path.basename(sys.argv[0])} --describe | --serve   (mla-diff runner protocol {PROTOCOL})")
        sys.exit(2)
    return argv


def _codec(codec):
    if codec == "numpy":
        return NumpyRunner()
    if codec == "torch":
        return TorchRunner()
    return codec  # an object with read(path) and write(path, outputs)


class _Served:
    """What the serve loop calls: the op functions by name, the codec's read/write and describe()."""

    def __init__(self, describe, ops, kernels, codec):
        self._describe = describe
        self._codec = _codec(codec)
        for name, fn in ops.items():
            if fn is not None:
                setattr(self, name, fn)
        for name, fn in (kernels or {}).items():
            if fn is not None:
                setattr(self, name + "_kernel", fn)

    def describe(self):
        d = self._describe() if callable(self._describe) else dict(self._describe)
        d.setdefault("protocol", PROTOCOL)
        return d

    def read(self, path):
        return self._codec.read(path)

    def write(self, path, outputs):
        self._codec.write(path, outputs)

    def write_back(self, path, tensors):
        # The inputs as the op left them, back into the file (mla-diff reports a kernel that wrote into them).
        if hasattr(self._codec, "write_back"):
            self._codec.write_back(path, tensors)


def serve(decode=None, prefill=None, describe=None, *, sparse_prefill=None, sparse_decode=None,
          environment=None, codec="numpy", kernels=None, argv=None):
    """Run a runner made of functions: `RUNNER --describe` or `RUNNER --serve` (from `argv`, default
    sys.argv[1:]), then exit with the protocol's code.

    - `decode`, `prefill`, `sparse_prefill`, `sparse_decode`: `fn(tensors, meta) -> {name: tensor}`
      for the ops the runner implements (the others None); raise `Unsupported` to decline a request.
    - `describe`: the describe dict (or a function returning it); `ops` defaults to the functions
      given, each with the two outputs every op must return.
    - `environment`: optional `fn() -> None | str`, called first; a string is why this machine cannot
      run it (exit 3, as unsupported).
    - `codec`: "numpy", "torch" (inputs as torch tensors on `codec.device`), or an object with
      `read(path)` / `write(path, outputs)`.
    - `kernels`: optional `{op: fn(tensors, meta) -> (run, collect)}` for `mla-diff bench --peers`.
    """
    argv = _check_argv(argv)
    problem = environment() if environment is not None else None
    if problem:
        unsupported_exit(problem)
    ops = {"decode": decode, "prefill": prefill, "sparse_prefill": sparse_prefill, "sparse_decode": sparse_decode}
    if describe is None:
        raise TypeError("serve(): describe= is required (a dict with at least name and version)")
    if not callable(describe) and "ops" not in describe:
        outs = {"decode": ["attn_latent", "lse"], "prefill": ["attn_heads", "lse"],
                "sparse_prefill": ["attn_latent", "lse"], "sparse_decode": ["attn_latent", "lse"]}
        describe = dict(describe, ops={k: {"outputs": outs[k]} for k, f in ops.items() if f is not None})
    served = _Served(describe, ops, kernels, codec)
    if argv[0] == "--describe":
        sys.stdout.write(json.dumps(served.describe()) + "\n")
        sys.stdout.flush()
        sys.exit(0)
    sys.exit(_serve_loop(served))


def main(runner_cls, argv=None):
    """Serve a runner class through `serve`: its `describe`, `environment_problem`, op methods,
    `<op>_kernel` methods and its own `read`/`write` codec (a subclass of `NumpyRunner` or
    `TorchRunner`). The class is made after the arguments are checked, as before the SDK."""
    argv = _check_argv(argv)
    runner = runner_cls()

    def get(name):
        return getattr(runner, name, None)

    serve(
        decode=get("decode"),
        prefill=get("prefill"),
        sparse_prefill=get("sparse_prefill"),
        sparse_decode=get("sparse_decode"),
        describe=runner.describe,
        environment=get("environment_problem"),
        codec=runner,
        kernels={op: get(op + "_kernel") for op in ("decode", "prefill", "sparse_prefill", "sparse_decode")},
        argv=argv,
    )
