#!/usr/bin/env bash
# Issue #17 on the H200: the CUDA sparse path (kernels/sparse_attn.cu) and the CUDA indexer
# (kernels/indexer.cu) on GLM-5-dims DSA layers past top_k 2048 (3072-token prompts: 1040 of 3088 queries
# sparse), against the fp64 sparse reference, with `selftest --backend cuda` meanwhile (GV=1: also
# gpu-validate --quick). The runs go in parallel on the host's cores (the fp64 reference's heads are
# spread over them too). PROFILE=1 sets MLA_DIFF_PROFILE on the 8-head bf16 run and the 64-head run: the
# CUDA indexer then also times the CPU mirror's scores and top-k on the same operands (stderr).
# Results: bench/RESULTS.md ("2026-12-01 (f)", "(k)"), bench/results/2026-12-01-h200-dsa*/.
# FP8=1 adds an 8-head run with --indexer-keys fp8; NO2304=1 drops the 2304-token run.
# Usage on the GPU host:  B=path/to/mla-diff OUT=dir [RUN_T=250] bash bench/h200-dsa.sh
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/sparse/mla-diff}
S=$(date +%s)
t() { echo "   [$(( $(date +%s) - S )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "cores $(nproc)" >> "$OUT/gpu.txt"
"$B" fixture --preset glm-5 --layers 1 --quant bf16 --heads 8 --hidden 2048 -o /tmp/glm5h8.gguf > /dev/null
"$B" fixture --preset glm-5 --layers 1 --quant bf16 -o /tmp/glm5.gguf > /dev/null
run() {  # name file dtype prompt chunk decode splits timeout [extra args]
  local n=$1 f=$2 d=$3 p=$4 c=$5 dec=$6 s=$7 to=$8; shift 8
  NO_COLOR=1 /usr/bin/time -f "%e s wall, %M KB" timeout $to "$B" run "$f" --backend cuda --dtype $d --mode shadow \
    --prompt-len $p --chunk $c --decode-steps $dec --num-splits $s --page-size 64 \
    --json "$OUT/$n.json" --markdown "$OUT/$n.md" "$@" > "$OUT/$n.txt" 2>&1
  echo "exit $?" >> "$OUT/$n.txt"
}
P=${PROFILE:+1}
MLA_DIFF_PROFILE=$P run glm5h8-bf16-p3072-c512-d16-s4 /tmp/glm5h8.gguf bf16 3072 512 16 4 ${RUN_T:-235} &
run glm5h8-fp16-p3072-c512-d16-s4 /tmp/glm5h8.gguf fp16 3072 512 16 4 ${RUN_T:-235} &
MLA_DIFF_PROFILE=$P run glm5-bf16-p2112-c1024-d4-s2 /tmp/glm5.gguf bf16 2112 1024 4 2 ${RUN_T:-235} &
[ -n "${FULL3K:-}" ] && run glm5-bf16-p3072-c1024-d16-s4 /tmp/glm5.gguf bf16 3072 1024 16 4 ${RUN_T:-235} &
[ -n "${FP8:-}" ] && run glm5h8-bf16-fp8-p3072-c512-d16-s4 /tmp/glm5h8.gguf bf16 3072 512 16 4 ${RUN_T:-235} --indexer-keys fp8 &
[ -z "${NO2304:-}" ] && run glm5h8-bf16-p2304-c512-d8-s4 /tmp/glm5h8.gguf bf16 2304 512 8 4 ${RUN_T:-235} &
NO_COLOR=1 timeout ${SELFTEST_T:-100} "$B" selftest --backend cuda > "$OUT/selftest-cuda.txt" 2>&1
echo "selftest --backend cuda: exit $?"; t
tail -3 "$OUT/selftest-cuda.txt"
grep -E "left out|glm-5-dsa" "$OUT/selftest-cuda.txt" | grep -v "^|" | head -12
if [ -n "${GV:-}" ]; then
  NO_COLOR=1 timeout ${GV_T:-90} "$B" gpu-validate --quick --json "$OUT/gpu-validate.json" > "$OUT/gpu-validate.txt" 2>&1
  echo "gpu-validate --quick: exit $?"; t
  tail -3 "$OUT/gpu-validate.txt"
fi
wait; t
for f in "$OUT"/glm5*.txt; do echo "== $f"; grep -vE "^\s*$" "$f" | grep -v "^|" | tail -16; done
