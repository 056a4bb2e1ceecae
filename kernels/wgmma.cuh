// wgmma.cuh — what both Hopper kernels (attention_sm90.cuh's decode, prefill_sm90.cuh's prefill) need to
// drive warpgroup MMA: shared-memory matrix descriptors (128-byte swizzle), the fence / commit / wait of
// the async pipeline, and the register pins that keep accumulator reads below a wait. sm_90a only; the
// including file's guard decides whether it is compiled.
#pragma once

// Shared-memory matrix descriptor: start address, leading / stride byte offsets (16-byte units), 128-byte
// swizzle. K-major operands (Q, K, P) step 8-row groups by 1024 B (stride); V, read N-major, steps 64-column
// blocks by the block size (leading) and 8-key groups by 1024 B (stride).
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Make generic-proxy writes (cp.async, st.shared) visible to wgmma's reads (async proxy).
__device__ __forceinline__ void wg_fence_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pin accumulators after a wait: reads of them may not move above it.
template <int N>
__device__ __forceinline__ void wg_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
