#!/usr/bin/env bash
# #16 in one device call: `bench table` (the issue's six shapes, bf16 and fp16, our fastest correct
# configuration, FlashMLA, vLLM TRITON_MLA and torch's cuDNN SDPA on the same inputs, the ceilings, ratios,
# correctness and floor verdicts) and the checks every kernel change keeps: `selftest --backend cuda` and
# `gpu-validate` (first), compute-sanitizer memcheck / synccheck / racecheck on a run that uses attn_wgmma.
# Carry the binary and the peers (runners/fetch_peers.sh) in .carry; .carry/COMMIT names the commit.
# Usage on the GPU host:  B=.carry/mla-diff OUT=dir bash bench/h200-kern.sh
# Outputs land in $OUT/kern/ as they are written (a call cut short still returns what ran).
# Env: SKIP_CHECKS=1 (selftest, gpu-validate), SKIP_TABLE=1, SKIP_SANITIZERS=1, PROBES (below),
#      DECODE16=1 (`bench decode --heads 16`, every tile, at 1 and 10 back-to-back launches per sample),
#      TABLE_L1=1 (the decode rows of the table, bf16, also at 1 launch per sample: the old timing),
#      PREFILL=1 (`bench prefill`: every prefill tile, wgmma and mma, both head-dim pairs, bf16),
#      TABLE_ONLY (e.g. 5,6: `bench table --only` for the main table).
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
OUT=${OUT:?set OUT}
D="$OUT/kern"
mkdir -p "$D" /tmp/peers-site
tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3 NO_COLOR=1
# The prefill floor is against cuDNN's SDPA.
export MLA_DIFF_SDPA_BACKEND=cudnn
fail=0
step() { # step NAME RC
  echo "$1: exit $2"; [ "$2" -eq 0 ] || fail=1
}
{
  date -u
  echo "commit $(cat .carry/COMMIT 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1
} | tee "$D/env.txt"
# Probes: `bench decode --heads H --best-only --kernels DIR` for each DIR:H in $PROBES (kernel variants with
# parts removed read only for their time, as in RESULTS.md), ./kernels first as the reference.
for p in ${PROBES:-}; do
  k=${p%:*} h=${p##*:}
  timeout 60 "$B" bench decode --heads "$h" --best-only --kernels "$k" > "$D/probe-$(basename "$k")-h$h.txt" 2>&1
  echo "probe $k H=$h: exit $? $(grep -E '^decode  ' "$D/probe-$(basename "$k")-h$h.txt" | sed -E 's/.*(splits [0-9]+) +([0-9.]+) .*/\1: \2 us/' | tr '\n' ' ')"
done
if [ "${DECODE16:-0}" = 1 ]; then
  for n in 1 10; do
    timeout 120 "$B" bench decode --heads 16 --launches $n > "$D/decode16-l$n.txt" 2>&1
    echo "bench decode --heads 16 --launches $n: exit $?"
    grep -E '^decode  ' "$D/decode16-l$n.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+),.*/  \1/; s/^decode +B=64 H=16 s_k=4096 page=64 d=576\/512 bf16 +//'
  done
fi
if [ "${PREFILL:-0}" = 1 ]; then
  timeout 120 "$B" bench prefill > "$D/prefill.txt" 2>&1
  echo "bench prefill: exit $?"
  grep -E '^prefill ' "$D/prefill.txt" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+),.*/  rel-L2 \1/'
fi
if [ "${SKIP_CHECKS:-0}" != 1 ]; then
  t0=$SECONDS
  timeout 100 "$B" selftest --backend cuda > "$D/selftest-cuda.txt" 2>&1
  step "selftest --backend cuda ($((SECONDS - t0)) s): $(tail -1 "$D/selftest-cuda.txt")" $?
  t0=$SECONDS
  timeout 150 "$B" gpu-validate --json "$D/gpu-validate.json" > "$D/gpu-validate.txt" 2>&1
  step "gpu-validate ($((SECONDS - t0)) s): $(tail -1 "$D/gpu-validate.txt")" $?
fi
if [ "${SKIP_TABLE:-0}" != 1 ]; then
  t0=$SECONDS
  timeout 300 "$B" bench table ${TABLE_ONLY:+--only $TABLE_ONLY} --json "$D/table.json" --markdown "$D/table.md" > "$D/table.txt" 2>&1
  step "bench table ($((SECONDS - t0)) s)" $?
  grep -E "^(GPU|ceilings|peer|decode|prefill) " "$D/table.txt" | grep -vE "^(decode|prefill) +(B=|T=)" | head -40
  cat "$D/table.md"
fi
if [ "${TABLE_L1:-0}" = 1 ]; then
  t0=$SECONDS
  timeout 200 "$B" bench table --launches 1 --only 1,2,3,4 --dtypes bf16 --json "$D/table-l1.json" --markdown "$D/table-l1.md" > "$D/table-l1.txt" 2>&1
  step "bench table --launches 1 --only 1,2,3,4 --dtypes bf16 ($((SECONDS - t0)) s)" $?
  cat "$D/table-l1.md"
fi
if [ "${SKIP_SANITIZERS:-0}" != 1 ]; then
  for tool in memcheck synccheck racecheck; do
    t0=$SECONDS
    timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool $tool "$B" run fixtures/glm-5-q4_0.gguf --backend cuda > "$D/$tool.txt" 2>&1
    rc=$?
    # racecheck also reports hazards inside cuBLAS's own split-K GEMMs (nvjet_*, RESULTS.md): only ours count.
    ours=$(grep -E "Race reported|Invalid|Barrier error|Error:" "$D/$tool.txt" | grep -vc nvjet)
    step "$tool (glm-5 fixture: attn_wgmma; $((SECONDS - t0)) s; sanitizer exit $rc; $ours error(s) outside cuBLAS)" $([ "$ours" -eq 0 ] && [ $rc -ne 124 ] && echo 0 || echo 1)
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$D/$tool.txt" | tail -2
  done
fi
# The device hands back a few files: the whole folder as one archive, the table as Markdown and JSON.
tar czf "$OUT/kern-h200.tar.gz" -C "$OUT" kern && cp "$D/table.md" "$D/table.json" "$OUT/" 2>/dev/null
cp "$D/table-l1.md" "$OUT/" 2>/dev/null
rm -rf "$D"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): bench/h200-kern.sh"
exit $fail
