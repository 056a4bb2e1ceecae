#!/usr/bin/env bash
# #15 goal 1 on the H200 host: the whole GLM-5 file (`fixture --preset glm-5 --quant q4_k`: 78 layers,
# 7.3 GB of attention weights) through the default `run --backend cuda`, timed with /usr/bin/time -v
# (wall, user, sys, peak RSS), with the phase table of MLA_DIFF_PROFILE=1; then the same for the
# classic 64-token schedule (48 prompt + 16 decode steps, as #15 first measured). Target: <= 60 s,
# peak RSS <= 3 GB. The generated file is deleted at the end (it is 7.3 GB).
#   B=path/to/mla-diff OUT=dir [LAYERS=8: the first 8 of the 78 layers only] bash bench/h200-scale.sh
#   (the whole file: about 10 minutes, most of it writing the file)
set -uo pipefail
export NO_COLOR=1 MLA_DIFF_PROFILE=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
R="$OUT/scale"; mkdir -p "$R"
F=${F:-/tmp/glm5-q4_k.gguf}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
nproc | tee "$R/nproc.txt"
[ -f "$F" ] || /usr/bin/time -v "$B" fixture --preset glm-5 --quant q4_k ${LAYERS:+--layers $LAYERS} -o "$F" > "$R/fixture.txt" 2>&1
ls -l "$F" | tee -a "$R/fixture.txt"
fail=0
# run NAME ARGS...: one timed run, its JSON, its profile; a summary line.
run() {
  local name=$1; shift
  /usr/bin/time -v "$B" run "$F" --backend cuda -q --json "$R/$name.json" "$@" > "$R/$name.txt" 2>&1
  local rc=$?
  [ "$rc" -le 1 ] || fail=1
  echo "$name exit $rc: $(grep -E 'Elapsed|User time|System time|Maximum resident' "$R/$name.txt" | sed 's/^\s*//' | tr '\n' ';')"
}
run default
run classic64 --prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4
rm -f "$F"
exit $fail
