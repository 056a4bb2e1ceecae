// kpool.cu — glm5-next's k-pool indexer on the GPU (src/backend/cuda/kpool.rs): the pooled keys, their scores and
// the per-query top-k of pools with its expansion to tokens and the visible tail, as the CPU mirror computes them
// (src/backend/cpu/kpool.rs, after llama.cpp's build_kpool_select; docs/dsa.md).
//
// The host gives the operands as the engine stores them: k [T][KP_D] (the normed indexer keys) and g [T][KP_D] (the
// gate scores attn_in·gateᵀ) as f32 holding values of the run's storage type exactly; the APE ape [KP_N][KP_D] in
// f32; q [T][KP_H][KP_D] in the run's type (with fp8 keys: its fp8 values times their block scales, as the mirror
// scores them) and the head weights w [T][KP_H] in f32, pre-scaled by (Hi·Di)^-0.5.
//
// Pools: pool p is the KP_N tokens from origin + p·KP_N; only complete pools exist (n_pools of them). origin is the
// grid's first complete pool's first token: 0, the first real token (a run has no padding), unless the host moves
// the grid (its fault kpool_from_position_zero).
//
//   kpool_pool:   K[p][c] = round_dt(Σ_s prob[s][c]·k[tok_s][c]), prob = the softmax over the slots s of
//                 g[tok_s][c] + ape[s][c]; all in f32, sums in slot order, the pooled key rounded to the run's
//                 type (the cache's pooled column). One CTA per pool, one thread per channel.
//   kpool_scores: S[t][p] = Σ_h w[t][h]·ReLU(q[t][h]·K[p]) in f32 for the pools visible to query t (last token
//                 ≤ t); -inf beyond, not computed. One thread per (query, pool), q in shared memory: there are
//                 kpool times fewer pools than tokens, and no warp reduction keeps the host emulation cheap.
//   kpool_topk:   per query, the min(budget, visible) best pools (ties to the lower pool, NaN as -inf) expanded
//                 to their tokens in rank order, then (tail = 1) the visible tail past the last complete pool;
//                 -1 padded to a row of budget·KP_N + KP_N − 1.
//
// The rank key and bitonic sort are indexer.cu's indexer_topk, restated here: that kernel ranks t + 1 keys of a
// [T][T] row, and reusing it for pools (a visible count and a row stride of their own) would mean editing the
// validated MLA indexer. To share once this unit has passed on the H200.
//
// Planted bugs (-D, kernels check holds each to changing this unit's code): MLA_FAULT_KPOOL_NO_APE (the pool
// softmax without the APE), MLA_FAULT_KPOOL_SOFTMAX_CHANNELS (the softmax over each slot's channels),
// MLA_FAULT_KPOOL_NO_TAIL (the visible tail not appended). kpool_from_position_zero is the host's (the grid's
// origin); the shared-layer faults are the run's routing (src/run/kpool.rs).
#include "common.cuh"

// glm5-next's indexer dims unless the host says (`kernels check` compiles with these).
#ifndef KP_H
#define KP_H 32
#endif
#ifndef KP_D
#define KP_D 128
#endif
#ifndef KP_N
#define KP_N 16
#endif
#define KP_POOLS 128  // pools (threads) per CTA of kpool_scores

// Grid (n_pools), block KP_D.
extern "C" __global__ void __launch_bounds__(KP_D)
    kpool_pool(const float* k, const float* g, const float* ape, float* pooled, int origin) {
    __shared__ float lg[KP_N * KP_D];  // the pool's logits, [slot][channel]
    const int p = blockIdx.x, c = threadIdx.x;
    const long long s0 = origin + (long long)p * KP_N;
    for (int s = 0; s < KP_N; ++s) {
#ifdef MLA_FAULT_KPOOL_NO_APE
        const float a = 0.f;
#else
        const float a = ape[s * KP_D + c];
#endif
        lg[s * KP_D + c] = g[(s0 + s) * KP_D + c] + a;
    }
    __syncthreads();
    float acc = 0.f;
#ifdef MLA_FAULT_KPOOL_SOFTMAX_CHANNELS
    // Each slot's softmax over its channels (every thread walks the slot's row: a fault, not a fast path).
    for (int s = 0; s < KP_N; ++s) {
        const float* row = lg + s * KP_D;
        float m = MLA_NEG_INF;
        for (int i = 0; i < KP_D; ++i) m = fmaxf(m, row[i]);
        float z = 0.f;
        for (int i = 0; i < KP_D; ++i) z += expf(row[i] - m);
        acc += expf(row[c] - m) / z * k[(s0 + s) * KP_D + c];
    }
#else
    // Channel c's softmax over the slots.
    float m = MLA_NEG_INF;
    for (int s = 0; s < KP_N; ++s) m = fmaxf(m, lg[s * KP_D + c]);
    float z = 0.f;
    for (int s = 0; s < KP_N; ++s) z += expf(lg[s * KP_D + c] - m);
    for (int s = 0; s < KP_N; ++s) acc += expf(lg[s * KP_D + c] - m) / z * k[(s0 + s) * KP_D + c];
#endif
    pooled[(long long)p * KP_D + c] = round_dt(acc);
}

