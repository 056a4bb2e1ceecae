#!/usr/bin/env bash
# Lead's #15 call 3: two judges in flight — the whole 78-layer GLM-5 file at 64 tokens, 4 layers default.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=.carry/lead/mla-diff-new; R=$OUT/scale3; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
echo "commit $(cat .carry/lead/COMMIT-new)"; nproc
/usr/bin/time -f "fixture wall %e s" $B fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local n=$1; shift; /usr/bin/time -v "$B" run $F --backend cuda -q --json $R/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A9 "^mla-diff: profile" $R/$n.txt | tail -n +2; grep -E "Elapsed|Maximum resident" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; gzip -9 $R/$n.json; }
run whole-64 $S64
run l4-default --layers 0..4
run l4-64 --layers 0..4 $S64
