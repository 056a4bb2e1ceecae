#!/usr/bin/env bash
# #14 on the H200, one device call: the sensitivity of each check through the CUDA kernels, determinism
# (run --repeat 5) and split invariance (sweep --splits) on the shipped fixtures, a length sweep, lint's
# kernel plan against what launched (gpu-validate) and its runner probes on FlashMLA / vLLM TRITON_MLA.
#   B=path/to/mla-diff OUT=dir bash bench/h200-detect.sh   (carry .carry/peers for the runner probes)
set -uo pipefail
cd "$(dirname "$0")/.."
export NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/mla-diff}
R="$OUT/detect"; mkdir -p "$R"
fail=0
want() { [ "$1" = "$2" ] || fail=1; }
mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t=$SECONDS; timeout 120 "$B" selftest --sensitivity --backend cuda > "$R/sensitivity-cuda.txt" 2>&1
echo "selftest --sensitivity --backend cuda: exit $? ($((SECONDS-t)) s): $(tail -1 "$R/sensitivity-cuda.txt")"
for f in fixtures/*.gguf; do
  n=$(basename "$f" .gguf)
  t=$SECONDS; timeout 60 "$B" run "$f" --backend cuda --repeat 5 --mode shadow --json "$R/$n-repeat.json" > "$R/$n-repeat.txt" 2>&1; rc=$?
  echo "run --repeat 5 $n: exit $rc ($((SECONDS-t)) s): $(grep -E '^repeat' "$R/$n-repeat.txt" | head -1) $(tail -2 "$R/$n-repeat.txt" | head -1 | cut -c1-120)"; want $rc 0
done
for n in deepseek-v3-yarn-q4_k glm-5-q4_0; do
  t=$SECONDS; timeout 90 "$B" sweep fixtures/$n.gguf --backend cuda --splits 1,2,4,8,16 --json "$R/$n-splits.json" > "$R/$n-splits.txt" 2>&1; rc=$?
  echo "sweep --splits $n: exit $rc ($((SECONDS-t)) s): $(tail -1 "$R/$n-splits.txt" | cut -c1-160)"; want $rc 0
done
t=$SECONDS; timeout 150 "$B" sweep fixtures/deepseek-v3-yarn-q4_k.gguf --backend cuda --json "$R/ds3-lengths.json" > "$R/ds3-lengths.txt" 2>&1; rc=$?
echo "sweep lengths deepseek-v3: exit $rc ($((SECONDS-t)) s): $(grep -E '^(boundaries|smallest|\[sweep)' "$R/ds3-lengths.txt" | tr '\n' '|' | cut -c1-300)"; want $rc 0
t=$SECONDS; timeout 150 "$B" gpu-validate --json "$R/gpu-validate.json" > "$R/gpu-validate.txt" 2>&1; rc=$?
echo "gpu-validate: exit $rc ($((SECONDS-t)) s): $(tail -1 "$R/gpu-validate.txt")"; want $rc 0
lint() { local name=$1 w=$2; shift 2
  timeout 60 "$B" lint "$@" --backend cuda --json "$R/lint-$name.json" > "$R/lint-$name.txt" 2>&1; local rc=$?
  echo "lint $name: exit $rc (want $w): $(grep -E '^(error|warning) ' "$R/lint-$name.txt" | cut -c1-140 | tr '\n' '|')"; want $rc $w; }
lint glm5-flashmla 0 fixtures/glm-5-q4_0.gguf --page-size 64 --runner "python3 runners/flashmla.py"
lint glm5-noscale 1 fixtures/glm-5-q4_0.gguf --page-size 64 --runner "python3 runners/bugs/flashmla_no_scale.py"
lint ds3-vllm 0 fixtures/deepseek-v3-yarn-q4_k.gguf --page-size 64 --runner "python3 runners/vllm_triton.py"
lint ds3-sdpa 0 fixtures/deepseek-v3-yarn-q4_k.gguf --runner "python3 runners/torch_sdpa.py"
echo "done: $SECONDS s, fail=$fail"
tar czf "$OUT/detect.tar.gz" -C "$OUT" detect && rm -rf "$R"
exit $fail
