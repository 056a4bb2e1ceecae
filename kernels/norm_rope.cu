// norm_rope.cu — RMSNorm and rotary embedding, the token-local stages before attention.
#include "common.cuh"

// Planted bugs (src/faults.rs): a rope kernel with its pairing hard-coded, whatever the model's.
#if defined(MLA_FAULT_ROPE_NEOX)
#define ROPE_PAIRS_NEOX 1
#elif defined(MLA_FAULT_ROPE_NORM)
#define ROPE_PAIRS_NEOX 0
#else
#define ROPE_PAIRS_NEOX MLA_ROPE_NEOX
#endif

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w   (f32 math, one rounding at the store).
// One block per row; x and y may alias (in-place norm of the latent part of kv_a's output).
extern "C" __global__ void rmsnorm(const dt* x, long long x_rs, const dt* w, dt* y, long long y_rs,
                                   int cols, float eps) {
    __shared__ float red[32];
    const dt* xr = x + (long long)blockIdx.x * x_rs;
    dt* yr = y + (long long)blockIdx.x * y_rs;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = to_f(xr[c]);
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = from_f(to_f(xr[c]) * inv * to_f(w[c]));
}

// In-place rope on `heads` vectors of MLA_R dims per row, at buf + row*row_stride + h*head_stride + offset.
// cos/sin: f32 tables [token, R/2] computed on the host in f64; row r is token t0 + r.
extern "C" __global__ void rope(dt* buf, long long row_stride, long long head_stride, int heads, int offset,
                                const float* cos_t, const float* sin_t, int t0) {
    const int half = MLA_R / 2;
    const long long t = t0 + blockIdx.x;
    for (int k = threadIdx.x; k < heads * half; k += blockDim.x) {
        const int h = k / half, i = k % half;
        dt* v = buf + (long long)blockIdx.x * row_stride + (long long)h * head_stride + offset;
#if ROPE_PAIRS_NEOX
        const int i0 = i, i1 = i + half;
#else
        const int i0 = 2 * i, i1 = 2 * i + 1;
#endif
        const float c = cos_t[t * half + i], s = sin_t[t * half + i];
        const float x0 = to_f(v[i0]), x1 = to_f(v[i1]);
        v[i0] = from_f(x0 * c - x1 * s);
        v[i1] = from_f(x0 * s + x1 * c);
    }
}
