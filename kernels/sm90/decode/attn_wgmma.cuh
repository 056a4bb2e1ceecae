// sm90/decode/attn_wgmma.cuh — split-KV absorbed decode on Hopper's warpgroup tensor cores (wgmma); sm_90a only.
//
// Same contract and numerics as attn_mma in attention.cuh (the CPU mirror's specification): rows are
// (query, head) pairs over the shared paged latent cache; scores in f32 scaled by the softmax scale; online
// softmax per 64-key tile; P rounded to the storage type for P·V, the row sum l from unrounded P;
// lse = m + ln(l); a row that sees no key gets out = 0, lse = -inf. It reuses that file's row, key-range and
// store helpers, so the planted faults (src/faults.rs) reach this kernel too.
//
// CTA: 64 rows, two warpgroups (256 threads), one split of one request. Per 64-key tile:
//   S    warpgroup g computes S[:, 32g, 32g+32) = Q·Kᵀ (wgmma m64n32k16, Q and K read from shared memory);
//   max  the two halves swap row maxima through shared memory;
//   P    each writes its exp2(S - m), rounded to the storage type, into one shared P tile;
//   P·V  warpgroup g accumulates O[:, g·Dv/2, (g+1)·Dv/2) += P·V (wgmma m64n(Dv/2)k16), V being the latent
//        columns of the same K tile read transposed (no second copy). P·V is left in flight while the next
//        tile's S is issued, so the tensor cores see S(i+1) right behind P·V(i).
// K tiles are double-buffered; the load of tile i+1 starts once both warpgroups are done with tile i-1
// (after the row-max exchange of tile i). With WG_TMA (a 64-key tile inside one cache page) one thread
// loads a tile by TMA (sm90/tma.cuh; nine 64-column boxes completing on the stage's mbarrier) and the tiles are
// aligned to 64 keys (pages): the first one starts at lo rounded down and masks the keys below lo. Without
// it, 256 threads load each tile with cp.async, one block-table lookup per row.
//
// At DeepSeek / GLM-5 dims with TMA the module also holds attn_wgmma_pairs (sm90/decode/attn_wgmma_pairs.cuh:
// the warpgroups on alternate whole tiles, no CTA barrier in the key loop), which the host launches unless a
// launch has more than two splits of fewer than 512 keys (attn.rs `pairs_rule`); this kernel runs the rest
// (those launches, MiniCPM3's 288/256, cp.async pages).
//
// Shared layout (what wgmma reads with the 128-byte swizzle): a tile of 64 rows is stored as 64-column
// blocks of 8 KB; in a block, row r is 128 bytes at r·128 and its 16-byte chunk c sits at chunk c ^ (r % 8).
// Columns past the key width (MiniCPM3's 288 → 320) are zero. At DeepSeek dims Q + 2 K stages + P = 224 KB.
#pragma once

// att_row / att_key_range (attention.cuh) number rows by ATT_BM, so the module's fallback tile must have
// 64 rows (ATT_WM = 4) for attn_wgmma to exist; the host skips the tile when it does not.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && ATT_MQA && ATT_V_IN_K && ATT_DB == 0 && MLA_DTYPE != 2 && \
    (ATT_DV == 512 || ATT_DV == 256) && ATT_DA % 8 == 0 && ATT_BM == 64

#define WG_BM 64
#define WG_BN 64
#define WG_NT 256
#define WG_KB ((ATT_DQK + 63) / 64)  // 64-column blocks per row
#define WG_BLK (64 * 128)            // one block: 64 rows x 128 bytes
#define WG_TILE (WG_KB * WG_BLK)     // a Q or K tile
#define WG_NV (ATT_DV / 2)           // value columns per warpgroup
// 1 KB of slack to align the tiles to 1024 bytes (the swizzle pattern's period), Q, 2 K stages, P, and
// the row max / row sum exchange ([2][64] floats each).
#define WG_SMEM (1024 + 3 * WG_TILE + WG_BLK + 4 * WG_BM * 4)

