#!/usr/bin/env bash
# `mla-diff run --backend cuda` on every shipped fixture × {bf16, fp16} × {default schedule; a 777-token
# prompt in chunks of 256, 64 decode steps, page 64, 8 splits}. Reports and texts go to $DIR; prints one
# line per run; exits 1 if any run did not pass. Usage: B=mla-diff DIR=dir bash bench/run-fixtures.sh
set -uo pipefail
fail=0
for f in fixtures/*.gguf; do
  n=$(basename "$f" .gguf)
  for dt in bf16 fp16; do
    for sc in default long; do
      extra=()
      [ "$sc" = long ] && extra=(--prompt-len 777 --chunk 256 --decode-steps 64 --page-size 64 --num-splits 8)
      NO_COLOR=1 timeout 120 "$B" run "$f" --backend cuda --dtype "$dt" "${extra[@]}" --json "$DIR/run-$n-$dt-$sc.json" > "$DIR/run-$n-$dt-$sc.txt" 2>&1
      rc=$?
      echo "run $n $dt $sc: exit $rc: $(grep -E 'PASS|DIVERGENCE' "$DIR/run-$n-$dt-$sc.txt" | tail -1 | cut -c1-150)"
      [ $rc -eq 0 ] || fail=1
    done
  done
done
exit $fail