// q·K over KP_D in f32, summed in the CPU mirror's order (backend::cpu::ops::dot: eight running sums, combined
// pairwise), so that the host emulation's scores are the mirror's (on the GPU, NVRTC's FMA contraction differs
// from them in the last bits).
__device__ __forceinline__ float kpool_dot(const float* a, const float* b) {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int d0 = 0; d0 < KP_D; d0 += 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (d0 + i < KP_D) s[i] += a[d0 + i] * b[d0 + i];
    }
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// The pools query t sees: those whose last token is ≤ t.
__device__ __forceinline__ int kpool_visible(int t, int origin, int n_pools) {
    const int n = t + 1 - origin;
    return n < KP_N ? 0 : min(n / KP_N, n_pools);
}

// Grid (T queries, ceil(n_pools / KP_POOLS)), block KP_POOLS.
extern "C" __global__ void __launch_bounds__(KP_POOLS)
    kpool_scores(const float* q, const float* pooled, const float* w, float* scores, int n_pools, int origin) {
    __shared__ float sq[KP_H * KP_D];
    __shared__ float sw[KP_H];
    const int t = blockIdx.x, p = blockIdx.y * KP_POOLS + threadIdx.x;
    for (int i = threadIdx.x; i < KP_H * KP_D; i += blockDim.x) sq[i] = q[(long long)t * KP_H * KP_D + i];
    for (int i = threadIdx.x; i < KP_H; i += blockDim.x) sw[i] = w[(long long)t * KP_H + i];
    __syncthreads();
    if (p >= n_pools) return;
    if (p >= kpool_visible(t, origin, n_pools)) {
        scores[(long long)t * n_pools + p] = MLA_NEG_INF;
        return;
    }
    const float* kp = pooled + (long long)p * KP_D;
    float acc = 0.f;
    for (int h = 0; h < KP_H; ++h) acc += sw[h] * fmaxf(kpool_dot(sq + h * KP_D, kp), 0.f);
    scores[(long long)t * n_pools + p] = acc;
}

// A score and its pool as one ascending sort key (indexer.cu's rank_key): higher score first, then the lower pool.
__device__ __forceinline__ unsigned long long kpool_rank_key(float s, int p) {
    if (isnan(s)) s = MLA_NEG_INF;
    const unsigned u = __float_as_uint(s);
    const unsigned mono = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)(~mono) << 32) | (unsigned)p;
}

// Grid (T queries), block up to 1024, dynamic shared memory n_pad · 8 bytes (n_pad: a power of two ≥ n_pools).
// Row t of out: budget·KP_N + KP_N − 1 token ids.
extern "C" __global__ void kpool_topk(const float* scores, int* out, int n_pools, int origin, int budget,
                                      int tail) {
    extern __shared__ unsigned long long keys[];
    const int t = blockIdx.x;
    const int n = kpool_visible(t, origin, n_pools);
    int np = 1;
    while (np < n) np <<= 1;
    const float* row = scores + (long long)t * n_pools;
    for (int i = threadIdx.x; i < np; i += blockDim.x) keys[i] = i < n ? kpool_rank_key(row[i], i) : ~0ull;
    __syncthreads();
    for (int size = 2; size <= np; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < np; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const unsigned long long a = keys[i], b = keys[j];
                    if ((a > b) == ((i & size) == 0)) {
                        keys[i] = b;
                        keys[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    // The visible tail: the tokens after the last complete pool (all t + 1 before the grid's first pool).
    int n_tail = ((t + 1 - origin) % KP_N + KP_N) % KP_N;
    n_tail = min(n_tail, t + 1);
#ifdef MLA_FAULT_KPOOL_NO_TAIL
    n_tail = 0;
#endif
    if (!tail) n_tail = 0;
    const int m = min(budget, n), width = budget * KP_N + KP_N - 1;
    for (int r = threadIdx.x; r < width; r += blockDim.x) {
        int j = -1;
        if (r < m * KP_N) {
            const int pool = (int)(keys[r / KP_N] & 0xffffffffu);
            j = origin + pool * KP_N + r % KP_N;
        } else if (r < m * KP_N + n_tail) {
            j = t + 1 - n_tail + (r - m * KP_N);
        }
        out[(long long)t * width + r] = j;
    }
}
