#!/usr/bin/env bash
# Issue #14 items 3 and 4 on the GPU: on every shipped fixture, `sweep` over sequence lengths around the
# CUDA kernels' boundaries (pages, chunks, the chosen attention tiles and per-warp key slices, the split
# partition; the boundaries follow the tiles the kernels picked, in each JSON's lengths.key_tiles), the
# split-invariance sweep over 1..16 splits, and `run --repeat 5` (is the CUDA path bit-for-bit
# deterministic?). GLM-5 (64 heads: the wgmma decode) sweeps 16..=208 only: its fp64 reference is the
# slow part. Usage on the GPU host:
#   B=path/to/mla-diff OUT=dir bash bench/h200-sweep.sh
# BACKEND=cpu runs the same on the CPU mirror (how the timings were estimated without a GPU).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
BACKEND=${BACKEND:-cuda}
export NO_COLOR=1
fail=0
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
D="$OUT/sweep"
mkdir -p "$D"
T0=$SECONDS
for f in fixtures/*.gguf; do
  n=$(basename "$f" .gguf)
  case $n in
    glm-5*) lens=(--lengths 16..=208) ;;
    *) lens=() ;;
  esac
  t0=$SECONDS
  timeout 150 "$B" sweep "$f" --backend "$BACKEND" "${lens[@]}" --json "$D/$n-lengths.json" \
    --junit "$D/$n-lengths.xml" > "$D/$n-lengths.txt" 2>&1
  rc=$?
  echo "sweep lengths $n: exit $rc ($((SECONDS-t0)) s)"; grep -E '^(boundaries|smallest|\[sweep)' "$D/$n-lengths.txt"
  [ $rc = 0 ] || fail=1
  t0=$SECONDS
  timeout 60 "$B" sweep "$f" --backend "$BACKEND" --splits 1,2,4,8,16 --json "$D/$n-splits.json" \
    > "$D/$n-splits.txt" 2>&1
  rc=$?
  echo "sweep splits $n: exit $rc ($((SECONDS-t0)) s)"; tail -2 "$D/$n-splits.txt" | head -1
  [ $rc = 0 ] || fail=1
  t0=$SECONDS
  timeout 60 "$B" run "$f" --backend "$BACKEND" --repeat 5 --json "$D/$n-repeat.json" > "$D/$n-repeat.txt" 2>&1
  rc=$?
  echo "run --repeat 5 $n: exit $rc ($((SECONDS-t0)) s)"; grep -E '^(repeat|  layer|\[shadow\] )' "$D/$n-repeat.txt" | head -4
  [ $rc = 0 ] || fail=1
done
echo "total: $((SECONDS-T0)) s"
# One file: the device hands back a limited number of files.
tar czf "$OUT/sweep.tar.gz" -C "$OUT" sweep && rm -rf "$D"
exit $fail
