# The preamble the H200 device scripts share (bench/h200-kern4.sh … h200-kern7.sh), sourced from the
# repository root after the script's `cd`, with NAME (the call: binary .carry/$NAME/mla-diff, commit
# .carry/$NAME/COMMIT, files under $OUT/$NAME) and BUDGET (seconds) set. Sets B, OUT, D, fail; defines
# step, left, tmo and ncu_one; writes $D/env.txt (date, commit, GPU) and shows it.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/$NAME/mla-diff}
OUT=${OUT:?set OUT}
D="$OUT/$NAME"
mkdir -p "$D"
export NO_COLOR=1
fail=0
step() { echo "$1: exit $2"; [ "$2" -eq 0 ] || fail=1; }
left() { echo $((BUDGET - SECONDS)); }
# A step's timeout: T seconds, or what is left of the budget less 8 (so the call always packs its files).
tmo() { local l=$(($(left) - 8)); echo $(($1 < l ? $1 : l)); }
{
  date -u
  echo "commit $(cat ".carry/$NAME/COMMIT" 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
} | tee "$D/env.txt"
ncu_one() { # ncu_one NAME KERNEL-REGEX HEADS
  local t0=$SECONDS
  timeout 75 ncu --clock-control none -k "regex:$2" -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
    "$B" bench decode --heads "$3" --best-only --launches 1 > "$D/ncu-$1.txt" 2>&1
  echo "ncu $1: exit $? ($((SECONDS - t0)) s)"
  grep -E "attn_|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Compute \(SM\)|Executed Ipc A|Registers Per|Achieved Occ|Stall|Shared Memory|Pipe|One or More|No Eligible|Issued Warp" "$D/ncu-$1.txt" | grep -v '^ *-' | head -40
}
