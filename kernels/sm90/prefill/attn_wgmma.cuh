// sm90/prefill/attn_wgmma.cuh — causal / context prefill (decompressed MHA) on Hopper's warpgroup tensor cores
// (wgmma); sm_90a only, included by prefill.cu next to attn_mma, which the host falls back to elsewhere.
//
// Same contract and numerics as attn_mma in attention.cuh (the CPU mirror's specification): per head,
// scores q·k in f32 scaled by the softmax scale; online softmax per key tile; P rounded to the storage
// type for P·V, the row sum l from unrounded P; lse = m + ln(l); a row that sees no key gets out = 0,
// lse = ATT_EMPTY_LSE. It reuses attention.cuh's row, key-range and store helpers, so the planted faults
// that reach prefill (CAUSAL_OFF_BY_ONE, EMPTY_CTX_LSE_INF; src/faults.rs) reach this kernel too.
//
// CTA: ATT_BM = 64 or 128 query rows of one head (the module's fallback tile: 4 or 8 warp rows) and
// FlashAttention-3's warp specialization: one consumer warpgroup per 64 rows, which owns rows
// [64g, 64g + 64) over every key (no row statistics cross warpgroups), and one producer warpgroup that
// loads Q and the K / V tiles (setmaxnreg moves registers from it to the consumers): by TMA where the
// host encoded the launch's tensor maps (parameter `mp`: one elected thread issues 64-column boxes on
// the stage's full barrier with expect-tx, the copy engine doing the 128-byte swizzle and zero-filling
// rows past the sequence and columns past the head width; 20–24 % less time than cp.async on the H200,
// 2026-12-02, bench/RESULTS.md), else by its 128 threads' cp.async (rows past `hi` zeroed). Rows in [hi, n_keys)
// that TMA brings in are real, finite keys: S masks them and their P is 0. Per
// ATT_BN-key tile a consumer computes:
//   S    S = Q·Kᵀ (wgmma m64n{BN}k16, Q and K from shared memory);
//   P    online softmax in registers; P rounded to the storage type stays in registers: the accumulator
//        layout of two adjacent 8-key column groups is the A-operand layout of one 16-key k-step;
//   P·V  O += P·V (wgmma m64n{DVP}k16, A = P from registers, V from shared memory read N-major).
// Overlap (measured on the H200, 2026-12-01): within a warpgroup, tile j issues S(j) and then P(j-1)·V(j-1),
// waits for S(j) only and runs tile j's softmax while P(j-1)·V(j-1) is on the tensor cores; across the
// two consumers, named barriers make them take turns issuing (ping-pong), so one's softmax runs under
// the other's MMAs. No CTA-wide barrier in the loop: K and V have PW_ST (2) stages each, with a "full"
// mbarrier (cp.async: the producer arrives once its copies landed, after the proxy fence; TMA: the
// copies complete it) and an "empty" one (consumer warps arrive once the MMAs that read the stage are
// done). K runs a tile ahead of V. (A third stage and a head-first CTA order were measured, not faster:
// head-first 5–10 % slower, a third stage up to 14 % slower on the H200, 2026-12-02.)
//
// Shared layout (128-byte swizzle, as sm90/decode/attn_wgmma.cuh): a tile of n rows is stored as 64-column blocks
// of n·128 bytes; in a block, row r is 128 bytes at r·128 and its 16-byte chunk c sits at chunk c ^ (r % 8).
// Columns past the key / value width (MiniCPM3's 96 → 128) are zero. DeepSeek's 192 / 128 at 64-key
// tiles (`run`'s): Q 48 KB + 2 × (K 24 KB + V 16 KB) + 1 KB alignment slack = 129 KB; at 128-key tiles
// (`bench`'s alternative) 209 KB. GLM-5's 256 / 256: 193 KB at 64 keys, 225 KB at 80 (`bench`'s
// alternative; 128 keys would need 321 KB).
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !ATT_MQA && !ATT_V_IN_K && MLA_DTYPE != 2 && ATT_DA % 8 == 0 && \
    ATT_DB % 8 == 0 && ATT_DV % 8 == 0 && ATT_DV <= 256 && (ATT_BM == 64 || ATT_BM == 128) &&             \
    (ATT_BN == 64 || ATT_BN == 80 || ATT_BN == 128)

