#!/usr/bin/env bash
# Correctness checks of the CUDA backend on a GPU host (the H200 calls of bench/RESULTS.md): the gates
# every kernel change passes before it lands (docs/gpu.md), one device call.
#
# Usage, from the repository root on the GPU host:
#   [B=mla-diff] [OUT=dir] [BUDGET=s] [KERNELS=dir|probe.patch] bash bench/gpu-check.sh [STEP…]
# STEPs (default: selftest validate runs sanitize), run in the order given, each under a timeout; a step
# starting with less than ~30 s of BUDGET left is skipped (and the call fails):
#   selftest   `selftest --backend cuda` (every planted fault caught, every clean run passing)
#   validate   `gpu-validate` (18 case runs against the CPU mirror, the fp64 products, plan.rs's kernel choice)
#   fixtures   `run --backend cuda` on every shipped fixture × bf16/fp16 × {default schedule; 777 prompt tokens in
#              chunks of 256, 64 decode steps, page 64, 8 splits}: must pass
#   runs       runs that take each decode kernel (attn_wgmma_pairs at page 64, attn_small at 16 rows, page 32,
#              MiniCPM3's 288-wide rows), then the planted decode faults on attn_small, which must fail (exit 1)
#   batch      the serving batch on our decode kernel (#32 item 6: 5 requests of mixed lengths in one launch,
#              per-entry seq_lens and block tables): every fixture at page 16 and 64 (bf16, fp16) must pass
#              with its batch checks in the JSON; planted combine faults must fail the batch's own checks
#   variants   every fixture's plain run (bf16, fp16) reaches every production variant (the sparse one by a fixed selection), those its schedule
#              does not by batches aimed at them (#35 item 2), each aimed batch on the kernel it names; then
#              --inject sparse_index_page_base must fail GLM-5's sparse aimed batch
#   faults35   the kernel-variant catalogue faults (#35 item 4): `run --inject pairs_handover_stale | small_ring_wrap |
#              tma_page_tile` on every fixture (bf16) must exit 1 with a failing variant_batch aimed at the fault's
#              kernel where the fixture's variants include it, 0 elsewhere; one line per case
#   contract   split_lse_bf16 (an LSE stored in bf16 before the combine) fails a plain run of every fixture first
#              at split_lse (the LSE's f32 storage contract, #35)
#   coverage   every fixture's plain run names the Hopper decode kernel without warnings; wg2_keys_dropped and
#              split_tail_dropped must fail first at split_out (docs/coverage.md)
#   sanitize   compute-sanitizer (no kernel filter: it breaks racecheck) memcheck / synccheck / racecheck, one
#              layer each: GLM-5 with two splits starting mid-page (TMA prefill, pairs decode), attn_small's
#              schedule and a ring that wraps, DeepSeek-V3 q_len 8 (pairs at 64 rows); passes when no error
#              or hazard is reported outside cuBLAS's nvjet_* GEMMs
#   localview  clean runs with the stage-local view deciding: every fixture × bf16/fp16 × SEEDS (default "0 1"),
#              JOBS at a time (default 5); SENSITIVITY=1 adds `selftest --sensitivity --backend cuda`
#   detect     `selftest --sensitivity`, `run --repeat 5` per fixture, `sweep --splits` and a length sweep
#   lint       `kernels check` (plan.rs's shared memory vs the PTX) and `lint --runner` on the real runners
#              (needs .carry/peers from runners/fetch_peers.sh)
#   dsa        sparse GLM-5 layers past top_k 2048 (8 heads at 3072 + 16 tokens, bf16 / fp16 / fp8 indexer keys;
#              64 heads at 2112 + 4) against the fp64 sparse reference, in parallel (docs/dsa.md)
#   dsa_flashmla  FlashMLA's sparse prefill and decode through runners/flashmla_sparse.py on a GLM-5 layer
#              (64 heads, 3072 + 4), beside our CUDA sparse path; the kernels alone first
#              (bench/probes/flashmla_sparse*.py); then with --kv-cache-dtype fp8_ds_mla (the cache sent
#              as its bytes) and lint's probe of both ops' cache convention; needs .carry/peers
#   fp8peers   the dense peers over the per-tensor fp8 cache (#38 item 6; the cache sent as its bytes, written by
#              the CPU mirror: CUDA refuses `fp8`): FlashMLA's dense fp8 decode (runners/flashmla.py, bf16: its
#              output is bf16 only; q in e4m3 too, conventions.q_fp8) and vLLM's Triton decode
#              (runners/vllm_triton.py, bf16 and fp16) on DeepSeek-V3 and GLM-5 (fixtures, page 64) must pass, and
#              `lint --kv-cache-dtype fp8` on each; runners/bugs/cache/{flashmla,vllm}_fp8_scale_twice.py (the scale
#              passed twice) must fail (exit 1); needs .carry/peers
#   v4         DeepSeek-V4 on its CUDA kernels (kernels/v4/, #37): clean runs of V4-Flash's dims (`fixture --preset
#              deepseek-v4 --layers 3`: a window, a CSA and an HCA layer) and of the golden, bf16/fp16, seeds 1-2, must
#              pass; each V4 fault planted in its layer must exit 1 first at its catalogue stage, on both files; then
#              compute-sanitizer memcheck on the golden. One line per run (verdict, worst check); stderr tails on errors
#   formats    quantized KV caches on CUDA (#38, kernels/cache_write.cu `cache_write_format`): every fixture with
#              a 512 + 64 row × fp8_ds_mla × bf16/fp16 and a generated glm5-next (512 + 0) × fp8_ds_mla_nope /
#              fp8_v41 / fp4_v41 × bf16 must pass; each planted cache fault must fail (exit 1) first at
#              cache_rows; the per-tensor `--kv-cache-dtype fp8` on every fixture × bf16/fp16/f32 must pass, and
#              kv_scale_twice / kv_scale_inverted / kv_saturate_240 with it must fail first at cache_rows
#   kpool      glm5-next's k-pool indexer on the GPU (kernels/kpool.cu, `run --backend cuda`'s own): the golden (395 tokens, top_k 16, kpool 4) in
#              bf16/fp16/f32 and bf16 with fp8 indexer keys must pass with the dsa section naming CUDA's own
#              indexer; each layer's GPU scores and selection against the CPU mirror's on the same input
#              (MLA_DIFF_PROFILE's line); then kpool_no_ape, kpool_softmax_channels, kpool_no_tail (layer 3),
#              kpool_from_position_zero (layer 1 and layer 2 sharing its selection, --pos-offset 5) and
#              kpool_shared_own_indexer (layer 2) must exit 1 failing exactly those layers' selection checks
#              with the stage checks clean; compute-sanitizer memcheck on a clean run. (kpool_shared_wrong_layer
#              needs two full layers before a shared one: the golden has one; it is host routing,
#              src/run/kpool.rs, the same code as on the CPU.)
#              KPOOL_BACKEND=cpu runs the same step on the CPU mirror (a dry run of its expectations, no GPU).
# KERNELS: a kernel directory or a probe patch (bench/probes/*.patch, applied to a copy of kernels/)
# passed to selftest / validate / runs / sanitize as `--kernels`, to check a kernel before it is embedded.
# B defaults to target/release/mla-diff, or .carry/check/mla-diff.xz when carried. Outputs go to
# $OUT/check/ (one file per step) and are packed into $OUT/check.tar.gz; the summary is on stdout.
# Exit 0 when every step passed.
set -uo pipefail
NAME=check
source bench/lib.sh
KX=()
[ -n "${KERNELS:-}" ] && { KX=(--kernels "$(kdir "$KERNELS")") || exit 2; }
V3=fixtures/deepseek-v3-yarn-q4_k.gguf
G5=fixtures/glm-5-q4_0.gguf
MC=fixtures/minicpm3-f32.gguf

