"""Engine captures end to end (issue #33, items 4 and 5): a tiny transformers checkpoint converted by
llama.cpp's own converter; transformers' forward and llama.cpp's run of the same GGUF captured with
mla_diff.capture.{transformers,llama_cpp}; `mla-diff run GGUF --capture DIR` must pass on the clean
captures and name each planted engine bug at its layer and stage."""

from __future__ import annotations

import pytest

import engine_bugs as bugs
from conftest import run_capture, tiny_model

T = 12          # prompt tokens
CHUNKS = [8, 4]  # chunked prefill of the prompt
N_DECODE = 3

# rms_norm_eps 1e-6 for GLM-5 and MiniCPM3: transformers hard-codes their q_a/kv_a norms' eps at 1e-6,
# while a GGUF has one eps for every norm (fixtures/golden/README.md); with rms_norm_eps = 1e-6 the
# checkpoint and its file mean the same model, so a clean capture can be held to f32 precision.
FAMILIES = {
    "deepseek-v3": {},
    "deepseek-v2-lite": {},
    # GLM-5 with index_topk (32) ≥ the tokens: the indexer runs and its top-k is captured, attention is
    # dense; past top_k run --capture checks the captured top-k against the reference's (docs/captures.md).
    "glm-5": {"rms_norm_eps": 1e-6},
    "minicpm3": {"rms_norm_eps": 1e-6},
}


def prompt(vocab: int, seed: int = 0):
    import torch

    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


def check_pass(mla_diff_bin, gguf, cap):
    rc, rep, out = run_capture(mla_diff_bin, gguf, cap)
    assert rep is not None, out
    assert (rc, rep["verdict"]["pass"]) == (0, True), f"rc {rc}: {rep['verdict']['message']}\n{out}"
    return rep


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_generate_passes(family, hf_stack, mla_diff_bin, models_root, tmp_path):
    from mla_diff.capture import transformers as tfcap

    model, gguf, vocab = tiny_model(family, models_root, **FAMILIES[family])
    cap = tmp_path / "cap"
    tfcap.generate(model, prompt(vocab), cap, model_file=gguf, max_new_tokens=N_DECODE)
    check_pass(mla_diff_bin, gguf, cap)


def test_transformers_capture_changes_nothing(hf_stack, models_root, tmp_path):
    """The taps copy: logits with and without a capture are bit for bit the same."""
    import torch
    from mla_diff.capture import transformers as tfcap

    model, gguf, vocab = tiny_model("deepseek-v3", models_root)
    ids = prompt(vocab)
    plain = bugs.drive(model, ids, CHUNKS, N_DECODE).logits
    with tfcap.capture(model, tmp_path / "cap", model_file=gguf):
        captured = bugs.drive(model, ids, CHUNKS, N_DECODE).logits
    assert torch.equal(plain, captured)


def capture_drive(model, gguf, vocab, cap, bug=None):
    import contextlib

    from mla_diff.capture import transformers as tfcap

    with (bug(model) if bug else contextlib.nullcontext()):
        with tfcap.capture(model, cap, model_file=gguf):
            bugs.drive(model, prompt(vocab), CHUNKS, N_DECODE)


def test_chunked_prefill_and_decode_pass(hf_stack, mla_diff_bin, models_root, tmp_path):
    model, gguf, vocab = tiny_model("deepseek-v3", models_root)
    capture_drive(model, gguf, vocab, tmp_path / "cap")
    check_pass(mla_diff_bin, gguf, tmp_path / "cap")


@pytest.mark.parametrize("bug", list(bugs.EXPECTED), ids=lambda b: b.__name__)
def test_planted_engine_bug_is_named(bug, hf_stack, mla_diff_bin, models_root, tmp_path):
    model, gguf, vocab = tiny_model("deepseek-v3", models_root)
    cap = tmp_path / "cap"
    capture_drive(model, gguf, vocab, cap, bug)
    rc, rep, out = run_capture(mla_diff_bin, gguf, cap)
    assert rep is not None, out
    v = rep["verdict"]
    layer, stage = bugs.EXPECTED[bug]
    assert rc == 1 and not v["pass"], out
    assert v["first_layer"] == layer, v["message"]
    assert (v["first_check"] or "").split("[")[0] == stage, v["message"]


def llama_capture(models_root, cap, f16: bool, flash_attn: bool | None = None):
    from mla_diff.capture import llama_cpp as lcap

    model, gguf, vocab = tiny_model("deepseek-v3", models_root)
    gen = lcap.run(gguf, cap, prompt=prompt(vocab)[0].tolist(), n_decode=N_DECODE, n_ubatch=CHUNKS[0],
                   flash_attn=f16 if flash_attn is None else flash_attn, type_k="f16" if f16 else "f32")
    return gguf, gen


