"""Tiny random Hugging Face MLA checkpoints and their GGUF, for the engine-capture tests.

The families, tokenizers and weight init are fixtures/golden/make_goldens.py's (imported, not copied);
the GGUF is written by llama.cpp's own convert_hf_to_gguf.py, run unmodified from the extracted
llama-cpp-python sdist that MLA_DIFF_LLAMA_CPP_SRC names (.ci/run downloads it). Unlike the goldens,
the converter's file is kept whole (tokenizer, token_embd, output): llama.cpp runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def goldens():
    spec = importlib.util.spec_from_file_location("make_goldens", REPO / "fixtures" / "golden" / "make_goldens.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def llama_cpp_src() -> Path:
    src = os.environ.get("MLA_DIFF_LLAMA_CPP_SRC")
    if not src:
        raise LookupError("MLA_DIFF_LLAMA_CPP_SRC (an extracted llama-cpp-python sdist) is not set")
    return Path(src) / "vendor" / "llama.cpp"


def build(family: str, out: Path, *, overrides: dict | None = None, seed: int | None = None):
    """Write the HF checkpoint of `family` to out/hf and its converter GGUF (F32) to out/model.gguf.
    Returns (model in float32, eval mode, eager attention; gguf path; vocab size)."""
    import torch
    import transformers

    g = goldens()
    spec = g.FAMILIES[family]
    llama_cpp = llama_cpp_src()
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    if spec["tokenizer"].startswith("gpt2"):
        tok = g.gpt2_tokenizer(llama_cpp, g.GLM_SPECIALS if spec["tokenizer"] == "gpt2+glm" else [])
        tok.save_pretrained(hf)
        vocab = len(tok)
    else:
        vocab = g.spm_tokenizer(hf)
    cfg = dict(spec["config"], **(overrides or {}))
    config = getattr(transformers, spec["cls"] + "Config")(**cfg, vocab_size=vocab)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    seed = spec.get("seed", g.SEED) if seed is None else seed
    torch.manual_seed(seed)
    model = getattr(transformers, spec["cls"] + "ForCausalLM")(config).eval()
    g.init_weights(model, seed)
    model.save_pretrained(hf)
    gguf = out / "model.gguf"
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32",
                    "--outfile", str(gguf)], check=True, env=env, cwd=str(llama_cpp),
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return model, gguf, vocab
