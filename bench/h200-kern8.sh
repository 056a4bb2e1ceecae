#!/usr/bin/env bash
# #16 decode, session (u): one device call = Nsight Compute on our two decode schedules and on FlashMLA's
# decode kernel (same shape), probe timings, and optionally the checks and the table (second call).
# Carry the binary, the probe directories and (for FlashMLA) .carry/peers; from the repository root:
#   B=.carry/kern8/mla-diff OUT=$OUT PROBES="…" bash .carry/kern8/h200-kern8.sh
# Env: NCU=1 (ncu: embedded attn_wgmma at H=128 splits 1, PAIRS_DIR's kernel, FlashMLA's splitkv kernel),
#      PROBES (kernel dirs for `bench decode --heads $HEADS --best-only --kernels DIR`),
#      TDIRS (kernel dirs, "embedded" = none, for `bench table --only 3,4 --dtypes bf16 --peers ''`),
#      CHECKS=1, RUNS=1, SANITIZE=1 (memcheck/synccheck/racecheck, no kernel filter), TABLE=1 (+TABLE_ONLY,
#      TABLE_PEERS), RDV (dir: racecheck again with it when the embedded pairs kernel has hazards),
#      RACE_DIRS (section `races`: racecheck of RACE_ARGS per kernel dir),
#      BUDGET (s, default 170), ORDER (sections).
set -uo pipefail
cd "${ROOT:-.}"
NAME=kern8
B=${B:-/tmp/mla-diff}
BUDGET=${BUDGET:-170}
# B, OUT, D, fail, step, left, tmo, ncu_one (redefined below where it differs); $D/env.txt.
source bench/lib.sh
peers_env() {
  [ -d /tmp/peers-site/flash_mla ] || { mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site; }
  export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3
  export MLA_DIFF_SDPA_BACKEND=cudnn
}
ncu_one() { # ncu_one NAME KERNEL-REGEX ARGS…
  local t0=$SECONDS n=$1 k=$2
  shift 2
  timeout $(tmo 60) ncu --clock-control none -k "regex:$k" -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section LaunchStats --section Occupancy "$B" bench decode --heads 128 --best-only --launches 1 "$@" > "$D/ncu-$n.txt" 2>&1
  echo "ncu $n: exit $? ($((SECONDS - t0)) s)"
  grep -E "attn_|flash|Duration|DRAM Throughput|Compute \(SM\)|Executed Ipc A|Issue Slots Busy|Registers Per|Stall|No Eligible|One or More|Shared Memory Throughput|Warp Cycles Per Issued" "$D/ncu-$n.txt" | grep -v '^ *-' | head -24
}
ncu_all() {
  [ "${NCU:-0}" = 1 ] || return 0
  ncu_one tma 'attn_wgmma'
  [ -n "${PAIRS_DIR:-}" ] && ncu_one pairs 'attn_wgmma' --kernels "$PAIRS_DIR"
  peers_env
  ncu_one flashmla 'splitkv_mla_kernel' --peers flashmla
}
BROKEN=0
decode() { # decode NAME [--kernels DIR]
  local t0=$SECONDS rc
  timeout $(tmo 45) "$B" bench decode --heads "${HEADS:-64,128}" --best-only "${@:2}" > "$D/decode-$1.txt" 2>&1
  rc=$?
  echo "bench decode $1: exit $rc ($((SECONDS - t0)) s)"
  [ "$1" = embedded ] && [ $rc -ne 0 ] && BROKEN=1
  grep -E '^decode ' "$D/decode-$1.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/; s/^decode +B=64 //; s/s_k=4096 page=64 d=576\/512 bf16 +//'
  grep -iE "error|not available" "$D/decode-$1.txt" | head -3
}
probes() {
  decode embedded
  for k in ${PROBES:-}; do
    [ "$(left)" -gt 30 ] || { echo "skip probe $k: budget"; continue; }
    decode "$(basename "$k")" --kernels "$k"
  done
}
tshapes() {
  for k in ${TDIRS:-}; do
    [ "$(left)" -gt 35 ] || { echo "skip table $k: budget"; continue; }
    local t0=$SECONDS n extra=()
    n=$(basename "$k"); [ "$k" = embedded ] || extra=(--kernels "$k")
    timeout $(tmo 60) "$B" bench table --only 3,4 --dtypes bf16 --peers '' "${extra[@]}" --json "$D/t34-$n.json" > "$D/t34-$n.txt" 2>&1
    echo "table 3,4 $n: exit $? ($((SECONDS - t0)) s)"
    grep -E "^decode .*splits" "$D/t34-$n.txt" | sed -E 's/ +vs scalar kernel.*//' | head -16
  done
}
checks() {
  [ "$BROKEN" = 0 ] && [ "${CHECKS:-0}" = 1 ] && [ "$(left)" -gt 60 ] || return 0
  local t0=$SECONDS
  timeout $(tmo 100) "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
  step "selftest --backend cuda ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")" $?
  grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
  t0=$SECONDS
  timeout $(tmo 120) "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
  step "gpu-validate ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")" $?
}
S3="--page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 3"  # attn_wgmma (3 splits)
S1="--page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 1"  # attn_wgmma_pairs
S2="--page-size 64 --prompt-len 200 --decode-steps 3 --num-splits 2" # pairs, second split mid-page
# run NAME EXPECTED-EXIT FIXTURE ARGS…
run1() {
  local n=$1 want=$2 f=$3 t0=$SECONDS rc
  shift 3
  [ "$(left)" -gt 25 ] || { echo "skip run $n: budget"; return 0; }
  timeout $(tmo 40) "$B" run "fixtures/$f" --backend cuda "$@" > "$D/run-$n.txt" 2>&1
  rc=$?
  step "run $n ($f $*; $((SECONDS - t0)) s; exit $rc, want $want)" $([ $rc -eq "$want" ] && echo 0 || echo 1)
  grep -E "decode: |verdict|PASS|FAIL|first diverg" "$D/run-$n.txt" | head -3
}
runs() {
  [ "$BROKEN" = 0 ] && [ "${RUNS:-0}" = 1 ] || return 0
  run1 glm5-s3 0 glm-5-q4_0.gguf $S3
  run1 glm5-s1 0 glm-5-q4_0.gguf $S1
  run1 glm5-s2 0 glm-5-q4_0.gguf $S2
  run1 v3-s3 0 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 8
  run1 v3-s1 0 deepseek-v3-yarn-q4_k.gguf $S1 --q-len 8
  run1 minicpm3-s3 0 minicpm3-f32.gguf $S3 --dtype bf16 --q-len 16
  # The planted fault reaches both decode kernels: the run must fail (exit 1) on each.
  run1 glm5-s1-wg2 1 glm-5-q4_0.gguf $S1 --inject wg2_keys_dropped
  run1 glm5-s3-wg2 1 glm-5-q4_0.gguf $S3 --inject wg2_keys_dropped
}
san1() { # san1 NAME TOOL T ARGS… (GLM-5 fixture, no kernel filter)
  local n=$1 tool=$2 tt=$3 t0=$SECONDS rc ours
  shift 3
  [ "$(left)" -gt 25 ] || { echo "skip $n: budget"; return 0; }
  timeout $(tmo "$tt") /usr/local/cuda/bin/compute-sanitizer --tool "$tool" "$B" run fixtures/glm-5-q4_0.gguf --backend cuda "$@" > "$D/$n.txt" 2>&1
  rc=$?
  ours=$(grep -E "Race reported|Invalid|Barrier error|Program hit|Sanitizer Error|Error: " "$D/$n.txt" | grep -vc nvjet)
  step "$n ($*; $((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Sanitizer Error|Race reported" "$D/$n.txt" | sort | uniq -c | head -6
  grep -A3 "Race reported" "$D/$n.txt" | grep -v nvjet | grep -E "attn_|at .*0x" | sort | uniq -c | head -6
  return 0
}
RACE_ARGS="--page-size 64 --prompt-len 200 --decode-steps 3 --num-splits 1 --mode shadow"
sanitize() {
  [ "$BROKEN" = 0 ] && [ "${SANITIZE:-0}" = 1 ] || return 0
  san1 memcheck-s1 memcheck 40 $S1
  san1 memcheck-s2 memcheck 40 $S2
  san1 memcheck-s3 memcheck 40 $S3
  san1 synccheck-s1 synccheck 40 $S1
  san1 racecheck-s1 racecheck 80 $RACE_ARGS
  # A hazard in the pairs kernel: the same racecheck with the hand-overs as full barriers (RDV dir).
  if [ -n "${RDV:-}" ] && grep -A4 "Race reported" "$D/racecheck-s1.txt" | grep -q attn_wgmma_pairs; then
    san1 racecheck-s1-rdv racecheck 80 $RACE_ARGS --kernels "$RDV"
  fi
}
races() { # racecheck of the RACE_ARGS schedule with each RACE_DIRS kernel directory (--kernels)
  local k
  for k in ${RACE_DIRS:-}; do san1 "racecheck-$(basename "$k")" racecheck 80 $RACE_ARGS --kernels "$k"; done
}
table() {
  [ "$BROKEN" = 0 ] && [ "${TABLE:-0}" = 1 ] || return 0
  [ "$(left)" -gt 50 ] || { echo "skip table: budget"; return 0; }
  peers_env
  local t0=$SECONDS
  timeout $(($(left) - 5)) "$B" bench table ${TABLE_ONLY:+--only $TABLE_ONLY} ${TABLE_PEERS:+--peers $TABLE_PEERS} --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table ($((SECONDS - t0)) s)" $?
  cat "$D/table.md"
}
for s in ${ORDER:-ncu_all probes tshapes checks runs sanitize table}; do "$s"; done
tar czf "$OUT/kern8-h200.tar.gz" -C "$OUT" kern8 && cp "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): h200-kern8.sh ($SECONDS s)"
exit $fail