#include "sm90/wgmma.cuh"
#include "sm90/tma.cuh"

#define PW_NC (ATT_BM / 64)   // consumer warpgroups, one per 64 rows
#define PW_PP (PW_NC == 2)  // the two consumers take turns issuing their MMAs
#define PW_NT (128 * PW_NC + 128)  // + one producer warpgroup (the loads)
#define PW_KB ((ATT_DQK + 63) / 64)         // 64-column blocks of a Q / K row
#define PW_VB ((ATT_DV + 63) / 64)          // 64-column blocks of a V row
#define PW_DVP (PW_VB * 64)                 // value columns computed (zeros past ATT_DV)
#define PW_QBLK (ATT_BM * 128)              // one block of the Q tile
#define PW_KBLK (ATT_BN * 128)              // one block of a K / V tile
#define PW_SQ (PW_KB * PW_QBLK)
#define PW_SK (PW_KB * PW_KBLK)
#define PW_SV (PW_VB * PW_KBLK)
#ifndef PW_ST
#define PW_ST 2  // K / V stages
#endif
#define PW_SMEM (1024 + PW_SQ + PW_ST * (PW_SK + PW_SV))
// TMA loads (sm90/tma.cuh) need k_nope's width in whole 64-column blocks (a K block is from k_nope or k_pe);
// 0 forces cp.async everywhere.
#ifndef PW_TMA
#define PW_TMA 1
#endif
#define PW_TMA_OK (PW_TMA && ATT_DA % 64 == 0)

// {dynamic shared bytes, threads per CTA, rows per CTA, keys per tile}
extern "C" __device__ const int attn_wgmma_config[4] = {PW_SMEM, PW_NT, ATT_BM, ATT_BN};

// 1: attn_wgmma can load by TMA (the host encodes the maps); its second parameter is there either way
// (the symbol tells the host it has one).
extern "C" __device__ const int attn_wgmma_tma_param = PW_TMA_OK;
// attn_wgmma's second parameter (src/backend/cuda/prefill.rs `PrefillLaunch`): the tensor maps of the
// launch's operands — q (columns × heads × tokens, 64 × 1 × BM boxes), k_nope and v (columns × heads ×
// keys, 64 × 1 × BN), the k_pe rows (columns × keys, 64 × BN); 128-byte swizzled, rows and columns past
// the tensor read as zeros — and `on`: 0 where the host could not encode them (the kernel then loads by
// cp.async). A __grid_constant__ parameter, as decode's map: encoded for this launch, so nothing to match.
struct PwMaps {
    TmaMap q, ka, kb, v;
    int on;
};
#if PW_TMA_OK
// One elected thread: keys [j0, j0 + BN) of head h into K stage sk (k_nope blocks, then k_pe's), the
// stage's full barrier expecting every box's bytes (out-of-bounds fill included).
__device__ __forceinline__ void pw_tma_k(const PwMaps& mp, int h, int j0, unsigned sk, unsigned bar) {
#pragma unroll
    for (int k = 0; k < PW_KB; ++k) {
        if (k < ATT_DA / 64)
            tma_load_3d(sk + k * PW_KBLK, &mp.ka, 64 * k, h, j0, bar);
        else
            tma_load_2d(sk + k * PW_KBLK, &mp.kb, 64 * (k - ATT_DA / 64), j0, bar);
    }
}
__device__ __forceinline__ void pw_tma_v(const PwMaps& mp, int h, int j0, unsigned sv, unsigned bar) {
#pragma unroll
    for (int k = 0; k < PW_VB; ++k) tma_load_3d(sv + k * PW_KBLK, &mp.v, 64 * k, h, j0, bar);
}
#endif


#if ATT_BN == 64
#define pw_s wg_ss_n64<0>
#elif ATT_BN == 80  // 256/256: Q 64 KB + two stages of 80-key K and V, 225 KB, fit where 128 keys do not
#define pw_s wg_ss_n80<0>
#else
#define pw_s wg_ss_n128<0>
#endif
#if PW_DVP == 64
#define pw_pv wg_rs_n64<1>
#elif PW_DVP == 128
#define pw_pv wg_rs_n128<1>
#elif PW_DVP == 192
#define pw_pv wg_rs_n192<1>
#else
#define pw_pv wg_rs_n256<1>
#endif

