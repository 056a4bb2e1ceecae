#!/usr/bin/env bash
# #16 decode probes in one device call (session (r), TMA key loads): ncu on the decode kernels, `bench decode` for the
# embedded kernels and each probe directory, then the checks and the table as asked. When the embedded
# kernels' `bench decode` fails (a hang, a launch error), the steps that run them are skipped.
# Carry the binary, the probe directories and .carry/peers; run from the repository root on the GPU host:
#   B=.carry/kern7/mla-diff OUT=$OUT PROBES=".carry/kern7/k/pf2 …" bash .carry/kern7/h200-kern7.sh
# Env: NCU=1 (Nsight Compute on attn_wgmma at H=128 and attn_mma at H=16, embedded kernels),
#      PROBES (kernel dirs timed by `bench decode --heads $HEADS --best-only --kernels DIR`; HEADS
#      default 16,128),
#      QUICK_DIRS (dirs whose `gpu-validate --quick` is wanted), CHECKS=1 (embedded selftest + full
#      gpu-validate), SANITIZE=1 (embedded), TABLE=1 (`bench table` with the peers),
#      RUNS=1 (plain runs at page 64 on three fixtures), DEC_T (bench decode's timeout, s; default 45),
#      RACE_T (racecheck's timeout, s; default 60), BUDGET (seconds: later steps are skipped once it is spent; default 270), ORDER (of the sections).
set -uo pipefail
cd "${ROOT:-.}"
BUDGET=${BUDGET:-270}
NAME=kern7
# B, OUT, D, fail, step, left, tmo, ncu_one; $D/env.txt.
source bench/lib.sh
ncu_all() {
  [ "${NCU:-0}" = 1 ] || return 0
  ncu_one h128 'attn_wgmma' 128
  ncu_one h16 'attn_mma' 16
}
BROKEN=0
decode() { # decode NAME [--kernels DIR]
  local t0=$SECONDS rc
  timeout $(tmo ${DEC_T:-45}) "$B" bench decode --heads "${HEADS:-16,128}" --best-only "${@:2}" > "$D/decode-$1.txt" 2>&1
  rc=$?
  echo "bench decode $1: exit $rc ($((SECONDS - t0)) s)"
  [ "$1" = embedded ] && [ $rc -ne 0 ] && BROKEN=1
  grep -E '^decode ' "$D/decode-$1.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/; s/^decode +B=64 //; s/s_k=4096 page=64 d=576\/512 bf16 +//'
  grep -iE "error|not available" "$D/decode-$1.txt" | head -3
}
probes() {
  decode embedded
  for k in ${PROBES:-}; do
    [ "$(left)" -gt 40 ] || { echo "skip probe $k: budget"; continue; }
    decode "$(basename "$k")" --kernels "$k"
  done
}
quick() {
  for k in ${QUICK_DIRS:-}; do
    [ "$(left)" -gt 40 ] || { echo "skip quick $k: budget"; continue; }
    local n t0=$SECONDS
    n=$(basename "$k")
    timeout $(tmo 90) "$B" gpu-validate --quick --kernels "$k" > "$D/gpu-validate-$n.txt" 2>&1
    step "gpu-validate --quick --kernels $k ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate-$n.txt")" $?
  done
}
checks() {
  [ "$BROKEN" = 0 ] && [ "${CHECKS:-0}" = 1 ] && [ "$(left)" -gt 60 ] || return 0
  local t0=$SECONDS
  timeout $(tmo 100) "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
  step "selftest --backend cuda embedded ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")" $?
  grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
  t0=$SECONDS
  timeout $(tmo 150) "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
  step "gpu-validate embedded ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")" $?
}
# Plain runs at page 64 (TMA key loads) with splits that do not start on a page, and partial last tiles:
# GLM-5 (64 heads), DeepSeek-V3 with q_len 8 (8 heads: 64 rows), MiniCPM3's 288/256 in bf16 (q_len 16).
SMALL="--page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 3"
runs() {
  [ "$BROKEN" = 0 ] && [ "${RUNS:-0}" = 1 ] || return 0
  local f extra n t0
  for f in "glm-5-q4_0.gguf|" "deepseek-v3-yarn-q4_k.gguf|--q-len 8" "minicpm3-f32.gguf|--dtype bf16 --q-len 16"; do
    [ "$(left)" -gt 30 ] || { echo "skip run $f: budget"; continue; }
    n=${f%%|*}; extra=${f#*|}; t0=$SECONDS
    timeout $(tmo 40) "$B" run "fixtures/$n" --backend cuda $SMALL $extra > "$D/run-$n.txt" 2>&1
    step "run $n $extra ($((SECONDS - t0)) s)" $?
    grep -E "decode: |paths|verdict|PASS|FAIL" "$D/run-$n.txt" | head -3
  done
}
sanitize() {
  [ "$BROKEN" = 0 ] && [ "${SANITIZE:-0}" = 1 ] || return 0
  # Only attn_wgmma (decode and prefill) instrumented, on the small page-64 schedule, so racecheck finishes.
  # RACES: extra racecheck runs "name|--kernels DIR" (the same schedule with other kernel sources).
  local v tool name extra
  for v in "memcheck|embedded|" "synccheck|embedded|" "racecheck|embedded|" ${RACES:-}; do
    tool=${v%%|*}; v=${v#*|}; name=${v%%|*}; extra=${v#*|}
    [ "$(left)" -gt 30 ] || { echo "skip $tool $name: budget"; continue; }
    local t0=$SECONDS rc ours
    timeout $(tmo $([ $tool = racecheck ] && echo "${RACE_T:-60}" || echo 40)) /usr/local/cuda/bin/compute-sanitizer --tool $tool --kernel-name kns=attn_wgmma "$B" run fixtures/glm-5-q4_0.gguf --backend cuda $SMALL $extra > "$D/$tool-$name.txt" 2>&1
    rc=$?
    ours=$(grep -E "Race reported|Invalid|Barrier error|Error:|Program hit|Sanitizer Error" "$D/$tool-$name.txt" | grep -vc nvjet)
    step "$tool $name ($((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Sanitizer Error|hazard|Race reported" "$D/$tool-$name.txt" | head -4
  done
}
table() {
  [ "$BROKEN" = 0 ] && [ "${TABLE:-0}" = 1 ] || return 0
  [ "$(left)" -gt 60 ] || { echo "skip table: budget"; return 0; }
  mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
  export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3
  export MLA_DIFF_SDPA_BACKEND=cudnn
  local t0=$SECONDS
  timeout $(($(left) - 5)) "$B" bench table ${TABLE_ONLY:+--only $TABLE_ONLY} --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table ($((SECONDS - t0)) s)" $?
  cat "$D/table.md"
}
for s in ${ORDER:-ncu_all probes quick checks runs sanitize table}; do "$s"; done
tar czf "$OUT/kern7-h200.tar.gz" -C "$OUT" kern7 && cp "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): h200-kern7.sh ($SECONDS s)"
exit $fail
