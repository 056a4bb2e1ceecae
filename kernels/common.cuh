// common.cuh — storage type, conversions and small helpers shared by every mla-diff kernel.
//
// Compile-time defines passed by the host (src/backend/cuda/nvrtc.rs):
//   MLA_DTYPE  0 = bf16, 1 = fp16, 2 = f32   (storage type of weights and activations)
//   MLA_LKV, MLA_R, MLA_P, MLA_DV, MLA_H     (kv latent, rope, nope, v head dims, heads)
//   MLA_PAGE                                  (rows per cache page)
//   MLA_ROPE_NEOX 0 = NORM pairs (x[2i], x[2i+1]), 1 = NEOX pairs (x[i], x[i+R/2])
//   MLA_DEBUG  1 = also write internal stage tensors (decode split partials even with one split)
// Every dot product accumulates in f32; every tensor written to memory is rounded to the storage type.
#pragma once

#if MLA_DTYPE == 0
#include <cuda_bf16.h>
typedef __nv_bfloat16 dt;
__device__ __forceinline__ float to_f(dt x) { return __bfloat162float(x); }
__device__ __forceinline__ dt from_f(float x) { return __float2bfloat16_rn(x); }
// Two floats → packed pair (lo in the low half), the operand format of mma.sync.
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
#define MMA_TYPE "bf16"
#elif MLA_DTYPE == 1
#include <cuda_fp16.h>
typedef __half dt;
__device__ __forceinline__ float to_f(dt x) { return __half2float(x); }
__device__ __forceinline__ dt from_f(float x) { return __float2half_rn(x); }
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
#define MMA_TYPE "f16"
#elif MLA_DTYPE == 2
typedef float dt;
__device__ __forceinline__ float to_f(dt x) { return x; }
__device__ __forceinline__ dt from_f(float x) { return x; }
#else
#error "MLA_DTYPE must be 0 (bf16), 1 (fp16) or 2 (f32)"
#endif

// Round an f32 to the storage type and back (what a store + load does).
__device__ __forceinline__ float round_dt(float x) { return to_f(from_f(x)); }

#define MLA_NEG_INF (-__int_as_float(0x7f800000))
#define MLA_LN2 0.6931471805599453f

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum; `red` holds one float per warp. All threads get the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += red[i];
    return t;
}

// Planted bug SPLIT_LSE_BF16 (src/faults.rs): a split's LSE stored rounded to bf16 (round to nearest
// even on the f32 bits; ±inf stay) before the combine reads it, as an LSE buffer in the activation dtype.
__device__ __forceinline__ float mla_fault_split_lse(float lse) {
#ifdef MLA_FAULT_SPLIT_LSE_BF16
    const unsigned u = __float_as_uint(lse);
    return __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
#else
    return lse;
#endif
}
