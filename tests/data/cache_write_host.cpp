// kernels/cache_write.cu's `cache_write_format` compiled for the host (tests/it/kv_format_kernel.rs): the
// CUDA built-ins it uses, shimmed with their IEEE meaning (__fdiv_rn, __fmul_rn: one f32 rounding each,
// built with -ffp-contract=off; __float2int_rn: nearest even), one thread per block, so the kernel's
// loops run in order. `cw.inc` is cache_write.cu without its `#include "common.cuh"` (the storage type is
// f32 here: the dequantized values are exact in bf16 and fp16 too, see the kernel's comment).
// argv: n [first_req_rows [ts]] (ts: the per-tensor `fp8`'s scale, f32 bits in hex; default 1); stdin: n rows of MLA_ROW f32 bit patterns (hex); stdout per row: its KV_BYTES bytes (hex), then the
// pool row read back from them (f32 bits, hex).
#include <cstdio>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
struct D3 { unsigned x; };
static D3 threadIdx{0}, blockDim{1}, blockIdx{0};
static inline void __syncthreads() {}
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
typedef float dt;
static inline float to_f(dt x) { return x; }
static inline dt from_f(float x) { return x; }
#include "cw.inc"  // kernels/cache_write.cu, its common.cuh include dropped
int main(int argc, char** argv) {
    int n = atoi(argv[1]);
    std::vector<float> rows((size_t)n * MLA_ROW);
    for (auto& v : rows) { unsigned u; if (scanf("%x", &u) != 1) return 3; v = __uint_as_float(u); }
    std::vector<float> pool((size_t)n * MLA_ROW, NAN);
    std::vector<unsigned char> kv((size_t)n * KV_BYTES, 0xff);
    std::vector<int> table(n / MLA_PAGE + 1);
    for (size_t i = 0; i < table.size(); ++i) table[i] = (int)i;
    // One launch of n blocks; argv[2] (default n): the launch's rows of its first request.
    int first = argc > 2 ? atoi(argv[2]) : n;
    float ts = argc > 3 ? __uint_as_float((unsigned)strtoul(argv[3], nullptr, 16)) : 1.f;
    for (int t = 0; t < n; ++t) { blockIdx.x = (unsigned)t; cache_write_format(rows.data(), pool.data(), kv.data(), table.data(), 0, first, ts); }
    for (int t = 0; t < n; ++t) {
        for (int i = 0; i < KV_BYTES; ++i) printf("%02x", kv[(size_t)t * KV_BYTES + i]);
        printf("\n");
        for (int i = 0; i < MLA_ROW; ++i) printf("%08x ", __float_as_uint(pool[(size_t)t * MLA_ROW + i]));
        printf("\n");
    }
}
