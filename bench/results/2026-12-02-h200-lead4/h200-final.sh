#!/usr/bin/env bash
# Lead, session r, call 3 on merged main: (1) racecheck over the TMA decode kernel without a kernel filter
# (the filter made the sanitizer fail, kern7's (r)), small page-64 schedule; (2) a DeepSeek-V3.2-dims DSA
# layer past top_k 2048 on the CUDA backend (#17 item 1's preset on the GPU).
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
C=/tmp/lead; mkdir -p $C; tar xJf .carry/lead/bins.tar.xz -C $C; B=$C/mla-m.s
R=$OUT/m; mkdir -p $R
echo "commit $(cat .carry/lead/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
SMALL="--page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 3 --mode shadow"
t0=$SECONDS; timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool racecheck $B run fixtures/glm-5-q4_0.gguf --backend cuda $SMALL > $R/racecheck.txt 2>&1
echo "== racecheck exit $? ($((SECONDS-t0)) s)"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|Sanitizer Error|Race reported|hazard|PASS|FAIL" $R/racecheck.txt | sort | uniq -c | head -12
grep -B2 -A6 "Race reported\|hazard" $R/racecheck.txt | grep -E "at .* in |kernel" | sort | uniq -c | head -10
/usr/bin/time -f "fixture %e s" $B fixture --preset deepseek-v3.2 --layers 1 --quant bf16 -o /tmp/v32.gguf 2>&1 | tail -1
t0=$SECONDS; timeout 200 $B run /tmp/v32.gguf --backend cuda --prompt-len 2304 --chunk 768 --decode-steps 2 --page-size 64 --mode shadow --json $R/v32.json > $R/v32.txt 2>&1
echo "== v32 run exit $? ($((SECONDS-t0)) s)"; tail -25 $R/v32.txt
