#!/usr/bin/env bash
# Lead's #15 call 3 (session l): 1cfe194 = + the next layer's load beside the reference.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C; B=$C/mla-diff-new
R=$OUT/n; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
echo "commit $(cat .carry/lead/COMMIT-new)"; nproc
/usr/bin/time -f "fixture wall %e s" $B fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local n=$1; shift; /usr/bin/time -v $B run $F --backend cuda -q --json $R/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A9 "^mla-diff: profile" $R/$n.txt | tail -n +2; grep -E "^\[shadow\]|CUDA passes" $R/$n.txt; grep -E "Elapsed|Maximum resident|User time|System time" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; gzip -9 $R/$n.json; }
run whole-64 $S64
