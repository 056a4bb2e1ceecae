#!/usr/bin/env bash
# Lead's #15 call 1 (session r): whole GLM-5 file at 64 tokens, CUDA backend —
# main = 8d26474 (last session's), A = fd58ff4 (the view's weight products next to free mode's pass; judges
# hold no weights; live heap counted), P = A + the next layer preloaded by the reference's thread.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C
R=$OUT/m; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
echo "commit A $(cat .carry/lead/COMMIT)"; nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
/usr/bin/time -f "fixture wall %e s" $C/mla-A.s fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local n=$1 bin=$2; shift 2; /usr/bin/time -v $bin run $F --backend cuda -q --json $R/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A11 "^mla-diff: profile" $R/$n.txt | tail -n +2; grep -E "^\[shadow\]" $R/$n.txt; grep -E "Elapsed|Maximum resident|User time|System time" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; }
run whole-A $C/mla-A.s $S64
run whole-P $C/mla-P.s $S64
run whole-main $C/mla-main.s $S64
for n in P main; do cmp $R/whole-A.json $R/whole-$n.json && echo "A, $n: JSON IDENTICAL"; done
gzip -9 $R/whole-A.json; rm -f $R/whole-P.json $R/whole-main.json
