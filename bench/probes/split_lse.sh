#!/usr/bin/env bash
# Probe (#14) on the GPU host: GLM-5 fixture, the clean runs whose split_lse failed the local view
# (seeds 6 and 8 in fp16, 6 in bf16; 2026-12-01, RESULTS.md history): dump layer 0 and describe the split_lse error.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}; OUT=${OUT:-out}
for run in "fp16 6" "fp16 8" "bf16 6"; do
    set -- $run
    rm -rf "$OUT/dump"
    NO_COLOR=1 "$B" run fixtures/glm-5-q4_0.gguf --backend cuda --mode shadow --dtype $1 --seed $2 \
        --tol split_lse=rel_l2:0 --dump-dir "$OUT/dump" -q > /dev/null 2>&1
    echo "== glm-5 $1 seed $2"
    python3 bench/probes/split_lse.py "$OUT/dump/layer0" 0.0625 131 132 2
done
rm -rf "$OUT/dump"