def plant_f16_noise(cap, stage: str, layer: int, step: int, times: float):
    """Add `times` f16 roundings' worth of noise (uniform in ±times·ulp16/2) to the first row of `stage`
    in `cap`'s layer/step file."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    path = cap / f"layer{layer}" / f"step{step}.safetensors"
    t = load_file(str(path))
    a = t[stage].astype(np.float32)
    row = a[0].reshape(-1)
    ulp = np.spacing(np.abs(row).astype(np.float16)).astype(np.float32)
    row += times * ulp * np.random.default_rng(0).uniform(-0.5, 0.5, row.shape).astype(np.float32)
    a[0] = row.reshape(a[0].shape)
    t[stage] = a.astype(t[stage].dtype)
    save_file(t, str(path))


def test_llama_cpp_run_of_the_gguf_passes(hf_stack, llama_cpp_lib, mla_diff_bin, models_root, tmp_path):
    """llama.cpp runs the converter's file itself (tokenizer, FFN and all) with an f32 cache and without
    flash attention: a chunked prompt (ubatches of 8), then greedy decode. Every stage passes at f32,
    attention and the cache read back included."""
    gguf, _ = llama_capture(models_root, tmp_path / "cap", f16=False)
    check_pass(mla_diff_bin, gguf, tmp_path / "cap")


def test_llama_cpp_default_f16_cache_and_flash_attention(hf_stack, llama_cpp_lib, mla_diff_bin, models_root, tmp_path):
    """llama.cpp's defaults: an f16 K cache read by flash attention (Q converted to f16, P·V summed in
    f16), f32 projections. The capture records each node's ggml type (`stage_dtypes`: the cache rows
    f16), and every stage passes at its own precision: the projections at f32, the cache as an exact
    f16 copy, the attention reading it at f16, o_proj at f32 from the heads llama.cpp computed."""
    import json

    gguf, _ = llama_capture(models_root, tmp_path / "cap", f16=True)
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (m["version"], m["dtype"], m["stage_dtypes"]) == (2, "f32", {"cache_rows": "fp16"})
    rep = check_pass(mla_diff_bin, gguf, tmp_path / "cap")
    for layer in rep["modes"][0]["layers"]:
        checks = {c["check"]: c for c in layer["checks"]}
        assert checks["cache_rows"]["local"]["rel_l2"] == 0.0, checks["cache_rows"]["local"]
        assert checks["q_pe"]["tolerance"]["rel_l2"] < 1e-5  # f32's
        assert checks["attn_latent"]["tolerance"]["rel_l2"] > 1e-3  # fp16's: it reads the f16 cache
    # The f16 bound is not loose: 10 f16 roundings' noise on one decode token's attn_latent fails there.
    plant_f16_noise(tmp_path / "cap", "attn_latent", 1, 2, 10.0)  # step 2: the first decode step
    rc, rep, out = run_capture(mla_diff_bin, gguf, tmp_path / "cap")
    assert rc == 1 and (rep["verdict"]["first_layer"], rep["verdict"]["first_check"]) == (1, "attn_latent"), out


def test_llama_cpp_flash_attention_over_an_f32_cache(hf_stack, llama_cpp_lib, mla_diff_bin, models_root, tmp_path):
    """Flash attention over an f32 K cache reads an f16 cast of it (llama-graph.cpp): the capture takes
    the cache rows from that cast, in f16, and passes as the f16 cache does."""
    import json

    gguf, _ = llama_capture(models_root, tmp_path / "cap", f16=False, flash_attn=True)
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["stage_dtypes"] == {"cache_rows": "fp16"}
    check_pass(mla_diff_bin, gguf, tmp_path / "cap")


def test_llama_cpp_and_transformers_generate_the_same_tokens(hf_stack, llama_cpp_lib, models_root, tmp_path):
    """The same GGUF in llama.cpp and its checkpoint in transformers agree on the greedy tokens: the two
    captures are of the same model."""
    import torch
    from mla_diff.capture import transformers as tfcap

    model, gguf, vocab = tiny_model("deepseek-v3", models_root)
    _, gen = llama_capture(models_root, tmp_path / "lcap", f16=False)
    out = tfcap.generate(model, prompt(vocab), tmp_path / "tcap", model_file=gguf, max_new_tokens=N_DECODE)
    assert out[0, T:].tolist() == gen