// Planted bug WG2_KEYS_DROPPED (src/faults.rs): the second warpgroup's 32 keys of every tile are masked.
#ifdef MLA_FAULT_WG2_KEYS_DROPPED
#define WG_FAULT_DROP(wg) ((wg) == 1)
#else
#define WG_FAULT_DROP(wg) 0
#endif

// {dynamic shared bytes, threads per CTA, rows per CTA, keys per tile}
extern "C" __device__ const int attn_wgmma_config[4] = {WG_SMEM, WG_NT, WG_BM, WG_BN};

#include "sm90/wgmma.cuh"

// Key tiles by TMA where a tile lies in one page; the host passes the tensor map when the module says so.
#ifndef WG_TMA
#define WG_TMA (MLA_PAGE % WG_BN == 0)
#endif
// The host reads this to know whether attn_wgmma takes the tensor map (src/backend/cuda/attn.rs).
extern "C" __device__ const int attn_wgmma_tma = WG_TMA;
// sm90/decode/attn_wgmma_pairs.cuh's attn_wgmma_pairs (warpgroups on alternate tiles) exists at 576/512 with TMA;
// the host reads this before looking it up (a missing symbol is an API error to compute-sanitizer).
#define WG_PAIRS (WG_TMA && WG_KB == 9 && ATT_DV == 512)
extern "C" __device__ const int attn_wgmma_pairs_on = WG_PAIRS;
#if WG_TMA
#include "sm90/tma.cuh"
#define WG_MAP_PARAM , const __grid_constant__ TmaMap km

// Key rows [j0, j0 + 64) (j0 a multiple of 64: one page), 64-column blocks [B0, B1), into a K stage by
// TMA, completing on `bar`; one thread. `rb`: the request's first pool row (its ka_bs in rows).
template <int B0, int B1>
__device__ __forceinline__ void wg_tma_k(const TmaMap* km, const AttnArgs& a, const int* table, long long rb, int j0,
                                         unsigned dst, unsigned bar) {
#ifdef MLA_FAULT_TMA_PAGE_TILE
    // Planted bug (src/faults.rs): the box starts at the page's first row, whichever 64-key tile of the page j0 is.
    const int row = (int)(rb + (long long)table[j0 / MLA_PAGE] * MLA_PAGE);
#else
    const int row = (int)(rb + key_slot(a, table, j0));
#endif
    mbar_expect_tx(bar, (B1 - B0) * WG_BLK);
#pragma unroll
    for (int k = B0; k < B1; ++k) tma_load_2d(dst + k * WG_BLK, km, 64 * k, row, bar);
}

// Rows [r0, 64) of a landed K stage set to zero: on a range's last tile the rows past `hi` may lie past the
// sequence, where the cache holds NaN poison, and P·V would multiply them by P = 0 (TMA copies whole pages;
// the cp.async loader zero-fills those rows instead). Threads `tid` of `nt`.
__device__ __forceinline__ void wg_zero_rows(unsigned char* gK, int r0, int tid, int nt) {
    const int per_blk = (WG_BN - r0) * 8;  // 16-byte chunks per block
    for (int i = tid; i < per_blk * WG_KB; i += nt) {
        const int k = i / per_blk, c = i % per_blk;
        *reinterpret_cast<uint4*>(gK + k * WG_BLK + (r0 + c / 8) * 128 + (c % 8) * 16) = make_uint4(0, 0, 0, 0);
    }
}
#else
#define WG_MAP_PARAM
#endif

// P·V (sm90/wgmma.cuh): B (the values) N-major.

#if ATT_DV == 512
#define wg_pv wg_ss_n256<1>
#else
#define wg_pv wg_ss_n128<1>
#endif

