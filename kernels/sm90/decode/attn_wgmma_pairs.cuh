// sm90/decode/attn_wgmma_pairs.cuh — attn_wgmma_pairs: decode at DeepSeek / GLM-5 dims (key rows 576 = 9 blocks,
// latent 512) with TMA key tiles (page a multiple of 64), the two warpgroups on alternate 64-key tiles so
// one's softmax runs under the other's MMAs (FlashMLA's schedule). Included by sm90/decode/attn_wgmma.cuh, whose
// helpers, contract, numerics and fault switches it shares; the host launches it unless a launch has more
// than two splits of fewer than 512 keys, attn_wgmma then (src/backend/cuda/attn.rs `pairs_rule`;
// measured on the H200 2026-12-02, bench/RESULTS.md).
//
// Why: the one-tile-at-a-time kernel (ncu, 2026-12-02) is bound by its serial per-tile chain (S, a CTA
// barrier for the row maxima, P, a barrier, P·V) with nothing else resident; here no CTA-wide barrier is
// in the key loop and the warpgroups hand each other the running max per tile.
//
// Per tile, fewer instructions than the first version (~1,700 per warp and pair in SASS; FlashMLA executes
// about half ours then, by ncu): descriptors as base + constant, the key compares only on a range's edge
// tiles, O's rescale skipped by a warp whose maxima all held, the scale inside exp2's FFMA, exp2 without
// its denormal path (the WA_* switches below). Together 5–9 % faster at B=64 s_k=4k; one lever off at a time
// (H=128, one run each) was slower by 0.6–15 µs, most for the descriptors, except the rescale skip: neutral
// on the bench's random data (2026-12-02).
//
// Pair k = tiles A = 2k (stage 0) and B = 2k+1 (stage 1). Warpgroup 0 computes S_A over all 64 keys and
// the max m_A = max(m, rowmax S_A), writes P_A; warpgroup 1 computes S_B, takes m_A and writes P_B with
// m_B = max(m_A, rowmax S_B). Each accumulates its half of O's 512 columns from both P's:
//   wg0: O *= α_A; O += P_A·V_A[0,256);  O *= α_B; O += P_B·V_B[0,256)
//   wg1: O *= α_A; O += P_A·V_A[256,512); O *= α_B; O += P_B·V_B[256,512)
// with α_A = exp2(m - m_A), α_B = exp2(m_A - m_B); each warpgroup sums l over its own tiles (rescaled
// by both α's), and the two sums are added at the end. wg1's order in a pair: wait for P_A, issue P_A·V_A, then
// S_B behind it, so stage 1's right half (refilled at the end of the last pair) lands under that MMA instead
// of in front of S_B, where wg1 spun and wg0 then spun on READY_B (2026-12-06, H100: −4 to −7 % at H=128
// one split, −5 % at H=64; the same operations in the same order on every accumulator, so the same bits;
// bench/probes/handover40.md has the timeline and the shared-memory arithmetic). Same rounding as the other
// kernels: P in the storage type from the running max of its own tile, l from unrounded P.
//
// Loads: each stage's left half (blocks 0–3: S and wg0's P·V) and right half (blocks 4–8: S and wg1's
// P·V) is refilled by one thread of the warpgroup that last reads it, by TMA on the half's mbarrier (4 or
// 5 boxes, one arrival + the bytes), as soon as that read is done: wg0 refills stage 0's left half right
// after its P_A·V_A, before waiting for wg1's P_B (a wait there left the load latency exposed: 165 vs 178
// µs at H=128, 2026-12-02). S starts on the left half before the right one lands. Tiles start on page
// boundaries as in sm90/decode/attn_wgmma.cuh.
// Shared memory (the same WG_SMEM): Q's rope block is read into registers once (the last four k-steps of
// S take A from registers), which frees it for P_B; P_A sits after the stages; m_A, m_B and the eight
// mbarriers in the exchange area: four "landed" (stage × half), READY_A (wg0's 128 threads arrive once P_A
// and m_A are written), READY_B (wg1's, once P_B and m_B are written and its P_A·V_A is done) and one per
// warpgroup (its four warps' MMAs done, before one thread refills a stage half). No named barrier: with
// 128-thread named barriers compute-sanitizer's racecheck reported hazards across them; on mbarriers
// it reports none (H200, 2026-12-02).
#pragma once



