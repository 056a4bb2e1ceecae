#!/usr/bin/env bash
# Lead, 2026-12-02 (w): one call on main + kern8-pairs (binary `lead8`, the alternating-tile decode candidate
# embedded). (1) racecheck, no kernel filter, of kern8's three barrier variants of attn_wgmma_pairs (kernel
# dirs = this tree's kernels + the variant's attention_sm90_pairs.cuh) on the GLM-5 fixture (prefill by TMA
# and decode at one split: the pairs kernel); (2) their decode timings; (3) the first variant with no hazard
# outside cuBLAS: selftest cuda, gpu-validate, memcheck at 2 splits, then `bench table` (all rows, peers)
# with it — or, none clean, `bench table` with the pairs kernel off (`nopairs`: main's kernels).
set -uo pipefail
export NO_COLOR=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=/tmp/mla-diff; xz -dc .carry/lead/mla-diff.xz > $B && chmod +x $B
K=.carry/lead/k; R=$OUT/final; mkdir -p $R; BUDGET=${BUDGET:-500}
left() { echo $((BUDGET - SECONDS)); }
tmo() { local l=$(($(left) - 10)); echo $(($1 < l ? $1 : l)); }
{ echo "commit $(cat .carry/lead/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; } | tee $R/env.txt
SCHED="--mode shadow --page-size 64 --prompt-len 200 --decode-steps 3"
CLEAN=
for v in ${VARIANTS:-own allmbar own-rdv}; do
  t0=$SECONDS; timeout $(tmo 90) /usr/local/cuda/bin/compute-sanitizer --tool racecheck $B run fixtures/glm-5-q4_0.gguf --backend cuda --kernels $K/$v $SCHED --num-splits 1 > $R/race-$v.txt 2>&1
  rc=$?; ours=$(grep 'Race reported' $R/race-$v.txt | grep -vc nvjet)
  echo "== racecheck $v exit $rc ($((SECONDS-t0)) s); races outside cuBLAS: $ours"
  grep -E "RACECHECK SUMMARY|Sanitizer Error|^\[shadow\]" $R/race-$v.txt | head -3
  grep 'Race reported' $R/race-$v.txt | grep -v nvjet | sed 's/.*Race reported between //' | sort | uniq -c | head -6
  t0=$SECONDS; timeout $(tmo 40) $B bench decode --heads 64,128 --best-only --kernels $K/$v > $R/decode-$v.txt 2>&1
  echo "   bench decode $v exit $? ($((SECONDS-t0)) s)"; grep -E '^decode ' $R/decode-$v.txt | sed -E 's/ +vs scalar kernel: rel-L2 ([^,]+), non-finite ([0-9]+).*/  rel-L2 \1 nf \2/; s/s_k=4096 page=64 d=576\/512 bf16 +//'
  [ $rc -eq 0 ] && [ "$ours" -eq 0 ] && [ -z "$CLEAN" ] && CLEAN=$v
  gzip -9 $R/race-$v.txt
done
echo "== clean variant: ${CLEAN:-none}"
if [ -n "$CLEAN" ]; then
  t0=$SECONDS; timeout $(tmo 80) $B selftest --backend cuda --kernels $K/$CLEAN > $R/selftest-cuda.txt 2>&1
  echo "== selftest cuda $CLEAN exit $? ($((SECONDS-t0)) s): $(tail -1 $R/selftest-cuda.txt)"; grep -E "FAIL|MISSED|ERROR" $R/selftest-cuda.txt | head -5
  t0=$SECONDS; timeout $(tmo 120) $B gpu-validate --kernels $K/$CLEAN --json $R/gpu-validate.json > $R/gpu-validate.txt 2>&1
  echo "== gpu-validate $CLEAN exit $? ($((SECONDS-t0)) s): $(tail -1 $R/gpu-validate.txt)"
  t0=$SECONDS; timeout $(tmo 50) /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B run fixtures/glm-5-q4_0.gguf --backend cuda --kernels $K/$CLEAN $SCHED --num-splits 2 > $R/memcheck.txt 2>&1
  echo "== memcheck $CLEAN splits 2 exit $? ($((SECONDS-t0)) s): $(grep 'ERROR SUMMARY' $R/memcheck.txt)"; gzip -9 $R/memcheck.txt
  TK=$CLEAN
else TK=nopairs; fi
if [ "$(left)" -gt 100 ]; then
  mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
  t0=$SECONDS
  PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site" MLA_DIFF_PYTHON=python3 MLA_DIFF_SDPA_BACKEND=cudnn \
    timeout $(($(left) - 8)) $B bench table --kernels $K/$TK --json $R/table.json --markdown $R/table.md > $R/table.txt 2>&1
  echo "== bench table --kernels $TK exit $? ($((SECONDS-t0)) s)"; cat $R/table.md
else echo "skip table: budget"; fi
cp $R/table.md $R/table.json $OUT/ 2>/dev/null; tar czf $OUT/final.tar.gz -C $OUT final; rm -rf $R
echo "done ($SECONDS s)"