// Byte offset of (row, 16-byte chunk) in a swizzled tile.
__device__ __forceinline__ unsigned wg_off(int r, int c) {
    return (c >> 3) * WG_BLK + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Row r of a tile from `src` (null: zeros) into its swizzled slots, eight threads per row: this thread
// copies the 16-byte chunks q, q + 8, … (q = threadIdx % 8), one 128-byte line per pass of the eight.
__device__ __forceinline__ void wg_load_row(unsigned dst, int r, const dt* src, const dt* any_valid) {
    const int q = threadIdx.x & 7;
    const unsigned d = dst + r * 128 + ((q ^ (r & 7)) << 4);
#pragma unroll
    for (int k = 0; k < WG_KB; ++k) {
        const int c = 8 * k + q;
        const bool in = src && c < ATT_DQK / 8;
        cp_async16(d + k * WG_BLK, in ? src + c * 8 : any_valid, in ? 16 : 0);
    }
}

// Key rows [j0, j0 + 64) ∩ [.., hi) of the paged cache into a K stage, one block-table lookup per row;
// rows past `hi` are zero (a page past the sequence holds NaN poison and is never read).
__device__ __forceinline__ void wg_load_k(const AttnArgs& a, int b, const int* table, int j0, int hi, unsigned dst) {
#pragma unroll
    for (int r = threadIdx.x >> 3; r < WG_BN; r += WG_NT / 8) {
        const int j = j0 + r;
        wg_load_row(dst, r, j < hi ? a.ka + b * a.ka_bs + key_slot(a, table, j) * a.ka_rs : nullptr, a.ka);
    }
}

// The epilogue both decode kernels share: this thread's row sums over the quad, then over the two
// warpgroups through `sSum` ([warpgroup][row]); lse and this warpgroup's half of O, normalised, stored.
// `wg`, `wr`, `g`, `t`: the kernels' thread coordinates (warpgroup, its warp's first row, lane / 4, lane % 4).
// Each row's address is formed once and each thread's adjacent pair goes out as one store (8 bytes of
// partials, 4 of 16-bit output): per-element stores through `att_store` made this tail 13 % of the pairs
// kernel's stall samples at B=64 H=128 (ncu, 2026-12-05): 3.7 k SASS instructions, most of them address
// arithmetic. The pair stores need aligned rows: the host checks (`Attn::run_on`, `pair_stores_fit`).
__device__ __forceinline__ void wg_finish(const AttnArgs& a, int b, int tile, int n_keys, const float (&o)[WG_NV / 2],
                                          float (&l)[2], const float (&m)[2], float* sSum, int wg, int wr, int g,
                                          int t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
        if (t == 0) sSum[wg * WG_BM + wr + g + 8 * e] = l[e];
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int row = wr + g + 8 * e;
        const RowInfo ri = att_row(a, tile, row, n_keys);
        if (!ri.valid) continue;
        const float L = sSum[row] + sSum[WG_BM + row];
        if (wg == 0 && t == 0) att_store_lse(a, b, ri, L > 0.f ? (m[e] + log2f(L)) * MLA_LN2 : ATT_EMPTY_LSE);
        const float inv = L > 0.f ? 1.f / L : 0.f;
        const int c0 = wg * WG_NV + 2 * t;
        // o is unset when no tile ran: zeros then.
#define WG_O(n, k) (L > 0.f ? o[4 * (n) + 2 * e + (k)] * inv : 0.f)
        if (ATT_PARTIALS(a)) {
            float* p = a.part_out +
                       ((((long long)b * a.n_q + ri.i) * a.n_heads + ri.h) * a.num_splits + att_split()) * ATT_DV + c0;
#pragma unroll
            for (int n = 0; n < WG_NV / 8; ++n)
                *reinterpret_cast<float2*>(p + n * 8) = make_float2(WG_O(n, 0), WG_O(n, 1));
        } else {
            dt* p = a.out + b * a.out_bs + (long long)ri.i * a.out_rs + (long long)ri.h * a.out_hs + c0;
#pragma unroll
            for (int n = 0; n < WG_NV / 8; ++n) *reinterpret_cast<unsigned*>(p + n * 8) = pack2(WG_O(n, 0), WG_O(n, 1));
        }
#undef WG_O
    }
}

