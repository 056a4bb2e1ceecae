// cache_write.cu — the paged latent cache: write rows [latent | k_pe] through the block table, read them back.
#include "common.cuh"

#define MLA_ROW (MLA_LKV + MLA_R)

__device__ __forceinline__ long long cache_slot(const int* table, long long t) {
    return (long long)table[t / MLA_PAGE] * MLA_PAGE + t % MLA_PAGE;
}

// rows: [n, MLA_ROW] for tokens t0..t0+n (contiguous); pool: [pages*MLA_PAGE, MLA_ROW].
extern "C" __global__ void cache_write(const dt* rows, dt* pool, const int* table, int t0) {
    const long long t = t0 + blockIdx.x;
    const dt* src = rows + (long long)blockIdx.x * MLA_ROW;
    dt* dst = pool + cache_slot(table, t) * MLA_ROW;
#ifdef MLA_FAULT_PAGE_OFF_BY_ONE
    // Planted bug: the page of token t taken from (t - 1) / page (a page's first row lands on the previous page).
    if (t > 0) dst = pool + ((long long)table[(t - 1) / MLA_PAGE] * MLA_PAGE + t % MLA_PAGE) * MLA_ROW;
#endif
#ifdef MLA_FAULT_CACHE_PE_FIRST
    // Planted bug: the row written [k_pe | latent]; every reader still expects [latent | k_pe].
    for (int c = threadIdx.x; c < MLA_ROW; c += blockDim.x) dst[(c + MLA_R) % MLA_ROW] = src[c];
#else
    for (int c = threadIdx.x; c < MLA_ROW; c += blockDim.x) dst[c] = src[c];
#endif
}

// Gather rows of tokens t0..t0+n from the pool into a contiguous [n, MLA_ROW] buffer.
extern "C" __global__ void cache_gather(const dt* pool, const int* table, dt* rows, int t0) {
    const long long t = t0 + blockIdx.x;
    const dt* src = pool + cache_slot(table, t) * MLA_ROW;
    dt* dst = rows + (long long)blockIdx.x * MLA_ROW;
    for (int c = threadIdx.x; c < MLA_ROW; c += blockDim.x) dst[c] = src[c];
}

// Strided copy of `width` elements for each (row, head): assembles the absorbed decode query [q_abs | q_pe].
extern "C" __global__ void copy_heads(const dt* src, long long src_rs, long long src_hs, dt* dst,
                                      long long dst_rs, long long dst_hs, int heads, int width) {
    for (int k = threadIdx.x; k < heads * width; k += blockDim.x) {
        const int h = k / width, c = k % width;
        dst[(long long)blockIdx.x * dst_rs + (long long)h * dst_hs + c] =
            src[(long long)blockIdx.x * src_rs + (long long)h * src_hs + c];
    }
}
