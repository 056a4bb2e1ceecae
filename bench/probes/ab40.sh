#!/usr/bin/env bash
# Issue #40's probe on the GPU host, one device call (~6 min): for each probe, the embedded kernels and the
# probe timed A/B/A/B (embedded, probe, embedded, probe; four processes, so a slow first process shows) at
# the #16 table rows it affects, then, if the probe is faster on its target rows (see `ab`),
# its gates (bench/gpu-check.sh with KERNELS=, the steps that take it). bench/probes/README.md says what
# each probe changes.
#
# Usage, from the repository root on the GPU host (the release binary built from this branch, whose
# src/backend/cuda/attn.rs reads MLA_DIFF_PROBE_FOLD):
#   [B=mla-diff] [OUT=dir] [BUDGET=s, default 390] bash bench/probes/ab40.sh
# Outputs: $OUT/<probe>/ab-{A1,B1,A2,B2}.txt (the `bench table` runs), ab.txt (the side-by-side medians) and,
# for a faster probe, gates1/ gates2/ (bench/gpu-check.sh's outputs) and memcheck-*.txt. Exit 0 when every
# probe ran, was faster and passed its gates; 1 otherwise (a slower probe is a measurement, but says so
# in the exit code).
#
# fold40 (bench/probes/fold40-combine-in-last-cta.patch): the split combine folded into the last CTA of each
# split group of attn_small and attn_wgmma_pairs (the host skips combine_splits after them under
# MLA_DIFF_PROBE_FOLD=1). Rows: #16's 1 (B=64 H=128 s_k=4k), 2 (B=64 H=16 s_k=4k: attn_small, attn_mma
# beside it as the in-run control) and 4 (B=16 H=128 s_k=32k), splits 1/2/4/8 (pairs, one-tile beside it),
# bf16, no peers. Targets: attn_small at 2 splits, pairs at 4 (what the table picks there). One-split rows
# (the fold code is in the kernel but returns at once) and the control kernels must not move; the checks
# (rel-L2 to 3 figures) must read the same in A and B (the fold computes combine_splits' bits).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NO_COLOR=1
OUT=${OUT:-gpu-out}
BUDGET=${BUDGET:-390}
# The binary: B, else .carry/bench/mla-diff.xz (as bench/gpu-bench.sh), else target/release/mla-diff.
if [ -z "${B:-}" ] && [ -f .carry/bench/mla-diff.xz ]; then
    B=/tmp/mla-diff-ab40
    xz -dc .carry/bench/mla-diff.xz > "$B" && chmod +x "$B"
fi
B=${B:-target/release/mla-diff}
fail=0
left() { echo $((BUDGET - SECONDS)); }

# ab NAME PATCH ONLY TARGETS ENV…: the A/B/A/B timing of one probe; TARGETS: regexes of "shape config".
# Returns 0 when the probe's mean of two medians is >= 1 % below the embedded one's on a target, no target
# is > 1 % slower, and every row's check (rel-L2, non-finite) reads the same in all four runs.
ab() {
    local name=$1 patch=$2 only=$3 targets=$4 d="$OUT/$1" v k t0 rc
    shift 4
    mkdir -p "$d"
    k="$d/kernels"
    rm -rf "$k" && cp -r kernels "$k" && patch -s -d "$k" -p2 < "$patch" || { echo "$name: $patch does not apply"; return 2; }
    for v in A1 B1 A2 B2; do
        [ "$(left)" -gt 60 ] || { echo "$name $v: skipped (budget)"; return 2; }
        t0=$SECONDS
        case $v in
        A*) timeout 150 "$B" bench table --only "$only" --dtypes bf16 --peers '' > "$d/ab-$v.txt" 2>&1 ;;
        B*) timeout 150 env "$@" "$B" bench table --only "$only" --dtypes bf16 --peers '' --kernels "$k" > "$d/ab-$v.txt" 2>&1 ;;
        esac
        rc=$?
        echo "$name $v: exit $rc ($((SECONDS - t0)) s)"
        [ $rc -eq 0 ] || { tail -3 "$d/ab-$v.txt"; return 2; }
    done
    python3 - "$d" "$targets" << 'PY' | tee "$d/ab.txt"
import re, sys
d, targets = sys.argv[1], sys.argv[2].split("|")
runs = ["A1", "B1", "A2", "B2"]
rows = {}  # "shape config" -> {run: (median µs, check text)}
for r in runs:
    for line in open(f"{d}/ab-{r}.txt"):
        # Session::table_text: kernel, shape, config, median µs, GB/s, %copy, TFLOP/s, %matmul, min µs, check
        m = re.match(r"decode\s+(.+?)\s+([\d.]+)\s+\d+\s+[\d.]+%\s+[\d.]+\s+[\d.]+%\s+[\d.]+\s+(.*)$", line)
        if m:
            rows.setdefault(" ".join(m[1].split()), {})[r] = (float(m[2]), m[3].strip())
