"""The mla-diff pytest plugin (entry point `pytest11`, docs/pytest.md).

Options (or environment variables):
  --mla-diff-model FILE      MLA_DIFF_MODEL      the GGUF whose real weights make the cases
  --mla-diff-layers SPEC     MLA_DIFF_LAYERS     run's --layers syntax (default: all)
  --mla-diff-dtype D         MLA_DIFF_DTYPE      bf16 (default), f16, f32
  --mla-diff-schedule K=V,…  (repeatable)        run's schedule options, one schedule per option given
  --mla-diff-device DEV      MLA_DIFF_DEVICE     torch device of the cases' tensors (default: numpy)

Fixtures, parametrized over the model's layers and the schedules, ids like
`glm5-L3-decode-q2-splits4-page64-bf16`: `mla_decode_case`, `mla_prefill_case`, `mla_case` (both).
Without a model they skip. Markers: `mla_diff_gpu` (a CUDA device through torch), `mla_diff_sm90`
(compute capability 9.0), `mla_diff_dtype("bf16", …)` (the case's dtype among these): a test whose
capability is missing is skipped, with the reason. The session ends with a summary of every
`mla_diff.check` made.
"""

from __future__ import annotations

import os

import pytest

_FIXTURES = {"mla_decode_case": ("decode",), "mla_prefill_case": ("prefill",), "mla_case": ("decode", "prefill")}


def pytest_addoption(parser):
    g = parser.getgroup("mla-diff", "MLA kernels against mla-diff's fp64 reference (docs/pytest.md)")
    g.addoption("--mla-diff-model", default=os.environ.get("MLA_DIFF_MODEL"), metavar="FILE",
                help="GGUF model whose real weights make the cases (env MLA_DIFF_MODEL)")
    g.addoption("--mla-diff-layers", default=os.environ.get("MLA_DIFF_LAYERS"), metavar="SPEC",
                help="layers, as run --layers (env MLA_DIFF_LAYERS; default all)")
    g.addoption("--mla-diff-dtype", default=os.environ.get("MLA_DIFF_DTYPE", "bf16"), metavar="D",
                help="storage dtype of the cases: bf16, fp16, f32 (env MLA_DIFF_DTYPE)")
    g.addoption("--mla-diff-schedule", action="append", default=[], metavar="K=V,...",
                help="a schedule (prompt_len, decode_steps, q_len, chunk, page_size, num_splits); repeatable")
    g.addoption("--mla-diff-device", default=os.environ.get("MLA_DIFF_DEVICE"), metavar="DEV",
                help="torch device of the case tensors (env MLA_DIFF_DEVICE; default numpy arrays)")


def pytest_configure(config):
    for m in ("mla_diff_gpu: needs a CUDA device through torch",
              "mla_diff_sm90: needs an SM90 GPU (H100/H200/H800)",
              "mla_diff_dtype(*dtypes): runs only cases of these dtypes"):
        config.addinivalue_line("markers", m)
    config._mla_diff_cases = None


def _parse_schedule(s):
    out = {}
    for part in filter(None, (p.strip() for p in s.split(","))):
        k, _, v = part.partition("=")
        out[k.strip().replace("-", "_")] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def _layers(spec):
    if spec in (None, "", "all"):
        return None
    out = []
    for part in spec.split(","):
        if ".." in part:
            a, b = part.split("..")
            out += range(int(a), int(b[1:]) + 1 if b.startswith("=") else int(b))
        else:
            out.append(int(part))
    return out


def _all_cases(config):
    if config._mla_diff_cases is None:
        from mla_diff import cases

        model = config.getoption("--mla-diff-model")
        scheds = [_parse_schedule(s) for s in config.getoption("--mla-diff-schedule")] or [None]
        config._mla_diff_cases = list(cases(model, layers=_layers(config.getoption("--mla-diff-layers")),
                                            schedule=scheds, dtype=config.getoption("--mla-diff-dtype"),
                                            device=config.getoption("--mla-diff-device")))
    return config._mla_diff_cases


def pytest_generate_tests(metafunc):
    for name, ops in _FIXTURES.items():
        if name not in metafunc.fixturenames:
            continue
        if not metafunc.config.getoption("--mla-diff-model"):
            metafunc.parametrize(name, [pytest.param(None, marks=pytest.mark.skip(
                reason="no model: pass --mla-diff-model FILE or set MLA_DIFF_MODEL"))], ids=["no-model"])
            continue
        cs = [c for c in _all_cases(metafunc.config) if c.op in ops]
        metafunc.parametrize(name, cs, ids=[c.id for c in cs])


def _cuda():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA device (torch.cuda.is_available() is False)"
    return torch, None


def pytest_runtest_setup(item):
    if item.get_closest_marker("mla_diff_gpu") or item.get_closest_marker("mla_diff_sm90"):
        torch, why = _cuda()
        if torch is None:
            pytest.skip(f"mla_diff_gpu: {why}")
        if item.get_closest_marker("mla_diff_sm90"):
            cap = torch.cuda.get_device_capability()
            if cap != (9, 0):
                pytest.skip(f"mla_diff_sm90: this GPU is sm_{cap[0]}{cap[1]} ({torch.cuda.get_device_name()})")
    m = item.get_closest_marker("mla_diff_dtype")
    if m is not None and hasattr(item, "callspec"):
        for name in _FIXTURES:
            c = item.callspec.params.get(name)
            if c is not None and c.dtype not in m.args:
                pytest.skip(f"mla_diff_dtype: the case is {c.dtype}, the test takes {', '.join(m.args)}")


def pytest_terminal_summary(terminalreporter):
    from mla_diff import _api

    done = _api.RESULTS
    if not done:
        return
    tr = terminalreporter
    failed = [v for v in done if not v.passed]
    tr.section("mla-diff")
    tr.write_line(f"{len(done)} cases checked against fp64: {len(done) - len(failed)} passed, {len(failed)} failed")
    for v in failed:
        tr.write_line(f"  {v.case.id}: {v.first_check or '?'}: {v.message}")
