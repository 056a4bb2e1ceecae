#!/usr/bin/env bash
# #14's GPU check (coverage): on the H200, with plain `mla-diff run` on the shipped fixtures (the
# kernel-aware default schedule, docs/coverage.md):
#   1. `selftest --backend cuda` (42 runs: the two coverage-probe faults and their controls included);
#   2. `run --backend cuda` on every fixture: must pass, with a coverage section that names the Hopper
#      decode kernel (wgmma) and warns about nothing, and no notice that the host's kernel prediction
#      (src/backend/cuda/plan.rs) disagreed with the device;
#   3. `run --backend cuda --inject wg2_keys_dropped` and `--inject split_tail_dropped` on every fixture:
#      must exit 1, first at split_out; and with the pre-#14 default schedule given explicitly
#      (48 + 16 x 1 tokens, 4 splits): must exit 0 (the gap the new default closes);
#   4. `gpu-validate`.
# Every output goes into $OUT/coverage-h200.tar.gz (one file: the device hands back a limited number).
# Usage on the GPU host:  B=path/to/mla-diff OUT=dir bash bench/h200-coverage.sh   (about 4 minutes)
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
export NO_COLOR=1
D="$OUT/coverage"
mkdir -p "$D"
fail=0
# expect WANT RC WHAT: one summary line; a mismatch fails the script.
expect() {
  local want=$1 rc=$2; shift 2
  if [ "$rc" -eq "$want" ]; then echo "ok    $* (exit $rc)"; else echo "FAIL  $* (exit $rc, expected $want)"; fail=1; fi
}
# A report's coverage and verdict in one line (python3: the device image has it).
summary() {
  python3 - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
c = r.get("coverage") or {}
k = {x["phase"]: x["family"] for x in c.get("kernels", [])}
notices = [n for n in r["run"].get("notices", []) if n.startswith("coverage:")]
print(f"  kernels {k}, {len(c.get('warnings', []))} coverage warning(s), {len(notices)} prediction notice(s), "
      f"first check {r['verdict']['first_check']}")
for w in c.get("warnings", []) + notices:
    print("  " + w)
EOF
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 180 "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
expect 0 $? "selftest --backend cuda ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")"
grep -E "wg2_keys_dropped|split_tail_dropped" "$D/selftest-cuda.txt" | grep -v "^|"
pre14=(--prompt-len 48 --chunk 32 --decode-steps 16 --q-len 1 --page-size 16 --num-splits 4)
for f in fixtures/*.gguf; do
  n=$(basename "$f" .gguf)
  t0=$SECONDS
  timeout 120 "$B" run "$f" --backend cuda --json "$D/run-$n.json" > "$D/run-$n.txt" 2>&1
  expect 0 $? "run $n ($((SECONDS - t0)) s)"
  summary "$D/run-$n.json"
  grep -q '"family": "wgmma"' "$D/run-$n.json" || { echo "FAIL  run $n: decode did not run the wgmma kernel"; fail=1; }
  for fault in wg2_keys_dropped split_tail_dropped; do
    timeout 120 "$B" run "$f" --backend cuda --mode shadow --inject "$fault" --json "$D/inject-$n-$fault.json" > "$D/inject-$n-$fault.txt" 2>&1
    expect 1 $? "run $n --inject $fault"
    summary "$D/inject-$n-$fault.json"
    grep -q '"first_check": "split_out"' "$D/inject-$n-$fault.json" || { echo "FAIL  $n $fault: not first at split_out"; fail=1; }
    timeout 120 "$B" run "$f" --backend cuda --mode shadow --inject "$fault" "${pre14[@]}" --json "$D/pre14-$n-$fault.json" > "$D/pre14-$n-$fault.txt" 2>&1
    expect 0 $? "run $n --inject $fault on the pre-#14 default schedule (not caught there)"
  done
done
t0=$SECONDS
timeout 240 "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
expect 0 $? "gpu-validate ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")"
tar czf "$OUT/coverage-h200.tar.gz" -C "$OUT" coverage && rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): bench/h200-coverage.sh"
exit $fail
