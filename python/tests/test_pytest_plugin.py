"""The pytest plugin and the worked example of docs/pytest.md, run with pytester against the installed
wheel (mla_diff._native): green on a real-dims model, and failing with the documented message when the
example's kernels carry the planted bug (the softmax scale FlashMLA defaults to)."""

import os
import pathlib
import re
import sys

import pytest

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pytest" / "test_mla_decode.py"
MODEL = ROOT / "fixtures" / "deepseek-v3-yarn-q4_k.gguf"
# Small, so the suite is quick; still MTP steps (q_len 2), splits past the visible keys, several pages.
SCHEDULE = "prompt_len=8,decode_steps=3,q_len=2,chunk=8,page_size=4,num_splits=3"

def _plugin_args():
    """`-p mla_diff.pytest_plugin` when the plugin is not installed through its entry point (a checkout
    on PYTHONPATH with the native module built in place). Read once, before `import numpy_mla` below puts
    the checkout's python/ first on sys.path: from then on importlib.metadata finds that folder's
    mla_diff.egg-info (the pure-Python install, no pytest11 entry point) before the wheel's, and a
    `-p` on top of the entry point registers the plugin twice (pytest refuses to start)."""
    from importlib.metadata import entry_points

    eps = entry_points()
    group = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
    return [] if any(e.value == "mla_diff.pytest_plugin" for e in group) else ["-p", "mla_diff.pytest_plugin"]


PLUGIN_ARGS = _plugin_args()


if os.environ.get("CI"):
    import mla_diff._native  # noqa: F401  (.ci/run installs the wheel: without it this file fails, never skips)
else:
    pytest.importorskip("mla_diff._native", reason="the mla-diff wheel is not installed (docs/pytest.md)")

# Imported here, at collection: pytester restores sys.modules after each test, and neither a pyo3 module
# nor torch can be loaded twice in one process.
import mla_diff  # noqa: E402

sys.path.insert(0, str(ROOT / "runners"))
import numpy_mla  # noqa: E402

try:
    import torch  # noqa: F401

    KERNELS = 2
except ImportError:
    KERNELS = 1


def run_example(pytester, monkeypatch, bug=None):
    pytester.makepyfile(test_mla_decode=EXAMPLE.read_text())
    if bug:
        monkeypatch.setenv("MLA_DIFF_EXAMPLE_BUG", bug)
    else:
        monkeypatch.delenv("MLA_DIFF_EXAMPLE_BUG", raising=False)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *PLUGIN_ARGS, "--mla-diff-model", str(MODEL),
                                         "--mla-diff-layers", "1", "--mla-diff-schedule", SCHEDULE, "-v")


def test_example_green(pytester, monkeypatch):
    r = run_example(pytester, monkeypatch)
    r.assert_outcomes(passed=KERNELS, skipped=2 - KERNELS)
    r.stdout.fnmatch_lines(["*test_decode*deepseekv3yarn-L1-decode-q2-splits3-page4-bf16-numpy*PASSED*",
                            "*mla-diff*", f"*{KERNELS} cases checked against fp64: {KERNELS} passed, 0 failed*"])


def test_example_planted_bug(pytester, monkeypatch):
    r = run_example(pytester, monkeypatch, bug="scale")
    r.assert_outcomes(failed=KERNELS, skipped=2 - KERNELS)
    out = r.stdout.str()
    assert "AssertionError: MLA decode output is not close: deepseekv3yarn-L1-decode-q2-splits3-page4-bf16" in out
    # The kernel's own error, attributed to it, with the rel-L2 against its bound.
    assert re.search(r"stage attn_latent@runner: rel-L2 \d\.\d{3}e[-+]\d\d vs bound \d\.\d{3}e[-+]\d\d "
                     r"\(the kernel's own error", out), out
    assert "Worst 5 elements" in out
    assert re.search(r"token \(entry \d, query \d\), head \d+, col \d+: keys 0\.\.\d+ \(splits", out), out
    assert f"Reproduce: mla-diff run {MODEL} --layers 1 --dtype bf16 --seed 0 --mode shadow" in out
    assert "cases checked against fp64: 0 passed" in out


