#!/usr/bin/env bash
# The runners' one GPU validation on the H200 (#10): every runner in runners/ through its real protocol
# with runners/selfcheck.py (float64 checks, no mla-diff), then mla-diff itself with the runners on the
# shipped fixtures and on full-dims DeepSeek-V3 and GLM-5 layers. Aimed at < 6 minutes of device time;
# every step has a timeout and the script goes on after a failure.
#
# Prepare here (internet): bash runners/fetch_peers.sh (writes .carry/peers, ~6 MB) and copy the release
# binary to .carry/mla-diff. Then on the device, from the repository root, carrying .carry/peers and
# .carry/mla-diff:
#   B=.carry/mla-diff bash bench/runners-h200.sh
# Writes $OUT/runners-h200.log (everything printed) and $OUT/runners-h200.tar.gz (selfcheck JSON, each
# mla-diff run's JSON report and text). PY (python3), BUDGET (480 s) and B (.carry/mla-diff) can be set.
# Needs on the device: python3 with torch (CUDA), triton, numpy, safetensors, packaging (the H200 image
# has them), tar with xz. No network.
set -uo pipefail
cd "$(dirname "$0")/.."
export NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
OUT=${OUT:?set OUT to the results folder}
R="$OUT/r"
mkdir -p "$R"
BUDGET=${BUDGET:-430}   # seconds: mla-diff runs starting later are skipped (the device call's limit is 600)
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }

main() {
fail=0

# --- peers: sgl-flash-mla unpacked into a site folder; vLLM modules + shims from .carry/peers ----------
PEERS=$PWD/.carry/peers
SITE=/tmp/peers-site
if [ ! -d "$PEERS" ]; then
    echo "no $PEERS: run 'bash runners/fetch_peers.sh' on a machine with internet and carry .carry/peers"
    exit 2
fi
mkdir -p "$SITE" && tar xJf "$PEERS/sgl_flash_mla.tar.xz" -C "$SITE"
export PYTHONPATH="$PEERS:$SITE${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}

step "environment"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
$PY -c 'import sys, torch, triton, numpy, safetensors; print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__, "| numpy", numpy.__version__, "| safetensors", safetensors.__version__)'
echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none) | ninja: $(command -v ninja || echo none)"
head -4 "$PEERS/MANIFEST.txt"
"$B" --version 2>/dev/null || echo "mla-diff binary: $B ($(stat -c %s "$B" 2>/dev/null) bytes)"

# --- 1. selfcheck: each runner alone against float64 ------------------------------------------------
step "selfcheck --bugs (numpy runner and planted bugs; CPU, bf16)"
echo "(the numpy runner and its planted bugs run in CI: tests/it/runners.rs)"

step "selfcheck: FlashMLA, vLLM Triton MLA, FlashInfer (bf16, fp16)"
timeout 150 $PY runners/selfcheck.py --dtypes bf16,fp16 --cases deepseek,glm5,minicpm3 \
    --runner "$PY runners/flashmla.py" --runner "$PY runners/vllm_triton.py" --runner "$PY runners/flashinfer_mla.py" \
    --json "$R/selfcheck-peers.json" || fail=1

step "selfcheck: torch SDPA prefill (flash; f32 goes to efficient), then cudnn"
timeout 90 $PY runners/selfcheck.py --dtypes bf16,fp16,f32 --cases deepseek,glm5,minicpm3 \
    --runner "$PY runners/torch_sdpa.py" --json "$R/selfcheck-sdpa.json" || fail=1
MLA_DIFF_SDPA_BACKEND=cudnn timeout 60 $PY runners/selfcheck.py --dtypes bf16 --cases deepseek,glm5 \
    --runner "$PY runners/torch_sdpa.py" --json "$R/selfcheck-sdpa-cudnn.json" | grep -E 'describe|^   [A-Z]|passed' || fail=1

