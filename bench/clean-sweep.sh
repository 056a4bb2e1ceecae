#!/usr/bin/env bash
# Clean runs that must stay clean (issue #35 item 3): every shipped fixture × bf16/f32 × seeds × the
# default (kernel-aware) schedule and the serving schedule of tests/it/no_false_alarms.rs, CPU mirror,
# shadow mode, JOBS at a time. Prints each failing run and, per check, the largest local-view ratio
# (statistic ÷ its bound; ≥ 1 fails) over all runs.
#   bash bench/clean-sweep.sh [BIN] [SEEDS]     (default: target/release/mla-diff, "1 2 3 4 5 6 7 8")
set -u
bin=${1:-target/release/mla-diff}
seeds=${2:-1 2 3 4 5 6 7 8}
py=${MLA_DIFF_PYTHON:-python3}
tmp=$(mktemp -d)
export bin tmp
one() { # FIXTURE DTYPE SCHED SEED
  local args="" out
  [ "$3" = serving ] && args="--prompt-len 48 --chunk 32 --decode-steps 16 --q-len 1 --page-size 16 --num-splits 4"
  out="$tmp/$(basename "$1" .gguf).$2.$3.$4.json"
  # shellcheck disable=SC2086
  "$bin" run "$1" --backend cpu --mode shadow -q --dtype "$2" --seed "$4" $args --json "$out" >/dev/null 2>&1 ||
    echo "FAIL $(basename "$1") $2 $3 seed $4"
}
export -f one
for f in fixtures/*.gguf; do for dt in bf16 f32; do for sc in default serving; do for s in $seeds; do
  echo "$f $dt $sc $s"
done; done; done; done | xargs -P "${JOBS:-$(nproc)}" -L 1 bash -c 'one "$@"' _ | tee "$tmp/fails"
n=$(find "$tmp" -name '*.json' | wc -l)
fail=$(wc -l <"$tmp/fails")
"$py" - "$tmp" <<'PY'
import json, sys, glob, collections
worst = collections.defaultdict(lambda: (0.0, ""))
for p in glob.glob(sys.argv[1] + "/*.json"):
    r = json.load(open(p))
    for mode in r["modes"]:
        for layer in mode["layers"]:
            for c in layer["checks"]:
                l = c.get("local")
                if l and l["ratio"] > worst[c["check"]][0]:
                    worst[c["check"]] = (l["ratio"], "%s layer %d" % (p.split("/")[-1][:-5], layer["layer"]))
for k, (v, at) in sorted(worst.items(), key=lambda kv: -kv[1][0]):
    print("  %-22s worst ratio %.3f  (%s)" % (k, v, at))
PY
echo "clean sweep: $fail of $n runs failed"
rm -rf "$tmp"
[ "$fail" -eq 0 ]
