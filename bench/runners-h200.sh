#!/usr/bin/env bash
# The runners' GPU validation on the H200 (#10, re-run for #32): every runner in runners/ through its real
# protocol with runners/selfcheck.py (float64 checks, no mla-diff), then mla-diff itself with the runners
# on the shipped fixtures and on full-dims DeepSeek-V3 and GLM-5 layers, all on the **default runner
# schedule** of #32 (the covering schedule within each runner's supports: FlashMLA gets page 64), so every
# run also sends each layer's serving batch (mixed lengths: 2,113 / 1 / shorter than a page / the whole
# sequence / a page + 1 keys), the same batch with padded entries (zero length, NaN query), two requests
# alone, and checks every input file after every reply (`runner_checks` in each JSON; docs/runners.md).
# Plus vLLM's Triton decode with its online-softmax rescale planted in base 2 (#32 item 5, patched in a
# /tmp copy of the extracted module): must pass the classic schedule and fail the default one.
# One device call of at most 9 minutes; every step has a timeout and the script goes on after a failure.
#
# Prepare here (internet): bash runners/fetch_peers.sh (writes .carry/peers, ~6 MB) and copy the release
# binary to .carry/mla-diff. Then on the device, from the repository root, carrying .carry/peers and
# .carry/mla-diff:
#   B=.carry/mla-diff bash bench/runners-h200.sh
# Writes $OUT/runners-h200.log (everything printed, with one `runner checks:` line per run) and
# $OUT/runners-h200.tar.gz (selfcheck JSON, each mla-diff run's JSON report and text). PY (python3),
# BUDGET (470 s) and B (.carry/mla-diff) can be set.
# Needs on the device: python3 with torch (CUDA), triton, numpy, safetensors, packaging (the H200 image
# has them), tar with xz. No network.
set -uo pipefail
cd "$(dirname "$0")/.."
export NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
OUT=${OUT:?set OUT to the results folder}
R="$OUT/r"
mkdir -p "$R"
BUDGET=${BUDGET:-470}   # seconds: mla-diff runs starting later are skipped (the device call: 540 s at most)
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }

main() {
fail=0

# --- peers: sgl-flash-mla unpacked into a site folder; vLLM modules + shims from .carry/peers ----------
PEERS=$PWD/.carry/peers
SITE=/tmp/peers-site
if [ ! -d "$PEERS" ]; then
    echo "no $PEERS: run 'bash runners/fetch_peers.sh' on a machine with internet and carry .carry/peers"
    exit 2
fi
mkdir -p "$SITE" && tar xJf "$PEERS/sgl_flash_mla.tar.xz" -C "$SITE"
export PYTHONPATH="$PEERS:$SITE${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}

step "environment"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
$PY -c 'import sys, torch, triton, numpy, safetensors; print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__, "| numpy", numpy.__version__, "| safetensors", safetensors.__version__)'
echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none) | ninja: $(command -v ninja || echo none)"
head -4 "$PEERS/MANIFEST.txt"
"$B" --version 2>/dev/null || echo "mla-diff binary: $B ($(stat -c %s "$B" 2>/dev/null) bytes)"

# --- 1. selfcheck: each runner alone against float64 ------------------------------------------------
step "selfcheck: FlashMLA, vLLM Triton MLA (bf16, fp16)"
timeout 120 $PY runners/selfcheck.py --dtypes bf16,fp16 --cases deepseek,glm5,minicpm3 \
    --runner "$PY runners/flashmla.py" --runner "$PY runners/vllm_triton.py" \
    --json "$R/selfcheck-peers.json" || fail=1

step "selfcheck: torch SDPA prefill (flash; f32 goes to efficient)"
timeout 60 $PY runners/selfcheck.py --dtypes bf16,fp16,f32 --cases deepseek,glm5,minicpm3 \
    --runner "$PY runners/torch_sdpa.py" --json "$R/selfcheck-sdpa.json" || fail=1

