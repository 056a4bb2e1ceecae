#!/usr/bin/env bash
# #16: our decode kernels and the peers' (FlashMLA, vLLM TRITON_MLA) timed in one run on the same inputs
# (bench decode --peers). Carry .carry/peers (runners/fetch_peers.sh) and the binary; B=path OUT=dir.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-.carry/mla-diff}
OUT=${OUT:?set OUT}
mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3 NO_COLOR=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
[ "${SKIP_DECODE:-0}" = 1 ] || timeout 200 "$B" bench decode --peers flashmla,vllm-triton --json "$OUT/bench-decode-peers.json" 2>&1 | tee "$OUT/bench-decode-peers.txt"
# Prefill against torch's cuDNN SDPA (the #16 peer), then its flash kernel.
MLA_DIFF_SDPA_BACKEND=cudnn timeout 300 "$B" bench prefill --peers torch --json "$OUT/bench-prefill-peers-cudnn.json" 2>&1 | tee "$OUT/bench-prefill-peers-cudnn.txt"