extern "C" __global__ void __launch_bounds__(WG_NT, 1) attn_wgmma(const AttnArgs a WG_MAP_PARAM) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned raw = smem_u32(smem), base = (raw + 1023) & ~1023u;
    unsigned char* gbase = smem + (base - raw);
    const unsigned sQ = base, sK0 = base + WG_TILE, sP = base + 3 * WG_TILE;
    float* sMax = reinterpret_cast<float*>(gbase + 3 * WG_TILE + WG_BLK);  // [warpgroup][row]
    float* sSum = sMax + 2 * WG_BM;                                         // [warpgroup][row]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wr = (warp & 3) * 16;  // warpgroup; first of this warp's 16 rows
    const int g = lane >> 2, t = lane & 3;
    const int b = blockIdx.z, tile = blockIdx.y;
    const int n_keys = a.seq_lens ? a.seq_lens[b] : a.n_keys;
    const int* table = a.table ? a.table + b * a.table_bs : nullptr;
    int lo, hi;
    att_key_range(a, n_keys, tile, &lo, &hi);
    att_fault_tail(lo, &hi, WG_BN);
#if WG_TMA
    const int jb = lo - lo % WG_BN;  // tiles start on a page boundary
    const long long rb = b * a.ka_bs / a.ka_rs;
    // The stages' "landed" mbarriers, in the row-sum exchange (used only after the key loop).
    const unsigned full = smem_u32(sSum);
    if (tid == 0) {
        tma_prefetch_map(&km);
        mbar_init(full, 1);
        mbar_init(full + 8, 1);
        mbar_init_fence();
    }
#else
    const int jb = lo;
#endif
    const int n_tiles = hi > lo ? (hi - jb + WG_BN - 1) / WG_BN : 0;

    // Q (rows past the end are zero) and the first key tile: one cp.async group (TMA: its own barrier).
    for (int r = tid >> 3; r < WG_BM; r += WG_NT / 8) {
        const RowInfo ri = att_row(a, tile, r, n_keys);
        const dt* src = a.q + b * a.q_bs + (long long)ri.i * a.q_rs + (long long)ri.h * a.q_hs;
        wg_load_row(sQ, r, ri.valid ? src : nullptr, a.q);
    }
#if WG_TMA
    if (tid == 0 && n_tiles > 0) wg_tma_k<0, WG_KB>(&km, a, table, rb, jb, sK0, full);
    cp_async_commit();
    cp_async_wait<0>();
    wg_fence_smem();
    __syncthreads();  // Q landed, the barriers initialised
#else
    if (n_tiles > 0) wg_load_k(a, b, table, lo, hi, sK0);
    cp_async_commit();
#endif

    // This thread's rows: wr + g + 8e.
    int lim[2];
    float m[2], l[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        lim[e] = att_row(a, tile, wr + g + 8 * e, n_keys).lim;
        m[e] = MLA_NEG_INF;
        l[e] = 0.f;
    }
    // O is not zeroed: tile 0's first P·V k-step overwrites it (scale-d 0), and a row block with no tile
    // stores zeros. Zeroing it made ptxas see non-wgmma definitions of the accumulators inside a P·V
    // pipeline stage and serialize every wgmma of the kernel (C7515; 254 registers, now 194).
    float o[WG_NV / 2];

    for (int it = 0; it < n_tiles; ++it) {
        const unsigned sK = sK0 + (it & 1) * WG_TILE;
        const int j0 = jb + it * WG_BN;
#if WG_TMA
        mbar_wait(full + 8 * (it & 1), (it >> 1) & 1);  // tile `it` landed (async proxy, as wgmma reads it)
        if (hi - j0 < WG_BN) {  // the range's last tile: rows past hi to zero, for everyone
            wg_zero_rows(gbase + (sK - base), hi - j0, tid, WG_NT);
            wg_fence_smem();
            __syncthreads();
        }
#else
        cp_async_wait<0>();
        wg_fence_smem();
        __syncthreads();  // tile `it` is in shared memory for everyone
#endif

        // S = Q·Kᵀ for this warpgroup's 32 keys (also completes this warpgroup's P·V of the previous tile).
        float s[16];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_KB * 4; ++kk) {
            const unsigned off = (kk >> 2) * WG_BLK + (kk & 3) * 32;
            wg_ss_n32<0>(s, wg_desc(sQ + off, 16, 1024), wg_desc(sK + wg * 32 * 128 + off, 16, 1024), kk > 0);
        }
        wg_commit();
        wg_wait<0>();
        wg_pin(s);
        wg_pin(o);

        // Scale, mask, this half's row max → shared.
        float tm[2] = {MLA_NEG_INF, MLA_NEG_INF};
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = j0 + wg * 32 + n * 8 + 2 * t + (e & 1);
                float v = s[4 * n + e] * a.scale_log2;
                if (key < lo || key >= hi || key > lim[e >> 1] || WG_FAULT_DROP(wg)) v = MLA_NEG_INF;
                s[4 * n + e] = v;
                tm[e >> 1] = fmaxf(tm[e >> 1], v);
            }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            tm[e] = fmaxf(tm[e], __shfl_xor_sync(0xffffffffu, tm[e], 1));
            tm[e] = fmaxf(tm[e], __shfl_xor_sync(0xffffffffu, tm[e], 2));
            if (t == 0) sMax[wg * WG_BM + wr + g + 8 * e] = tm[e];
        }
        __syncthreads();  // both halves' maxima are in; both warpgroups are done with tile it-1 and P