__device__ __forceinline__ void wa_mbar_wait(unsigned bar, int parity) {
    asm volatile(
        "{\n.reg .pred p;\nWA_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WA_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// The warpgroup-wide barrier before a refill (and after wa_fix's zeros), on the warpgroup's mbarrier of
// 128 arrivals. `ph`: this thread's parity of that barrier, flipped per use.
__device__ __forceinline__ void wa_own(unsigned bar, int& ph) {
    mbar_arrive(bar);
    mbar_wait(bar, ph);
    ph ^= 1;
}

// Key rows [j0, j0 + 64), 64-column blocks [B0, B1), into a stage half by TMA, one thread of the warpgroup
// (rows past hi are zeroed by wa_fix once landed).
#define wa_load(B0, B1, j0, dst, bar)                                                     \
    do {                                                                                  \
        if ((threadIdx.x & 127) == 0) wg_tma_k<B0, B1>(&km, a, table, rb, j0, dst, bar); \
    } while (0)

// Before S on a range's last tile: wait for both halves, zero the rows past hi, and make that
// visible to this warpgroup's wgmma (and, through the hand-overs, to the other's P·V).
__device__ __forceinline__ void wa_fix(unsigned char* gK, unsigned bar, int ph, int j0, int hi, unsigned own, int& oph) {
    if (hi - j0 < WG_BN) {
        mbar_wait(bar, ph);
        mbar_wait(bar + 8, ph);
        wg_zero_rows(gK, hi - j0, threadIdx.x & 127, 128);
        wg_fence_smem();
        wa_own(own, oph);
    }
}

// Probe switches (each 1 in the landed kernel; a probe directory sets one to 0; bench/probes/README.md):
// WA_NOMASK: interior tiles skip the per-key compares; WA_SKIPSCALE: O's rescale skipped by a warp whose
// α are all 1; WA_FFMA: the softmax scale folded into exp2's argument; WA_FTZ: exp2 without the
// denormal-result path; WA_DESC: descriptors as a base plus a constant.
#ifndef WA_NOMASK
#define WA_NOMASK 1
#endif
#ifndef WA_SKIPSCALE
#define WA_SKIPSCALE 1
#endif
#ifndef WA_FFMA
#define WA_FFMA 1
#endif
#ifndef WA_FTZ
#define WA_FTZ 1
#endif
#ifndef WA_DESC
#define WA_DESC 1
#endif

// Descriptors (sm90/wgmma.cuh's wg_desc) as the low word of a base plus off / 16: the address field is the
// low word's bits 0–13 and no offset inside the CTA's 227 KB carries out of it, so each MMA's descriptor
// is one add instead of a rebuild (the rebuilds were ~470 of the ~1,700 instructions per pair).
// `lo`: wa_desc_lo of the base; the high word (stride 1024 B, 128-byte swizzle) is the same for all.
__device__ __forceinline__ unsigned wa_desc_lo(unsigned addr, unsigned lbo) {
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ unsigned long long wa_desc(unsigned lo, unsigned off) {
    return ((unsigned long long)((1024 >> 4) | (1u << 30)) << 32) | (lo + (off >> 4));
}
#if WA_DESC
#define WA_DQ(addr, off) wa_desc(addr, off)
#define WA_DV(addr, off) wa_desc(addr, off)
#define WA_LO(addr, lbo) wa_desc_lo(addr, lbo)
#else
#define WA_DQ(addr, off) wg_desc((addr) + (off), 16, 1024)
#define WA_DV(addr, off) wg_desc((addr) + (off), WG_BLK, 1024)
#define WA_LO(addr, lbo) (addr)
#endif

// S (+)= Q·Kᵀ over blocks [B0, B1) of a stage; block 8 (rope) takes Q from registers. dQ, dK: WA_LO of
// sQ and the stage (lbo 16).
template <int B0, int B1>
__device__ __forceinline__ void wa_s(float (&s)[32], unsigned dQ, unsigned dK, const unsigned (&qr)[4][4]) {
#pragma unroll
    for (int kk = 4 * B0; kk < 4 * B1; ++kk) {
        const unsigned off = (kk >> 2) * WG_BLK + (kk & 3) * 32;
        if (kk < 32)
            wg_ss_n64<0>(s, WA_DQ(dQ, off), WA_DQ(dK, off), kk > 0);
        else
            wg_rs_n64<0>(s, qr[kk & 3], WA_DQ(dK, off));  // A: Q's rope columns from registers
    }
}

// O (+)= P·V over 64 keys for value columns [256·half, 256·half + 256). dP: WA_LO of the P tile (lbo 16);
// dV: of the stage with lbo WG_BLK (V is read N-major).
__device__ __forceinline__ void wa_pv(float (&o)[128], unsigned dP, unsigned dV, int half, int acc) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        wg_pv(o, WA_DQ(dP, kk * 32), WA_DV(dV, half * 4 * WG_BLK + kk * 16 * 128), acc || kk > 0);
}

// Mask (keys below lo, at or past hi, past a row's limit; the fault's upper 32 of each tile) and row max
// of S. With WA_FFMA S stays unscaled (the scale is positive, so the max of the scaled S is the scaled max,
// rounding included) and only the two maxima are scaled; wa_exp folds the scale into its FFMA. With
// WA_NOMASK a tile inside [lo, hi) and below every row's limit of the warp (warp-uniform vote) takes the
// path without compares.
__device__ __forceinline__ void wa_mask_max(float (&s)[32], int lo, int j0, int hi, const int (&lim)[2], int t,
                                            float (&tm)[2], float scale_log2) {
    tm[0] = tm[1] = MLA_NEG_INF;
#if WA_FFMA
    const float sc = 1.f;
#else
    const float sc = scale_log2;
#endif
#if WA_NOMASK
    const bool inside =
        __all_sync(0xffffffffu, j0 >= lo && j0 + WG_BN <= hi && j0 + WG_BN - 1 <= min(lim[0], lim[1]));
#else
    const bool inside = false;
#endif
    if (inside) {
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = s[4 * n + e] * sc;
                if (WG_FAULT_DROP(n * 8 + 2 * t + (e & 1) >= 32)) v = MLA_NEG_INF;
                s[4 * n + e] = v;
                tm[e >> 1] = fmaxf(tm[e >> 1], v);
            }
    } else {
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = n * 8 + 2 * t + (e & 1), key = j0 + c;
                float v = s[4 * n + e] * sc;
                if (key < lo || key >= hi || key > lim[e >> 1] || WG_FAULT_DROP(c >= 32)) v = MLA_NEG_INF;
                s[4 * n + e] = v;
                tm[e >> 1] = fmaxf(tm[e >> 1], v);
            }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        tm[e] = fmaxf(tm[e], __shfl_xor_sync(0xffffffffu, tm[e], 1));
        tm[e] = fmaxf(tm[e], __shfl_xor_sync(0xffffffffu, tm[e], 2));
#if WA_FFMA
        tm[e] *= scale_log2;
#endif
    }
}

