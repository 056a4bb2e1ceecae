#!/usr/bin/env bash
# #16 prefill overlap probes in one device call (session (j)): `bench prefill --wgmma-only` for the
# embedded kernels and each probe directory, then the checks of whichever candidates are named.
# Carry the binary, the probe directories and .carry/peers; run from the repository root on the GPU host:
#   B=.carry/kern4/mla-diff OUT=$OUT PROBES=".carry/kern4/base .carry/kern4/kws" bash bench/h200-kern4.sh
# Env: PROBES (kernel dirs timed by `bench prefill --wgmma-only --kernels DIR`), CHECK_DIRS (dirs whose
#      gpu-validate --quick and compute-sanitizer runs are wanted, besides the embedded kernels; "" none),
#      SKIP_CHECKS=1 (embedded selftest + gpu-validate), SANITIZE=1 (embedded), TABLE=1 (`bench table`),
#      BUDGET (seconds: later steps are skipped once it is spent; default 280), ORDER (of the sections
#      probes checks check_dirs sanitize table; that one by default).
set -uo pipefail
cd "${ROOT:-$(dirname "$0")/..}"  # ROOT=. when run from a copy under .carry/
BUDGET=${BUDGET:-280}
NAME=kern4
# B, OUT, D, fail, step, left, tmo, ncu_one; $D/env.txt.
source bench/lib.sh
prefill() { # prefill NAME [--kernels DIR]
  local t0=$SECONDS
  timeout 90 "$B" bench prefill --wgmma-only "${@:2}" > "$D/prefill-$1.txt" 2>&1
  echo "bench prefill --wgmma-only $1: exit $? ($((SECONDS - t0)) s)"
  grep -E '^prefill ' "$D/prefill-$1.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/; s/^prefill +T=4096 //; s/ causal bf16 +/ /'
  grep -iE "error|not available|skipped" "$D/prefill-$1.txt" | head -3
}
probes() {
  prefill embedded
  for k in ${PROBES:-}; do
    [ "$(left)" -gt 40 ] || { echo "skip probe $k: budget"; continue; }
    prefill "$(basename "$k")" --kernels "$k"
  done
}
checks() {
  [ "${SKIP_CHECKS:-0}" != 1 ] && [ "$(left)" -gt 60 ] || return 0
  t0=$SECONDS
  timeout 100 "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
  step "selftest --backend cuda embedded ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")" $?
  grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
  t0=$SECONDS
  timeout 150 "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
  step "gpu-validate embedded ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")" $?
  grep -oE "wgmma [0-9a-z ]+st2" "$D/gpu-validate.txt" | sort | uniq -c | head -4
}
san() { # san NAME [--kernels DIR]: the GLM-5 fixture's run (prefill and decode on attn_wgmma)
  for tool in memcheck synccheck racecheck; do
    [ "$(left)" -gt 30 ] || { echo "skip $tool $1: budget"; continue; }
    local t0=$SECONDS
    timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool $tool "$B" run fixtures/glm-5-q4_0.gguf --backend cuda "${@:2}" > "$D/$tool-$1.txt" 2>&1
    local rc=$?
    local ours
    ours=$(grep -E "Race reported|Invalid|Barrier error|Error:" "$D/$tool-$1.txt" | grep -vc nvjet)
    step "$tool $1 ($((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -ne 124 ] && echo 0 || echo 1)
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$D/$tool-$1.txt" | tail -1
  done
}
check_dirs() {
  for k in ${CHECK_DIRS:-}; do
    [ "$(left)" -gt 40 ] || { echo "skip checks $k: budget"; continue; }
    n=$(basename "$k"); t0=$SECONDS
    timeout 90 "$B" gpu-validate --quick --kernels "$k" > "$D/gpu-validate-$n.txt" 2>&1
    step "gpu-validate --quick --kernels $k ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate-$n.txt")" $?
    san "$n" --kernels "$k"
  done
}
sanitize() { [ "${SANITIZE:-0}" = 1 ] && san embedded; return 0; }
table() {
  [ "${TABLE:-0}" = 1 ] && [ "$(left)" -gt 60 ] || { [ "${TABLE:-0}" = 1 ] && echo "skip table: budget"; return 0; }
  mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
  export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3
  export MLA_DIFF_SDPA_BACKEND=cudnn
  t0=$SECONDS
  timeout $(($(left) - 5)) "$B" bench table --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table ($((SECONDS - t0)) s)" $?
  cat "$D/table.md"
}
# ORDER: the sections, in the order run (a later one is skipped once BUDGET is spent).
for s in ${ORDER:-probes checks check_dirs sanitize table}; do "$s"; done
tar czf "$OUT/kern4-h200.tar.gz" -C "$OUT" kern4 && cp "$D"/prefill-*.txt "$OUT/" 2>/dev/null
cp "$D/table.md" "$D/table.json" "$D/gpu-validate.json" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): bench/h200-kern4.sh ($SECONDS s)"
exit $fail
