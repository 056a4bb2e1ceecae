// sm90/wgmma.cuh — what the Hopper kernels (sm90/decode/attn_wgmma.cuh's and sm90/decode/attn_wgmma_pairs.cuh's decode,
// sm90/prefill/attn_wgmma.cuh's prefill) need to drive warpgroup MMA: shared-memory matrix descriptors (128-byte
// swizzle), the fence / commit / wait of the async pipeline, the register pins that keep accumulator reads
// below a wait, and the one set of `wgmma.mma_async` wrappers they all call. sm_90a only; the including
// file's guard decides whether it is compiled (MMA_TYPE comes from common.cuh).
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

// ---------------------------------------------------------------------------------------------------
// Warpgroup MMA, D (+)= A·B, m64nNk16 with f32 accumulators (the kernels' MMA_TYPE inputs); `acc` = 0
// overwrites D. `wg_ss_nN`: A and B by shared-memory descriptor; `wg_rs_nN`: A (16 rows x 16 k per warp,
// the mma.sync A fragment) from registers, B by descriptor. TB: B is N-major (1: V, or K read
// transposed) or K-major (0). One wrapper per N the kernels use; the asm operand lists are spelled out
// because PTX names every accumulator register.
// ---------------------------------------------------------------------------------------------------

#define WG_R8_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define WG_R8_8 "%8, %9, %10, %11, %12, %13, %14, %15"
#define WG_R8_16 "%16, %17, %18, %19, %20, %21, %22, %23"
#define WG_R8_24 "%24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R8_32 "%32, %33, %34, %35, %36, %37, %38, %39"
#define WG_R8_40 "%40, %41, %42, %43, %44, %45, %46, %47"
#define WG_R8_48 "%48, %49, %50, %51, %52, %53, %54, %55"
#define WG_R8_56 "%56, %57, %58, %59, %60, %61, %62, %63"
#define WG_R8_64 "%64, %65, %66, %67, %68, %69, %70, %71"
#define WG_R8_72 "%72, %73, %74, %75, %76, %77, %78, %79"
#define WG_R8_80 "%80, %81, %82, %83, %84, %85, %86, %87"
#define WG_R8_88 "%88, %89, %90, %91, %92, %93, %94, %95"
#define WG_R8_96 "%96, %97, %98, %99, %100, %101, %102, %103"
#define WG_R8_104 "%104, %105, %106, %107, %108, %109, %110, %111"
#define WG_R8_112 "%112, %113, %114, %115, %116, %117, %118, %119"
#define WG_R8_120 "%120, %121, %122, %123, %124, %125, %126, %127"
// The accumulator operands: d[i], …, d[i + 7] (and 16, 32, 64 of them) as read-write f32 registers.
#define WG_D8(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define WG_D16(i) WG_D8(i), WG_D8((i) + 8)
#define WG_D32(i) WG_D16(i), WG_D16((i) + 16)
#define WG_D64(i) WG_D32(i), WG_D32((i) + 32)

template <int TB>
__device__ __forceinline__ void wg_ss_n32(float (&d)[16], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8
        "}, %16, %17, p, 1, 1, 0, %19;\n}\n"
        : WG_D16(0)
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_ss_n64(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24
        "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
        : WG_D32(0)
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_ss_n80(float (&d)[40], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24 ", " WG_R8_32
        "}, %40, %41, p, 1, 1, 0, %43;\n}\n"
        : WG_D32(0), WG_D8(32)
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_ss_n128(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24 ", " WG_R8_32 ", " WG_R8_40 ", " WG_R8_48 ", " WG_R8_56
        "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
        : WG_D64(0)
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_ss_n256(float (&d)[128], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24 ", " WG_R8_32 ", " WG_R8_40 ", " WG_R8_48 ", " WG_R8_56 ", " WG_R8_64 ", " WG_R8_72 ", " WG_R8_80 ", " WG_R8_88 ", " WG_R8_96 ", " WG_R8_104 ", " WG_R8_112 ", " WG_R8_120
        "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
        : WG_D64(0), WG_D64(64)
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_rs_n64(float (&d)[32], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : WG_D32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}
// Always accumulating (the predicate a constant, no register for it): the pairs kernel's rope k-steps.
template <int TB>
__device__ __forceinline__ void wg_rs_n64(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
        : WG_D32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_rs_n128(float (&d)[64], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24 ", " WG_R8_32 ", " WG_R8_40 ", " WG_R8_48 ", " WG_R8_56
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : WG_D64(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_rs_n192(float (&d)[96], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24 ", " WG_R8_32 ", " WG_R8_40 ", " WG_R8_48 ", " WG_R8_56 ", " WG_R8_64 ", " WG_R8_72 ", " WG_R8_80 ", " WG_R8_88
        "}, {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n"
        : WG_D64(0), WG_D32(64)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_rs_n256(float (&d)[128], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." MMA_TYPE "." MMA_TYPE " {" WG_R8_0 ", " WG_R8_8 ", " WG_R8_16 ", " WG_R8_24 ", " WG_R8_32 ", " WG_R8_40 ", " WG_R8_48 ", " WG_R8_56 ", " WG_R8_64 ", " WG_R8_72 ", " WG_R8_80 ", " WG_R8_88 ", " WG_R8_96 ", " WG_R8_104 ", " WG_R8_112 ", " WG_R8_120
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
        : WG_D64(0), WG_D64(64)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}
