#!/usr/bin/env bash
# #16 prefill probes and checks in one device call (session (v): TMA loads, head-first CTA order, a third
# K/V stage): `bench prefill --wgmma-only` for the embedded kernels and each probe directory, then the
# checks of the embedded kernels as asked. When the embedded kernels' bench fails, the steps that run
# them are skipped. Carry the binary and the probe directories; run from the repository root:
#   B=/tmp/mla-diff OUT=$OUT PROBES=".carry/pref8/base …" bash .carry/pref8/h200-pref8.sh
# Env: PROBES (kernel dirs timed by `bench prefill --wgmma-only --kernels DIR`), QUICK=1 (embedded
#      gpu-validate --quick), RUNS=1 (default-schedule runs on three fixtures; RUN_KERNELS: from this kernel
#      dir, e.g. one that traps when a prefill launch does not take the TMA path), CHECKS=1 (selftest + full
#      gpu-validate), SANITIZE=1 (memcheck / synccheck / racecheck, every kernel instrumented, on a small
#      GLM-5 schedule that prefills several tiles and a context pass), TABLE=1 (`bench table --only 5,6`:
#      cuDNN from torch), BUDGET (s; later steps are skipped once spent; default 270), ORDER.
set -uo pipefail
cd "${ROOT:-.}"
NAME=pref8
B=${B:-/tmp/mla-diff}
BUDGET=${BUDGET:-270}
BROKEN=0
# B, OUT, D, fail, step, left, tmo, ncu_one (redefined below where it differs); $D/env.txt.
source bench/lib.sh
prefill() { # prefill NAME [--kernels DIR]
  local t0=$SECONDS
  timeout $(tmo ${PRE_T:-60}) "$B" bench prefill --wgmma-only "${@:2}" > "$D/prefill-$1.txt" 2>&1
  local rc=$?
  echo "bench prefill --wgmma-only $1: exit $rc ($((SECONDS - t0)) s)"
  [ "$1" = embedded ] && [ $rc -ne 0 ] && BROKEN=1
  grep -E '^prefill ' "$D/prefill-$1.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/; s/^prefill +T=4096 //; s/ causal bf16 +/ /'
  grep -iE "error|TMA|not available|skipped" "$D/prefill-$1.txt" | head -4
}
probes() {
  prefill embedded
  for k in ${PROBES:-}; do
    [ "$(left)" -gt 40 ] || { echo "skip probe $k: budget"; continue; }
    prefill "$(basename "$k")" --kernels "$k"
  done
}
quick() {
  [ "$BROKEN" = 0 ] && [ "${QUICK:-0}" = 1 ] && [ "$(left)" -gt 40 ] || return 0
  local t0=$SECONDS
  timeout $(tmo 90) "$B" gpu-validate --quick > "$D/gpu-validate-quick.txt" 2>&1
  step "gpu-validate --quick embedded ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate-quick.txt")" $?
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
# The default (kernel-aware) schedule: chunks crossing the prefill tiles, a context pass and the merge.
runs() {
  [ "$BROKEN" = 0 ] && [ "${RUNS:-0}" = 1 ] || return 0
  local f extra n t0
  for f in "glm-5-q4_0.gguf|" "deepseek-v3-yarn-q4_k.gguf|" "minicpm3-f32.gguf|--dtype bf16"; do
    [ "$(left)" -gt 30 ] || { echo "skip run $f: budget"; continue; }
    n=${f%%|*}; extra=${f#*|}; t0=$SECONDS
    timeout $(tmo 40) "$B" run "fixtures/$n" --backend cuda $extra ${RUN_KERNELS:+--kernels $RUN_KERNELS} > "$D/run-$n.txt" 2>&1
    step "run $n $extra ($((SECONDS - t0)) s)" $?
    grep -E "prefill: |verdict|PASS|FAIL" "$D/run-$n.txt" | head -3
  done
}
# Small GLM-5 schedule: chunk 0 (160 tokens: 2 query tiles, 3 key tiles), chunk 1 (140) over 160 cached keys.
SMALL="--prompt-len 300 --chunk 160 --decode-steps 2 --page-size 64 --num-splits 2"
sanitize() {
  [ "$BROKEN" = 0 ] && [ "${SANITIZE:-0}" = 1 ] || return 0
  local tool t0 rc ours
  for tool in memcheck synccheck racecheck; do
    [ "$(left)" -gt 30 ] || { echo "skip $tool: budget"; continue; }
    t0=$SECONDS
    timeout $(tmo $([ $tool = racecheck ] && echo "${RACE_T:-90}" || echo ${SAN_T:-45})) /usr/local/cuda/bin/compute-sanitizer --tool $tool "$B" run fixtures/glm-5-q4_0.gguf --backend cuda $SMALL > "$D/$tool.txt" 2>&1
    rc=$?
    ours=$(grep -E "Race reported|Invalid|Barrier error|Error:|Program hit|Sanitizer Error" "$D/$tool.txt" | grep -vc nvjet)
    step "$tool ($((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -ne 124 ] && echo 0 || echo 1)
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Sanitizer Error|Race reported" "$D/$tool.txt" | sort | uniq -c | head -4
  done
}
table() {
  [ "$BROKEN" = 0 ] && [ "${TABLE:-0}" = 1 ] || return 0
  [ "$(left)" -gt 50 ] || { echo "skip table: budget"; return 0; }
  export MLA_DIFF_PYTHON=python3 MLA_DIFF_SDPA_BACKEND=cudnn
  local t0=$SECONDS
  timeout $(($(left) - 5)) "$B" bench table --only 5,6 --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table --only 5,6 ($((SECONDS - t0)) s)" $?
  cat "$D/table.md"
}
# LATE_PROBES: kernel dirs timed after everything else, while budget is left.
late() {
  for k in ${LATE_PROBES:-}; do
    [ "$(left)" -gt 35 ] || { echo "skip probe $k: budget"; continue; }
    prefill "$(basename "$k")" --kernels "$k"
  done
}
for s in ${ORDER:-probes quick runs checks sanitize table late}; do "$s"; done
tar czf "$OUT/pref8-h200.tar.gz" -C "$OUT" pref8 && cp "$D"/prefill-*.txt "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): bench/h200-pref8.sh ($SECONDS s)"
exit $fail