// `width` elements of row `src` (null: zeros) into row r of a tile with blocks of `blk` bytes, eight
// threads per row: this thread copies chunks q, q + 8, … (q = threadIdx % 8). `src2` continues the row
// after `width2` chunks of `src` (K's k_pe after k_nope).
template <int BLOCKS>
__device__ __forceinline__ void pw_load_row(unsigned dst, int blk, int r, const dt* src, int c1, const dt* src2,
                                            int c2, const dt* any_valid) {
    const int q = threadIdx.x & 7;  // the producer warpgroup starts at a multiple of 8 threads
    const unsigned d = dst + r * 128 + ((q ^ (r & 7)) << 4);
#pragma unroll
    for (int k = 0; k < BLOCKS; ++k) {
        const int c = 8 * k + q;
        const dt* s = any_valid;
        int n = 0;
        if (src && c < c1) {
            s = src + c * 8;
            n = 16;
        } else if (src && c < c2) {
            s = src2 + (c - c1) * 8;
            n = 16;
        }
        cp_async16(d + k * blk, s, n);
    }
}

// Keys [j0, j0 + BN) ∩ [.., hi) of head h: K = [k_nope | k_pe] rows (rows past `hi` are zero).
__device__ __forceinline__ void pw_load_k(const AttnArgs& a, int b, int h, int j0, int hi, unsigned sk) {
#pragma unroll
    for (int r = (threadIdx.x - 128 * PW_NC) >> 3; r < ATT_BN; r += 16) {
        const int j = j0 + r;
        const bool ok = j < hi;
        const dt* ka = ok ? a.ka + b * a.ka_bs + (long long)j * a.ka_rs + (long long)h * a.ka_hs : nullptr;
        const dt* kb = a.kb + b * a.kb_bs + (long long)j * a.kb_rs;
        pw_load_row<PW_KB>(sk, PW_KBLK, r, ka, ATT_DA / 8, kb, ATT_DQK / 8, a.ka);
    }
}
// The same keys' V rows.
__device__ __forceinline__ void pw_load_v(const AttnArgs& a, int b, int h, int j0, int hi, unsigned sv) {
#pragma unroll
    for (int r = (threadIdx.x - 128 * PW_NC) >> 3; r < ATT_BN; r += 16) {
        const int j = j0 + r;
        const dt* v = j < hi ? a.v + b * a.v_bs + (long long)j * a.v_rs + (long long)h * a.v_hs : nullptr;
        pw_load_row<PW_VB>(sv, PW_KBLK, r, v, ATT_DV / 8, nullptr, 0, a.ka);
    }
}

// S = Q·Kᵀ for warpgroup wg's 64 rows and one key tile (issued, not waited).
__device__ __forceinline__ void pw_issue_s(float (&s)[ATT_BN / 2], unsigned sQ, unsigned sK, int wg) {
#pragma unroll
    for (int kk = 0; kk < PW_KB * 4; ++kk) {
        const unsigned off = (kk & 3) * 32;
        pw_s(s, wg_desc(sQ + (kk >> 2) * PW_QBLK + wg * 64 * 128 + off, 16, 1024),
             wg_desc(sK + (kk >> 2) * PW_KBLK + off, 16, 1024), kk > 0);
    }
}
// O (+)= P·V over one key tile (issued, not waited); `first`: overwrite O (its first tile).
__device__ __forceinline__ void pw_issue_pv(float (&o)[PW_DVP / 2], const unsigned (&pa)[ATT_BN / 16][4],
                                            unsigned sV, bool first) {
#pragma unroll
    for (int kk = 0; kk < ATT_BN / 16; ++kk)
        pw_pv(o, pa[kk], wg_desc(sV + kk * 16 * 128, PW_KBLK, 1024), !first || kk > 0);
}
// Online softmax of one tile's scores, in place: s becomes P = exp2(S·scale - m) (unrounded); m moves to
// the new row maxima (in the scaled, log2 domain); al gets each row's rescale factor for O and l, rs the
// rows' partial sums of P. MASK: the tile holds keys past a row's causal limit or past `hi` (a CTA's
// last tiles); the others skip the per-score compares. The scale goes into the exponent's FFMA: as
// scale > 0 the scaled row maximum equals the maximum of the scaled scores (rounding is monotone).
// Both together: 6–12 % less time at T = 4096 on the H200 (2026-12-02, bench/RESULTS.md).
template <bool MASK>
__device__ __forceinline__ void pw_softmax_t(float (&s)[ATT_BN / 2], float (&m)[2], float (&al)[2],
                                             float (&rs)[2], const int (&lim)[2], int j0, int hi,
                                             float scale_log2, int t) {
    float mu[2];
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
        float tm = MLA_NEG_INF;
#pragma unroll
        for (int n = 0; n < ATT_BN / 8; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int i = 4 * n + 2 * e2 + c, key = j0 + n * 8 + 2 * t + c;
                if (MASK && (key >= hi || key > lim[e2])) s[i] = MLA_NEG_INF;
                tm = fmaxf(tm, s[i]);
            }
        tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
        tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
        const float mn = tm == MLA_NEG_INF ? m[e2] : fmaxf(m[e2], tm * scale_log2);
        mu[e2] = mn == MLA_NEG_INF ? 0.f : mn;
        al[e2] = exp2f(m[e2] - mu[e2]);
        m[e2] = mn;
        rs[e2] = 0.f;
    }
