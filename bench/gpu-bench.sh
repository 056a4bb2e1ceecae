#!/usr/bin/env bash
# Speed of the CUDA kernels on a GPU host (the H200 calls of bench/RESULTS.md): the decode / prefill
# timings, #16's `bench table` against the peers, Nsight Compute profiles, and the whole-file wall time
# and peak memory (#15). One device call.
#
# Usage, from the repository root on the GPU host:
#   [B=mla-diff] [OUT=dir] [BUDGET=s] [PROBES="dir|probe.patch …"] bash bench/gpu-bench.sh [STEP…]
# STEPs (default: decode prefill table), run in the order given; a step starting with too little BUDGET
# left is skipped (and the call fails):
#   decode   `bench decode --heads $HEADS --best-only` (HEADS default 16,64,128) with the embedded kernels,
#            then once per PROBES item with `--kernels`: the same shape, so rows compare within the call
#   prefill  `bench prefill --wgmma-only` likewise (PREFILL_PEERS=torch adds cuDNN SDPA in the same run)
#   table    `bench table` (#16's six shapes × bf16/fp16, ours vs FlashMLA, vLLM TRITON_MLA, cuDNN SDPA, with
#            the copy / cuBLAS ceilings of the same run); ONLY (rows, e.g. 1,3,4), DTYPES, TABLE_PEERS
#            (default all; '' for none) and TABLE_KERNELS (a kernel dir or probe patch) narrow it
#   profile  Nsight Compute (`--clock-control none`, the bench's first launch) of NCU_KERNEL (regex, default
#            attn_wgmma_pairs) in `bench decode --heads $NCU_HEADS` (default 128); NCU_PEER=flashmla profiles
#            FlashMLA's splitkv kernel on the same inputs instead; NCU_BENCH=prefill profiles `bench prefill
#            --wgmma-only`'s first launch (NCU_KERNEL default attn_wgmma; NCU_PEER=torch: cuDNN's SDPA kernel);
#            NCU_COUNT=n profiles the first n launches (the prefill tiles run in prefill_tiles' order)
#   scale    the whole GLM-5 file (`fixture --preset glm-5 --quant q4_k`, 78 layers; LAYERS=N for the first
#            N) through `run --backend cuda` at the default and the 64-token schedule, `/usr/bin/time -v` and
#            MLA_DIFF_PROFILE's phase table (docs/scale.md); B0=another binary runs the default schedule first
#            with it (`default-before`: a before/after pair on one machine), SCALE_TOKENS64=0 skips 64 tokens
# PROBES items are kernel directories or probe patches (bench/probes/*.patch, applied to a copy of
# kernels/). The peers need .carry/peers (runners/fetch_peers.sh). B defaults to target/release/mla-diff,
# or .carry/bench/mla-diff.xz when carried. Outputs go to $OUT/bench/ and are packed into
# $OUT/bench.tar.gz; `table` also copies table.{md,json} to $OUT. Exit 0 when every step ran and exited 0.
set -uo pipefail
NAME=bench
source bench/lib.sh

