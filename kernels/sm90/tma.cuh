// sm90/tma.cuh — Hopper's tensor memory accelerator for the decode kernel's key tiles: a 2-D tensor map over
// the paged latent cache (columns × pool rows, encoded on the host: src/backend/cuda/tma.rs), one bulk
// copy per 64-column block of a 64-row tile with the 128-byte swizzle wgmma's descriptors expect, and the
// mbarriers that count the bytes in. sm_90a only; the including file's guard decides whether it is compiled.
//
// Why: the cp.async loader spends 128–256 threads × (36 copies + 4 block-table lookups) per tile; one
// thread and nine copies do it here, the copy engine doing the swizzle and zero-filling columns past the
// key width (MiniCPM3's 288 → 320).
#pragma once

// CUtensorMap (opaque, 128 bytes); passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) TmaMap {
    unsigned long long v[16];
};

__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Make the initialised barriers visible to the copy engine (async proxy).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_inval(unsigned bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// This thread's arrival, announcing `bytes` more to come by copies that complete on the barrier.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// This thread's arrival (no bytes), on a barrier counting threads.
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, int parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// The box at (column c, row r) of `map` into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap* map, int c, int r, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c), "r"(r), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Prefill (kernels/sm90/prefill/attn_wgmma.cuh): the box at (column c, y, z) of a 3-D `map` (columns × heads × rows)
// into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap* map, int c, int y, int z, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c), "r"(y), "r"(z), "r"(bar)
        : "memory");
}