#pragma unroll
    for (int n = 0; n < ATT_BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[4 * n + e] = exp2f(fmaf(s[4 * n + e], scale_log2, -mu[e >> 1]));
            rs[e >> 1] += s[4 * n + e];
        }
}
__device__ __forceinline__ void pw_softmax(float (&s)[ATT_BN / 2], float (&m)[2], float (&al)[2], float (&rs)[2],
                                           const int (&lim)[2], int j0, int hi, bool mask, float scale_log2,
                                           int t) {
    if (mask)
        pw_softmax_t<true>(s, m, al, rs, lim, j0, hi, scale_log2, t);
    else
        pw_softmax_t<false>(s, m, al, rs, lim, j0, hi, scale_log2, t);
}
// P rounded to the storage type: the A fragments of P·V's k-steps (two adjacent 8-key column groups of
// the accumulator layout are one 16-key k-step's A layout).
__device__ __forceinline__ void pw_pack(unsigned (&pa)[ATT_BN / 16][4], const float (&s)[ATT_BN / 2]) {
#pragma unroll
    for (int n = 0; n < ATT_BN / 8; ++n) {
        pa[n >> 1][2 * (n & 1)] = pack2(s[4 * n], s[4 * n + 1]);
        pa[n >> 1][2 * (n & 1) + 1] = pack2(s[4 * n + 2], s[4 * n + 3]);
    }
}

// The named barriers 1 and 2 of the consumers' ping-pong (the K / V stages' mbarriers: sm90/tma.cuh's
// mbar_arrive / mbar_wait; the producer fills, consumer warps empty).
__device__ __forceinline__ void pp_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void pp_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

extern "C" __global__ void __launch_bounds__(PW_NT, 1) attn_wgmma(const AttnArgs a, const __grid_constant__ PwMaps mp) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[4 * PW_ST];  // K full, V full, K empty, V empty: a stage each
    const unsigned raw = smem_u32(smem), base = (raw + 1023) & ~1023u;
    const unsigned sQ = base, sK0 = base + PW_SQ, sV0 = sK0 + PW_ST * PW_SK;
    const unsigned kfull = smem_u32(bars), vfull = kfull + 8 * PW_ST, kempty = vfull + 8 * PW_ST,
                   vempty = kempty + 8 * PW_ST;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wr = 64 * wg + (warp & 3) * 16;  // warpgroup; first of this warp's 16 rows
    const int g = lane >> 2, t = lane & 3;
    const int b = blockIdx.z, h = blockIdx.y, tile = att_tile();
    const int n_keys = a.seq_lens ? a.seq_lens[b] : a.n_keys;
    int lo, hi;
    att_key_range(a, n_keys, tile, &lo, &hi);
    const int n_tiles = hi > lo ? (hi - lo + ATT_BN - 1) / ATT_BN : 0;

#if PW_TMA_OK
    // One request (the maps cover one); the same in every thread.
    const bool tma = mp.on && gridDim.z == 1 && !a.seq_lens;
#else
    const bool tma = false;
