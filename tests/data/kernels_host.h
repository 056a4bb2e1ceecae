// CUDA's built-ins emulated on the host, for kernels/ compiled as C++ (tests/it/*kernels_host.rs): a warp is 32
// threads whose shuffles exchange through a barrier; a CTA's threads run together (its __syncthreads a barrier),
// CTAs one after another (`run`). Dynamic shared arrays are rewritten by the tests into pointers into g_smem.
#pragma once
#include <cstdio>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include <vector>
#include <thread>
#include <barrier>
#include <algorithm>
#include <functional>
#include <memory>
using std::min; using std::max; using std::isnan;
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(x)
#define __shared__ static
struct D3 { unsigned x, y, z; };
static thread_local D3 threadIdx{0,0,0};
static D3 blockIdx{0,0,0}, blockDim{1,1,1}, gridDim{1,1,1};
alignas(16) static unsigned char g_smem[1 << 20];
static std::barrier<>* g_block = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> g_warps;
static float g_xf[64][32]; static int g_xi[64][32];
static inline void __syncthreads() { g_block->arrive_and_wait(); }
static inline void __syncwarp() { g_warps[threadIdx.x >> 5]->arrive_and_wait(); }
static inline float xch(float v, int src) { int w = threadIdx.x >> 5, l = threadIdx.x & 31; g_xf[w][l] = v; __syncwarp(); float r = g_xf[w][src]; __syncwarp(); return r; }
static inline float __shfl_xor_sync(unsigned, float v, int o) { return xch(v, (threadIdx.x & 31) ^ o); }
static inline float __shfl_sync(unsigned, float v, int s) { return xch(v, s); }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
// The storage type: values held in f32, rounded by round_dt / from_f (MLA_DTYPE as common.cuh: 0 bf16,
// 1 fp16, 2 f32, the default).
#ifndef MLA_DTYPE
#define MLA_DTYPE 2
#endif
typedef float dt;
#if MLA_DTYPE == 0
static inline float round_dt(float x) {  // round to nearest even on the top 16 bits, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return x;
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}
#elif MLA_DTYPE == 1
static inline float round_dt(float x) { return (float)(_Float16)x; }
#else
static inline float round_dt(float x) { return x; }
#endif
static inline float to_f(dt x) { return x; }
static inline dt from_f(float x) { return round_dt(x); }
#define MLA_NEG_INF (-__int_as_float(0x7f800000))
static inline float warp_sum(float v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o); return v; }
static inline float warp_max(float v) { for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o)); return v; }
static inline float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v); __syncthreads(); if (lane == 0) red[warp] = v; __syncthreads();
    float t = 0.f; for (int i = 0; i < nw; ++i) t += red[i]; return t;
}
// Launch: grid (gx, gy), block bx threads, in sequence.
static void run(int gx, int gy, int bx, std::function<void()> k) {
    blockDim = {(unsigned)bx, 1, 1}; gridDim = {(unsigned)gx, (unsigned)gy, 1};
    for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
        blockIdx = {(unsigned)x, (unsigned)y, 0};
        std::barrier<> bb(bx); g_block = &bb; g_warps.clear();
        for (int w = 0; w < (bx + 31) / 32; ++w) g_warps.emplace_back(new std::barrier<>(min(32, bx - 32 * w)));
        std::vector<std::thread> ts;
        for (int t = 0; t < bx; ++t) ts.emplace_back([t, &k] { threadIdx = {(unsigned)t, 0, 0}; k(); });
        for (auto& t : ts) t.join();
    }
}
