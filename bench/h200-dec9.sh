#!/usr/bin/env bash
# #16 decode, session (x) (branch dec9): one device call. The per-tile instruction cuts of attn_wgmma_pairs
# (embedded: every WA_* lever on) against main's kernels (k/base) and each lever off (k/no*, --kernels);
# `bench table --only 1,3,4` with FlashMLA (bf16, fp16; every split count on both schedules: the pairs
# rule's evidence); then the landing gates on the embedded kernel: selftest cuda, gpu-validate, racecheck
# (no kernel filter) of GLM-5 at two splits starting mid-page and DeepSeek-V3 at q_len 8, memcheck,
# synccheck; ncu of the embedded pairs kernel last. From the repository root, .carry/dec9 and
# .carry/peers carried:  OUT=$OUT bash .carry/dec9/h200-dec9.sh
set -uo pipefail
NAME=dec9
B=/tmp/mla-diff
xz -dc .carry/dec9/mla-diff.xz > $B && chmod +x $B
mkdir -p /tmp/k && tar xJf .carry/dec9/k.tar.xz -C /tmp && K=/tmp/k
BUDGET=${BUDGET:-340}
source bench/lib.sh 2>/dev/null || source .carry/dec9/lib.sh
peers_env() {
  [ -d /tmp/peers-site/flash_mla ] || { mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site; }
  export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3
  export MLA_DIFF_SDPA_BACKEND=cudnn
}
BROKEN=0
decode() { # decode NAME HEADS [--kernels DIR]
  local t0=$SECONDS rc
  [ "$(left)" -gt 25 ] || { echo "skip decode $1: budget"; return 0; }
  timeout $(tmo 40) "$B" bench decode --heads "$2" --best-only "${@:3}" > "$D/decode-$1.txt" 2>&1
  rc=$?
  echo "bench decode $1: exit $rc ($((SECONDS - t0)) s)"
  [ "$1" = embedded ] && [ $rc -ne 0 ] && BROKEN=1
  grep -E '^decode ' "$D/decode-$1.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/; s/^decode +B=64 //; s/s_k=4096 page=64 d=576\/512 bf16 +//; s/wgmma 2 warpgroups bn64 st2 //; s/ +[0-9]+ +[0-9.]+% +[0-9.]+ +[0-9.]+% / /'
  grep -iE "error|not available" "$D/decode-$1.txt" | head -3
}
table() {
  [ "$BROKEN" = 0 ] && [ "$(left)" -gt 60 ] || { echo "skip table: budget/broken"; return 0; }
  peers_env
  local t0=$SECONDS
  timeout $(tmo 110) "$B" bench table --only 1,3,4 --peers flashmla --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table --only 1,3,4 --peers flashmla ($((SECONDS - t0)) s)" $?
  cat "$D/table.md" 2>/dev/null | head -12
  grep -E "^decode .*(B=128|B=16)" "$D/table.txt" | sed -E 's/ +vs scalar kernel.*//; s/wgmma 2 warpgroups bn64 st2 //; s/ +[0-9]+ +[0-9.]+% +[0-9.]+ +[0-9.]+% / /' | head -34
}
checks() {
  [ "$BROKEN" = 0 ] && [ "$(left)" -gt 40 ] || { echo "skip checks"; return 0; }
  local t0=$SECONDS
  timeout $(tmo 70) "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
  step "selftest --backend cuda ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")" $?
  grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
  [ "$(left)" -gt 40 ] || { echo "skip gpu-validate"; return 0; }
  t0=$SECONDS
  timeout $(tmo 90) "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
  step "gpu-validate ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")" $?
}
san1() { # san1 NAME TOOL T FIXTURE ARGS… (no kernel filter)
  local n=$1 tool=$2 tt=$3 f=$4 t0=$SECONDS rc ours
  shift 4
  [ "$(left)" -gt 25 ] || { echo "skip $n: budget"; return 0; }
  timeout $(tmo "$tt") /usr/local/cuda/bin/compute-sanitizer --tool "$tool" "$B" run "fixtures/$f" --backend cuda "$@" > "$D/$n.txt" 2>&1
  rc=$?
  ours=$(grep -E "Race reported|Invalid|Barrier error|Program hit|Sanitizer Error|Error: " "$D/$n.txt" | grep -vc nvjet)
  step "$n ($f $*; $((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Sanitizer Error|^\[shadow\]|decode wgmma" "$D/$n.txt" | sort | uniq -c | head -6
  grep -A3 "Race reported" "$D/$n.txt" | grep -v nvjet | grep -E "attn_|at .*0x" | sort | uniq -c | head -6
  gzip -9 "$D/$n.txt"
  return 0
}
G2="--mode shadow --page-size 64 --prompt-len 330 --chunk 330 --decode-steps 2 --num-splits 2"
V8="--mode shadow --q-len 8 --page-size 64 --prompt-len 200 --decode-steps 2 --num-splits 1"
sanitize() {
  [ "$BROKEN" = 0 ] || return 0
  san1 racecheck-glm5-s2 racecheck 75 glm-5-q4_0.gguf $G2
  san1 racecheck-v3-q8 racecheck 60 deepseek-v3-yarn-q4_k.gguf $V8
  san1 memcheck-glm5-s2 memcheck 35 glm-5-q4_0.gguf $G2
  san1 synccheck-glm5-s2 synccheck 35 glm-5-q4_0.gguf $G2
}
ncu_pairs() {
  [ "$BROKEN" = 0 ] && [ "$(left)" -gt 30 ] || { echo "skip ncu: budget"; return 0; }
  local t0=$SECONDS
  timeout $(tmo 45) ncu --clock-control none -k "regex:attn_wgmma_pairs" -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section LaunchStats --section Occupancy "$B" bench decode --heads 128 --best-only --launches 1 > "$D/ncu-pairs.txt" 2>&1
  echo "ncu pairs: exit $? ($((SECONDS - t0)) s)"
  grep -E "attn_|Duration|DRAM Throughput|Compute \(SM\)|Executed Ipc A|Issue Slots Busy|Executed Instructions |Registers Per|No Eligible|Shared Memory Throughput|Warp Cycles Per Issued|Elapsed Cycles|SM Frequency" "$D/ncu-pairs.txt" | grep -v '^ *-' | head -20
}
probes() {
  decode embedded 64,128
  decode base 64,128 --kernels $K/base
  for v in nodesc nonomask noskipscale noffma noftz; do decode $v 128 --kernels $K/$v; done
}
for s in ${ORDER:-probes table checks sanitize ncu_pairs}; do "$s"; done
tar czf "$OUT/dec9-h200.tar.gz" -C "$OUT" dec9 && cp "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): h200-dec9.sh ($SECONDS s)"
exit $fail
