#!/usr/bin/env bash
# Lead's #15 call 2 (session r), whole GLM-5 file at 64 tokens, CUDA backend. A = fd58ff4 (call 1: 53.4 s,
# 3.03 GB). C = A + the fp64 products' engine on its own non-blocking stream; CB = C + mi_collect on every
# rayon worker once per layer; S = A over the system allocator (glibc). Then gpu-validate --quick on C.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C
R=$OUT/m; mkdir -p $R; F=/tmp/g5-78.gguf
S64="--prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4"
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
/usr/bin/time -f "fixture wall %e s" $C/mla-A.s fixture --preset glm-5 --quant q4_k -o $F 2>&1 | tail -1
export MLA_DIFF_PROFILE=1
run() { local n=$1 bin=$2; shift 2; /usr/bin/time -v $bin run $F --backend cuda -q --json $R/$n.json "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A11 "^mla-diff: profile" $R/$n.txt | tail -n +2 | grep -v "^\["; grep -E "Elapsed|Maximum resident|User time|System time|Minor" $R/$n.txt | sed 's/^\s*//' | tr '\n' ';'; echo; }
run whole-C $C/mla-C.s $S64
run whole-CB $C/mla-CB.s $S64
run whole-S $C/mla-S.s $S64
for n in CB S; do cmp $R/whole-C.json $R/whole-$n.json && echo "C, $n: JSON IDENTICAL"; done
gzip -9 $R/whole-C.json; rm -f $R/whole-CB.json $R/whole-S.json
unset MLA_DIFF_PROFILE
timeout 90 $C/mla-C.s gpu-validate --quick --dtype bf16 > $R/gv-C.txt 2>&1; echo "== gpu-validate C exit $?"; grep -i -E "fp64 products|pass|fail|within" $R/gv-C.txt | head -20