// 2^x. With WA_FTZ a result below 2^-126 is 0 (ex2.approx.ftz: one MUFU; exp2f adds a compare and two
// multiplies for denormal results). Harmless here: every P row holds a 1 (its max), so such terms are
// far below l's last bit, and P rounds them to 0 or a bf16/fp16 denormal that P·V cannot see next to 1.
__device__ __forceinline__ float wa_ex2(float x) {
#if WA_FTZ
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

// P = exp2(S·scale - mu) in place (WA_FFMA; else S is scaled already); row sums into rs.
__device__ __forceinline__ void wa_exp(float (&s)[32], const float (&mu)[2], float (&rs)[2], float scale_log2) {
    rs[0] = rs[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
#if WA_FFMA
        s[i] = wa_ex2(fmaf(s[i], scale_log2, -mu[(i >> 1) & 1]));
#else
        s[i] = wa_ex2(s[i] - mu[(i >> 1) & 1]);
#endif
        rs[(i >> 1) & 1] += s[i];
    }
}

// P (storage type) → the shared P tile: key column 8n + 2t is chunk n, bytes 4t.
__device__ __forceinline__ void wa_store_p(unsigned char* gP, const float (&s)[32], int wr, int g, int t) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            *reinterpret_cast<unsigned*>(gP + wg_off(wr + g + 8 * e, n) + 4 * t) =
                pack2(s[4 * n + 2 * e], s[4 * n + 2 * e + 1]);
}

// O *= α per row. With WA_SKIPSCALE a warp whose 16 rows all kept their max (α = 1: the multiply would be
// exact) skips the 128 multiplies; the vote keeps the branch warp-uniform.
__device__ __forceinline__ void wa_scale_o(float (&o)[128], const float (&al)[2]) {
#if WA_SKIPSCALE
    if (__all_sync(0xffffffffu, al[0] == 1.f && al[1] == 1.f)) return;
#endif
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] *= al[(i >> 1) & 1];
}