def test_no_model_skips(pytester, monkeypatch):
    monkeypatch.delenv("MLA_DIFF_MODEL", raising=False)
    pytester.makepyfile(test_mla_decode=EXAMPLE.read_text())
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", *PLUGIN_ARGS, "-rs")
    r.assert_outcomes(skipped=2)
    r.stdout.fnmatch_lines(["*no model: pass --mla-diff-model FILE or set MLA_DIFF_MODEL*"])


def mla_diff_command():
    import shutil

    exe = shutil.which("mla-diff") or str(ROOT / "target" / "release" / "mla-diff")
    if not os.access(exe, os.X_OK):
        (pytest.fail if os.environ.get("CI") else pytest.skip)("no mla-diff binary (the wheel's command, or target/release/mla-diff)")
    return exe


def test_check_is_run_runner(tmp_path):
    """check() with the numpy runner's outputs computed in this process gives the verdict and the
    figures `mla-diff run --runner 'python3 runners/numpy_mla.py'` gives through the subprocess
    protocol; and a 1 % error in attn_latent fails at the kernel (attn_latent@runner)."""
    import json
    import subprocess

    import numpy as np

    sched = dict(prompt_len=8, decode_steps=3, q_len=2, chunk=8, page_size=4, num_splits=3)
    case = next(c for c in mla_diff.cases(str(MODEL), layers=[1], schedule=sched) if c.op == "decode")
    def kernel(x, meta):
        o = numpy_mla.NumpyMLA().decode(x, meta)
        return o["attn_latent"].array, o["lse"], o["split_out"], o["split_lse"]

    o = numpy_mla.NumpyMLA().decode(case.tensors(), case.meta)
    v = mla_diff.check(case, out=o["attn_latent"].array, lse=o["lse"], split_out=o["split_out"],
                       split_lse=o["split_lse"], out_dtype="bf16", kernel=kernel)
    report = tmp_path / "r.json"
    cmd = [mla_diff_command()] + case.argv + ["--json", str(report), "--runner",
                                              f"{sys.executable} {ROOT / 'runners' / 'numpy_mla.py'}"]
    rc = subprocess.run(cmd, capture_output=True, text=True).returncode
    r = json.loads(report.read_text())
    theirs = {c["check"]: c for m in r["modes"] for l in m["layers"] for c in l["checks"]}
    decode = [c for c in v.checks if c["check"].split("@")[0] in
              ("attn_latent", "lse[decode]", "split_out", "split_lse", "attn_heads[decode]", "attn_out[decode]")]
    assert len(decode) >= 6, decode
    for c in decode:
        t = theirs[c["check"]]
        assert (c["pass"], c["rel_l2"], c["bound"]) == (t["pass"], t["metrics"]["rel_l2"], t["tolerance"]["rel_l2"]), c
    assert v.passed == (rc == 0), (v.message, rc)

    bad = o["attn_latent"].array * np.float32(1.05)
    v = mla_diff.check(case, out=bad, lse=o["lse"], out_dtype="bf16", kernel=kernel)
    assert not v.passed and v.exit_code == 1
    assert "attn_latent@runner" in [c["check"] for c in v.failing()]


def test_default_schedule_cases():
    """Without a schedule, the cases are those of `run --runner`'s default schedule (chosen from the
    runner's describe, here the in-process recorder's): one decode and one prefill case per layer."""
    cs = list(mla_diff.cases(str(MODEL), layers=[0]))
    assert sorted(c.op for c in cs) == ["decode", "prefill"], [c.id for c in cs]
    d = next(c for c in cs if c.op == "decode")
    assert d.id.startswith("deepseekv3yarn-L0-decode-q"), d.id
    assert d.inputs["kv_cache"].shape[-1] == 576 and d.bounds.get("attn_latent@runner")