faster, slower, same_all = False, False, True
print(f"{'shape config':<90} {'A1':>7} {'B1':>7} {'A2':>7} {'B2':>7}  B/A   same check")
for key, v in rows.items():
    if len(v) < 4:
        continue
    a = (v["A1"][0] + v["A2"][0]) / 2
    b = (v["B1"][0] + v["B2"][0]) / 2
    same = len({v[r][1] for r in runs}) == 1
    tgt = any(re.search(t, key) for t in targets)
    print(f"{key:<90} {v['A1'][0]:7.1f} {v['B1'][0]:7.1f} {v['A2'][0]:7.1f} {v['B2'][0]:7.1f}  {b / a:.3f} {'yes' if same else 'NO'}{'  <- target' if tgt else ''}")
    faster |= tgt and b < 0.99 * a
    slower |= tgt and b > 1.01 * a
    same_all &= same
ok = faster and not slower and same_all
print(f"faster by >= 1 % on a target: {faster}; slower by > 1 % on one: {slower}; every check the same: {same_all}")
sys.exit(0 if ok else 1)
PY
}

# memcheck NAME TAG ARGS…: compute-sanitizer memcheck on one `run` through the probe's kernels (as
# bench/gpu-check.sh's sanitize step, one layer); passes with no error outside cuBLAS's nvjet_* GEMMs.
memcheck() {
    local name=$1 tag=$2 d="$OUT/$1" t0=$SECONDS rc n
    shift 2
    [ "$(left)" -gt 50 ] || { echo "$name memcheck $tag: skipped (budget)"; return 1; }
    timeout $(($(left) - 10 < 60 ? $(left) - 10 : 60)) /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        "$B" run "$@" --backend cuda --mode shadow --kernels "$d/kernels" > "$d/memcheck-$tag.txt" 2>&1
    rc=$?
    # bench/gpu-check.sh's sanitizer_errors
    n=$(grep -E "Race reported|Invalid|Barrier error|Program hit|Sanitizer Error|Error: " "$d/memcheck-$tag.txt" |
        grep -v nvjet | grep -vc "CUDA_ERROR_NOT_FOUND.*cuModuleGetGlobal")
    echo "$name memcheck $tag: sanitizer exit $rc, $n error(s) outside cuBLAS ($((SECONDS - t0)) s)"
    grep -E 'ERROR SUMMARY' "$d/memcheck-$tag.txt" | head -2
    [ "$rc" -eq 0 ] && [ "$n" -eq 0 ]
}

# gates NAME: in what is left, by priority: bench/gpu-check.sh selftest validate (KERNELS=, the probe's
# kernel copy), memcheck of a 2-split pairs layer and a 3-split attn_small layer (gpu-check.sh's
# memcheck-g5-2split and memcheck-small), then gpu-check.sh runs. Every one must pass.
gates() {
    local name=$1 d="$OUT/$1" ok=0
    gate() {  # gate SUBDIR STEP…
        local sub=$1 l=$(($(left) - 5))
        shift
        [ "$l" -gt 60 ] || { echo "$name gates $*: skipped (budget ${l} s)"; return 1; }
        OUT="$d/$sub" BUDGET="$l" B="$B" KERNELS="$d/kernels" bash bench/gpu-check.sh "$@"
    }
    gate gates1 selftest validate || ok=1
    memcheck "$name" g5-pairs-2split fixtures/glm-5-q4_0.gguf --layers 0 --page-size 64 --prompt-len 330 \
        --chunk 330 --decode-steps 2 --num-splits 2 || ok=1
    memcheck "$name" v3-small-3split fixtures/deepseek-v3-yarn-q4_k.gguf --layers 0 --page-size 64 \
        --prompt-len 200 --decode-steps 3 --num-splits 3 --q-len 2 || ok=1
    gate gates2 runs || ok=1
    return $ok
}

echo "== fold40: the split combine in the last CTA (MLA_DIFF_PROBE_FOLD=1)"
ab fold40 bench/probes/fold40-combine-in-last-cta.patch 1,2,4 'B=64 H=16 .*attn_small.*splits 2$|B=16 H=128 .*pairs; splits 4$' \
    MLA_DIFF_PROBE_FOLD=1
rc=$?
case $rc in
0) MLA_DIFF_PROBE_FOLD=1 gates fold40 || fail=1 ;;
*) fail=1 ;;
esac
echo "left: $(left) s"
echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): bench/probes/ab40.sh ($SECONDS s)"
exit $fail
