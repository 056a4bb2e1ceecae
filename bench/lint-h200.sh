#!/usr/bin/env bash
# `mla-diff lint`'s GPU validation on the H200: what lint says without a GPU, checked against what the
# GPU does. Three parts, each with a timeout; the script goes on after a failure and exits 1 if any
# check did not give the exit code expected.
#
# 1. `kernels check`: compiles every kernel job with NVRTC and fails (exit 2) if the shared memory that
#    src/backend/cuda/plan.rs (lint --backend cuda) computes differs from the compiled PTX's.
# 2. `gpu-validate`: every case now also fails if the kernels the CUDA backend launched differ from
#    plan.rs's choice ("kernel plan ... says"). (A unit test already holds plan.rs to the kernels the
#    H200 launched in bench/results/2026-11-30-h200-host-split-recheck.)
# 3. `lint --runner` with the real runners: their conventions probed on the GPU. Expected: FlashMLA,
#    vLLM TRITON_MLA and torch SDPA clean (exit 0) where their supports take the model; FlashMLA on
#    MiniCPM3 exit 1 (runner.supports.kv_lora_rank, qk_rope); FlashMLA without softmax_scale
#    (runners/bugs/flashmla_no_scale.py) exit 1 with runner.decode.softmax_scale naming the 576^-0.5
#    trap; FlashInfer exit 0 if installed (its declared lse_base verified by the probe), 2 if not.
#
# Prepare here (internet) as for bench/runners-h200.sh: bash runners/fetch_peers.sh (.carry/peers) and
# the release binary in .carry/mla-diff. On the device, from the repository root, carrying both:
#   B=.carry/mla-diff OUT=dir bash bench/lint-h200.sh
# Writes $OUT/lint-h200.log and $OUT/lint-h200.tar.gz (every lint's JSON). About 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
OUT=${OUT:?set OUT to the results folder}
R="$OUT/lint"
mkdir -p "$R"
PY=${PY:-python3}
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }

main() {
fail=0
PEERS=$PWD/.carry/peers
SITE=/tmp/peers-site
if [ -d "$PEERS" ]; then
    mkdir -p "$SITE" && tar xJf "$PEERS/sgl_flash_mla.tar.xz" -C "$SITE"
    export PYTHONPATH="$PEERS:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "no $PEERS: the FlashMLA and vLLM lints will report their runners unsupported (exit 2)"
fi
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader

step "1. kernels check (plan.rs shared memory vs the compiled PTX)"
timeout 240 "$B" kernels check --arch sm_90a,sm_90,sm_80,sm_120 > "$R/kernels-check.txt" 2>&1
rc=$?; echo "kernels check: exit $rc (want 0)"; tail -3 "$R/kernels-check.txt"; [ "$rc" = 0 ] || fail=1

step "2. gpu-validate (plan.rs's kernel choice vs what the backend launched, every case)"
timeout 200 "$B" gpu-validate --json "$R/gpu-validate.json" > "$R/gpu-validate.txt" 2>&1
rc=$?; echo "gpu-validate: exit $rc (want 0)"; grep -E "kernel plan|gpu-validate:" "$R/gpu-validate.txt" | tail -5
[ "$rc" = 0 ] || fail=1

step "3. lint --runner: conventions probed on the GPU"
lint() {  # lint NAME EXPECTED_RC FILE ARGS...
    local name=$1 want=$2; shift 2
    timeout 120 "$B" lint "$@" --backend cuda --json "$R/lint-$name.json" > "$R/lint-$name.txt" 2>&1
    local rc=$?
    echo "lint $name: exit $rc (want $want): $(grep -E '^(error|warning) ' "$R/lint-$name.txt" | cut -c1-160 | tr '\n' '|')$(tail -1 "$R/lint-$name.txt")"
    [ "$rc" = "$want" ] || fail=1
}
timeout 120 "$B" fixture --preset deepseek-v3 --layers 1 --quant q4_k -o /tmp/ds3-full.gguf > /dev/null
timeout 120 "$B" fixture --preset glm-5 --layers 1 --quant q4_0 -o /tmp/glm5-full.gguf > /dev/null
P64=(--page-size 64)
for f in fixtures/deepseek-v3-yarn-q4_k.gguf fixtures/glm-5-q4_0.gguf /tmp/ds3-full.gguf /tmp/glm5-full.gguf; do
    n=$(basename "$f" .gguf)
    lint "$n-flashmla"   0 "$f" "${P64[@]}" --runner "$PY runners/flashmla.py"
    lint "$n-flashmla-fp16" 0 "$f" "${P64[@]}" --dtype fp16 --runner "$PY runners/flashmla.py"
    lint "$n-noscale"    1 "$f" "${P64[@]}" --runner "$PY runners/bugs/flashmla_no_scale.py"
    lint "$n-vllm"       0 "$f" "${P64[@]}" --runner "$PY runners/vllm_triton.py"
    lint "$n-sdpa"       0 "$f" --runner "$PY runners/torch_sdpa.py"
done
lint minicpm3-vllm     0 fixtures/minicpm3-f32.gguf --runner "$PY runners/vllm_triton.py"
lint minicpm3-flashmla 1 fixtures/minicpm3-f32.gguf "${P64[@]}" --runner "$PY runners/flashmla.py"
lint v2lite-flashinfer 2 fixtures/deepseek-v2-lite-bf16.gguf --runner "$PY runners/flashinfer_mla.py"   # 0 if flashinfer is installed
grep -h -o '"check": "runner.decode.softmax_scale"' "$R"/lint-*noscale.json | wc -l | xargs echo "no-scale runs with a softmax_scale error:"

step "done: $SECONDS s; fail=$fail"
return $fail
}

main 2>&1 | tee "$OUT/lint-h200.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/lint-h200.tar.gz" -C "$OUT" lint && rm -rf "$R"
exit "$rc"
