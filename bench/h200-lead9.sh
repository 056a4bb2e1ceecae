#!/usr/bin/env bash
# Lead, 2026-12-02 (aa): one device call on merged main (pre9's prefill, h16's attn_small, dec9's pairs decode
# kernel, all embedded) — the checks each branch owed, then #16's whole table from one run:
#   checks:   selftest --backend cuda, gpu-validate (all kernels at once);
#   runs:     fixture runs taking attn_small (DeepSeek-V3 8 heads at q_len 2 / page 32, MiniCPM3 q_len 4, fp16),
#             with three planted decode faults that must fail them (exit 1);
#   sanitize: compute-sanitizer (no kernel filter) memcheck / synccheck on GLM-5 with two splits starting
#             mid-page (pairs decode + TMA prefill with its maps as a parameter) and on attn_small's schedule;
#             racecheck on DeepSeek-V3 q_len 8 (pairs at 64 rows) and on attn_small's schedule (dec9 and pre9
#             racechecked GLM-5's two mid-page splits and its prefill on their own calls);
#   table:    `bench table` (every row, FlashMLA + vLLM TRITON_MLA + cuDNN SDPA), bf16 and fp16.
# Carry .carry/lead9 (mla-diff.xz, COMMIT) and .carry/peers; from the repository root:
#   OUT=$OUT BUDGET=… ORDER="checks runs table sanitize" bash bench/h200-lead9.sh
set -uo pipefail
NAME=lead9
B=/tmp/mla-diff
xz -dc .carry/lead9/mla-diff.xz > $B && chmod +x $B
BUDGET=${BUDGET:-500}
source bench/lib.sh
# One step: its exit code captured before anything else runs (a `$(tail …)` in the same line would
# overwrite `$?`).
timed() { # timed LABEL T FILE CMD…
  local label=$1 t=$2 f=$3 t0=$SECONDS rc
  shift 3
  [ "$(left)" -gt 30 ] || { echo "skip $label: budget"; fail=1; return 0; }
  timeout "$(tmo "$t")" "$@" > "$f" 2>&1
  rc=$?
  step "$label ($((SECONDS - t0)) s): $(tail -1 "$f" | cut -c1-160)" $rc
}
checks() {
  timed "selftest --backend cuda" 90 "$D/selftest-cuda.txt" "$B" selftest --backend cuda
  grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
  timed gpu-validate 120 "$D/gpu-validate.txt" "$B" gpu-validate --json "$D/gpu-validate.json"
  grep -iE "FAIL|mismatch" "$D/gpu-validate.txt" | head -5
}
run1() { # run1 NAME EXPECTED-EXIT FIXTURE ARGS…
  local n=$1 want=$2 f=$3 t0=$SECONDS rc
  shift 3
  [ "$(left)" -gt 40 ] || { echo "skip run $n: budget"; fail=1; return 0; }
  timeout "$(tmo 40)" "$B" run "fixtures/$f" --backend cuda "$@" > "$D/run-$n.txt" 2>&1
  rc=$?
  step "run $n ($f $*; $((SECONDS - t0)) s; exit $rc, want $want)" "$([ $rc -eq "$want" ] && echo 0 || echo 1)"
  grep -E "attn_small|pairs|verdict|first diverg" "$D/run-$n.txt" | head -3
}
S3="--page-size 64 --prompt-len 200 --decode-steps 3 --num-splits 3"
runs() {
  run1 v3-q2-s3 0 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2
  run1 v3-q1-p32 0 deepseek-v3-yarn-q4_k.gguf --page-size 32 --prompt-len 77 --decode-steps 3 --num-splits 1
  run1 minicpm3-q4-s3 0 minicpm3-f32.gguf $S3 --dtype bf16 --q-len 4
  run1 v3-q2-s3-fp16 0 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --dtype fp16
  run1 glm5-default 0 glm-5-q4_0.gguf
  run1 v3-q2-wg2 1 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --inject wg2_keys_dropped
  run1 v3-q2-tail 1 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --inject split_tail_dropped
  run1 v3-q2-past 1 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --inject read_past_end
}
san1() { # san1 NAME TOOL T FIXTURE ARGS… (no kernel filter: it breaks racecheck)
  local n=$1 tool=$2 tt=$3 f=$4 t0=$SECONDS rc ours
  shift 4
  [ "$(left)" -gt 45 ] || { echo "skip $n: budget"; fail=1; return 0; }
  timeout "$(tmo "$tt")" /usr/local/cuda/bin/compute-sanitizer --tool "$tool" "$B" run "fixtures/$f" --backend cuda --mode shadow "$@" > "$D/$n.txt" 2>&1
  rc=$?
  ours=$(grep -E "Race reported|Invalid|Barrier error|Program hit|Sanitizer Error|Error: " "$D/$n.txt" | grep -vc nvjet)
  step "$n ($f $*; $((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" "$([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Sanitizer Error|decode: |prefill: " "$D/$n.txt" | sort | uniq -c | head -6
  grep 'Race reported' "$D/$n.txt" | grep -v nvjet | sed 's/.*Race reported between //; s/+0x[0-9a-f]*//g' | sort | uniq -c | head -6
  gzip -9 "$D/$n.txt"
}
sanitize() {
  # One layer each (the kernels are the same in every layer): the sanitizers slow the fp64 side 10-50x.
  local G="--layers 0 --page-size 64 --prompt-len 330 --chunk 330 --decode-steps 2 --num-splits 2"
  san1 memcheck-glm5-2split memcheck 60 glm-5-q4_0.gguf $G
  san1 synccheck-glm5-2split synccheck 60 glm-5-q4_0.gguf $G
  san1 memcheck-small memcheck 40 deepseek-v3-yarn-q4_k.gguf --layers 0 $S3 --q-len 2
  san1 synccheck-small synccheck 40 deepseek-v3-yarn-q4_k.gguf --layers 0 $S3 --q-len 2
  san1 race-v3-q8 racecheck 100 deepseek-v3-yarn-q4_k.gguf --layers 0 --q-len 8 --page-size 64 --prompt-len 200 --decode-steps 2 --num-splits 1
  san1 race-small racecheck 90 deepseek-v3-yarn-q4_k.gguf --layers 0 --page-size 64 --prompt-len 96 --decode-steps 2 --num-splits 2 --q-len 2
}
table() {
  [ "$(left)" -gt 120 ] || { echo "skip table: budget"; fail=1; return 0; }
  mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
  local t0=$SECONDS rc
  PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site" MLA_DIFF_PYTHON=python3 MLA_DIFF_SDPA_BACKEND=cudnn \
    timeout $(($(left) - 10)) "$B" bench table --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  rc=$?
  step "bench table ($((SECONDS - t0)) s)" $rc
  cat "$D/table.md"
}
# Call 2 (ORDER="rule race2 profile", no peers; binary with attn_small's split rule): racecheck where call 1's schedules were thin — attn_small over a ring
# that wraps (one split of 200 keys: 7 tiles through 2 stages) and GLM-5's two mid-page splits on the merged
# kernels — and ncu of the pairs kernel at B=64 H=128 one split, beside (u)'s 46.0 M instructions.
race2() {
  san1 race-small-wrap racecheck 60 deepseek-v3-yarn-q4_k.gguf --layers 0 --page-size 64 --prompt-len 200 --decode-steps 2 --num-splits 1 --q-len 2
  san1 race-glm5-2split racecheck 90 glm-5-q4_0.gguf --layers 0 --page-size 64 --prompt-len 330 --chunk 330 --decode-steps 2 --num-splits 2
}
# attn_small's split rule (host only, after call 1): 8 splits of ~25 keys must run on attn_mma (label
# without "attn_small"), 3 splits on attn_small.
rule() {
  run1 v3-q2-s8 0 deepseek-v3-yarn-q4_k.gguf --page-size 64 --prompt-len 200 --decode-steps 2 --num-splits 8 --q-len 2
  run1 v3-q2-s3b 0 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2
}
profile() {
  local t0=$SECONDS rc
  [ "$(left)" -gt 50 ] || { echo "skip profile: budget"; return 0; }
  timeout "$(tmo 70)" ncu --clock-control none -k "regex:attn_wgmma_pairs" -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section LaunchStats --section Occupancy \
    "$B" bench decode --heads 128 --best-only --launches 1 > "$D/ncu-pairs.txt" 2>&1
  rc=$?
  step "ncu attn_wgmma_pairs H=128 ($((SECONDS - t0)) s)" $rc
  grep -E "attn_|Duration|Elapsed Cycles|DRAM Throughput|Compute \(SM\)|Executed Ipc A|Issue Slots Busy|Executed Instructions |Registers Per|No Eligible|One or More|Shared Memory Throughput|Warp Cycles Per Issued|SM Frequency" "$D/ncu-pairs.txt" | grep -v '^ *-' | head -24
}
for s in ${ORDER:-checks runs table sanitize}; do "$s"; done
echo "left: $(left) s"
cp "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
tar czf "$OUT/lead9-h200.tar.gz" -C "$OUT" lead9 && rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): h200-lead9.sh ($SECONDS s)"
exit $fail
