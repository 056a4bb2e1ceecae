#!/usr/bin/env bash
# #16 decode at 16 heads, session (y): one device call = probe timings (kernel dirs: attn_small's group /
# stage variants, loads-only probes of it and of attn_mma), then with attn_small embedded: selftest,
# gpu-validate, fixture runs that take attn_small (and planted faults that must fail them), the
# sanitizers on one, and `bench table --only 2` (B=64 H=16 s_k=4k) with FlashMLA in the same run.
# Call 1 (837d0ad, SM_NG 2 embedded) ran PROBES="mma-loads loads-ng2ns5 loads-ng1ns2 ng1ns5 ng2ns3 ng1ns2";
# the checks of the landed default (SM_NG 1, SM_NS 2) are ORDER="probes table runs checks sanitize"
# with PROBES="" (about 230 s of command).
# Carry .carry/h16 (mla-diff.xz, COMMIT, k.tar.xz: the probe dirs) and .carry/peers; from the repository root:
#   OUT=$OUT bash .carry/h16/h200-h16.sh
# Env: PROBES (dir names in .carry/h16/k.tar.xz), BUDGET (s, default 250), ORDER (sections).
set -uo pipefail
cd "${ROOT:-.}"
NAME=h16
B=/tmp/mla-diff
xz -dc .carry/h16/mla-diff.xz > $B && chmod +x $B
BUDGET=${BUDGET:-250}
source bench/lib.sh
mkdir -p /tmp/h16k && { [ ! -f .carry/h16/k.tar.xz ] || tar xJf .carry/h16/k.tar.xz -C /tmp/h16k; }
K=/tmp/h16k/k
PROBES=${PROBES-}
BROKEN=0
decode() { # decode NAME HEADS [--kernels DIR]
  local t0=$SECONDS rc
  timeout $(tmo 40) "$B" bench decode --heads "$2" --best-only "${@:3}" > "$D/decode-$1.txt" 2>&1
  rc=$?
  echo "bench decode $1: exit $rc ($((SECONDS - t0)) s)"
  [ "$1" = embedded ] && [ $rc -ne 0 ] && BROKEN=1
  grep -E '^decode ' "$D/decode-$1.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/; s/^decode +B=64 //; s/s_k=4096 page=64 d=576\/512 bf16 +//'
  grep -iE "error|not available" "$D/decode-$1.txt" | head -3
}
probes() {
  decode embedded 16,32
  for k in ${PROBES:-}; do
    [ "$(left)" -gt 190 ] || { echo "skip probe $k: budget"; continue; }
    decode "$k" 16 --kernels "$K/$k"
  done
}
checks() {
  [ "$BROKEN" = 0 ] || return 0
  local t0=$SECONDS
  timeout $(tmo 60) "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
  step "selftest --backend cuda ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")" $?
  grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
  t0=$SECONDS
  timeout $(tmo 90) "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
  step "gpu-validate ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")" $?
  grep -iE "small|1x4w|FAIL" "$D/gpu-validate.txt" | head -8
}
# DeepSeek-V3 fixture (8 heads) at q_len 2: 16 rows, the 1x4w bn32 module, page 64, 3 splits of ~67 keys
# (splits start and end mid-tile: the masked head of a first tile, the zeroed rows past a last one).
S3="--page-size 64 --prompt-len 200 --decode-steps 3 --num-splits 3"
run1() { # run1 NAME EXPECTED-EXIT FIXTURE ARGS…
  local n=$1 want=$2 f=$3 t0=$SECONDS rc
  shift 3
  [ "$(left)" -gt 60 ] || { echo "skip run $n: budget"; return 0; }
  timeout $(tmo 30) "$B" run "fixtures/$f" --backend cuda "$@" > "$D/run-$n.txt" 2>&1
  rc=$?
  step "run $n ($f $*; $((SECONDS - t0)) s; exit $rc, want $want)" $([ $rc -eq "$want" ] && echo 0 || echo 1)
  grep -E "attn_small|decode: |verdict|first diverg" "$D/run-$n.txt" | head -3
}
runs() {
  [ "$BROKEN" = 0 ] || return 0
  run1 v3-q2-s3 0 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2
  run1 v3-q1-s1 0 deepseek-v3-yarn-q4_k.gguf --page-size 32 --prompt-len 77 --decode-steps 3 --num-splits 1
  run1 minicpm3-q4-s3 0 minicpm3-f32.gguf $S3 --dtype bf16 --q-len 4
  run1 v3-q2-s3-fp16 0 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --dtype fp16
  # Planted faults in the attention core must fail the run on attn_small (exit 1).
  run1 v3-q2-wg2 1 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --inject wg2_keys_dropped
  run1 v3-q2-tail 1 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --inject split_tail_dropped
  run1 v3-q2-past 1 deepseek-v3-yarn-q4_k.gguf $S3 --q-len 2 --inject read_past_end
}
san1() { # san1 NAME TOOL T ARGS… (DeepSeek-V3 fixture, no kernel filter)
  local n=$1 tool=$2 tt=$3 t0=$SECONDS rc ours
  shift 3
  [ "$(left)" -gt 50 ] || { echo "skip $n: budget"; return 0; }
  timeout $(tmo "$tt") /usr/local/cuda/bin/compute-sanitizer --tool "$tool" "$B" run fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda "$@" > "$D/$n.txt" 2>&1
  rc=$?
  ours=$(grep -E "Race reported|Invalid|Barrier error|Program hit|Sanitizer Error|Error: " "$D/$n.txt" | grep -vc nvjet)
  step "$n ($*; $((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Sanitizer Error|Race reported" "$D/$n.txt" | sort | uniq -c | head -6
  grep -A3 "Race reported" "$D/$n.txt" | grep -v nvjet | grep -E "attn_|at .*0x" | sort | uniq -c | head -6
  gzip -9 "$D/$n.txt"
  return 0
}
sanitize() {
  [ "$BROKEN" = 0 ] || return 0
  san1 memcheck memcheck 40 $S3 --q-len 2 --mode shadow
  san1 synccheck synccheck 40 $S3 --q-len 2 --mode shadow
  # racecheck of call 1 (prompt 200) did not finish in 43 s: a shorter prefill.
  san1 racecheck racecheck 90 --page-size 64 --prompt-len 96 --decode-steps 2 --num-splits 2 --q-len 2 --mode shadow
}
table() {
  [ "$BROKEN" = 0 ] || return 0
  [ "$(left)" -gt 40 ] || { echo "skip table: budget"; return 0; }
  [ -d /tmp/peers-site/flash_mla ] || { mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site; }
  export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3
  local t0=$SECONDS
  timeout $(($(left) - 6)) "$B" bench table --only 2 --peers flashmla --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table --only 2 ($((SECONDS - t0)) s)" $?
  cat "$D/table.md"
  grep -E "^decode " "$D/table.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/' | head -12
}
for s in ${ORDER:-probes table runs checks sanitize}; do "$s"; done
echo "left: $(left) s"
tar czf "$OUT/h16-h200.tar.gz" -C "$OUT" h16 && cp "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): h200-h16.sh ($SECONDS s)"
exit $fail