# rows FILE: the timing lines of a bench output, short.
rows() { grep -E '^(decode|prefill) ' "$1" | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/'; }
decode() {
    local k n
    for k in embedded ${PROBES:-}; do
        local kx=()
        n=$(basename "$k" .patch)
        [ "$k" = embedded ] || kx=(--kernels "$(kdir "$k")") || { fail=1; continue; }
        timed "bench decode $n" 60 "$D/decode-$n.txt" "$B" bench decode --heads "${HEADS:-16,64,128}" --best-only "${kx[@]}"
        rows "$D/decode-$n.txt"
    done
}
prefill() {
    local k n
    [ -z "${PREFILL_PEERS:-}" ] || peers_env
    for k in embedded ${PROBES:-}; do
        local kx=()
        n=$(basename "$k" .patch)
        [ "$k" = embedded ] || kx=(--kernels "$(kdir "$k")") || { fail=1; continue; }
        timed "bench prefill $n" 90 "$D/prefill-$n.txt" "$B" bench prefill --wgmma-only ${PREFILL_PEERS:+--peers "$PREFILL_PEERS"} "${kx[@]}"
        rows "$D/prefill-$n.txt"
    done
}
table() {
    peers_env
    local ax=()
    [ -z "${ONLY:-}" ] || ax+=(--only "$ONLY")
    [ -z "${DTYPES:-}" ] || ax+=(--dtypes "$DTYPES")
    [ -z "${TABLE_PEERS+x}" ] || ax+=(--peers "$TABLE_PEERS")
    [ -z "${TABLE_KERNELS:-}" ] || ax+=(--kernels "$(kdir "$TABLE_KERNELS")")
    timed "bench table ${ax[*]}" 400 "$D/table.txt" "$B" bench table "${ax[@]}" --json "$D/table.json" --markdown "$D/table.md"
    cat "$D/table.md" 2> /dev/null
    cp "$D/table.md" "$D/table.json" "$OUT/" 2> /dev/null
}
profile() {
    local k=${NCU_KERNEL:-attn_wgmma_pairs} px=() cmd=(bench decode --heads "${NCU_HEADS:-128}" --best-only)
    # Prefill: the first wgmma tile at DeepSeek's 192/128 (the table's first prefill row), or cuDNN's SDPA
    # kernel on the same inputs.
    [ "${NCU_BENCH:-decode}" = prefill ] && k=${NCU_KERNEL:-attn_wgmma} && cmd=(bench prefill --wgmma-only)
    if [ "${NCU_PEER:-}" = flashmla ]; then
        peers_env
        k=splitkv_mla_kernel
        px=(--peers flashmla)
    elif [ "${NCU_PEER:-}" = torch ]; then
        peers_env
        k='sdpa|fprop|fmha'
        px=(--peers torch)
    fi
    timed "ncu $k" 90 "$D/ncu-$k.txt" ncu --clock-control none -k "regex:$k" -c "${NCU_COUNT:-1}" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section LaunchStats --section Occupancy \
        "$B" "${cmd[@]}" --launches 1 "${px[@]}"
    grep -E "attn_|flash|Duration|Elapsed Cycles|DRAM Throughput|Compute \(SM\)|Executed Ipc A|Issue Slots Busy|Executed Instructions |Registers Per|No Eligible|One or More|Warp Cycles Per Issued|SM Frequency|L1TEX" \
        "$D/ncu-$k.txt" | grep -v '^ *-' | head -30
}
# scale1 NAME ARGS…: one timed run of the whole file; its exit 0 or 1 (a verdict) both count as ran.
scale1() {
    local n=$1 rc
    shift
    [ "$(left)" -gt 60 ] || { echo "skip scale $n: budget"; fail=1; return 0; }
    MLA_DIFF_PROFILE=1 timeout "$(tmo 400)" /usr/bin/time -v "$B" run "$F" --backend cuda -q --json "$D/scale-$n.json" "$@" > "$D/scale-$n.txt" 2>&1
    rc=$?
    [ $rc -le 1 ] || fail=1
    echo "scale $n exit $rc: $(grep -E 'Elapsed|User time|System time|Maximum resident' "$D/scale-$n.txt" | sed 's/^\s*//' | tr '\n' ';')"
    grep -E '^  (load|waiting|freed|hand-back|optimized|wall)|CUDA passes' "$D/scale-$n.txt" | sed 's/^ */  /'
}
scale() {
    F=${F:-/tmp/glm5-q4_k.gguf}
    [ -f "$F" ] || /usr/bin/time -v "$B" fixture --preset glm-5 --quant q4_k ${LAYERS:+--layers $LAYERS} -o "$F" > "$D/scale-fixture.txt" 2>&1
    [ -z "${B0:-}" ] || B=$B0 scale1 default-before
    scale1 default
    [ "${SCALE_TOKENS64:-1}" = 0 ] || scale1 tokens64 --prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4
    rm -f "$F"
}
run_steps "decode prefill table" "$@"
