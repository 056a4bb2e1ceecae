"""mla_diff: mla-diff from Python.

- `cases`, `check`, `assert_mla_close`: MLA kernels checked in a test suite against the fp64 reference,
  with the verdict of `mla-diff run --runner` (docs/pytest.md); the pytest plugin is `mla_diff.pytest_plugin`.
- `mla_diff.runner`: the runner SDK, `serve(decode=fn, prefill=fn, describe=...)` (docs/runners.md).
- `mla_diff.capture`: captures of what an MLA serving engine computed, for `mla-diff run FILE --capture
  DIR` (docs/captures.md); `gguf_identity` is the model identity a capture's manifest carries.
"""

from __future__ import annotations

import hashlib
import os
import re

__version__ = "0.1.0"

__all__ = ["__version__", "gguf_identity", "cases", "check", "assert_mla_close", "Case", "Verdict"]

# The test-suite API (docs/pytest.md): cheap to import (numpy, torch and the native module load on use),
# since the runners import this package too.
from mla_diff._api import Case, Verdict, assert_mla_close, cases, check  # noqa: E402

_SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def gguf_identity(path) -> dict:
    """The `model` object of a capture manifest for the GGUF file at `path`: base file name, size in
    bytes (over all shards of a split model), architecture, and the SHA-256 of the header — every byte
    before the tensor data (`GGUFReader.data_offset`), of the first shard for a split model.

    `mla-diff run FILE --capture DIR` computes the same from FILE (src/gguf/) and refuses a capture
    whose identity differs.
    """
    from gguf import GGUFReader  # the header parser llama.cpp's converter itself uses

    path = os.fspath(path)
    reader = GGUFReader(path, "r")
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        raise ValueError(f"{path}: no general.architecture key")
    architecture = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8")
    header_bytes = int(reader.data_offset)
    del reader
    with open(path, "rb") as f:
        header = f.read(header_bytes)
    if len(header) != header_bytes:
        raise ValueError(f"{path}: shorter than its header ({header_bytes} bytes)")

    name = os.path.basename(path)
    size = os.path.getsize(path)
    m = _SPLIT.match(name)
    if m is not None:
        # A split model: the identity names the first shard and the size counts every shard, as
        # src/gguf/split.rs gathers them.
        count = int(m.group("count"))
        folder = os.path.dirname(path)
        name = f"{m.group('prefix')}-00001-of-{count:05}.gguf"
        size = sum(
            os.path.getsize(os.path.join(folder, f"{m.group('prefix')}-{i:05}-of-{count:05}.gguf"))
            for i in range(1, count + 1)
        )
        if int(m.group("no")) != 1:
            return gguf_identity(os.path.join(folder, name))
    return {
        "file": name,
        "size": size,
        "architecture": architecture,
        "header_bytes": header_bytes,
        "header_sha256": hashlib.sha256(header).hexdigest(),
    }