selftest() {
    timed "selftest --backend cuda" 300 "$D/selftest-cuda.txt" "$B" selftest --backend cuda "${KX[@]}"
    grep -E "FAIL|MISSED|ERROR" "$D/selftest-cuda.txt" | head -5
}
validate() {
    timed gpu-validate 150 "$D/gpu-validate.txt" "$B" gpu-validate "${KX[@]}" --json "$D/gpu-validate.json"
    grep -iE "FAIL|mismatch|kernel plan" "$D/gpu-validate.txt" | head -5
}
fixtures() {
    local f n dt s
    for f in fixtures/*.gguf; do
        n=$(basename "$f" .gguf)
        for dt in bf16 fp16; do
            for s in default long; do
                local extra=()
                [ $s = long ] && extra=(--prompt-len 777 --chunk 256 --decode-steps 64 --page-size 64 --num-splits 8)
                timed "run $n $dt $s" 120 "$D/fixture-$n-$dt-$s.txt" "$B" run "$f" --backend cuda --dtype $dt \
                    "${extra[@]}" --json "$D/fixture-$n-$dt-$s.json"
            done
        done
    done
}
# run1 NAME WANT FIXTURE ARGS…: one run that must exit WANT.
run1() {
    local n=$1 want=$2 f=$3 t0=$SECONDS rc
    shift 3
    [ "$(left)" -gt 40 ] || { echo "skip run $n: budget"; fail=1; return 0; }
    timeout "$(tmo 60)" "$B" run "$f" --backend cuda "${KX[@]}" "$@" > "$D/run-$n.txt" 2>&1
    rc=$?
    expect "$want" $rc "run $n ($(basename "$f") $*; $((SECONDS - t0)) s)"
    grep -E "decode: |verdict|first diverg" "$D/run-$n.txt" | head -3
}
S3="--page-size 64 --prompt-len 200 --decode-steps 3 --num-splits 3"
runs() {
    run1 g5-pairs-s1 0 $G5 --page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 1
    run1 g5-pairs-s2 0 $G5 --page-size 64 --prompt-len 200 --decode-steps 3 --num-splits 2
    run1 v3-q8-s3 0 $V3 --page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 3 --q-len 8
    run1 mc3-q16 0 $MC --page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 3 --dtype bf16 --q-len 16
    run1 v3-small-s3 0 $V3 $S3 --q-len 2
    run1 v3-small-fp16 0 $V3 $S3 --q-len 2 --dtype fp16
    run1 v3-small-p32 0 $V3 --page-size 32 --prompt-len 77 --decode-steps 3 --num-splits 1
    run1 mc3-small-q4 0 $MC $S3 --dtype bf16 --q-len 4
    run1 g5-default 0 $G5
    local fault
    for fault in wg2_keys_dropped split_tail_dropped read_past_end; do
        run1 "v3-small-$fault" 1 $V3 $S3 --q-len 2 --inject $fault
    done
    run1 g5-pairs-wg2 1 $G5 --page-size 64 --prompt-len 77 --decode-steps 3 --num-splits 1 --inject wg2_keys_dropped
}
# batch_checks JSON: the serving batch's checks of a CUDA run (one line each), exit 1 unless there are some.
batch_checks() {
    python3 - "$1" <<'PYEOF'
import json, sys
rc = (json.load(open(sys.argv[1])).get("runner_checks") or {})
checks = [c for c in rc.get("checks", []) if c.get("check") == "serving_batch"]
print("    " + rc.get("message", "no runner checks"))
for c in checks[:4]:
    print(f"    {c.get('what')}: {c.get('status')} {c.get('detail', '')[:150]}")
sys.exit(0 if checks else 1)
PYEOF
}
batch() {
    local f n dt page rc
    for f in fixtures/*.gguf; do
        n=$(basename "$f" .gguf)
        for dt in bf16 fp16; do
            for page in 16 64; do
                [ "$(left)" -gt 40 ] || { echo "skip batch $n: budget"; fail=1; return 0; }
                timeout "$(tmo 90)" "$B" run "$f" --backend cuda "${KX[@]}" --dtype $dt --page-size $page \
                    --json "$D/batch-$n-$dt-$page.json" > "$D/batch-$n-$dt-$page.txt" 2>&1
                rc=$?
                expect 0 $rc "batch $n $dt page $page"
                batch_checks "$D/batch-$n-$dt-$page.json" || { echo "FAIL  batch $n $dt page $page: no serving_batch checks"; fail=1; }
            done
        done
    done
    local fault
    for fault in lse_log2_merge split_drop_last; do
        timeout "$(tmo 90)" "$B" run $G5 --backend cuda "${KX[@]}" --page-size 64 --inject $fault \
            --json "$D/batch-g5-$fault.json" > "$D/batch-g5-$fault.txt" 2>&1
        expect 1 $? "batch g5 --inject $fault"
        python3 -c 'import json,sys; r=json.load(open(sys.argv[1])).get("runner_checks") or {}; f=[c for c in r.get("checks",[]) if c.get("check")=="serving_batch" and c.get("status")=="fail"]; print("    batch checks failed:", ", ".join(c["what"] for c in f)); sys.exit(0 if f else 1)' "$D/batch-g5-$fault.json" \
            || { echo "FAIL  $fault: the serving batch's own checks did not fail"; fail=1; }
    done
}
# variant_checks JSON: every production variant reached (the sparse one aside) and each aimed batch on the
# kernel its variant names; one line per aimed variant.
variant_checks() {
    python3 - "$1" <<'PYEOF'
import json, re, sys
r = json.load(open(sys.argv[1]))
v = (r.get("coverage") or {}).get("variants") or {}
bad = [x["id"] for x in v.get("list", []) if not x["reached"]]
checks = [c for c in (r.get("runner_checks") or {}).get("checks", []) if c.get("check") == "variant_batch"]
seen = {}
for c in checks:
    m = re.search(r"aimed at decode/([a-z_]+)/(\S+?):", c["detail"])
    k = re.search(r"\(([a-z_]+), one launch", c["detail"])
    if not m or not k:
        bad.append("unparsed: " + c["detail"][:120]); continue
    want, loads, ran = m.group(1), m.group(2), k.group(1)
    if want != ran:
        bad.append(f"aimed at {want}/{loads} but ran {ran}")
    worst = seen.get((want, loads), (0.0, None))
    if c.get("what") == "attn_latent":
        seen[(want, loads)] = (c.get("value") or float("nan"), c.get("bound"))
for (k, l), (val, b) in sorted(seen.items()):
    print(f"    aimed {k}/{l}: attn_latent {val:.2e} (bound {b})")
for b in bad:
    print("    BAD " + b)
sys.exit(1 if bad or not checks else 0)
PYEOF
}
variants() {
    local f n dt rc p k want first
    for f in fixtures/*.gguf; do
        n=$(basename "$f" .gguf)
        for dt in bf16 fp16; do
            [ "$(left)" -gt 40 ] || { echo "skip variants $n: budget"; fail=1; return 0; }
            timeout "$(tmo 120)" "$B" run "$f" --backend cuda "${KX[@]}" --dtype $dt \
                --json "$D/variants-$n-$dt.json" > "$D/variants-$n-$dt.txt" 2>&1
            expect 0 $? "variants $n $dt"
            variant_checks "$D/variants-$n-$dt.json" || { echo "FAIL  variants $n $dt: a variant not reached or on another kernel"; fail=1; }
        done
    done
    # The sparse kernel's aimed batch (GLM-5: a DSA file within top_k) catches a sparse index fault.
    timeout "$(tmo 120)" "$B" run $G5 --backend cuda "${KX[@]}" --inject sparse_index_page_base \
        --json "$D/variants-g5-sparse-index.json" > "$D/variants-g5-sparse-index.txt" 2>&1
    expect 1 $? "variants g5 --inject sparse_index_page_base"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); f=[c for c in (r.get("runner_checks") or {}).get("checks",[]) if c["status"]=="fail"]; print("    failed:", "; ".join(c["what"]+" "+c["detail"][:100] for c in f[:2])); sys.exit(0 if any("sparse_attn/past-top-k" in c["detail"] for c in f) else 1)' "$D/variants-g5-sparse-index.json" \
        || { echo "FAIL  sparse_index_page_base: the sparse aimed batch did not fail"; fail=1; }
}
faults35() {
    local f n p fault k want rc got
    for p in pairs_handover_stale:attn_wgmma_pairs/ small_ring_wrap:attn_small/ tma_page_tile:tma-multi-tile-page; do
        fault=${p%%:*} k=${p#*:}
        for f in fixtures/*.gguf; do
            n=$(basename "$f" .gguf)
            [ "$(left)" -gt 40 ] || { echo "skip faults35 $fault $n: budget"; fail=1; return 0; }
            want=0
            [ -f "$D/variants-$n-bf16.json" ] || timeout "$(tmo 120)" "$B" run "$f" --backend cuda "${KX[@]}" \
                --json "$D/variants-$n-bf16.json" > "$D/variants-$n-bf16.txt" 2>&1
            grep -q "\"id\": \"decode/[^\"]*$k" "$D/variants-$n-bf16.json" 2>/dev/null && want=1
            timeout "$(tmo 120)" "$B" run "$f" --backend cuda "${KX[@]}" --inject "$fault" \
                --json "$D/faults35-$fault-$n.json" > "$D/faults35-$fault-$n.txt" 2>&1
            rc=$?
            got=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); f=[c for c in (r.get("runner_checks") or {}).get("checks",[]) if c["status"]=="fail"]; print(r["verdict"].get("first_check"), "| batch:", (f[0]["check"]+" "+f[0]["what"]+" %.3g/%.3g "%(f[0].get("value") or float("nan"), f[0].get("bound") or float("nan"))+f[0]["detail"][:80]) if f else "-", "| aimed at the kernel:", bool(f) and all(c["check"]=="variant_batch" and sys.argv[2] in c["detail"] for c in f))' "$D/faults35-$fault-$n.json" "$k" 2>/dev/null)
            expect $want $rc "faults35 $fault on $n"
            [ $want -eq 0 ] || [[ "$got" == *"aimed at the kernel: True" ]] || { echo "FAIL  faults35 $fault $n: not at a variant_batch aimed at $k"; fail=1; }
            echo "    $fault $n: exit $rc (want $want); first $got"
        done
    done
}
contract() {
    local f n
    for f in fixtures/*.gguf; do
        n=$(basename "$f" .gguf)
        [ "$(left)" -gt 40 ] || { echo "skip contract $n: budget"; fail=1; return 0; }
        timeout "$(tmo 90)" "$B" run "$f" --backend cuda "${KX[@]}" --inject split_lse_bf16 --json "$D/contract-$n.json" > "$D/contract-$n.txt" 2>&1
        expect 1 $? "run $n --inject split_lse_bf16"
        grep -q '"first_check": "split_lse"' "$D/contract-$n.json" 2>/dev/null || { echo "FAIL  $n split_lse_bf16: not first at split_lse"; fail=1; }
    done
}
coverage() {
    local f n fault
    for f in fixtures/*.gguf; do
        n=$(basename "$f" .gguf)
        timed "run $n (coverage)" 120 "$D/cov-$n.txt" "$B" run "$f" --backend cuda --json "$D/cov-$n.json"
        grep -q '"family": "wgmma"' "$D/cov-$n.json" 2>/dev/null || { echo "FAIL  $n: decode did not run a wgmma kernel"; fail=1; }
        grep -A3 -iE "coverage.*warn|prediction" "$D/cov-$n.txt" | head -4
        for fault in wg2_keys_dropped split_tail_dropped; do
            timeout "$(tmo 120)" "$B" run "$f" --backend cuda --mode shadow --inject $fault --json "$D/cov-$n-$fault.json" > "$D/cov-$n-$fault.txt" 2>&1
            expect 1 $? "run $n --inject $fault"
            grep -q '"first_check": "split_out"' "$D/cov-$n-$fault.json" 2>/dev/null || { echo "FAIL  $n $fault: not first at split_out"; fail=1; }
        done
    done
}
# san1 NAME TOOL T FIXTURE ARGS…: compute-sanitizer on one run; hazards inside cuBLAS's nvjet_* are not ours.
san1() {
    local n=$1 tool=$2 tt=$3 f=$4 t0=$SECONDS rc ours
    shift 4
    [ "$(left)" -gt 45 ] || { echo "skip $n: budget"; fail=1; return 0; }
    timeout "$(tmo "$tt")" /usr/local/cuda/bin/compute-sanitizer --tool "$tool" "$B" run "$f" --backend cuda --mode shadow \
        "${KX[@]}" "$@" > "$D/$n.txt" 2>&1
    rc=$?
    ours=$(sanitizer_errors "$D/$n.txt")
    step "$n ($(basename "$f") $*; $((SECONDS - t0)) s; sanitizer exit $rc; $ours outside cuBLAS)" \
        "$([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Sanitizer Error|decode: |prefill: " "$D/$n.txt" | sort | uniq -c | head -6
    grep 'Race reported' "$D/$n.txt" | grep -v nvjet | sed 's/.*Race reported between //; s/+0x[0-9a-f]*//g' | sort | uniq -c | head -6
    gzip -9f "$D/$n.txt"
}
# sanitizer_errors FILE: the sanitizer's reports outside cuBLAS's nvjet_* GEMMs, less the driver's NOT_FOUND
# answers to `Kernels::has_global`'s probes (cuModuleGetGlobal for a global a module may not define: the
# attention modules ask which kernels they hold; a global the run needs and lacks fails the run itself).
sanitizer_errors() {
    grep -E "Race reported|Invalid|Barrier error|Program hit|Sanitizer Error|Error: " "$1" | grep -v nvjet |
        grep -vc "CUDA_ERROR_NOT_FOUND.*cuModuleGetGlobal"
}
sanitize() {
    # One layer each (the kernels are the same in every layer): the sanitizers slow the fp64 side 10-50x.
    local G="--layers 0 --page-size 64 --prompt-len 330 --chunk 330 --decode-steps 2 --num-splits 2"
    local Q8="--layers 0 --q-len 8 --page-size 64 --prompt-len 200 --decode-steps 2 --num-splits 1"
    san1 memcheck-g5-2split memcheck 60 $G5 $G
    san1 synccheck-g5-2split synccheck 60 $G5 $G
    san1 memcheck-small memcheck 40 $V3 --layers 0 $S3 --q-len 2
    san1 synccheck-small synccheck 40 $V3 --layers 0 $S3 --q-len 2
    san1 racecheck-g5-2split racecheck 90 $G5 $G
    san1 racecheck-v3-q8 racecheck 100 $V3 $Q8
    san1 racecheck-small-wrap racecheck 60 $V3 --layers 0 --page-size 64 --prompt-len 200 --decode-steps 2 --num-splits 1 --q-len 2
}
# The largest local ratio of a report, and where (≥ 1 fails; bench/ratios.py reads a check one way for all three summaries).
worst() { python3 bench/ratios.py local "$1"; }
local1() { # local1 FIXTURE DTYPE SEED
    local n j
    n=$(basename "$1" .gguf)
    j="$D/local/$n-$2-$3.json"
    timeout 300 "$B" run "$1" --backend cuda --mode shadow --dtype "$2" --seed "$3" --json "$j" -q > "${j%.json}.txt" 2>&1
    echo "$n $2 seed $3: exit $?; $(worst "$j" 2> /dev/null)"
}
localview() {
    mkdir -p "$D/local"
    export -f local1 worst
    export B D
    local f dt s
    for f in fixtures/*.gguf; do for dt in bf16 fp16; do for s in ${SEEDS:-0 1}; do echo "$f $dt $s"; done; done; done |
        timeout "$(tmo 400)" xargs -P "${JOBS:-5}" -L 1 bash -c 'local1 "$0" "$1" "$2"' | sort > "$D/local-runs.txt"
    cat "$D/local-runs.txt"
    local want ran bad
    want=$(($(ls fixtures/*.gguf | wc -l) * 2 * $(echo ${SEEDS:-0 1} | wc -w)))
    ran=$(wc -l < "$D/local-runs.txt")
    bad=$(grep -vc ": exit 0;" "$D/local-runs.txt")
    expect 0 $((bad + want - ran)) "clean runs with the local view deciding: $ran of $want ran, $bad failed (their sum as exit)"
    [ -z "${SENSITIVITY:-}" ] || timed "selftest --sensitivity --backend cuda" 240 "$D/sensitivity-cuda.txt" \
        "$B" selftest --sensitivity --backend cuda
}
detect() {
    local f n
    timed "selftest --sensitivity --backend cuda" 150 "$D/sensitivity-cuda.txt" "$B" selftest --sensitivity --backend cuda
    for f in fixtures/*.gguf; do
        n=$(basename "$f" .gguf)
        timed "run --repeat 5 $n" 60 "$D/repeat-$n.txt" "$B" run "$f" --backend cuda --repeat 5 --mode shadow --json "$D/repeat-$n.json"
    done
    for n in deepseek-v3-yarn-q4_k glm-5-q4_0; do
        timed "sweep --splits $n" 90 "$D/splits-$n.txt" "$B" sweep "fixtures/$n.gguf" --backend cuda --splits 1,2,4,8,16 --json "$D/splits-$n.json"
    done
    timed "sweep lengths deepseek-v3" 150 "$D/lengths-v3.txt" "$B" sweep $V3 --backend cuda --json "$D/lengths-v3.json"
}
# lint1 NAME WANT FILE ARGS…
lint1() {
    local n=$1 want=$2 rc
    shift 2
    timeout "$(tmo 120)" "$B" lint "$@" --backend cuda --json "$D/lint-$n.json" > "$D/lint-$n.txt" 2>&1
    rc=$?
    expect "$want" $rc "lint $n: $(grep -E '^(error|warning) ' "$D/lint-$n.txt" | cut -c1-120 | tr '\n' '|')"
}
lint() {
    timed "kernels check" 240 "$D/kernels-check.txt" "$B" kernels check --arch sm_90a,sm_90,sm_80,sm_120
    peers_env
    local f n P="python3 runners"
    "$B" fixture --preset deepseek-v3 --layers 1 --quant q4_k -o /tmp/ds3-full.gguf > /dev/null
    "$B" fixture --preset glm-5 --layers 1 --quant q4_0 -o /tmp/glm5-full.gguf > /dev/null
    for f in $V3 $G5 /tmp/ds3-full.gguf /tmp/glm5-full.gguf; do
        n=$(basename "$f" .gguf)
        lint1 "$n-flashmla" 0 "$f" --page-size 64 --runner "$P/flashmla.py"
        lint1 "$n-flashmla-fp16" 0 "$f" --page-size 64 --dtype fp16 --runner "$P/flashmla.py"
        lint1 "$n-noscale" 1 "$f" --page-size 64 --runner "$P/bugs/flashmla_no_scale.py"
        lint1 "$n-vllm" 0 "$f" --page-size 64 --runner "$P/vllm_triton.py"
        lint1 "$n-sdpa" 0 "$f" --runner "$P/torch_sdpa.py"
    done
    lint1 minicpm3-vllm 0 $MC --runner "$P/vllm_triton.py"
    lint1 minicpm3-flashmla 1 $MC --page-size 64 --runner "$P/flashmla.py"
    # 2 while FlashInfer is not installable on the device image; 0 once it is.
    lint1 v2lite-flashinfer "${FLASHINFER_RC:-2}" fixtures/deepseek-v2-lite-bf16.gguf --runner "$P/flashinfer_mla.py"
}
# first_check JSON: the shadow mode's first failing check ("-" when none).
first_check() {
    python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["modes"][0]["verdict"]; print(m.get("first_check") or "-")' "$1" 2>/dev/null || echo "?"
}
formats() {
    local f n dt kv fault
    for f in fixtures/deepseek-v2-lite-bf16.gguf fixtures/deepseek-v3-legacy-kv-b-q8_0.gguf $V3 $G5; do
        n=$(basename "$f" .gguf)
        for dt in bf16 fp16; do
            run1 "fmt-$n-fp8_ds_mla-$dt" 0 "$f" --dtype $dt --kv-cache-dtype fp8_ds_mla --json "$D/fmt-$n-fp8_ds_mla-$dt.json"
        done
    done
    "$B" fixture --preset glm5-next --layers 4 --hidden 256 --heads 4 -o /tmp/g5n.gguf > /dev/null
    for kv in fp8_ds_mla_nope fp8_v41 fp4_v41; do
        run1 "fmt-g5n-$kv-bf16" 0 /tmp/g5n.gguf --dtype bf16 --kv-cache-dtype $kv --json "$D/fmt-g5n-$kv-bf16.json"
    done
    for fault in kv_scale_twice kv_scale_inverted kv_rope_quantized kv_scale_wrong_group kv_saturate_240; do
        run1 "fmt-v3-$fault" 1 $V3 --dtype bf16 --kv-cache-dtype fp8_ds_mla --inject $fault --json "$D/fmt-v3-$fault.json"
        echo "    first check: $(first_check "$D/fmt-v3-$fault.json") (want cache_rows)"
    done
    for kv in fp8_v41 fp4_v41; do
        run1 "fmt-g5n-$kv-wrong_group" 1 /tmp/g5n.gguf --dtype bf16 --kv-cache-dtype $kv --inject kv_scale_wrong_group \
            --json "$D/fmt-g5n-$kv-wrong_group.json"
        echo "    first check: $(first_check "$D/fmt-g5n-$kv-wrong_group.json") (want cache_rows)"
    done
    for f in fixtures/*.gguf; do
        n=$(basename "$f" .gguf)
        for dt in bf16 fp16 f32; do
            run1 "fmt-$n-fp8-$dt" 0 "$f" --dtype $dt --kv-cache-dtype fp8 --json "$D/fmt-$n-fp8-$dt.json"
        done
    done
    for fault in kv_scale_twice kv_scale_inverted kv_saturate_240; do
        run1 "fmt-v3-fp8-$fault" 1 $V3 --dtype bf16 --kv-cache-dtype fp8 --inject $fault --json "$D/fmt-v3-fp8-$fault.json"
        echo "    first check: $(first_check "$D/fmt-v3-fp8-$fault.json") (want cache_rows)"
    done
}
# dsa1 NAME GGUF DTYPE PROMPT CHUNK DECODE SPLITS [ARGS…]: one sparse run in the background.
dsa1() {
    local n=$1 f=$2 dt=$3 p=$4 c=$5 dec=$6 s=$7
    shift 7
    /usr/bin/time -f "%e s wall, %M KB" timeout "$(tmo 300)" "$B" run "$f" --backend cuda --dtype "$dt" --mode shadow \
        --prompt-len "$p" --chunk "$c" --decode-steps "$dec" --num-splits "$s" --page-size 64 \
        --json "$D/dsa-$n.json" "$@" > "$D/dsa-$n.txt" 2>&1
    echo "exit $?" >> "$D/dsa-$n.txt"
}
dsa() {
    "$B" fixture --preset glm-5 --layers 1 --quant bf16 --heads 8 --hidden 2048 -o /tmp/glm5h8.gguf > /dev/null
    "$B" fixture --preset glm-5 --layers 1 --quant bf16 -o /tmp/glm5.gguf > /dev/null
    dsa1 h8-bf16-3072 /tmp/glm5h8.gguf bf16 3072 512 16 4 &
    dsa1 h8-fp16-3072 /tmp/glm5h8.gguf fp16 3072 512 16 4 &
    dsa1 h8-bf16-fp8keys-3072 /tmp/glm5h8.gguf bf16 3072 512 16 4 --indexer-keys fp8 &
    MLA_DIFF_PROFILE=1 dsa1 h64-bf16-2112 /tmp/glm5.gguf bf16 2112 1024 4 2 &
    wait
    local f
    for f in "$D"/dsa-*.txt; do
        expect 0 "$(tail -1 "$f" | sed 's/exit //')" "$(basename "$f" .txt)"
        grep -E "verdict|recall|far flips|PASS|FAIL" "$f" | head -4
    done
}
dsa_flashmla() {
    peers_env
    "$B" fixture --preset glm-5 --layers 1 --quant bf16 -o /tmp/glm5.gguf > /dev/null
    timed "FlashMLA sparse prefill alone" 30 "$D/probe-sparse-prefill.txt" env RUNNERS="$PWD/runners" python3 bench/probes/flashmla_sparse.py
    timed "FlashMLA sparse decode alone" 30 "$D/probe-sparse-decode.txt" env RUNNERS="$PWD/runners" python3 bench/probes/flashmla_sparse_decode.py
    MLA_DIFF_RUNNER_TIME=$D/flashmla-times.txt dsa1 h64-flashmla /tmp/glm5.gguf bf16 3072 1024 4 2 \
        --runner "python3 runners/flashmla_sparse.py" &
    MLA_DIFF_PROFILE=1 dsa1 h64-cuda /tmp/glm5.gguf bf16 3072 1024 4 2 &
    wait
    # The cache as the format's bytes (#38): CUDA writes fp8_ds_mla, FlashMLA's sparse decode reads those
    # bytes as sent, its sparse prefill their bf16 upconversion; lint probes both ops' scale convention.
    dsa1 h64-flashmla-fp8ds /tmp/glm5.gguf bf16 3072 1024 4 2 --kv-cache-dtype fp8_ds_mla \
        --runner "python3 runners/flashmla_sparse.py"
    "$B" lint /tmp/glm5.gguf --runner "python3 runners/flashmla_sparse.py" --kv-cache-dtype fp8_ds_mla \
        --page-size 64 > "$D/lint-flashmla-fp8ds.txt" 2>&1
    echo "exit $?" >> "$D/lint-flashmla-fp8ds.txt"
    local f
    for f in "$D"/dsa-h64-flashmla.txt "$D"/dsa-h64-cuda.txt "$D"/dsa-h64-flashmla-fp8ds.txt "$D"/lint-flashmla-fp8ds.txt; do
        expect 0 "$(tail -1 "$f" | sed 's/exit //')" "$(basename "$f" .txt)"
    done
    head -12 "$D/flashmla-times.txt" 2> /dev/null
}
# fp8p1 NAME WANT GGUF [ARGS…]: one runner run over the per-tensor fp8 cache, the CPU mirror around it (it
# writes the cache's bytes the runner is sent; CUDA refuses `fp8`), in shadow mode.
fp8p1() {
    local n=$1 want=$2 f=$3 t0=$SECONDS rc
    shift 3
    [ "$(left)" -gt 60 ] || { echo "skip fp8peers $n: budget"; fail=1; return 0; }
    timeout "$(tmo 240)" "$B" run "$f" --backend cpu --mode shadow --kv-cache-dtype fp8 --page-size 64 \
        --json "$D/fp8p-$n.json" "$@" > "$D/fp8p-$n.txt" 2>&1
    rc=$?
    expect "$want" $rc "fp8peers $n ($(basename "$f") $*; $((SECONDS - t0)) s)"
    grep -E "DIVERGENCE|runner checks|RUNNER CHECK|error:" "$D/fp8p-$n.txt" | cut -c1-240 | head -3
    [ -s "$D/fp8p-$n.json" ] && worst_at_runner "$D/fp8p-$n.json"
}
# worst_at_runner JSON: each @runner check's worst ratio to what decides it over the layers (≥ 1 fails):
# the stage-local view's ratio where it judges the check, else the end-to-end tolerance's (rel-L2, and the
# elementwise factor where the check is elementwise), as the report's table cells.
worst_at_runner() { python3 bench/ratios.py runner "$1"; }
fp8peers() {
    peers_env
    local f n dt r P="python3 runners"
    for f in $V3 $G5; do
        n=$(basename "$f" .gguf)
        fp8p1 "$n-flashmla-bf16" 0 "$f" --dtype bf16 --runner "$P/flashmla.py"
        for dt in bf16 fp16; do
            fp8p1 "$n-vllm-$dt" 0 "$f" --dtype $dt --runner "$P/vllm_triton.py"
        done
        for r in flashmla vllm_triton; do
            timeout "$(tmo 120)" "$B" lint "$f" --kv-cache-dtype fp8 --page-size 64 --runner "$P/$r.py" \
                > "$D/lint-fp8-$n-$r.txt" 2>&1
            expect 0 $? "lint --kv-cache-dtype fp8 $n $r: $(grep -E 'cache_scale|cache_rope' "$D/lint-fp8-$n-$r.txt" | cut -c1-100 | tr '\n' '|')"
        done
    done
    fp8p1 v3-flashmla-scale-twice 1 $V3 --dtype bf16 --runner "$P/bugs/cache/flashmla_fp8_scale_twice.py"
    fp8p1 v3-vllm-scale-twice 1 $V3 --dtype bf16 --runner "$P/bugs/cache/vllm_fp8_scale_twice.py"
}
# v4sum JSON: a V4 report in one line: verdict, first failing layer/check, the worst check's ratio to its
# tolerance (end to end; inf: non-finite), the backend and the kernels coverage names.
v4sum() { python3 bench/ratios.py v4 "$1"; }
# v4run NAME WANT FIRST FILE ARGS…: one V4 run on the CUDA kernels that must exit WANT, and with WANT 1 fail
# first at FIRST (layer/check); its JSON in one line, its stderr's tail when it errored.
v4run() {
    local n=$1 want=$2 first=$3 f=$4 t0=$SECONDS rc got
    shift 4
    [ "$(left)" -gt 40 ] || { echo "skip v4 $n: budget"; fail=1; return 0; }
    timeout "$(tmo 150)" "$B" run "$f" --backend cuda "${KX[@]}" "$@" --json "$D/v4-$n.json" \
        > "$D/v4-$n.txt" 2> "$D/v4-$n.err"
    rc=$?
    got=$(v4sum "$D/v4-$n.json" 2> /dev/null || echo "no report")
    expect "$want" $rc "v4 $n ($(basename "$f") $*; $((SECONDS - t0)) s): $got"
    if [ "$want" -eq 1 ] && [ $rc -eq 1 ] && [[ "$got" != "first $first;"* ]]; then
        echo "FAIL  v4 $n: not first at $first"
        fail=1
    fi
    [ $rc -le 1 ] || tail -5 "$D/v4-$n.err" | sed 's/^/    stderr: /'
}
v4() {
    local G=fixtures/golden/deepseek-v4.gguf F=/tmp/v4flash.gguf f n dt s
    "$B" fixture --preset deepseek-v4 --layers 3 -o $F > "$D/v4-fixture.txt" 2>&1 || { echo "FAIL  v4 fixture: $(tail -1 "$D/v4-fixture.txt")"; fail=1; return 0; }
    # The kernels compile for this device first (NVRTC errors name the file and line).
    v4run golden-compile 0 - $G --layers 0 --prompt-len 20 --chunk 20 --decode-steps 1
    for f in $G $F; do
        n=$(basename "$f" .gguf)
        for dt in bf16 fp16; do
            for s in 1 2; do
                v4run "$n-$dt-s$s" 0 - "$f" --dtype $dt --seed $s
            done
        done
    done
    # Each V4 fault in its layer (0 window, 1 CSA, 2 HCA on both files), first at the catalogue's stage.
    for f in $G $F; do
        n=$(basename "$f" .gguf)
        v4run "$n-window_off_by_one" 1 1/attn_heads "$f" --layers 1 --inject window_off_by_one@layer=1
        v4run "$n-compress_group_off_by_one" 1 2/compressed "$f" --layers 2 --inject compress_group_off_by_one@layer=2
        v4run "$n-compressor_state_dropped" 1 1/compressed "$f" --layers 1 --inject compressor_state_dropped@layer=1
        v4run "$n-sink_dropped" 1 2/attn_heads "$f" --layers 1,2 --inject sink_dropped@layer=2
    done
    # The kernels under memcheck, every layer kind of the golden.
    if [ -x /usr/local/cuda/bin/compute-sanitizer ] && [ "$(left)" -gt 60 ]; then
        timeout "$(tmo 120)" /usr/local/cuda/bin/compute-sanitizer --tool memcheck "$B" run $G --backend cuda \
            "${KX[@]}" --json "$D/v4-memcheck.json" > "$D/v4-memcheck.txt" 2>&1
        local rc=$? ours
        ours=$(sanitizer_errors "$D/v4-memcheck.txt")
        step "v4 memcheck (golden, every layer kind; sanitizer exit $rc; $ours errors outside cuBLAS)" \
            "$([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)"
        grep -E "ERROR SUMMARY|Invalid|Program hit" "$D/v4-memcheck.txt" | sort | uniq -c | head -4
    fi
}
# kpsum JSON LAYERS BACKEND: the k-pool indexer's part of a glm5-next report in one line (the stage verdict,
# the dsa section's indexer and its layers' selection checks); exit 1 unless the selection failed in exactly
# LAYERS (a comma list; -: none) with every stage check passing, and BACKEND's own indexer ran.
kpsum() {
    python3 - "$1" "$2" "${KPOOL_BACKEND:-cuda}" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
want = [] if sys.argv[2] == "-" else [int(x) for x in sys.argv[2].split(",")]
v, d = r["modes"][0]["verdict"], r["dsa"]
sel = {l["layer"]: l["selection"] for l in d["layers"]}
failed = [l for l, s in sel.items() if not s["pass"]]
print(f'stages {"pass" if v["pass"] else "FAIL first " + str(v.get("first_layer")) + "/" + str(v.get("first_check"))}; '
      f'selection failed in {failed or "none"}; differing pools ' +
      ", ".join(f'{l}: {s["differing"]} ({s["within_margin"]} within), layout {s["pools"]["layout_mismatch"]}' for l, s in sel.items()) +
      f'; {d["indexer"][:40]}')
ok = v["pass"] and d["indexer"].startswith(sys.argv[3] + "'s own") and failed == want
sys.exit(0 if ok else 1)
PYEOF
}
# kprun NAME WANT LAYERS ARGS…: one glm5-next golden run with CUDA's k-pool indexer that must exit WANT, its
# selection failing in exactly LAYERS (-: nowhere); the profile's k-pool lines (GPU against the mirror) kept.
kprun() {
    local n=$1 want=$2 layer=$3 t0=$SECONDS rc got src
    shift 3
    [ "$(left)" -gt 40 ] || { echo "skip kpool $n: budget"; fail=1; return 0; }
    MLA_DIFF_PROFILE=1 timeout "$(tmo 120)" "$B" run fixtures/golden/glm5-next.gguf \
        --backend "${KPOOL_BACKEND:-cuda}" "${KX[@]}" "$@" --json "$D/kpool-$n.json" > "$D/kpool-$n.txt" 2> "$D/kpool-$n.err"
    rc=$?
    got=$(kpsum "$D/kpool-$n.json" "$layer" 2> /dev/null)
    src=$?
    expect "$want" $rc "kpool $n ($*; $((SECONDS - t0)) s): ${got:-no report}"
    [ $src -eq 0 ] || { echo "FAIL  kpool $n: selection not failing in exactly layers $layer, stages failing, or not ${KPOOL_BACKEND:-cuda}'s indexer"; fail=1; }
    grep -E "k-pool indexer \(" "$D/kpool-$n.err" | sed 's/.*profile: /    /' | head -3
    [ $rc -le 1 ] || tail -5 "$D/kpool-$n.err" | sed 's/^/    stderr: /'
}
kpool() {
    local dt
    for dt in bf16 fp16 f32; do kprun "clean-$dt" 0 - --dtype $dt; done
    kprun clean-fp8 0 - --indexer-keys fp8
    kprun no_ape 1 3 --inject kpool_no_ape@layer=3
    kprun softmax_channels 1 3 --inject kpool_softmax_channels@layer=3
    kprun no_tail 1 3 --inject kpool_no_tail@layer=3
    kprun from_position_zero 1 1,2 --inject kpool_from_position_zero@layer=1 --pos-offset 5
    kprun shared_own_indexer 1 2 --inject kpool_shared_own_indexer@layer=2
    if [ -x /usr/local/cuda/bin/compute-sanitizer ] && [ "$(left)" -gt 60 ]; then
        timeout "$(tmo 120)" /usr/local/cuda/bin/compute-sanitizer --tool memcheck "$B" run \
            fixtures/golden/glm5-next.gguf --backend cuda "${KX[@]}" --json "$D/kpool-memcheck.json" > "$D/kpool-memcheck.txt" 2>&1
        local rc=$? ours
        ours=$(sanitizer_errors "$D/kpool-memcheck.txt")
        step "kpool memcheck (golden; sanitizer exit $rc; $ours errors outside cuBLAS)" \
            "$([ "$ours" -eq 0 ] && [ $rc -eq 0 ] && echo 0 || echo 1)"
    fi
}
run_steps "selftest validate runs sanitize" "$@"
