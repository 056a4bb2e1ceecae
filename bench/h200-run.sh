#!/usr/bin/env bash
# The GPU session of 2026-11-29 (lead): `mla-diff run --backend cuda` on every shipped fixture, two
# dtypes, two schedules (the default, and a long one crossing many page and split boundaries), then
# the full gpu-validate sweep against the calibrated tolerances. Usage on the GPU host:
#   B=path/to/mla-diff OUT=dir bash bench/h200-run.sh
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
mkdir -p "$OUT/r"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fail=0
B="$B" DIR="$OUT/r" bash bench/run-fixtures.sh || fail=1
echo "--- auto picks the GPU:"
"$B" run fixtures/deepseek-v3-yarn-q4_k.gguf --json - 2>/dev/null | grep -E '"backend"|"gpu"' | head -3
echo "--- gpu-validate (full sweep, calibrated tolerances):"
timeout 300 "$B" gpu-validate --json "$OUT/r/gpu-validate.json" 2>&1 | tail -40
echo "gpu-validate exit ${PIPESTATUS[0]}"
tar czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$OUT/r"
exit $fail
