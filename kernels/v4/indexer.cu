// v4/indexer.cu — DeepSeek-V4's CSA indexer (docs/deepseek-v4.md, step 7): each query's score of every
// compressed entry it sees and its top-k of them.
//
//   score(t, w) = round(Σ_h w_{t,h}/√Hi · ReLU(q_{t,h} · C^I_w)/√Di)     for w < visible(t), else −inf
//
// q [token][Hi·Di] (roped, no norm), the head weights w [token][Hi] and the indexer compressor's entries
// C^I [entry][Di] in the storage type; dot products and the sum over heads in f32 (heads in order), the
// score rounded to the storage type as an engine writes it, kept as f32. Not kernels/indexer.cu (GLM-5's
// DSA indexer): its keys are tokens, causal at j ≤ t, and its head weights are pre-scaled; here the keys are
// compressed entries, causal at v4_visible, and each term divided by √Hi and √Di as the CPU mirror does.
//
//   v4_index_topk: per query the min(k, visible) best entries, ties to the lower entry (the CPU mirror's
//   order; NaN ranks as −inf), best first, −1 padded to k.
#include "common.cuh"
#include "v4/v4.cuh"

#define V4_IX_KEYS 8  // entries (warps) per CTA of v4_index_scores

// Grid (queries t0 .., ceil(n_cols / V4_IX_KEYS)), block 32·V4_IX_KEYS, dynamic shared memory
// (hi·di + hi + V4_IX_KEYS·di) floats. scores [token][n_cols].
extern "C" __global__ void __launch_bounds__(32 * V4_IX_KEYS)
    v4_index_scores(const dt* q, const dt* wts, const dt* keys, float* scores, int t0, int n_cols, int m,
                    int hi, int di) {
    extern __shared__ float sm[];
    float* sq = sm;            // [hi][di]
    float* sw = sq + hi * di;  // [hi]
    float* sk = sw + hi;       // [V4_IX_KEYS][di]
    const int t = t0 + blockIdx.x, lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int e = blockIdx.y * V4_IX_KEYS + wi;
    for (int i = threadIdx.x; i < hi * di; i += blockDim.x) sq[i] = to_f(q[(long long)t * hi * di + i]);
    for (int i = threadIdx.x; i < hi; i += blockDim.x) sw[i] = to_f(wts[(long long)t * hi + i]);
    __syncthreads();
    if (e >= n_cols) return;
    float* out = scores + (long long)t * n_cols + e;
    if (e >= v4_visible(t, m)) {
        if (lane == 0) *out = MLA_NEG_INF;
        return;
    }
    float* k = sk + wi * di;
    for (int i = lane; i < di; i += 32) k[i] = to_f(keys[(long long)e * di + i]);
    __syncwarp();
    const float shi = sqrtf((float)hi), sdi = sqrtf((float)di);
    float acc = 0.f;
    for (int h = 0; h < hi; ++h) {
        float part = 0.f;
        for (int i = lane; i < di; i += 32) part += sq[h * di + i] * k[i];
        const float dot = warp_sum(part);
        acc += sw[h] / shi * fmaxf(dot, 0.f) / sdi;
    }
    if (lane == 0) *out = round_dt(acc);
}

// A score and its entry as one ascending sort key: higher score first, then the lower entry (as
// kernels/indexer.cu's rank_key).
__device__ __forceinline__ unsigned long long v4_rank_key(float s, int j) {
    if (isnan(s)) s = MLA_NEG_INF;
    const unsigned u = __float_as_uint(s);
    const unsigned mono = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)(~mono) << 32) | (unsigned)j;
}

// Grid (queries t0 ..), block up to 1024, dynamic shared memory n_pad · 8 bytes (n_pad: a power of two
// ≥ n_cols). out [token][k].
extern "C" __global__ void v4_index_topk(const float* scores, int* out, int t0, int n_cols, int m, int k) {
    extern __shared__ unsigned long long rk[];
    const int t = t0 + blockIdx.x;
    const int n = min(v4_visible(t, m), n_cols);
    int np = 1;
    while (np < n) np <<= 1;
    const float* row = scores + (long long)t * n_cols;
    for (int i = threadIdx.x; i < np; i += blockDim.x) rk[i] = i < n ? v4_rank_key(row[i], i) : ~0ull;
    __syncthreads();
    for (int size = 2; size <= np; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < np; i += blockDim.x) {
                const int p = i ^ stride;
                if (p > i) {
                    const unsigned long long a = rk[i], b = rk[p];
                    if ((a > b) == ((i & size) == 0)) {
                        rk[i] = b;
                        rk[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    const int kept = min(k, n);
    for (int r = threadIdx.x; r < k; r += blockDim.x)
        out[(long long)t * k + r] = r < kept ? (int)(rk[r] & 0xffffffffu) : -1;
}
