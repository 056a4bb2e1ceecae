#!/usr/bin/env bash
# Issue #17 item 6 on the H200: FlashMLA's sparse prefill (sgl-flash-mla 1.0.0, flash_mla_sparse_fwd,
# runners/flashmla_sparse.py) on a GLM-5-dims DSA layer past top_k 2048 (64 heads, 3072 prompt tokens in
# chunks of 1024 + 4 decode steps), against the fp64 reference, next to our CUDA sparse path on the same
# layer; and the two kernels' times at the run's prefill shapes. One device call (< 200 s):
#   1. bench/probe/flashmla_sparse.py: the kernel alone against float64 (LSE base measured) and timed;
#   2. the runner run (inner path CUDA; MLA_DIFF_RUNNER_TIME: FlashMLA's time per request) and the CUDA
#      run (MLA_DIFF_PROFILE: sparse_attn's time per launch), in parallel, each under a timeout (their
#      kernel times may overlap on the GPU: the probe's time is the one taken alone).
# Prepare here: copy the release binary, runners/, bench/probe/flashmla_sparse.py and this script into
# .carry/dsa5 (git-ignored), have .carry/peers (runners/fetch_peers.sh). On the device, from the
# repository root, carrying .carry/dsa5 and .carry/peers:
#   OUT=$OUT bash .carry/dsa5/h200-dsa5.sh
# Results: bench/results/2026-12-02-h200-dsa5/, bench/RESULTS.md "(m)".
set -uo pipefail
export NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
D=${D:-$PWD/.carry/dsa5}
B=$D/mla-diff
OUT=${OUT:?set OUT}
RUN_T=${RUN_T:-150}
S=$(date +%s)
t() { echo "   [$(( $(date +%s) - S )) s]"; }
SITE=/tmp/peers-site
mkdir -p "$SITE" && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C "$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | tee "$OUT/gpu.txt"
echo "cores $(nproc)" >> "$OUT/gpu.txt"
"$B" fixture --preset glm-5 --layers 1 --quant bf16 -o /tmp/glm5.gguf > /dev/null
run() {  # name timeout [extra args]
  local n=$1 to=$2; shift 2
  /usr/bin/time -f "%e s wall, %M KB" timeout $to "$B" run /tmp/glm5.gguf --dtype bf16 --mode shadow \
    --prompt-len 3072 --chunk 1024 --decode-steps 4 --num-splits 2 --page-size 64 \
    --json "$OUT/$n.json" "$@" > "$OUT/$n.txt" 2>&1
  echo "exit $?" >> "$OUT/$n.txt"
}
timeout ${PROBE_T:-30} python3 "$D/flashmla_sparse_probe.py" > "$OUT/probe.txt" 2>&1
echo "probe exit $?" >> "$OUT/probe.txt"; t
MLA_DIFF_RUNNER_TIME=$OUT/flashmla-times.txt run glm5-flashmla-sparse $RUN_T --backend cuda \
  --runner "python3 $D/runners/flashmla_sparse.py" &
MLA_DIFF_PROFILE=1 run glm5-cuda $RUN_T --backend cuda &
wait; t
cat "$OUT/probe.txt"
grep -h "sparse_attn" "$OUT/glm5-cuda.txt" | head -12
cat "$OUT/flashmla-times.txt" 2>/dev/null | head -12
for f in "$OUT"/glm5*.txt; do echo "== $f"; grep -v "sparse_attn" "$f" | grep -vE "^\s*$" | tail -22; done