# --- 2. mla-diff with the runners, default runner schedule -------------------------------------------
# >>> LEAD: the exit code expected is 0 (pass), 1 for a planted bug, 2 for a runner unsupported here.
run() {  # run NAME EXPECTED_RC ARGS...: one mla-diff run, its JSON and text kept, its runner checks shown
    local name=$1 want=$2; shift 2
    if [ "$SECONDS" -gt "$BUDGET" ]; then echo "run $name: skipped (past ${BUDGET}s)"; fail=1; return; fi
    local t0=$SECONDS
    timeout 120 "$B" run "$@" --json "$R/run-$name.json" > "$R/run-$name.txt" 2>&1
    local rc=$?
    echo "run $name: exit $rc (want $want), $((SECONDS - t0)) s: $(grep -E 'PASS|DIVERGENCE|UNSUPPORTED|unsupported|error' "$R/run-$name.txt" | tail -1 | cut -c1-200)"
    $PY - "$R/run-$name.json" <<'PYEOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
s = r["run"]["schedule"]
print(f"    schedule: prompt {s['prompt_len']}/{s['chunk']}, {s['decode_steps']} x q_len {s['q_len']}, page {s['page_size']}, {s['num_splits']} splits")
rc = r.get("runner_checks") or {}
print("    " + rc.get("message", "no runner checks"))
for c in rc.get("checks", []):
    if c["status"] != "pass" or c["check"] in ("serving_batch", "padding"):
        print(f"      {c.get('layer', 'all')} {c['check']} {c['what']}: {c['status']} ({c['detail'][:160]})")
for c in r["modes"][0]["layers"][0]["checks"]:
    if c["check"] in ("attn_latent", "attn_latent@runner", "lse[decode]", "lse[decode]@runner", "attn_heads[prefill]", "attn_heads[prefill]@runner"):
        print(f"      {c['check']}: rel-L2 {c['metrics']['rel_l2']:.2e} pass={c['pass']}")
for w in r.get("coverage", {}).get("warnings", []):
    print("    " + w[:200])
PYEOF
    [ "$rc" = "$want" ] || fail=1
}
step "mla-diff: shipped fixtures (default runner schedule, serving batch, padding, inputs)"
run ds3-flashmla   0 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/flashmla.py"
run glm5-flashmla  0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/flashmla.py"
run ds3-vllm       0 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/vllm_triton.py"
run glm5-vllm      0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/vllm_triton.py"
run glm5-vllm-fp16 0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype fp16 --mode shadow --runner "$PY runners/vllm_triton.py"
run minicpm3-vllm  0 fixtures/minicpm3-f32.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/vllm_triton.py"
run ds3-sdpa       0 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/torch_sdpa.py"
run glm5-sdpa      0 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/torch_sdpa.py"
run minicpm3-flashmla 2 fixtures/minicpm3-f32.gguf --backend cuda --dtype bf16 --runner "$PY runners/flashmla.py"   # 256/32: unsupported

step "planted: vLLM's Triton decode with its online-softmax rescale in base 2 (#32 item 5)"
BUGGY=/tmp/vllm-rescale-bug
rm -rf "$BUGGY" && cp -r "$PEERS" "$BUGGY"
n=$(grep -rl 're_scale = tl.exp(e_max - n_e_max)' "$BUGGY" | wc -l)
if [ "$n" -gt 0 ]; then
    grep -rl 're_scale = tl.exp(e_max - n_e_max)' "$BUGGY" | xargs sed -i 's/re_scale = tl.exp(e_max - n_e_max)/re_scale = tl.exp2(e_max - n_e_max)/'
    echo "planted in $n file(s): $(grep -rc 'tl.exp2(e_max - n_e_max)' "$BUGGY" | grep -v ':0' | tr '\n' ' ')"
    CLASSIC=(--prompt-len 48 --chunk 32 --decode-steps 16 --num-splits 4)
    PYTHONPATH="$BUGGY:$SITE" run ds3-vllm-rescale-classic 1 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 --mode shadow "${CLASSIC[@]}" --runner "$PY runners/vllm_triton.py"
    PYTHONPATH="$BUGGY:$SITE" run ds3-vllm-rescale 1 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/vllm_triton.py"
    PYTHONPATH="$BUGGY:$SITE" run glm5-vllm-rescale 1 fixtures/glm-5-q4_0.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/vllm_triton.py"
else
    echo "rescale line not found in the extracted vLLM modules: not planted (grep 'e_max - n_e_max' to adapt)"; fail=1
fi
run ds3-flashmla-noscale 1 fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/bugs/flashmla_no_scale.py"

step "mla-diff: full-dims layers (DeepSeek-V3 128 heads, GLM-5 64 heads; one layer each; default runner schedule)"
timeout 60 "$B" fixture --preset deepseek-v3 --layers 1 --quant q4_k -o /tmp/ds3-full.gguf && ls -la /tmp/ds3-full.gguf
timeout 60 "$B" fixture --preset glm-5 --layers 1 --quant q4_0 -o /tmp/glm5-full.gguf && ls -la /tmp/glm5-full.gguf
run ds3full-flashmla  0 /tmp/ds3-full.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/flashmla.py"
run ds3full-vllm      0 /tmp/ds3-full.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/vllm_triton.py"
run glm5full-flashmla 0 /tmp/glm5-full.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/flashmla.py"
run glm5full-vllm     0 /tmp/glm5-full.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/vllm_triton.py"
run glm5full-sdpa     0 /tmp/glm5-full.gguf --backend cuda --dtype bf16 --mode shadow --runner "$PY runners/torch_sdpa.py"
# <<< LEAD

step "done: $SECONDS s; fail=$fail"
return $fail
}

main 2>&1 | tee "$OUT/runners-h200.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/runners-h200.tar.gz" -C "$OUT" r && rm -rf "$R"
exit "$rc"