#endif
    if (tid < PW_ST) {
        // Full: the producer's 128 threads (cp.async) or its one elected thread's expect-tx (TMA).
        mbar_init(kfull + 8 * tid, tma ? 1 : 128);
        mbar_init(vfull + 8 * tid, tma ? 1 : 128);
        mbar_init(kempty + 8 * tid, 4 * PW_NC);
        mbar_init(vempty + 8 * tid, 4 * PW_NC);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == PW_NC) {
        // Producer. Items in the order the consumers need them: Q + K(0), V(0), K(1), V(1), …; item i's
        // full barrier is signalled once item i+1 is issued and item i has landed.
#if PW_NC == 2
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
#if PW_TMA_OK
        if (tma) {
            // One thread issues every copy, K running a tile ahead of V: K(j), then V(j-1); a stage is
            // refilled once the consumers' MMAs that read it are done (its empty barrier).
            if (tid == 128 * PW_NC) {
                for (int j = 0; j <= n_tiles; ++j) {
                    if (j < n_tiles) {
                        const int st = j % PW_ST;
                        const unsigned bar = kfull + 8 * st, sk = sK0 + st * PW_SK;
                        if (j >= PW_ST) mbar_wait(kempty + 8 * st, (j / PW_ST - 1) & 1);  // S(j-ST) done
                        mbar_expect_tx(bar, PW_SK + (j == 0 ? PW_SQ : 0));
                        if (j == 0) {
                            // Q's rows past the chunk's queries read as zeros (out of the map's bounds).
#pragma unroll
                            for (int k = 0; k < PW_KB; ++k)
                                tma_load_3d(sQ + k * PW_QBLK, &mp.q, 64 * k, h, tile * ATT_BM, bar);
                        }
                        pw_tma_k(mp, h, lo + j * ATT_BN, sk, bar);
                    }
                    if (j >= 1) {
                        const int jv = j - 1, st = jv % PW_ST;
                        if (jv >= PW_ST) mbar_wait(vempty + 8 * st, (jv / PW_ST - 1) & 1);  // P·V(jv-ST) done
                        mbar_expect_tx(vfull + 8 * st, PW_SV);
                        pw_tma_v(mp, h, lo + jv * ATT_BN, sV0 + st * PW_SV, vfull + 8 * st);
                    }
                }
            }
            return;
        }
#endif
        for (int r = (tid - 128 * PW_NC) >> 3; r < ATT_BM; r += 16) {
            const RowInfo ri = att_row(a, tile, r, n_keys);
            const dt* src =
                ri.valid ? a.q + b * a.q_bs + (long long)ri.i * a.q_rs + (long long)ri.h * a.q_hs : nullptr;
            pw_load_row<PW_KB>(sQ, PW_QBLK, r, src, ATT_DQK / 8, nullptr, 0, a.q);
        }
        if (n_tiles > 0) pw_load_k(a, b, h, lo, hi, sK0);
        cp_async_commit();
        for (int i = 1; i < 2 * n_tiles; ++i) {
            const int j = i >> 1, st = j % PW_ST;
            if (i & 1) {
                if (j >= PW_ST) mbar_wait(vempty + 8 * st, (j / PW_ST - 1) & 1);  // P(j-ST)·V(j-ST) done
                pw_load_v(a, b, h, lo + j * ATT_BN, hi, sV0 + st * PW_SV);
            } else {
                if (j >= PW_ST) mbar_wait(kempty + 8 * st, (j / PW_ST - 1) & 1);  // S(j-ST) done
                pw_load_k(a, b, h, lo + j * ATT_BN, hi, sK0 + st * PW_SK);
            }
            cp_async_commit();
            cp_async_wait<1>();
            wg_fence_smem();
            const int p = i - 1;  // the item that has landed
            mbar_arrive(((p & 1) ? vfull : kfull) + 8 * ((p >> 1) % PW_ST));
        }
        cp_async_wait<0>();  // with no key tile, Q's copies (unread) still finish before the exit
        if (n_tiles > 0) {
            wg_fence_smem();
            const int p = 2 * n_tiles - 1;
            mbar_arrive(vfull + 8 * ((p >> 1) % PW_ST));
        }
        return;
    }
#if PW_NC == 2
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
#endif
#if PW_PP
    const int my_bar = 1 + wg, other_bar = 2 - wg;
    if (wg == 1) pp_arrive(1);  // warpgroup 0 issues first
