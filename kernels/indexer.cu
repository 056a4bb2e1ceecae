// indexer.cu — the DSA lightning indexer's scores and top-k selection on the GPU (src/backend/cuda/indexer.rs).
//
// The host gives the operands as the engine stores them (backend::cpu::indexer::operands): q [T][IX_H][IX_D]
// and k [T][IX_D] as f32 holding values of the run's storage type exactly, or fp8 e4m3 values with their
// per-128 block scales qs [T][IX_H][nb], ks [T][nb] (nb = 0 without fp8: nothing to scale); and the
// per-head weights w [T][IX_H] in f32, pre-scaled by (Hi·Di)^-0.5.
//
//   indexer_scores: score[t][j] = Σ_h w[t][h]·ReLU(Σ_b qs·ks·(q[t][h]·k[j] over block b)), f32, j ≤ t
//                   (causal; -inf beyond, not computed). One warp per key, each lane 1/32 of the dims.
//   indexer_topk:   per query, the min(top_k, t+1) best keys of 0..=t, ties to the lower key (the CPU mirror's
//                   order; NaN ranks as -inf), written in rank order, -1 padded to top_k.
//
// Planted bugs (-D, kernels check holds each to changing this unit's code): MLA_FAULT_INDEXER_NON_CAUSAL
// (every key scored and ranked, the future ones then dropped: fewer than top_k visible keys kept),
// MLA_FAULT_INDEXER_NO_RELU, MLA_FAULT_INDEXER_TOPK_OFF_BY_ONE (top_k − 1 kept), MLA_FAULT_INDEXER_FP8_SCALE (the
// key's block scale left out of an fp8 logit).
#include "common.cuh"

// GLM-5's indexer dims unless the host says (`kernels check` compiles with these).
#ifndef IX_H
#define IX_H 32
#endif
#ifndef IX_D
#define IX_D 128
#endif
#define IX_DC ((IX_D + 31) / 32)
#define IX_KEYS 8  // keys (warps) per CTA of indexer_scores

// Grid (T queries, ceil(T / IX_KEYS)), block 32·IX_KEYS.
extern "C" __global__ void __launch_bounds__(32 * IX_KEYS)
    indexer_scores(const float* q, const float* qs, const float* k, const float* ks, const float* w,
                   float* scores, int n_tok, int nb) {
    __shared__ float sq[IX_H * IX_D];
    __shared__ float sw[IX_H];
    const int t = blockIdx.x, lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int j = blockIdx.y * IX_KEYS + wi;
    for (int i = threadIdx.x; i < IX_H * IX_D; i += blockDim.x) sq[i] = q[(long long)t * IX_H * IX_D + i];
    for (int i = threadIdx.x; i < IX_H; i += blockDim.x) sw[i] = w[(long long)t * IX_H + i];
    __syncthreads();
    if (j >= n_tok) return;
    float* out = scores + (long long)t * n_tok + j;
#ifndef MLA_FAULT_INDEXER_NON_CAUSAL
    if (j > t) {
        if (lane == 0) *out = MLA_NEG_INF;
        return;
    }
#endif
    float kv[IX_DC];
#pragma unroll
    for (int c = 0; c < IX_DC; ++c) {
        const int d = lane + 32 * c;
        kv[c] = d < IX_D ? k[(long long)j * IX_D + d] : 0.f;
    }
    float acc = 0.f;
    for (int h = 0; h < IX_H; ++h) {
        const float* qh = sq + h * IX_D;
        float logit = 0.f;
        if (nb > 0) {
            // fp8: each 128-dim block's dot (32 consecutive dims per c: a block holds 4 c's), then its scales.
            for (int b = 0; b < nb; ++b) {
                float part = 0.f;
#pragma unroll
                for (int c = 0; c < IX_DC; ++c) {
                    const int d = lane + 32 * c;
                    if (d < IX_D && c / 4 == b) part += qh[d] * kv[c];
                }
#ifdef MLA_FAULT_INDEXER_FP8_SCALE
                const float k_scale = 1.f;
#else
                const float k_scale = ks[(long long)j * nb + b];
#endif
                logit += warp_sum(part) * (qs[((long long)t * IX_H + h) * nb + b] * k_scale);
            }
        } else {
            float part = 0.f;
#pragma unroll
            for (int c = 0; c < IX_DC; ++c) {
                const int d = lane + 32 * c;
                if (d < IX_D) part += qh[d] * kv[c];
            }
            logit = warp_sum(part);
        }
#ifndef MLA_FAULT_INDEXER_NO_RELU
        logit = fmaxf(logit, 0.f);
#endif
        acc += sw[h] * logit;
    }
    if (lane == 0) *out = acc;
}

// A score and its key as one ascending sort key: higher score first, then the lower key. The float's bits
// made monotonic (negatives inverted, positives' sign bit set; -0 < +0 as Rust's total_cmp), inverted so
// that higher sorts first; NaN as -inf.
__device__ __forceinline__ unsigned long long rank_key(float s, int j) {
    if (isnan(s)) s = MLA_NEG_INF;
    const unsigned u = __float_as_uint(s);
    const unsigned mono = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)(~mono) << 32) | (unsigned)j;
}

// Grid (T queries), block up to 1024, dynamic shared memory n_pad · 8 bytes (n_pad: a power of two ≥ the keys
// any query ranks). Bitonic sort of the query's keys, then the first min(top_k, visible) in rank order.
extern "C" __global__ void indexer_topk(const float* scores, int* out, int n_tok, int top_k) {
    extern __shared__ unsigned long long keys[];
    const int t = blockIdx.x;
#ifdef MLA_FAULT_INDEXER_NON_CAUSAL
    const int n = n_tok;  // the future keys compete too
#else
    const int n = t + 1;
#endif
#ifdef MLA_FAULT_INDEXER_TOPK_OFF_BY_ONE
    const int k = max(top_k - 1, 0);
#else
    const int k = top_k;
#endif
    int np = 1;
    while (np < n) np <<= 1;
    const float* row = scores + (long long)t * n_tok;
    for (int i = threadIdx.x; i < np; i += blockDim.x) keys[i] = i < n ? rank_key(row[i], i) : ~0ull;
    __syncthreads();
    for (int size = 2; size <= np; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < np; i += blockDim.x) {
                const int p = i ^ stride;
                if (p > i) {
                    const unsigned long long a = keys[i], b = keys[p];
                    if ((a > b) == ((i & size) == 0)) {
                        keys[i] = b;
                        keys[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    const int m = min(k, n);
    for (int r = threadIdx.x; r < top_k; r += blockDim.x) {
        int j = r < m ? (int)(keys[r] & 0xffffffffu) : -1;
        if (j > t) j = -1;  // a future key ranked by a non-causal reading: masked out of attention
        out[(long long)t * top_k + r] = j;
    }
}
