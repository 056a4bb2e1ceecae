#!/usr/bin/env bash
# Lead's #15 call 2 (session o): peak RSS of the whole GLM-5 file at 64 tokens —
# c = 3cc9cb5 (judges let the layer's weights go after the local view's products),
# e = c + mi_collect(true) once per layer, f = e without the next layer's preload.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C
R=$OUT/m; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
echo "commit c $(cat .carry/lead/COMMIT-c)"; nproc
/usr/bin/time -f "fixture wall %e s" $C/mla-diff-c fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local n=$1 bin=$2; shift 2; /usr/bin/time -v $bin run $F --backend cuda -q --json $R/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A9 "^mla-diff: profile" $R/$n.txt | tail -n +2; grep -E "^\[shadow\]|CUDA passes" $R/$n.txt; grep -E "Elapsed|Maximum resident|User time|System time" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; }
run whole-f $C/mla-diff-f $S64
run whole-e $C/mla-diff-e $S64
cmp $R/whole-e.json $R/whole-f.json && echo "e, f: JSON IDENTICAL"
gzip -9 $R/whole-f.json; rm -f $R/whole-e.json
run l40-c $C/mla-diff-c $S64 --layers 0..40
run l40-e $C/mla-diff-e $S64 --layers 0..40
