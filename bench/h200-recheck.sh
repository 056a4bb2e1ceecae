#!/usr/bin/env bash
# #12's GPU re-check: the same binary commands before and after the CUDA host code was split into typed
# launch wrappers. The fault self-test, the gpu-validate sweep, `run --backend cuda` on every fixture
# (bench/run-fixtures.sh), a memcheck of one run, and the decode/prefill benches. Usage on the GPU host:
#   B=path/to/mla-diff OUT=dir bash bench/h200-recheck.sh
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
export NO_COLOR=1
fail=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 120 "$B" selftest --backend cuda > "$OUT/selftest-cuda.txt" 2>&1
echo "selftest --backend cuda: exit $? ($((SECONDS-t0)) s)"; tail -2 "$OUT/selftest-cuda.txt"
t0=$SECONDS
timeout 200 "$B" gpu-validate --json "$OUT/gpu-validate.json" > "$OUT/gpu-validate.txt" 2>&1
echo "gpu-validate: exit $? ($((SECONDS-t0)) s)"; tail -3 "$OUT/gpu-validate.txt"
t0=$SECONDS
mkdir -p "$OUT/runs"
B="$B" DIR="$OUT/runs" bash bench/run-fixtures.sh || fail=1
# One file: the device hands back a limited number of files.
tar czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$OUT/runs"
echo "fixture sweep: $((SECONDS-t0)) s"
t0=$SECONDS
timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck "$B" run fixtures/glm-5-q4_0.gguf --backend cuda --prompt-len 77 --chunk 32 --decode-steps 9 --page-size 16 --num-splits 3 > "$OUT/memcheck.txt" 2>&1
echo "memcheck: exit $? ($((SECONDS-t0)) s)"; tail -2 "$OUT/memcheck.txt"
timeout 120 "$B" bench decode --backend cuda --best-only --json "$OUT/bench-decode.json" > "$OUT/bench-decode.txt" 2>&1
echo "bench decode: exit $?"; cat "$OUT/bench-decode.txt"
timeout 90 "$B" bench prefill --backend cuda --json "$OUT/bench-prefill.json" > "$OUT/bench-prefill.txt" 2>&1
echo "bench prefill: exit $?"; cat "$OUT/bench-prefill.txt"
exit $fail
