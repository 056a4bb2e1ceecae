#!/usr/bin/env bash
# #16 decode probes in one device call (session (l)): ncu on the decode kernels, `bench decode` for the
# embedded kernels and each probe directory, then the checks and the table as asked.
# Carry the binary, the probe directories and .carry/peers; run from the repository root on the GPU host:
#   B=.carry/kern5/mla-diff OUT=$OUT PROBES=".carry/kern5/k/pf2 …" bash .carry/kern5/h200-kern5.sh
# Env: NCU=1 (Nsight Compute on attn_wgmma at H=128 and attn_mma at H=16, embedded kernels),
#      PROBES (kernel dirs timed by `bench decode --heads $HEADS --best-only --kernels DIR`; HEADS
#      default 16,128),
#      QUICK_DIRS (dirs whose `gpu-validate --quick` is wanted), CHECKS=1 (embedded selftest + full
#      gpu-validate), SANITIZE=1 (embedded), TABLE=1 (`bench table` with the peers),
#      BUDGET (seconds: later steps are skipped once it is spent; default 270), ORDER (of the sections).
set -uo pipefail
cd "${ROOT:-.}"
BUDGET=${BUDGET:-270}
NAME=kern5
# B, OUT, D, fail, step, left, tmo, ncu_one; $D/env.txt.
source bench/lib.sh
ncu_all() {
  [ "${NCU:-0}" = 1 ] || return 0
  ncu_one h128 'attn_wgmma' 128
  ncu_one h16 'attn_mma' 16
}
decode() { # decode NAME [--kernels DIR]
  local t0=$SECONDS
  timeout 70 "$B" bench decode --heads "${HEADS:-16,128}" --best-only "${@:2}" > "$D/decode-$1.txt" 2>&1
  echo "bench decode $1: exit $? ($((SECONDS - t0)) s)"
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
    timeout 90 "$B" gpu-validate --quick --kernels "$k" > "$D/gpu-validate-$n.txt" 2>&1
    step "gpu-validate --quick --kernels $k ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate-$n.txt")" $?
  done
}
checks() {
  [ "${CHECKS:-0}" = 1 ] && [ "$(left)" -gt 60 ] || return 0
  local t0=$SECONDS
  timeout 100 "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
  step "selftest --backend cuda embedded ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")" $?
  grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
  t0=$SECONDS
  timeout 150 "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
  step "gpu-validate embedded ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")" $?
}
sanitize() {
  [ "${SANITIZE:-0}" = 1 ] || return 0
  for tool in memcheck synccheck racecheck; do
    [ "$(left)" -gt 30 ] || { echo "skip $tool: budget"; continue; }
    local t0=$SECONDS rc ours
    timeout 50 /usr/local/cuda/bin/compute-sanitizer --tool $tool "$B" run fixtures/glm-5-q4_0.gguf --backend cuda > "$D/$tool.txt" 2>&1
    rc=$?
    ours=$(grep -E "Race reported|Invalid|Barrier error|Error:" "$D/$tool.txt" | grep -vc nvjet)
    step "$tool ($((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -ne 124 ] && echo 0 || echo 1)
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$D/$tool.txt" | tail -1
  done
}
table() {
  [ "${TABLE:-0}" = 1 ] || return 0
  [ "$(left)" -gt 60 ] || { echo "skip table: budget"; return 0; }
  mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
  export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3
  export MLA_DIFF_SDPA_BACKEND=cudnn
  local t0=$SECONDS
  timeout $(($(left) - 5)) "$B" bench table ${TABLE_ONLY:+--only $TABLE_ONLY} --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table ($((SECONDS - t0)) s)" $?
  cat "$D/table.md"
}
for s in ${ORDER:-ncu_all probes quick checks sanitize table}; do "$s"; done
tar czf "$OUT/kern5-h200.tar.gz" -C "$OUT" kern5 && cp "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): h200-kern5.sh ($SECONDS s)"
exit $fail
