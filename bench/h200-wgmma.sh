#!/usr/bin/env bash
# GPU session 3 of 2026-11-29: the Hopper wgmma decode kernel (kernels/attention_sm90.cuh). Decode bench
# (every tile against the scalar kernel), prefill bench, the gpu-validate sweep, the CUDA self-test, a memcheck of a
# run that uses attn_wgmma, then `run --backend cuda` on every fixture (as bench/h200-run.sh). Usage:
#   B=path/to/mla-diff OUT=dir bash bench/h200-wgmma.sh
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
fail=0
mkdir -p "$OUT/w"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
NO_COLOR=1 timeout 240 "$B" bench decode --backend cuda --json "$OUT/w/bench-decode.json" > "$OUT/w/bench-decode.txt" 2>&1
echo "bench decode: exit $?"; cat "$OUT/w/bench-decode.txt"
NO_COLOR=1 timeout 120 "$B" bench prefill --backend cuda --json "$OUT/w/bench-prefill.json" > "$OUT/w/bench-prefill.txt" 2>&1
echo "bench prefill: exit $?"; cat "$OUT/w/bench-prefill.txt"
NO_COLOR=1 timeout 240 "$B" gpu-validate --json "$OUT/w/gpu-validate.json" > "$OUT/w/gpu-validate.txt" 2>&1
echo "gpu-validate: exit $?"; tail -45 "$OUT/w/gpu-validate.txt"
NO_COLOR=1 timeout 120 "$B" selftest --backend cuda > "$OUT/w/selftest-cuda.txt" 2>&1
echo "selftest --backend cuda: exit $?"; tail -12 "$OUT/w/selftest-cuda.txt"
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck "$B" run fixtures/glm-5-q4_0.gguf --backend cuda > "$OUT/w/memcheck.txt" 2>&1
echo "memcheck (glm-5 fixture, 64 heads: attn_wgmma): exit $?"; tail -4 "$OUT/w/memcheck.txt"
for tool in racecheck synccheck; do
  timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool $tool "$B" run fixtures/glm-5-q4_0.gguf --backend cuda > "$OUT/w/$tool.txt" 2>&1
  echo "$tool (glm-5 fixture: attn_wgmma): exit $?"; tail -3 "$OUT/w/$tool.txt"
done
B="$B" DIR="$OUT/w" bash bench/run-fixtures.sh || fail=1
tar czf "$OUT/wgmma.tar.gz" -C "$OUT" w && rm -rf "$OUT/w"
exit $fail
