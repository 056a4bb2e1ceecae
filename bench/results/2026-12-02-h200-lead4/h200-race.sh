#!/usr/bin/env bash
# Lead, session r, call 4: racecheck over the TMA decode kernel on a schedule whose decode splits hold
# several full 64-key tiles (two_full_tiles, pipeline_wrap, tail_tile), no kernel filter.
set -uo pipefail; i=0
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C; B=$C/mla-m.s
R=$OUT/m; mkdir -p $R; echo "commit $(cat .carry/lead/COMMIT)"; date -u
for s in "--page-size 64 --prompt-len 300 --chunk 300 --decode-steps 2 --num-splits 1" "--page-size 64 --prompt-len 330 --chunk 330 --decode-steps 2 --num-splits 2"; do
t0=$SECONDS; n=r$((++i)); timeout 230 /usr/local/cuda/bin/compute-sanitizer --tool racecheck $B run fixtures/glm-5-q4_0.gguf --backend cuda --mode shadow $s > $R/$n.txt 2>&1
echo "== racecheck $n [$s] exit $? ($((SECONDS-t0)) s)"; grep -E "RACECHECK SUMMARY|Sanitizer Error|^\[shadow\]|decode wgmma" $R/$n.txt | head -4
echo "races outside cuBLAS: $(grep 'Race reported' $R/$n.txt | grep -vc nvjet)"; gzip -9 $R/$n.txt
done
