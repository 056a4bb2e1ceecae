#!/usr/bin/env bash
# Probe (#14) on the GPU host: dump layer 0 of the GLM-5 fixture's clean runs whose split_out rows came
# closest to their bound (seeds 3 and 4, 2026-12-01) and decompose those rows' errors.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}; OUT=${OUT:-out}
probe() {  # dtype seed rows...
    local dt=$1 seed=$2; shift 2
    rm -rf "$OUT/dump"
    # A zero rel-L2 tolerance makes the end-to-end view fail the layer, which is what --dump-dir dumps.
    NO_COLOR=1 "$B" run fixtures/glm-5-q4_0.gguf --backend cuda --mode shadow --dtype $dt --seed $seed \
        --tol split_out=rel_l2:0 --dump-dir "$OUT/dump" -q > /dev/null 2>&1
    echo "== glm-5 $dt seed $seed"
    python3 bench/probes/split_row.py "$OUT/dump/layer0" 0.0625 $dt 131 "$@"
}
probe fp16 3 316:50:0:0:198 351:16:0:0:198
probe bf16 3 316:7:0:0:198 165:41:0:0:132
probe fp16 4 348:1:1:198:349 141:5:0:0:132
rm -rf "$OUT/dump"
