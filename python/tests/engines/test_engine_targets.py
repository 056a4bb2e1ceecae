"""The functions mla_diff.capture.vllm / .sglang wrap exist in the released wheels, with the parameters
the wrappers expect (checked with `ast` on the wheels' source; vLLM and SGLang are not imported, they
need a GPU). .ci/run downloads the wheels (`pip download --no-deps`) into MLA_DIFF_ENGINE_WHEELS."""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path

import pytest

from conftest import need

WHEELS = {"vllm": "0.33.0", "sglang": "0.5.23"}


def wheel(name: str) -> zipfile.ZipFile:
    d = os.environ.get("MLA_DIFF_ENGINE_WHEELS")
    need("MLA_DIFF_ENGINE_WHEELS (a folder with the vLLM and SGLang wheels)", bool(d))
    found = sorted(Path(d).glob(f"{name}-{WHEELS[name]}-*.whl"))
    need(f"{name}-{WHEELS[name]} wheel in {d}", bool(found))
    return zipfile.ZipFile(found[0])


def params(zf: zipfile.ZipFile, module: str, qual: str) -> list:
    src = zf.read(module.replace(".", "/") + ".py").decode()
    cls_name, fn = qual.split(".")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == fn:
                    a = item.args
                    return [x.arg for x in a.posonlyargs + a.args]
            raise AssertionError(f"{module}.{cls_name} has no {fn}")
    raise AssertionError(f"{module} has no class {cls_name}")


def targets():
    from mla_diff.capture import sglang, vllm

    return [("vllm", *t) for t in vllm.TARGETS] + [("sglang", *t) for t in sglang.TARGETS]


@pytest.mark.parametrize("engine,module,qual,expected", targets(), ids=lambda v: v if isinstance(v, str) and "." in v and "/" not in v else None)
def test_wrapped_function_exists_with_its_parameters(engine, module, qual, expected):
    got = params(wheel(engine), module, qual)
    assert got[: len(expected)] == expected, f"{engine} {module}.{qual}: parameters {got}, the wrapper expects {expected}…"


def test_a_renamed_parameter_is_caught():
    """The check can fail: a parameter list that differs from the source's is reported."""
    module, qual, expected = ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention.forward_impl",
                              ["self", "q", "kv_c_normed"])
    got = params(wheel("vllm"), module, qual)
    assert got[: len(expected)] != expected
