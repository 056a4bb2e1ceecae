#!/usr/bin/env bash
# The second GPU session of 2026-11-29 (lead): the fault self-test on the CUDA backend, then the full
# gpu-validate sweep against the current calibrated tolerances. Usage on the GPU host:
#   B=path/to/mla-diff OUT=dir bash bench/h200-selftest.sh
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
NO_COLOR=1 timeout 300 "$B" selftest --backend cuda > "$OUT/selftest-cuda.txt" 2>&1
echo "selftest --backend cuda: exit $?"
cat "$OUT/selftest-cuda.txt"
NO_COLOR=1 timeout 200 "$B" gpu-validate --json "$OUT/gpu-validate.json" > "$OUT/gpu-validate.txt" 2>&1
echo "gpu-validate: exit $?"
grep -E "^== |PASS|DIVERGENCE|gpu-validate:" "$OUT/gpu-validate.txt" | tail -40
