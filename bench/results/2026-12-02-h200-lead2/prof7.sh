#!/usr/bin/env bash
# Lead's #15 call 4 (session l): A/B of the next layer's load beside the reference, back to back:
# a = 55aad61 (load after the reference, same thread), b = 1cfe194 (load beside it). Order b, a, b.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C
R=$OUT/o; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
nproc; /usr/bin/time -f "fixture wall %e s" $C/mla-diff-b fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local b=$1 n=$2; shift 2; /usr/bin/time -v $C/mla-diff-$b run $F --backend cuda -q --json /tmp/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A9 "^mla-diff: profile" $R/$n.txt | tail -n +2 | grep -E "load|reference|wall"; grep -E "Elapsed|Maximum resident" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; }
run b whole-64-b1 $S64
run a whole-64-a $S64
run b whole-64-b2 $S64