extern "C" __global__ void __launch_bounds__(WG_NT, 1) attn_wgmma_pairs(const AttnArgs a WG_MAP_PARAM) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned raw = smem_u32(smem), base = (raw + 1023) & ~1023u;
    unsigned char* gbase = smem + (base - raw);
    const unsigned sQ = base, sK0 = base + WG_TILE, sK1 = base + 2 * WG_TILE;
    const unsigned sPA = base + 3 * WG_TILE, sPB = sQ + 8 * WG_BLK;  // P_B in Q's rope block, once in registers
    unsigned char* gPA = gbase + 3 * WG_TILE;
    unsigned char* gPB = gbase + 8 * WG_BLK;
    float* sMA = reinterpret_cast<float*>(gbase + 3 * WG_TILE + WG_BLK);  // m_A per row
    float* sMB = sMA + WG_BM;                                              // m_B per row
    const unsigned full = smem_u32(sMB + WG_BM);  // mbarriers, + 8 · (2 · stage + half): "left / right landed"
    // Epilogue row sums [warpgroup][row] in Q's first block: every S is done by then (each warpgroup's
    // last S precedes a hand-over the other has passed).
    float* sSum = reinterpret_cast<float*>(gbase);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wr = (warp & 3) * 16;  // warpgroup; first of this warp's 16 rows
    const int g = lane >> 2, t = lane & 3;
    const int b = blockIdx.z, tile = blockIdx.y;
    const int n_keys = a.seq_lens ? a.seq_lens[b] : a.n_keys;
    const int* table = a.table ? a.table + b * a.table_bs : nullptr;
    int lo, hi;
    att_key_range(a, n_keys, tile, &lo, &hi);
    att_fault_tail(lo, &hi, WG_BN);
    const int jb = lo - lo % WG_BN;  // tiles start on a page boundary
    const long long rb = b * a.ka_bs / a.ka_rs;
    if (tid == 0) tma_prefetch_map(&km);
    if (tid < 4) {
        mbar_init(full + 8 * tid, 1);  // the loading thread's arrival + the bytes
        mbar_init(full + 32 + 8 * tid, 128);  // warpgroup 0's and 1's own barriers, READY_A, READY_B
        mbar_init_fence();
    }
    const int n_tiles = hi > lo ? (hi - jb + WG_BN - 1) / WG_BN : 0;
    const int n_pairs = (n_tiles + 1) / 2;
    const unsigned own = full + 32 + 8 * wg;  // this warpgroup's barrier
    // The hand-overs: 128 arrivals (the producing warpgroup's threads) complete one phase per pair; the
    // consumer waits on parity k & 1.
    const unsigned readyA = full + 48, readyB = full + 56;
    int oph = 0;
    // The descriptors' bases (WA_DESC: low words; else the addresses).
    const unsigned dQ = WA_LO(sQ, 16), dK0 = WA_LO(sK0, 16), dK1 = WA_LO(sK1, 16), dPA = WA_LO(sPA, 16),
                   dPB = WA_LO(sPB, 16), dV0 = WA_LO(sK0, WG_BLK), dV1 = WA_LO(sK1, WG_BLK);

    // Q (rows past the end are zero), then its rope block into registers.
    for (int r = tid >> 3; r < WG_BM; r += WG_NT / 8) {
        const RowInfo ri = att_row(a, tile, r, n_keys);
        const dt* src = a.q + b * a.q_bs + (long long)ri.i * a.q_rs + (long long)ri.h * a.q_hs;
        wg_load_row(sQ, r, ri.valid ? src : nullptr, a.q);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // Q landed; the mbarriers are initialised
    unsigned qr[4][4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i)  // a0..a3: rows g, g+8 (i & 1) of columns 16k + 2t (+8 for i ≥ 2)
            qr[k][i] = *reinterpret_cast<const unsigned*>(gbase + wg_off(wr + g + 8 * (i & 1), 64 + 2 * k + (i >> 1)) + 4 * t);
    __syncthreads();  // the rope block is free for P_B
    // Tiles 0 and 1: each warpgroup fills the halves it will refill later (wg0 left, wg1 right).
#pragma unroll
    for (int st = 0; st < 2; ++st)
        if (st < n_tiles) {
            const unsigned dst = st ? sK1 : sK0, bar = full + 8 * (2 * st + wg);
            if (wg == 0) wa_load(0, 4, jb + st * WG_BN, dst, bar);
            else wa_load(4, 9, jb + st * WG_BN, dst, bar);
        }
    wg_fence_smem();

    int lim[2];
    float m[2], l[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        lim[e] = att_row(a, tile, wr + g + 8 * e, n_keys).lim;
        m[e] = MLA_NEG_INF;
    }
    // O is not zeroed: pair 0's first P·V k-step overwrites it (scale-d 0); see sm90/decode/attn_wgmma.cuh.
    float o[128];
    float s[32];

    if (wg == 0) {
        if (n_pairs > 0) {
            wa_fix(gbase + WG_TILE, full + 0, 0, jb, hi, own, oph);
            wa_mbar_wait(full + 0, 0);
            wg_fence_smem();
            wg_fence();
            wa_s<0, 4>(s, dQ, dK0, qr);
            wa_mbar_wait(full + 8, 0);
            wg_fence_smem();
            wg_fence();
            wa_s<4, 9>(s, dQ, dK0, qr);
            wg_commit();
        }
        // Every S is waited for in the iteration that issues it: a wait at the loop's top would leave the
        // loop-carried s (defined by the softmax) inside a wgmma pipeline stage, and ptxas serializes (C7515).
        wg_wait<0>();
        wg_pin(s);
        for (int k = 0; k < n_pairs; ++k) {
            const int jA = jb + 2 * k * WG_BN, ph = k & 1;
            const bool has_b = 2 * k + 1 < n_tiles, next_a = 2 * k + 2 < n_tiles, next_b = 2 * k + 3 < n_tiles;
            float tm[2], mu[2], al[2], rs[2];
            wa_mask_max(s, lo, jA, hi, lim, t, tm, a.scale_log2);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float mn = fmaxf(m[e], tm[e]);
                mu[e] = mn == MLA_NEG_INF ? 0.f : mn;
                al[e] = exp2f(m[e] - mu[e]);
                m[e] = mn;
                if (t == 0) sMA[wr + g + 8 * e] = mn;
            }
            wa_exp(s, mu, rs, a.scale_log2);
            wa_store_p(gPA, s, wr, g, t);
            l[0] = l[0] * al[0] + rs[0];
            l[1] = l[1] * al[1] + rs[1];
            wa_scale_o(o, al);
            wg_fence_smem();
            mbar_arrive(readyA);  // P_A, m_A → wg1

            wg_fence();
            wa_pv(o, dPA, dV0, 0, k > 0);
            wg_commit();
            // Stage 0's left half is free once this P_A·V_A is done (S_A was its other reader): refill it
            // now, under wg1's softmax of B, not after the hand-over below.
            wg_wait<0>();  // P_A·V_A (left)
            wg_pin(o);
            wa_own(own, oph);
            if (next_a) wa_load(0, 4, jA + 2 * WG_BN, sK0, full + 0);
            mbar_wait(readyB, k & 1);  // P_B, m_B in; wg1 is done reading P_A
#ifdef MLA_FAULT_PAIRS_HANDOVER_STALE
            // Planted bug (src/faults.rs): the hand-over takes wg1's running max without rescaling wg0's O and l to it.
#pragma unroll
            for (int e = 0; e < 2; ++e) m[e] = sMB[wr + g + 8 * e];
#else
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float mn = sMB[wr + g + 8 * e];
                al[e] = exp2f(m[e] - (mn == MLA_NEG_INF ? 0.f : mn));
                m[e] = mn;
            }
            l[0] *= al[0];
            l[1] *= al[1];
            wa_scale_o(o, al);
#endif
            if (has_b) {
                wa_mbar_wait(full + 16, ph);  // stage 1's left half (landed before S_B)
                wg_fence_smem();
                wg_fence();
                wa_pv(o, dPB, dV1, 0, 1);
                wg_commit();
            }
            if (next_a) {  // S_A of the next pair: left half under P_B·V_B
                wa_fix(gbase + WG_TILE, full + 0, ph ^ 1, jA + 2 * WG_BN, hi, own, oph);
                wa_mbar_wait(full + 0, ph ^ 1);
                wg_fence_smem();
                wg_fence();
                wa_s<0, 4>(s, dQ, dK0, qr);
                wg_commit();
            }
            if (has_b) {
                if (next_a) wg_wait<1>();
                else wg_wait<0>();
                wg_pin(o);
                wa_own(own, oph);
                if (next_b) wa_load(0, 4, jA + 3 * WG_BN, sK1, full + 16);
            }
            if (next_a) {
                wa_mbar_wait(full + 8, ph ^ 1);
                wg_fence_smem();
                wg_fence();
                wa_s<4, 9>(s, dQ, dK0, qr);
                wg_commit();
            }
            wg_wait<0>();  // the next S_A (and P_B·V_B)
            wg_pin(s);
            wg_pin(o);
        }
    } else {
        for (int k = 0; k < n_pairs; ++k) {
            const int jB = jb + (2 * k + 1) * WG_BN, ph = k & 1;
            const bool has_b = 2 * k + 1 < n_tiles, next_a = 2 * k + 2 < n_tiles, next_b = 2 * k + 3 < n_tiles;
            mbar_wait(readyA, k & 1);  // P_A, m_A in
            float al[2], mu[2], rs[2] = {0.f, 0.f}, tm[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float mn = sMA[wr + g + 8 * e];
                al[e] = exp2f(m[e] - (mn == MLA_NEG_INF ? 0.f : mn));
                m[e] = mn;
            }
            l[0] *= al[0];
            l[1] *= al[1];
            wa_scale_o(o, al);
            wa_mbar_wait(full + 8, ph);  // stage 0's right half (landed before S_A)
            wg_fence_smem();
            // S_B behind P_A·V_A: stage 1's load (issued at the end of the last pair) lands under
            // P_A·V_A instead of ahead of it, and P_A·V_A no longer holds stage 1 (bench/probes/handover40.md).
            // P_A·V_A is issued inside each branch: a branch entered with a wgmma in flight made ptxas
            // serialize every wgmma (C7518 / C7520).
            if (has_b) {
                wg_fence();
                wa_pv(o, dPA, dV0, 1, k > 0);
                wg_commit();
                wa_fix(gbase + 2 * WG_TILE, full + 16, ph, jB, hi, own, oph);
                wa_mbar_wait(full + 16, ph);
                wg_fence_smem();
                wg_fence();
                wa_s<0, 4>(s, dQ, dK1, qr);
                wa_mbar_wait(full + 24, ph);
                wg_fence_smem();
                wg_fence();
                wa_s<4, 9>(s, dQ, dK1, qr);
                wg_commit();
                wg_wait<1>();  // P_A·V_A (right); S_B may still run
                wg_pin(o);
                wa_own(own, oph);
                if (next_a) wa_load(4, 9, jB + WG_BN, sK0, full + 8);
                wg_wait<0>();  // S_B
                wg_pin(s);
                wa_mask_max(s, lo, jB, hi, lim, t, tm, a.scale_log2);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float mn = fmaxf(m[e], tm[e]);
                    mu[e] = mn == MLA_NEG_INF ? 0.f : mn;
                    al[e] = exp2f(m[e] - mu[e]);
                    m[e] = mn;
                }
                wa_exp(s, mu, rs, a.scale_log2);
            } else {
                wg_fence();
                wa_pv(o, dPA, dV0, 1, k > 0);
                wg_commit();
                wg_wait<0>();  // P_A·V_A (right)
                wg_pin(o);
                wa_own(own, oph);
                if (next_a) wa_load(4, 9, jB + WG_BN, sK0, full + 8);
                al[0] = al[1] = 1.f;
            }
            if (has_b) wa_store_p(gPB, s, wr, g, t);
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (t == 0) sMB[wr + g + 8 * e] = m[e];
            wg_fence_smem();
            mbar_arrive(readyB);  // P_B, m_B → wg0; P_A is free
            l[0] = l[0] * al[0] + rs[0];
            l[1] = l[1] * al[1] + rs[1];
            if (has_b) {
                wa_scale_o(o, al);
                wg_fence();
                wa_pv(o, dPB, dV1, 1, 1);
                wg_commit();
                wg_wait<0>();  // P_B·V_B (right)
                wg_pin(o);
                wa_own(own, oph);
                if (next_b) wa_load(4, 9, jB + 2 * WG_BN, sK1, full + 24);
            }
        }
    }
    wg_wait<0>();
    wg_pin(o);

    // Row sums: over the quad, then over the two warpgroups; the stores.
    wg_finish(a, b, tile, n_keys, o, l, m, sSum, wg, wr, g, t);
}