#if WG_TMA
        if (tid == 0 && it + 1 < n_tiles)
            wg_tma_k<0, WG_KB>(&km, a, table, rb, j0 + WG_BN, sK0 + ((it + 1) & 1) * WG_TILE, full + 8 * ((it + 1) & 1));
#else
        if (it + 1 < n_tiles) wg_load_k(a, b, table, j0 + WG_BN, hi, sK0 + ((it + 1) & 1) * WG_TILE);
        cp_async_commit();
#endif

        float al[2], mu[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int row = wr + g + 8 * e;
            const float mn = fmaxf(m[e], fmaxf(sMax[row], sMax[WG_BM + row]));
            mu[e] = mn == MLA_NEG_INF ? 0.f : mn;
            al[e] = exp2f(m[e] - mu[e]);
            m[e] = mn;
        }
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[4 * n + e] = exp2f(s[4 * n + e] - mu[e >> 1]);
                rs[e >> 1] += s[4 * n + e];
            }
            // P (storage type) → shared: key column 32·wg + 8n + 2t is chunk 4·wg + n, bytes 4t.
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int row = wr + g + 8 * e;
                *reinterpret_cast<unsigned*>(gbase + 3 * WG_TILE + wg_off(row, 4 * wg + n) + 4 * t) =
                    pack2(s[4 * n + 2 * e], s[4 * n + 2 * e + 1]);
            }
        }
        l[0] = l[0] * al[0] + rs[0];  // per-thread partial; reduced at the end
        l[1] = l[1] * al[1] + rs[1];
#pragma unroll
        for (int i = 0; i < WG_NV / 2; ++i) o[i] *= al[(i >> 1) & 1];  // unset on tile 0: overwritten
        wg_fence_smem();
        __syncthreads();  // P complete

        // O += P·V over the tile's 64 keys for this warpgroup's value columns; left in flight.
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BN / 16; ++kk)
            wg_pv(o, wg_desc(sP + kk * 32, 16, 1024), wg_desc(sK + wg * (WG_NV / 64) * WG_BLK + kk * 16 * 128, WG_BLK, 1024), it > 0 || kk > 0);
        wg_commit();
    }
    wg_wait<0>();
    wg_pin(o);
#if WG_TMA
    __syncthreads();  // every wait on the barriers is done: their memory becomes the row-sum exchange
    if (tid == 0) {
        mbar_inval(full);
        mbar_inval(full + 8);
    }
    __syncthreads();
#else
    cp_async_wait<0>();
#endif

    // Row sums: over the quad, then over the two warpgroups; the stores.
    wg_finish(a, b, tile, n_keys, o, l, m, sSum, wg, wr, g, t);
}
#if WG_PAIRS
#include "sm90/decode/attn_wgmma_pairs.cuh"
#endif
#endif  // wgmma path
