#!/usr/bin/env bash
# Lead (w), call 2: racecheck (no kernel filter) of the landed attn_wgmma_pairs (main's kernels/, via --kernels)
# on schedules (w)'s call did not cover: two splits starting mid-page on GLM-5, and DeepSeek-V3 with q_len 8.
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=/tmp/mla-diff; xz -dc .carry/lead/mla-diff.xz > $B && chmod +x $B
R=$OUT/race2; mkdir -p $R; echo "binary $(cat .carry/lead/COMMIT) (main), kernels: embedded = this checkout's kernels/"; date -u
i=0
for c in "glm-5-q4_0.gguf|--page-size 64 --prompt-len 330 --chunk 330 --decode-steps 2 --num-splits 2" "deepseek-v3-yarn-q4_k.gguf|--q-len 8 --page-size 64 --prompt-len 200 --decode-steps 2 --num-splits 1"; do
  f=${c%%|*}; s=${c#*|}; n=r$((++i)); t0=$SECONDS
  timeout 85 /usr/local/cuda/bin/compute-sanitizer --tool racecheck $B run fixtures/$f --backend cuda --kernels kernels --mode shadow $s > $R/$n.txt 2>&1
  echo "== racecheck $n $f [$s] exit $? ($((SECONDS-t0)) s); races outside cuBLAS: $(grep 'Race reported' $R/$n.txt | grep -vc nvjet)"
  grep -E "RACECHECK SUMMARY|Sanitizer Error|^\[shadow\]|decode wgmma|prefill wgmma" $R/$n.txt | head -5
  grep 'Race reported' $R/$n.txt | grep -v nvjet | sed 's/.*Race reported between //; s/+0x[0-9a-f]*//' | sort | uniq -c | head -5
  gzip -9 $R/$n.txt; tar czf $OUT/race2.tar.gz -C $OUT race2
done
rm -rf $R; echo "done ($SECONDS s)"
