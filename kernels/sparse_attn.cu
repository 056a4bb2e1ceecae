// sparse_attn.cu — DSA sparse MLA in the absorbed form: each query attends only to the keys its indexer
// selected, read from the paged latent cache through an index list, as FlashMLA's sparse interface takes it.
//
// q [query][head][Lkv+R] = [W_UKᵀ·q_nope | rope(q_pe)]; the pool holds rows [latent | k_pe]; a key's value
// is its latent. indices [query][topk] are cache slots (page·MLA_PAGE + offset, through the block table),
// in key order, padded with -1: a -1 entry is skipped, never read. Decode splits the keys by position
// (split k covers key positions [k·c, (k+1)·c), as decode.cu does), so the host gives each query the bounds
// of every split inside its index row: split k of query i reads indices[i][bounds[i][k] .. bounds[i][k+1]).
// Prefill is the same kernel with one split (FlashMLA's sparse prefill is absorbed too).
//
// Numerics as attn_scalar (attention.cuh), the CPU mirror's specification: scores in f32 scaled by the
// softmax scale, online softmax over tiles of 32 indices, P rounded to the storage type for P·V, the row
// sum from unrounded P; lse natural log; a split that sees no key writes out 0, lse -inf.
#include "common.cuh"

#define SP_ROW (MLA_LKV + MLA_R)
#define SP_ROWS 4  // (query, head) rows per CTA, one warp each
#define SP_QC ((SP_ROW + 31) / 32)
#define SP_VC ((MLA_LKV + 31) / 32)

// Grid (ceil(n_q·n_heads / SP_ROWS), num_splits) (rows on x: y is limited to 65535); block 32·SP_ROWS. With `partials` each split writes its
// f32 partial [row][split][Lkv] and lse [row][split] for decode.cu's combine_splits; without, the one split
// writes the final out (storage type, row stride out_rs, head stride out_hs) and lse [row].
extern "C" __global__ void __launch_bounds__(32 * SP_ROWS)
    sparse_attn(const dt* q, const dt* pool, const int* indices, const int* bounds, dt* out, long long out_rs,
                long long out_hs, float* lse, float* part_out, float* part_lse, int n_q, int n_heads, int topk,
                int num_splits, int partials, float scale_log2) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, s = blockIdx.y;
    const long long row = (long long)blockIdx.x * SP_ROWS + w;  // query · n_heads + head
    if (row >= (long long)n_q * n_heads) return;
    const int i = (int)(row / n_heads), h = (int)(row % n_heads);
    const int* idx = indices + (long long)i * topk;
    const int lo = bounds[i * (num_splits + 1) + s], hi = bounds[i * (num_splits + 1) + s + 1];

    const dt* qr = q + row * SP_ROW;
    float qv[SP_QC];
#pragma unroll
    for (int c = 0; c < SP_QC; ++c) {
        const int d = lane + 32 * c;
        qv[c] = d < SP_ROW ? to_f(qr[d]) : 0.f;
    }
    float acc[SP_VC];
#pragma unroll
    for (int c = 0; c < SP_VC; ++c) acc[c] = 0.f;
    float m = MLA_NEG_INF, l = 0.f;

    for (int j0 = lo; j0 < hi; j0 += 32) {
        const int nj = min(32, hi - j0);
        const int my_slot = lane < nj ? idx[j0 + lane] : -1;
        float my_s = MLA_NEG_INF;
        for (int jj = 0; jj < nj; ++jj) {
            const int slot = __shfl_sync(0xffffffffu, my_slot, jj);
            if (slot < 0) continue;  // padding: FlashMLA's invalid index
            const dt* k = pool + (long long)slot * SP_ROW;
            float part = 0.f;
#pragma unroll
            for (int c = 0; c < SP_QC; ++c) {
                const int d = lane + 32 * c;
                if (d < SP_ROW) part += qv[c] * to_f(k[d]);
            }
            const float sc = warp_sum(part) * scale_log2;
            if (lane == jj) my_s = sc;
        }
        const float m_new = fmaxf(m, warp_max(my_s));
        const float m_use = m_new == MLA_NEG_INF ? 0.f : m_new;
        const float alpha = exp2f(m - m_use);
        const float p = exp2f(my_s - m_use);
        l = l * alpha + warp_sum(p);
        const float pr = round_dt(p);
#pragma unroll
        for (int c = 0; c < SP_VC; ++c) acc[c] *= alpha;
        for (int jj = 0; jj < nj; ++jj) {
            const int slot = __shfl_sync(0xffffffffu, my_slot, jj);
            const float pj = __shfl_sync(0xffffffffu, pr, jj);
            if (slot < 0) continue;
            const dt* v = pool + (long long)slot * SP_ROW;  // the value is the key row's latent
#pragma unroll
            for (int c = 0; c < SP_VC; ++c) {
                const int d = lane + 32 * c;
                if (d < MLA_LKV) acc[c] += pj * to_f(v[d]);
            }
        }
        m = m_new;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float row_lse = l > 0.f ? (m + log2f(l)) * MLA_LN2 : MLA_NEG_INF;
    if (partials) {
        float* po = part_out + (row * num_splits + s) * MLA_LKV;
#pragma unroll
        for (int c = 0; c < SP_VC; ++c) {
            const int d = lane + 32 * c;
            if (d < MLA_LKV) po[d] = acc[c] * inv;
        }
        if (lane == 0) part_lse[row * num_splits + s] = mla_fault_split_lse(row_lse);
    } else {
        dt* o = out + (long long)i * out_rs + (long long)h * out_hs;
#pragma unroll
        for (int c = 0; c < SP_VC; ++c) {
            const int d = lane + 32 * c;
            if (d < MLA_LKV) o[d] = from_f(acc[c] * inv);
        }
        if (lane == 0) lse[row] = row_lse;
    }
}