#endif

    // This thread's rows: wr + g + 8e. Keys below `lim_lo` + 1 are visible to every row of the CTA: tiles
    // below it need no causal mask.
    int lim[2];
    float m[2], l[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        lim[e] = att_row(a, tile, wr + g + 8 * e, n_keys).lim;
        m[e] = MLA_NEG_INF;
        l[e] = 0.f;
    }
    const int lim_lo = att_row(a, tile, 0, n_keys).lim;
    // O is not zeroed: the first P·V k-step overwrites it (scale-d 0) and a CTA with no tile stores zeros
    // (zeroing it inside the loop's reach serializes the wgmmas, C7515; sm90/decode/attn_wgmma.cuh).
    float o[PW_DVP / 2];
    float s[ATT_BN / 2];
    unsigned pa[ATT_BN / 16][4];

    if (n_tiles > 0) {
        mbar_wait(kfull, 0);  // Q and K(0)
#if PW_PP
        pp_sync(my_bar);
#endif
        wg_fence();
        pw_issue_s(s, sQ, sK0, wg);
        wg_commit();
#if PW_PP
        pp_arrive(other_bar);
#endif
        wg_wait<0>();
        wg_pin(s);
        if (lane == 0) mbar_arrive(kempty);
        float al[2], rs[2];
        pw_softmax(s, m, al, rs, lim, lo, hi, lo + ATT_BN > lim_lo + 1 || lo + ATT_BN > hi, a.scale_log2, t);
        l[0] = rs[0];
        l[1] = rs[1];
        pw_pack(pa, s);
    }
    for (int it = 1; it < n_tiles; ++it) {
        const int j0 = lo + it * ATT_BN, sk = it % PW_ST, sv = (it - 1) % PW_ST;
        mbar_wait(kfull + 8 * sk, (it / PW_ST) & 1);
        mbar_wait(vfull + 8 * sv, ((it - 1) / PW_ST) & 1);
#if PW_PP
        pp_sync(my_bar);
#endif
        wg_fence();
        pw_issue_s(s, sQ, sK0 + sk * PW_SK, wg);
        wg_commit();
        pw_issue_pv(o, pa, sV0 + sv * PW_SV, it == 1);
        wg_commit();
#if PW_PP
        pp_arrive(other_bar);
#endif
        wg_wait<1>();  // S(it) done; P(it-1)·V(it-1) may still run
        wg_pin(s);
        if (lane == 0) mbar_arrive(kempty + 8 * sk);
        float al[2], rs[2];
        pw_softmax(s, m, al, rs, lim, j0, hi, j0 + ATT_BN > lim_lo + 1 || j0 + ATT_BN > hi, a.scale_log2, t);
        wg_wait<0>();
        wg_pin(o);
        if (lane == 0) mbar_arrive(vempty + 8 * sv);
#pragma unroll
        for (int i = 0; i < PW_DVP / 2; ++i) o[i] *= al[(i >> 1) & 1];
        l[0] = l[0] * al[0] + rs[0];  // per-thread partial; reduced over the quad at the end
        l[1] = l[1] * al[1] + rs[1];
        pw_pack(pa, s);
    }
    if (n_tiles > 0) {
        const int sv = (n_tiles - 1) % PW_ST;
        mbar_wait(vfull + 8 * sv, ((n_tiles - 1) / PW_ST) & 1);
#if PW_PP
        pp_sync(my_bar);
#endif
        wg_fence();
        pw_issue_pv(o, pa, sV0 + sv * PW_SV, n_tiles == 1);
        wg_commit();
#if PW_PP
        if (wg == 0) pp_arrive(other_bar);  // warpgroup 1's last turn: nothing follows
#endif
        wg_wait<0>();
        wg_pin(o);
    }

#pragma unroll
    for (int e = 0; e < 2; ++e) {
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
        const RowInfo ri = att_row(a, tile, wr + g + 8 * e, n_keys);
        if (!ri.valid) continue;
        const float L = l[e];
        if (t == 0) att_store_lse(a, b, ri, L > 0.f ? (m[e] + log2f(L)) * MLA_LN2 : ATT_EMPTY_LSE);
        const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
        for (int n = 0; n < ATT_DV / 8; ++n)
            att_store(a, b, ri, n * 8 + 2 * t, L > 0.f ? o[4 * n + 2 * e] * inv : 0.f,
                      L > 0.f ? o[4 * n + 2 * e + 1] * inv : 0.f, 1);  // o is unset when no tile ran
    }
}
#endif  // wgmma prefill
