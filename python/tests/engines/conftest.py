"""Shared fixtures of the engine-capture tests (python/tests/).

The end-to-end tests need torch + transformers, llama-cpp-python, the extracted llama-cpp-python sdist
(MLA_DIFF_LLAMA_CPP_SRC, for llama.cpp's converter) and a built `target/release/mla-diff`. .ci/run
provides all of them; elsewhere a missing one skips its tests, but with CI set it fails them (a green
CI must not hide a missing install step).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def need(what: str, ok: bool) -> None:
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing (CI is set: .ci/run must install it)")
    pytest.skip(f"{what} is missing")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="session")
def mla_diff_bin() -> Path:
    p = Path(os.environ.get("MLA_DIFF_BIN", REPO / "target" / "release" / "mla-diff"))
    need(f"{p} (cargo build --release)", p.exists())
    return p


@pytest.fixture(scope="session")
def hf_stack():
    need("torch and transformers", _importable("torch") and _importable("transformers"))
    need("MLA_DIFF_LLAMA_CPP_SRC (the extracted llama-cpp-python sdist: llama.cpp's converter)",
         bool(os.environ.get("MLA_DIFF_LLAMA_CPP_SRC")))


@pytest.fixture(scope="session")
def llama_cpp_lib():
    need("llama-cpp-python", _importable("llama_cpp"))


_BUILT: dict = {}


def tiny_model(family: str, root: Path, **overrides):
    """A tiny checkpoint of `family` and its converter GGUF, built once per test session."""
    import tiny

    key = (family, json.dumps(overrides, sort_keys=True))
    if key not in _BUILT:
        out = root / f"{family}-{len(_BUILT)}"
        _BUILT[key] = tiny.build(family, out, overrides=overrides or None)
    return _BUILT[key]


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def run_capture(mla_diff_bin: Path, gguf: Path, cap: Path, *extra: str):
    """`mla-diff run GGUF --capture CAP --json …`: (exit code, JSON report or None, stderr)."""
    js = cap.parent / (cap.name + ".report.json")
    if js.exists():
        js.unlink()
    p = subprocess.run([str(mla_diff_bin), "run", str(gguf), "--capture", str(cap), "--json", str(js), *extra],
                       capture_output=True, text=True, timeout=600)
    rep = json.loads(js.read_text()) if js.exists() else None
    return p.returncode, rep, p.stdout + p.stderr
