// v4/attn.cu — DeepSeek-V4 attention (docs/deepseek-v4.md, step 8): H query heads over one shared K = V
// head of width V4_D, each query over its key set — its window rows (the last sliding_window positions up
// to itself, kernels/v4/v4.cuh) then its compressed entries (CSA: the indexer's selection; HCA: every
// entry closed at or before it) — and a per-head sink logit in the softmax's denominator (no value).
//
//   s = (q·k)·scale (f32),  m = max(s, sink),  l = Σ exp(s − m) + exp(sink − m),
//   out = round(Σ round(exp(s − m))·v / l),  lse = m + ln l
//
// The CPU mirror's numerics (src/backend/cpu/v4/mod.rs `attend_one`), computed online as attn_scalar does:
// one warp per (query, head) row, tiles of 32 keys, the running max starting at the sink (l = 1), each
// tile's P rounded to the storage type for P·V, l from the unrounded P.
//
// Defines: MLA_DTYPE, V4_D (head width). Planted bugs: MLA_FAULT_SINK_DROPPED (no sink in the
// denominator) here; the window edge and the compressor's groups in v4/v4.cuh.
#include "common.cuh"
#include "v4/v4.cuh"

#ifndef V4_D
#define V4_D 512
#endif
#define V4_C ((V4_D + 31) / 32)
#define V4_ROWS 4  // (query, head) rows per CTA, one warp each: consecutive heads of a query share keys

// Key j of query t's list: window rows first, then compressed entries (sel: the query's selection row of
// ksel entries, −1 = none; without sel, entries 0 .. n_comp − 1). Null: no key.
__device__ __forceinline__ const dt* v4_key(const dt* rows, const dt* comp, const int* sel, int ksel, int t,
                                            int ws, int nwin, int j) {
    if (j < nwin) return rows + (long long)(ws + j) * V4_D;
    const int e = sel ? sel[(long long)t * ksel + (j - nwin)] : j - nwin;
    return e >= 0 ? comp + (long long)e * V4_D : nullptr;
}

// Grid (ceil(n_q·n_heads / V4_ROWS)), block 32·V4_ROWS. Queries t0 .. t0 + n_q − 1. q and out
// [token][head][V4_D], rows [token][V4_D] (the window cache), comp [entry][V4_D], lse [token][head] f32,
// sinks [head] f32. m: the layer's compression ratio (0: window only); sel (CSA) [token][ksel] or null.
extern "C" __global__ void __launch_bounds__(32 * V4_ROWS)
    v4_attn(const dt* q, const dt* rows, const dt* comp, const int* sel, int ksel, const float* sinks, dt* out,
            float* lse, int t0, int n_q, int n_heads, int window, int m, float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * V4_ROWS + (threadIdx.x >> 5);
    if (row >= (long long)n_q * n_heads) return;
    const int t = t0 + (int)(row / n_heads), h = (int)(row % n_heads);
    const int ws = v4_window_start(t, window), nwin = t - ws + 1;
    const int ncomp = sel ? ksel : (m > 0 ? v4_visible(t, m) : 0);
    const int nk = nwin + ncomp;

    const dt* qr = q + ((long long)t * n_heads + h) * V4_D;
    float qv[V4_C], acc[V4_C];
#pragma unroll
    for (int c = 0; c < V4_C; ++c) {
        const int d = lane + 32 * c;
        qv[c] = d < V4_D ? to_f(qr[d]) : 0.f;
        acc[c] = 0.f;
    }
#ifdef MLA_FAULT_SINK_DROPPED
    float mx = MLA_NEG_INF, l = 0.f;
#else
    float mx = sinks[h], l = 1.f;  // exp(sink − sink)
#endif
    for (int j0 = 0; j0 < nk; j0 += 32) {
        const int nj = min(32, nk - j0);
        float my_s = MLA_NEG_INF;
        for (int jj = 0; jj < nj; ++jj) {
            const dt* k = v4_key(rows, comp, sel, ksel, t, ws, nwin, j0 + jj);
            if (!k) continue;
            float part = 0.f;
#pragma unroll
            for (int c = 0; c < V4_C; ++c) {
                const int d = lane + 32 * c;
                if (d < V4_D) part += qv[c] * to_f(k[d]);
            }
            const float s = warp_sum(part) * scale;
            if (lane == jj) my_s = s;
        }
        const float m_new = fmaxf(mx, warp_max(my_s));
        const float m_use = m_new == MLA_NEG_INF ? 0.f : m_new;
        const float alpha = expf(mx - m_use);
        const float p = expf(my_s - m_use);
        l = l * alpha + warp_sum(p);
        const float pr = round_dt(p);
#pragma unroll
        for (int c = 0; c < V4_C; ++c) acc[c] *= alpha;
        for (int jj = 0; jj < nj; ++jj) {
            const float pj = __shfl_sync(0xffffffffu, pr, jj);
            const dt* v = v4_key(rows, comp, sel, ksel, t, ws, nwin, j0 + jj);
            if (!v) continue;
#pragma unroll
            for (int c = 0; c < V4_C; ++c) {
                const int d = lane + 32 * c;
                if (d < V4_D) acc[c] += pj * to_f(v[d]);
            }
        }
        mx = m_new;
    }
    dt* o = out + ((long long)t * n_heads + h) * V4_D;
#pragma unroll
    for (int c = 0; c < V4_C; ++c) {
        const int d = lane + 32 * c;
        if (d < V4_D) o[d] = from_f(acc[c] / l);
    }
    if (lane == 0) lse[(long long)t * n_heads + h] = mx + logf(l);
}
