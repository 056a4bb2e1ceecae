// fill.cu — deterministic pseudo-random normal fill, for benchmark inputs generated on the device.
#include "common.cuh"

__device__ __forceinline__ unsigned hash32(unsigned x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// p[i] = scale * N(0, 1) (Box-Muller on two hashed uniforms of (seed, i)).
extern "C" __global__ void fill_normal(dt* p, long long n, unsigned seed, float scale) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const unsigned a = hash32((unsigned)i * 2u + 0x9e3779b9u * seed), b = hash32(a ^ (unsigned)(i >> 31) ^ 0x85ebca6bu);
        const float u1 = ((a >> 8) + 1) * (1.0f / 16777217.0f), u2 = (b >> 8) * (1.0f / 16777216.0f);
        p[i] = from_f(scale * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
    }
}

// Not a kernel under test: the fp64 products of the reference and the stage-local view
// (src/backend/cuda/dgemm.rs) widen each weight chunk exactly, f32 -> f64, and square it in f64 for the
// variance product where w2 is given.
extern "C" __global__ void widen_f32_f64(const float* w, double* w64, double* w2, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const double v = w[i];
        w64[i] = v;
        if (w2) w2[i] = v * v;
    }
}
