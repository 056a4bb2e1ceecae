#!/usr/bin/env bash
# Lead's #15 call 1 (session o): memory split (sampler), one judge vs two, mimalloc purge, --gpus 0,0.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C; A=$C/mla-diff-a; B=$C/mla-diff-b
R=$OUT/m; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
echo "commit $(cat .carry/lead/COMMIT-a)"; nproc; nvidia-smi --query-gpu=name,memory.used --format=csv
/usr/bin/time -f "fixture wall %e s" $A fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local n=$1 bin=$2; shift 2; /usr/bin/time -v $bin run $F --backend cuda -q --json $R/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A9 "^mla-diff: profile" $R/$n.txt | tail -n +2; grep -E "^\[shadow\]|CUDA passes|GPU worker" $R/$n.txt; grep -E "Elapsed|Maximum resident|User time|System time" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; }
# --gpus: 8 layers one process vs two workers on the one GPU; the JSON must be byte-identical.
unset MLA_DIFF_PROFILE
run l8-one $A --layers 0..8 $S64
run l8-gpus00 $A --layers 0..8 $S64 --gpus 0,0
run l8-gpusall $A --layers 0..8 $S64 --gpus all
cmp $R/l8-one.json $R/l8-gpus00.json && echo "GPUS 0,0: JSON IDENTICAL"; cmp $R/l8-one.json $R/l8-gpusall.json && echo "GPUS all: JSON IDENTICAL"
export MLA_DIFF_PROFILE=1
run whole-a $A $S64
run whole-b1judge $B $S64
MIMALLOC_PURGE_DELAY=0 run whole-a-purge0 $A $S64
cmp $R/whole-a.json $R/whole-b1judge.json && echo "1 judge: JSON IDENTICAL"
cmp $R/whole-a.json $R/whole-a-purge0.json && echo "purge0: JSON IDENTICAL"
for f in $R/*.json; do gzip -9 $f; done
rm -f $R/l8-*.json.gz
