#!/usr/bin/env bash
# Issue #17 on the H200: FlashMLA's sparse DECODE over its fp8 cache (sgl-flash-mla 1.0.0,
# flash_mla_with_kvcache with indices, runners/flashmla_sparse.py op sparse_decode) and its sparse prefill
# at 128 heads, on GLM-5-dims DSA layers past top_k 2048, against the fp64 reference, next to our CUDA
# sparse path. One device call (< 220 s):
#   1. bench/probe/flashmla_sparse_decode.py: the fp8 cache bytes against torch's e4m3fn cast, the decode
#      kernel alone against float64 over the fp8 cache (LSE base measured), its time;
#   2. in parallel, each under a timeout (their kernel times may overlap on the GPU; the probe's are alone):
#      a. 64 heads, 3072 prompt tokens in chunks of 1024 + 4 decode steps, --backend cuda with the runner
#         (sparse prefill and sparse decode; MLA_DIFF_RUNNER_TIME: FlashMLA's time per request);
#      b. 128 heads (fixture --heads 128: DeepSeek-V3.2's head count on GLM-5's dims; there is no V3.2
#         preset), 2304 prompt tokens in chunks of 1152 + 2 decode steps, the same runner;
#      c. b's run on our CUDA sparse path alone (MLA_DIFF_PROFILE: sparse_attn's time per launch).
# Prepare here: the release binary, runners/, bench/probe/flashmla_sparse_decode.py and this script in
# .carry/dsa6 (git-ignored), .carry/peers from runners/fetch_peers.sh. On the device, from the repository
# root, carrying .carry/dsa6 and .carry/peers:
#   OUT=$OUT bash .carry/dsa6/h200-dsa6.sh
# $OUT gets summary.txt and results.tar.xz (the device returns at most 8 files).
# Results: bench/results/2026-12-02-h200-dsa6/, bench/RESULTS.md "(p)".
set -uo pipefail
export NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
D=${D:-$PWD/.carry/dsa6}
B=/tmp/mla-diff
OUT=${OUT:?set OUT}
R=/tmp/dsa6-results
mkdir -p "$R"
RUN_T=${RUN_T:-165}
S=$(date +%s)
t() { echo "   [$(( $(date +%s) - S )) s] $*" | tee -a "$R/log.txt"; }
xz -dc "$D/mla-diff.xz" > "$B" && chmod +x "$B"
SITE=/tmp/peers-site
mkdir -p "$SITE" && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C "$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader > "$R/gpu.txt"
echo "cores $(nproc)" >> "$R/gpu.txt"
"$B" --version >> "$R/gpu.txt" 2>&1
"$B" fixture --preset glm-5 --layers 1 --quant bf16 -o /tmp/glm5.gguf > /dev/null
"$B" fixture --preset glm-5 --heads 128 --layers 1 --quant bf16 -o /tmp/glm5-h128.gguf > /dev/null
t fixtures
RUNNERS=$D/runners timeout ${PROBE_T:-30} python3 "$D/flashmla_sparse_decode_probe.py" > "$R/probe.txt" 2>&1
echo "probe exit $?" >> "$R/probe.txt"; t probe
run() {  # name gguf prompt chunk decode-steps [extra args]
  local n=$1 f=$2 p=$3 c=$4 d=$5; shift 5
  /usr/bin/time -f "%e s wall, %M KB" timeout $RUN_T "$B" run "$f" --dtype bf16 --mode shadow \
    --prompt-len $p --chunk $c --decode-steps $d --num-splits 2 --page-size 64 \
    --json "$R/$n.json" "$@" > "$R/$n.txt" 2>&1
  echo "exit $?" >> "$R/$n.txt"
}
FM="python3 $D/runners/flashmla_sparse.py"
MLA_DIFF_RUNNER_TIME=$R/flashmla-times-h64.txt run h64-flashmla /tmp/glm5.gguf 3072 1024 4 --backend cuda --runner "$FM" &
MLA_DIFF_RUNNER_TIME=$R/flashmla-times-h128.txt run h128-flashmla /tmp/glm5-h128.gguf 2304 1152 2 --backend cuda --runner "$FM" &
MLA_DIFF_PROFILE=1 run h128-cuda /tmp/glm5-h128.gguf 2304 1152 2 --backend cuda &
wait; t runs
{
  cat "$R/gpu.txt" "$R/probe.txt"
  for f in "$R"/flashmla-times-*.txt; do echo "== $f"; cat "$f"; done
  echo "== sparse_attn (h128-cuda)"; grep -h "sparse_attn" "$R/h128-cuda.txt" | head -12
  for f in "$R"/h*.txt; do echo "== $f"; grep -v "sparse_attn" "$f" | grep -vE "^\s*$" | tail -40; done
  cat "$R/log.txt"
} > "$OUT/summary.txt" 2>&1
tar cJf "$OUT/results.tar.xz" -C "$R" .
cat "$OUT/summary.txt" | tail -150
