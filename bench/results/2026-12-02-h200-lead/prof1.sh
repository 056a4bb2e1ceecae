#!/usr/bin/env bash
# Lead's #15 profiling call: where a GLM-5 layer's time goes on the H200 host now.
set -uo pipefail
export NO_COLOR=1 MLA_DIFF_PROFILE=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-.carry/lead/mla-diff}; R=$OUT/prof; mkdir -p $R; F=/tmp/g5.gguf
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
/usr/bin/time -f "fixture wall %e" $B fixture --preset glm-5 --quant q4_k --layers 4 -o $F 2>&1 | tail -1
run() { local n=$1; shift; /usr/bin/time -f "$n: wall %e user %U sys %S rss %M KB" "$@" > $R/$n.txt 2>&1; echo "== $n exit $?"; grep -A12 "profile" $R/$n.txt; tail -1 $R/$n.txt; }
run cuda-default $B run $F --backend cuda -q --json $R/cuda-default.json
run cuda-64 $B run $F --backend cuda -q --json $R/cuda-64.json --prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4
run cuda-default-shadow $B run $F --backend cuda -q --mode shadow --layers 0,1
run cpu-64 $B run $F --backend cpu -q --prompt-len 48 --chunk 32 --decode-steps 16 --page-size 16 --num-splits 4
python3 - <<'PY'
import torch, time
for (m,k,n) in [(395,6144,2048),(395,2048,16384),(395,16384,6144),(64,6144,2048),(64,16384,6144),(395*64,512,192)]:
    a=torch.randn(m,k,dtype=torch.float64,device='cuda'); b=torch.randn(n,k,dtype=torch.float64,device='cuda')
    for _ in range(3): c=a@b.T
    torch.cuda.synchronize(); t=time.perf_counter(); it=20
    for _ in range(it): c=a@b.T
    torch.cuda.synchronize(); dt=(time.perf_counter()-t)/it
    print(f"dgemm {m}x{k}x{n}: {dt*1e6:.0f} us {2*m*n*k/dt/1e12:.1f} TFLOP/s")
a=torch.randn(16384,6144,dtype=torch.float32).pin_memory(); torch.cuda.synchronize(); t=time.perf_counter(); d=a.cuda(); torch.cuda.synchronize(); print(f"H2D pinned {a.numel()*4/(time.perf_counter()-t)/1e9:.1f} GB/s")
PY
