#!/usr/bin/env bash
# Lead's #15 call 1 (session l): the fp64 products on the GPU (cuBLAS DGEMM) and mimalloc.
# old = main b8d0cf1; mi = old + mimalloc; new = d39baf5 (mimalloc + DGEMM engine).
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C; cp .carry/lead/jdiff.py .carry/lead/COMMIT-new $C/; R=$OUT/l; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
echo "commit new $(cat $C/COMMIT-new)"; nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 $C/mla-diff-new gpu-validate --quick > $R/gpu-validate.txt 2>&1; echo "== gpu-validate exit $?"; grep -E "fp64 products|^   [A-Z].*\[|gpu-validate:" $R/gpu-validate.txt
/usr/bin/time -f "fixture wall %e s" $C/mla-diff-new fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local b=$1 n=$2; shift 2; /usr/bin/time -v $C/mla-diff-$b run $F --backend cuda -q --json $R/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A9 "^mla-diff: profile" $R/$n.txt | tail -n +2; grep -E "Elapsed|Maximum resident|User time|System time|Minor" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; }
run new whole-64-new $S64
run new l4-default-new --layers 0..4
run old l4-default-old --layers 0..4
run new l4-64-new --layers 0..4 $S64
run mi l4-64-mi --layers 0..4 $S64
run old l4-64-old --layers 0..4 $S64
for n in l4-default l4-64; do echo "== $n old vs new:"; python3 $C/jdiff.py $R/$n-old.json $R/$n-new.json | tail -3; done
grep -o '"fp64_products": "[^"]*"' $R/l4-64-new.json
gzip -9 $R/*.json