# --- 2. mla-diff with the runners ---------------------------------------------------------------------
# >>> LEAD: check the flags below against the merged CLI (docs/runners.md, docs/commands.md); the exit
# >>> code expected is 0 (pass), 1 for the planted bug, 2 for a runner that is unsupported here.
run() {  # run NAME EXPECTED_RC ARGS...: one mla-diff run, its JSON and text kept
    local name=$1 want=$2; shift 2
    if [ "$SECONDS" -gt "$BUDGET" ]; then echo "run $name: skipped (past ${BUDGET}s)"; fail=1; return; fi
    timeout 150 "$B" run "$@" --json "$R/run-$name.json" > "$R/run-$name.txt" 2>&1
    local rc=$?
    echo "run $name: exit $rc (want $want): $(grep -E 'PASS|DIVERGENCE|UNSUPPORTED|unsupported|error' "$R/run-$name.txt" | tail -1 | cut -c1-200)"
    [ "$rc" = "$want" ] || fail=1
}
step "mla-diff: shipped fixtures"
SCHED=(--page-size 64 --num-splits 4)   # FlashMLA takes page 64 only; default schedule otherwise
run ds3-flashmla   0 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/flashmla.py"
run ds3-vllm       0 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/vllm_triton.py"
run ds3-sdpa       0 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/torch_sdpa.py"
run glm5-flashmla  0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/flashmla.py"
run glm5-vllm      0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/vllm_triton.py"
run glm5-vllm-fp16 0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype fp16 "${SCHED[@]}" --runner "$PY runners/vllm_triton.py"
run glm5-sdpa      0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/torch_sdpa.py"
run minicpm3-vllm  0 fixtures/minicpm3-f32.gguf --backend cuda --dtype bf16 --runner "$PY runners/vllm_triton.py"
run minicpm3-flashmla 2 fixtures/minicpm3-f32.gguf --backend cuda --dtype bf16 --runner "$PY runners/flashmla.py"   # 256/32, page 16: unsupported
run v2lite-flashinfer 2 fixtures/deepseek-v2-lite-bf16.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/flashinfer_mla.py"  # no flashinfer here
run ds3-mtp-flashmla 0 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --q-len 2 --runner "$PY runners/flashmla.py"
run glm5-bug-scale 1 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 --runner "$PY runners/bugs/scale_default.py"
run ds3-flashmla-noscale 1 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/bugs/flashmla_no_scale.py"
run glm5-flashmla-noscale 1 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 "${SCHED[@]}" --runner "$PY runners/bugs/flashmla_no_scale.py"

step "mla-diff: full-dims layers (DeepSeek-V3 128 heads, GLM-5 64 heads; one layer each)"
timeout 120 "$B" fixture --preset deepseek-v3 --layers 1 --quant q4_k -o /tmp/ds3-full.gguf && ls -la /tmp/ds3-full.gguf
timeout 120 "$B" fixture --preset glm-5 --layers 1 --quant q4_0 -o /tmp/glm5-full.gguf && ls -la /tmp/glm5-full.gguf
LONG=(--prompt-len 300 --chunk 128 --decode-steps 16 --page-size 64 --num-splits 8 --mode shadow)
run ds3full-flashmla 0 /tmp/ds3-full.gguf --backend cuda --dtype bf16 "${LONG[@]}" --runner "$PY runners/flashmla.py"
run ds3full-vllm     0 /tmp/ds3-full.gguf --backend cuda --dtype bf16 "${LONG[@]}" --runner "$PY runners/vllm_triton.py"
run glm5full-flashmla 0 /tmp/glm5-full.gguf --backend cuda --dtype bf16 "${LONG[@]}" --runner "$PY runners/flashmla.py"
run glm5full-vllm    0 /tmp/glm5-full.gguf --backend cuda --dtype bf16 "${LONG[@]}" --runner "$PY runners/vllm_triton.py"
run glm5full-sdpa    0 /tmp/glm5-full.gguf --backend cuda --dtype bf16 "${LONG[@]}" --runner "$PY runners/torch_sdpa.py"
run ds3full-flashmla-noscale 1 /tmp/ds3-full.gguf --backend cuda --dtype bf16 "${LONG[@]}" --runner "$PY runners/bugs/flashmla_no_scale.py"
# <<< LEAD

step "done: $SECONDS s; fail=$fail"
return $fail
}

main 2>&1 | tee "$OUT/runners-h200.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/runners-h200.tar.gz" -C "$OUT" r && rm -rf "$R"
exit "$rc"
