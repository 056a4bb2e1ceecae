"""vLLM end to end on a GPU (not run in CI: no GPU there): a tiny DeepSeek-V3 checkpoint with the real
model's head dims (kv_lora 512, rope 64, nope 128, v 128: what vLLM's MLA kernels accept), converted by
llama.cpp's converter; vLLM 0.33 runs the checkpoint in bf16 with mla_diff.capture.vllm installed, a
prompt long enough for two prefill chunks (the has_context path), then greedy decode; `mla-diff run` on
the GGUF checks the capture. Needs vLLM 0.33.0, the packages of .ci/run's capture venv, and
MLA_DIFF_LLAMA_CPP_SRC.

    python python/tests/engines/vllm_gpu.py OUT_DIR [--chunk 32] [--backend TRITON_MLA]
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DIMS = dict(q_lora_rank=192, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            hidden_size=512, num_attention_heads=16, num_key_value_heads=16, intermediate_size=256)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--chunk", type=int, default=32, help="max_num_batched_tokens (prompt is 48 tokens)")
    ap.add_argument("--backend", default=None, help="VLLM_ATTENTION_BACKEND, e.g. TRITON_MLA, FLASHMLA")
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if a.backend:
        os.environ["VLLM_ATTENTION_BACKEND"] = a.backend
    import tiny

    a.out.mkdir(parents=True, exist_ok=True)
    _, gguf, vocab = tiny.build("deepseek-v3", a.out, overrides=DIMS)
    from mla_diff.capture import vllm as vcap

    vcap.install(a.out / "cap", model_file=gguf, dtype="bf16")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(str(a.out / "hf"), dtype="bfloat16", enforce_eager=True, compilation_config=0,
              enable_prefix_caching=False, max_num_batched_tokens=a.chunk, max_model_len=256,
              gpu_memory_utilization=0.3)
    prompt = TokensPrompt(prompt_token_ids=[(i * 7919) % vocab for i in range(48)])
    llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))
    vcap.close()
    repo = HERE.parents[2]
    return subprocess.call([str(repo / "target/release/mla-diff"), "run", str(gguf), "--capture",
                            str(a.out / "cap" / "rank0"), "--json", str(a.out / "report.json")])


if __name__ == "__main__":
    sys.exit(main())
