#!/usr/bin/env bash
# Issue #17 on the H200: one GLM-5-dims DSA layer (hidden 6144, 64 heads, q_lora 2048, kv_lora 512,
# 192/64/256, indexer 32 x 128, top_k 2048) on a 3072-token prompt + 16 decode steps (1024 + 16 queries
# past top_k), through `run::dsa` (docs/dsa.md): the sparse fp64 reference against
#   1. the CPU mirror (bf16) over the reference's selection, its own indexer's selection (tie-aware), and
#      over its own selection;
#   2. the CUDA kernels (bf16), likewise. Until the kernels take `LayerCtx::selection` (sparse decode over
#      FlashMLA-style page*64+offset indices, `reference::sparse::flashmla_indices`), step 2 is expected
#      to FAIL past top_k (dense attention is not the model there): that is the check working.
# Needs the example built on the host (cargo build --release --example dsa_check) and carried as
# .carry/dsa_check with the binary .carry/mla-diff. Output: $OUT/dsa-h200.txt.
# Usage on the GPU host:  OUT=dir bash bench/h200-dsa.sh   (fp64 reference at T = 3088: several minutes)
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
E=${E:-.carry/dsa_check}
mkdir -p "$OUT"
log="$OUT/dsa-h200.txt"
"$B" fixture --preset glm-5 --layers 1 --quant bf16 -o "$OUT/glm5-dsa.gguf" | tee "$log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$log"
for backend in cpu cuda; do
  echo "== $backend: layer 0, prompt 3072, 16 decode steps" | tee -a "$log"
  /usr/bin/time -f "   %e s, %M KB" "$E" "$OUT/glm5-dsa.gguf" 0 3072 16 "$backend" bf16 2>&1 | tee -a "$log"
  echo "   exit ${PIPESTATUS[0]}" | tee -a "$log"
done
rm -f "$OUT/glm5-dsa.gguf"
