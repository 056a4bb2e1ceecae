#!/usr/bin/env bash
# #14 on the H200 with the stage-local view deciding: clean runs of every shipped fixture × bf16/fp16 ×
# seeds through the CUDA kernels (each line: the worst check's local ratio, ≥ 1 fails), then the fault
# self-test, and with SENSITIVITY=1 `selftest --sensitivity`. Usage on the GPU host:
#   B=path/to/mla-diff OUT=dir SEEDS="0 1 2" [JOBS=4] [SENSITIVITY=1] bash bench/h200-local.sh
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
OUT=${OUT:-out}
mkdir -p "$OUT/runs"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
worst() {  # the largest local ratio of a report, and where
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
best, kappa = (0.0, "-"), []
for m in r["modes"]:
    for l in m["layers"]:
        for c in l["checks"]:
            lo = c.get("local")
            if lo and lo["ratio"] > best[0]:
                best = (lo["ratio"], f'layer {l["layer"]} {c["check"]}')
            if lo and lo.get("truncation") is not None and "lse" in c["check"]:
                kappa.append(f'{c["check"]} {lo["truncation"]:.2f}')
print(f"worst local ratio {best[0]:.3f} at {best[1]}; kappa: {', '.join(kappa) or '-'}")
PY
}
one() {  # one clean run: fixture dtype seed
    local n; n=$(basename "$1" .gguf); local j="$OUT/runs/$n-$2-$3.json"
    NO_COLOR=1 timeout 300 "$B" run "$1" --backend cuda --mode shadow --dtype "$2" --seed "$3" --json "$j" -q > "$OUT/runs/$n-$2-$3.txt" 2>&1
    echo "$n $2 seed $3: exit $?; $(worst "$j" 2>/dev/null)"
}
export -f one worst; export B OUT
# JOBS runs at a time (the GPU host has 16 cores; each run's reference and local view use several).
for f in fixtures/*.gguf; do for dt in bf16 fp16; do for s in ${SEEDS:-0 1 2}; do echo "$f $dt $s"; done; done; done |
    xargs -P "${JOBS:-4}" -L 1 bash -c 'one "$0" "$1" "$2"' | sort > "$OUT/clean-runs.txt"
cat "$OUT/clean-runs.txt"
fails=$(grep -vc ": exit 0;" "$OUT/clean-runs.txt")
echo "clean runs failing: $fails"
NO_COLOR=1 timeout 300 "$B" selftest --backend cuda > "$OUT/selftest-cuda.txt" 2>&1
echo "selftest --backend cuda: exit $?"
tail -5 "$OUT/selftest-cuda.txt"
if [ -n "${SENSITIVITY:-}" ]; then
    t=$SECONDS; NO_COLOR=1 timeout 240 "$B" selftest --sensitivity --backend cuda > "$OUT/sensitivity-cuda.txt" 2>&1
    echo "selftest --sensitivity --backend cuda: exit $? ($((SECONDS - t)) s)"; cat "$OUT/sensitivity-cuda.txt"
fi
tar czf "$OUT/local-h200.tar.gz" -C "$OUT" runs selftest-cuda.txt 2>/dev/null
rm -rf "$OUT/runs"
