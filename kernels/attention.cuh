// attention.cuh — one flash-attention core for both MLA forms, configured by the including file.
//
//   prefill (decompressed MHA): per head, q = [q_nope | q_pe] (P+R), k = [k_nope[h] | k_pe] (P+R), v[h] (Dv)
//   decode (absorbed MQA):      rows are (query, head) pairs, q = [q_abs | q_pe] (Lkv+R); every head reads
//                               the same paged cache rows [latent | k_pe]; v = the latent, i.e. the first
//                               Lkv columns of the key row (no second copy is loaded).
//
// Required defines (set by prefill.cu / decode.cu):
//   ATT_DA, ATT_DB   widths of the two key segments (k = segA ++ segB; segB is shared by all heads)
//   ATT_DV           value width
//   ATT_MQA          1: rows are (query, head) pairs over shared keys; 0: one head per CTA (blockIdx.y)
//   ATT_V_IN_K       1: V = first ATT_DV columns of the key row
//   ATT_PAGED        1: key row j lives at cache slot table[j / MLA_PAGE] * MLA_PAGE + j % MLA_PAGE
// Tile defines (host-chosen, defaults below): ATT_WM x ATT_WN warps, ATT_BM = 16*ATT_WM query rows,
// ATT_BN keys per tile, ATT_STAGES cp.async pipeline depth.
//
// Numerics (the CPU mirror's specification): scores q·k in f32, scaled by the model's softmax scale;
// online softmax over key tiles; P rounded to the storage type for P·V, the row sum l from unrounded P;
// out = acc / l; lse = m + ln(l) (natural log). A row that sees no key gets out = 0, lse = -inf.
#pragma once
#include "common.cuh"

#ifndef ATT_WM
#define ATT_WM 4
#endif
#ifndef ATT_WN
#define ATT_WN 2
#endif
#ifndef ATT_BN
#define ATT_BN 64
#endif
#ifndef ATT_STAGES
#define ATT_STAGES 2
#endif
#define ATT_BM (16 * ATT_WM)
#define ATT_DQK (ATT_DA + ATT_DB)
#define ATT_NO_LIMIT (1 << 30)  // a non-causal row's last key (lim + 1 must not overflow)

// Kernel arguments, mirrored by `AttnArgs` in src/backend/cuda/attn.rs (same field order, repr(C)).
struct AttnArgs {
    const dt* q;       // [batch][query][head][ATT_DQK]
    const dt* ka;      // key segment A (paged: the cache pool)
    const dt* kb;      // key segment B (shared by heads)
    const dt* v;       // values (unused with ATT_V_IN_K)
    const int* table;  // block table (ATT_PAGED)
    const int* seq_lens;  // per-batch key count, or null: n_keys
    dt* out;           // final output [batch][query][head][ATT_DV] (strided)
    float* lse;        // final lse [batch][query][head]
    float* part_out;   // split partials [batch][query][head][split][ATT_DV]
    float* part_lse;   // [batch][query][head][split]
    long long q_bs, q_rs, q_hs;
    long long ka_bs, ka_rs, ka_hs;
    long long kb_bs, kb_rs;
    long long v_bs, v_rs, v_hs;
    long long out_bs, out_rs, out_hs;
    long long table_bs;
    int n_keys, n_q, n_heads, num_splits;
    int causal;          // query i sees keys j <= i + (n_keys - n_q)
    float scale_log2;    // softmax scale * log2(e)
};

// Split-KV decode writes per-split partials (f32 out, lse) for the combine kernel; with one split the
// serving kernel writes the final output directly, unless MLA_DEBUG asks for the partials anyway.
#define ATT_PARTIALS(a) (ATT_MQA && (MLA_DEBUG || (a).num_splits > 1))

// The host checks its copy of the struct against this size before the first launch.
extern "C" __device__ const int attn_args_size = sizeof(AttnArgs);

// The split this CTA computes (decode: blockIdx.x; prefill has one).
__device__ __forceinline__ int att_split() {
#if ATT_MQA
    return blockIdx.x;
#else
    return 0;
#endif
}

// Planted bugs (src/faults.rs), all off unless the host defines MLA_FAULT_…:
//   CAUSAL_OFF_BY_ONE  every causal row sees one key past its limit (prefill's own chunk, decode steps);
//   READ_PAST_END      decode's last split runs one key further: its end and each row's limit move by one
//                      (past the sequence end that is an unwritten, NaN-poisoned cache row);
//   EMPTY_CTX_LSE_INF  prefill: a row that sees no key reports lse = +inf (FA2) instead of -inf;
//   SPLIT_TAIL_DROPPED decode: a split's partial last tile is dropped when the split spans more than one tile
//                      (att_fault_tail);
//   WG2_KEYS_DROPPED   decode: the upper half of each tile's keys masked (ATT_FAULT_DROP; sm90/decode/attn_wgmma.cuh).
__device__ __forceinline__ int att_last_split_extra(const AttnArgs& a) {
#if defined(MLA_FAULT_READ_PAST_END) && ATT_PAGED
    return att_split() == a.num_splits - 1;
#else
    return 0;
#endif
}
__device__ __forceinline__ int att_causal_extra(const AttnArgs& a) {
#ifdef MLA_FAULT_CAUSAL_OFF_BY_ONE
    return 1 + att_last_split_extra(a);
#else
    return att_last_split_extra(a);
#endif
}
#if defined(MLA_FAULT_EMPTY_CTX_LSE_INF) && !ATT_MQA
#define ATT_EMPTY_LSE __int_as_float(0x7f800000)
#else
#define ATT_EMPTY_LSE MLA_NEG_INF
#endif

struct RowInfo {
    int i, h;     // query index, head
    int valid;    // row exists
    int lim;      // last key index this row may see
};

// Row r of the CTA's tile → (query, head).
__device__ __forceinline__ RowInfo att_row(const AttnArgs& a, int tile, int r, int n_keys) {
    RowInfo ri;
#if ATT_MQA
    const int gr = tile * ATT_BM + r;
    ri.i = gr / a.n_heads;
    ri.h = gr % a.n_heads;
    ri.valid = gr < a.n_q * a.n_heads;
#else
    ri.i = tile * ATT_BM + r;
    ri.h = blockIdx.y;
    ri.valid = ri.i < a.n_q;
#endif
    ri.lim = a.causal ? ri.i + (n_keys - a.n_q) + att_causal_extra(a) : ATT_NO_LIMIT;
    return ri;
}

__device__ __forceinline__ int att_tile() {
#if ATT_MQA
    return blockIdx.y;
#else
    return gridDim.x - 1 - blockIdx.x;  // longest causal rows first
#endif
}

// Offset (in elements) of key row j of segment A / B / V for head h.
__device__ __forceinline__ long long key_slot(const AttnArgs& a, const int* table, long long j) {
#if ATT_PAGED
    return (long long)table[j / MLA_PAGE] * MLA_PAGE + j % MLA_PAGE;
#else
    return j;
#endif
}

// The CTA's key range: split `s` of vLLM's partition (ceil(n/S) keys per split), cut at the last key
// any of its rows may see.
__device__ __forceinline__ void att_key_range(const AttnArgs& a, int n_keys, int tile, int* lo, int* hi) {
    const int per = (n_keys + a.num_splits - 1) / a.num_splits;
    const int s = att_split();
    int k0 = min(s * per, n_keys), k1 = min(k0 + per, n_keys);
    k1 += att_last_split_extra(a);
    // rows are ordered by query index, so the last valid row has the largest limit
    int last = ATT_BM - 1;
    while (last > 0 && !att_row(a, tile, last, n_keys).valid) --last;
    const RowInfo rl = att_row(a, tile, last, n_keys);
    if (rl.lim < k1 - 1) k1 = max(k0, rl.lim + 1);
    *lo = k0;
    *hi = k1;
}

// Planted bug SPLIT_TAIL_DROPPED (decode only): a key range of more than one `bn`-key tile is cut to whole
// tiles, so the partial last tile of a split is never loaded or scored; a range within one tile stays whole.
__device__ __forceinline__ void att_fault_tail(int lo, int* hi, int bn) {
#if defined(MLA_FAULT_SPLIT_TAIL_DROPPED) && ATT_MQA
    if (*hi - lo > bn) *hi = lo + (*hi - lo) / bn * bn;
#endif
}

__device__ __forceinline__ void att_store(const AttnArgs& a, int b, const RowInfo& ri, int col, float v0,
                                          float v1, int two) {
    if (ATT_PARTIALS(a)) {
        float* p = a.part_out +
                   ((((long long)b * a.n_q + ri.i) * a.n_heads + ri.h) * a.num_splits + att_split()) * ATT_DV + col;
        p[0] = v0;
        if (two) p[1] = v1;
    } else {
        dt* p = a.out + b * a.out_bs + (long long)ri.i * a.out_rs + (long long)ri.h * a.out_hs + col;
        p[0] = from_f(v0);
        if (two) p[1] = from_f(v1);
    }
}

__device__ __forceinline__ void att_store_lse(const AttnArgs& a, int b, const RowInfo& ri, float lse) {
    const long long row = ((long long)b * a.n_q + ri.i) * a.n_heads + ri.h;
    if (ATT_PARTIALS(a))
        a.part_lse[row * a.num_splits + att_split()] = mla_fault_split_lse(lse);
    else
        a.lse[row] = lse;
}

// ---------------------------------------------------------------------------------------------------
// Scalar path: one warp per row, keys in tiles of 32. Any dims, any dtype (the only path for f32).
// Grid: same as the tensor-core kernel but with ATT_BM replaced by 4 rows (4 warps) per CTA.
// ---------------------------------------------------------------------------------------------------
#define SC_ROWS 4
#define SC_QC ((ATT_DQK + 31) / 32)
#define SC_VC ((ATT_DV + 31) / 32)

extern "C" __global__ void __launch_bounds__(32 * SC_ROWS) attn_scalar(const AttnArgs a) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, b = blockIdx.z;
    const int n_keys = a.seq_lens ? a.seq_lens[b] : a.n_keys;
#if ATT_MQA
    const int tile = blockIdx.y;
    const int gr = tile * SC_ROWS + w;
    RowInfo ri;
    ri.i = gr / a.n_heads;
    ri.h = gr % a.n_heads;
    ri.valid = gr < a.n_q * a.n_heads;
#else
    const int tile = blockIdx.x;
    RowInfo ri;
    ri.i = tile * SC_ROWS + w;
    ri.h = blockIdx.y;
    ri.valid = ri.i < a.n_q;
#endif
    if (!ri.valid) return;
    ri.lim = a.causal ? ri.i + (n_keys - a.n_q) + att_causal_extra(a) : ATT_NO_LIMIT;
    const int per = (n_keys + a.num_splits - 1) / a.num_splits;
    const int s = att_split();
    const int k0 = min(s * per, n_keys);
    int k1 = min(min(k0 + per, n_keys) + att_last_split_extra(a), max(k0, ri.lim + 1));
    att_fault_tail(k0, &k1, 32);
    const int* table = a.table ? a.table + b * a.table_bs : nullptr;

    const dt* qr = a.q + b * a.q_bs + (long long)ri.i * a.q_rs + (long long)ri.h * a.q_hs;
    float q[SC_QC];
#pragma unroll
    for (int c = 0; c < SC_QC; ++c) {
        const int d = lane + 32 * c;
        q[c] = d < ATT_DQK ? to_f(qr[d]) : 0.f;
    }
    float acc[SC_VC];
#pragma unroll
    for (int c = 0; c < SC_VC; ++c) acc[c] = 0.f;
    float m = MLA_NEG_INF, l = 0.f;

    for (int j0 = k0; j0 < k1; j0 += 32) {
        float my_s = MLA_NEG_INF;
        const int nj = min(32, k1 - j0);
        for (int jj = 0; jj < nj; ++jj) {
            const long long slot = key_slot(a, table, j0 + jj);
            const dt* ka = a.ka + b * a.ka_bs + slot * a.ka_rs + (long long)ri.h * a.ka_hs;
            const dt* kb = a.kb + b * a.kb_bs + slot * a.kb_rs;
            float part = 0.f;
#pragma unroll
            for (int c = 0; c < SC_QC; ++c) {
                const int d = lane + 32 * c;
                if (d < ATT_DA)
                    part += q[c] * to_f(ka[d]);
                else if (d < ATT_DQK)
                    part += q[c] * to_f(kb[d - ATT_DA]);
            }
            const float sc = warp_sum(part) * a.scale_log2;
            if (lane == jj) my_s = sc;
        }
        const float m_new = fmaxf(m, warp_max(my_s));
        const float m_use = m_new == MLA_NEG_INF ? 0.f : m_new;
        const float alpha = exp2f(m - m_use);
        const float p = exp2f(my_s - m_use);
        l = l * alpha + warp_sum(p);
        const float pr = round_dt(p);
#pragma unroll
        for (int c = 0; c < SC_VC; ++c) acc[c] *= alpha;
        for (int jj = 0; jj < nj; ++jj) {
            const float pj = __shfl_sync(0xffffffffu, pr, jj);
            const long long slot = key_slot(a, table, j0 + jj);
#if ATT_V_IN_K
            const dt* vr = a.ka + b * a.ka_bs + slot * a.ka_rs + (long long)ri.h * a.ka_hs;
#else
            const dt* vr = a.v + b * a.v_bs + slot * a.v_rs + (long long)ri.h * a.v_hs;
#endif
#pragma unroll
            for (int c = 0; c < SC_VC; ++c) {
                const int d = lane + 32 * c;
                if (d < ATT_DV) acc[c] += pj * to_f(vr[d]);
            }
        }
        m = m_new;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int c = 0; c < SC_VC; ++c) {
        const int d = lane + 32 * c;
        if (d < ATT_DV) att_store(a, b, ri, d, acc[c] * inv, 0.f, 0);
    }
    if (lane == 0) att_store_lse(a, b, ri, l > 0.f ? (m + log2f(l)) * MLA_LN2 : ATT_EMPTY_LSE);
}

// ---------------------------------------------------------------------------------------------------
// Tensor-core path: mma.sync m16n8k16 (bf16/fp16 in, f32 accumulate), ldmatrix from XOR-swizzled shared
// memory, cp.async multi-stage key pipeline. Compiled only for 16-bit storage and dims that are multiples
// of 8 (16-byte copies); otherwise the host uses attn_scalar.
// S phase, warp (wm, wn): S = Q·Kᵀ for rows [16wm, 16wm+16) and keys [wn·BN/WN, …).
// PV phase, warp (pm, pn) = (w % (WM/PVM), w / (WM/PVM)): O += P·V for ATT_PVM 16-row m-tiles from row
// 16·PVM·pm and value columns [pn·DVP/(WN·PVM), …). PVM = 2 feeds every V fragment to two m-tiles, which
// halves the shared-memory reads of the PV phase. Unless WN = PVM = 1 (P stays in registers), P and the
// per-row rescale factors go through shared memory.
// ---------------------------------------------------------------------------------------------------
#if MLA_DTYPE != 2 && ATT_DA % 8 == 0 && ATT_DB % 8 == 0 && ATT_DV % 8 == 0

#define ATT_NW (ATT_WM * ATT_WN)
#define ATT_NT (ATT_NW * 32)
#define ATT_DQKP ((ATT_DQK + 63) / 64 * 64)           // swizzle needs a multiple of 8 chunks per row
#define ATT_CQ (ATT_DQKP / 8)                           // 16-byte chunks per key/query row
// S phase: ATT_SMT 16-row m-tiles per warp, ATT_SWN key groups; warps past ATT_SNW skip it. 32x32 warp
// tiles (SMT 2, 4 n-tiles) read 256 B of fragments per mma instead of 384 B for 16x32.
#ifndef ATT_SMT
#define ATT_SMT 1
#endif
#ifndef ATT_SWN
#define ATT_SWN ATT_WN
#endif
#define ATT_SWM (ATT_WM / ATT_SMT)                      // S phase: warp rows
#define ATT_SNW (ATT_SWM * ATT_SWN)                     // S phase: warps taking part
#define ATT_BNW (ATT_BN / ATT_SWN)                      // keys per warp in the S phase
#define ATT_NTS (ATT_BNW / 8)                           // S n-tiles per warp
#ifndef ATT_PVM
#define ATT_PVM 1
#endif
#ifndef ATT_SUNROLL
#define ATT_SUNROLL (ATT_PVM > 1 ? 2 : 4)                // S-phase k-loop unroll (register pressure)
#endif
#define ATT_PWM (ATT_WM / ATT_PVM)                      // PV phase: warp rows
#define ATT_PWN (ATT_WN * ATT_PVM)                      // PV phase: warp columns
#define ATT_PSMEM (ATT_SWN > 1 || ATT_PVM > 1 || ATT_SMT > 1 || ATT_SNW != ATT_NW)  // P through shared memory
#define ATT_DVP ((ATT_DV + 16 * ATT_PWN - 1) / (16 * ATT_PWN) * (16 * ATT_PWN))
#define ATT_DVW (ATT_DVP / ATT_PWN)                     // value columns per PV warp
#define ATT_NTO (ATT_DVW / 8)                           // O n-tiles per m-tile of a PV warp
#if ATT_V_IN_K
#define ATT_CV ATT_CQ
#else
#define ATT_CV (((ATT_DVP + 63) / 64 * 64) / 8)
#endif
#define ATT_PS (ATT_BN + 8)                             // padded row of the P tile (elements)
#define ATT_TPR 8                                       // threads per row in tile loads (8 x 16 B = 128 B)

// Planted bug WG2_KEYS_DROPPED (decode): the upper half of the key groups of a tile (its keys BN/2..BN-1)
// masked, as Hopper's attn_wgmma masks its second warpgroup's 32 keys of 64.
#if defined(MLA_FAULT_WG2_KEYS_DROPPED) && ATT_MQA && ATT_SWN >= 2
#define ATT_FAULT_DROP(wn) ((wn) >= ATT_SWN / 2)
#else
#define ATT_FAULT_DROP(wn) 0
#endif

static_assert(ATT_BNW % 8 == 0 && ATT_BN % 16 == 0, "ATT_BN must be a multiple of 16 and of 8*ATT_WN");
static_assert(!ATT_V_IN_K || ATT_DVP <= ATT_DQKP, "value columns must lie inside the key row");
static_assert(ATT_STAGES >= 2, "ATT_STAGES >= 2");
static_assert(ATT_WM % ATT_PVM == 0, "ATT_PVM must divide ATT_WM");
static_assert(ATT_WM % ATT_SMT == 0 && ATT_SNW <= ATT_NW, "S-phase warp layout must fit the CTA");

// Shared memory layout (bytes); the host reads `attn_mma_config` instead of recomputing it.
#define ATT_SQ (ATT_BM * ATT_DQKP * 2)
#define ATT_SK (ATT_BN * ATT_DQKP * 2)
#if ATT_V_IN_K
#define ATT_SV 0
#else
#define ATT_SV (ATT_BN * ATT_CV * 8 * 2)
#endif
#define ATT_SP (ATT_PSMEM ? ATT_BM * ATT_PS * 2 : 0)
#define ATT_SRED ((ATT_SWN + 1) * ATT_BM * 4)          // row max (loop) / row sum (epilogue) per key group; rescale factors
#define ATT_SMEM (ATT_SQ + ATT_STAGES * (ATT_SK + ATT_SV) + ATT_SP + ATT_SRED)

// {dynamic shared bytes, threads per CTA, rows per CTA, keys per tile}
extern "C" __device__ const int attn_mma_config[4] = {ATT_SMEM, ATT_NT, ATT_BM, ATT_BN};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(unsigned addr, unsigned& r0, unsigned& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Element offset of (row, 16-byte chunk) in a swizzled tile whose rows hold `chunks` chunks: the chunk
// index is XORed with row % 8, so the 8 rows an ldmatrix reads fall in 8 different bank groups.
__device__ __forceinline__ int swz(int row, int chunk, int chunks) { return row * chunks * 8 + ((chunk ^ (row & 7)) << 3); }

// Load one key tile (and value tile) for keys [j0, j0+BN) ∩ [.., hi) into stage buffers; rows past `hi`
// are zero-filled (never read: a page past the sequence holds NaN poison).
__device__ __forceinline__ void att_load_kv(const AttnArgs& a, int b, int h, const int* table, int j0, int hi,
                                            dt* sk, dt* sv) {
    const int tid = threadIdx.x;
    const int rpp = ATT_NT / ATT_TPR;  // rows per pass
    for (int r = tid / ATT_TPR; r < ATT_BN; r += rpp) {
        const int j = j0 + r;
        const bool ok = j < hi;
        const long long slot = ok ? key_slot(a, table, j) : 0;
        const dt* ka = a.ka + b * a.ka_bs + slot * a.ka_rs + (long long)h * a.ka_hs;
        const dt* kb = a.kb + b * a.kb_bs + slot * a.kb_rs;
        const unsigned base = smem_u32(sk);
#pragma unroll 3
        for (int c = tid % ATT_TPR; c < ATT_CQ; c += ATT_TPR) {
            const dt* src = a.ka;
            int n = 0;
            if (ok && c < ATT_DA / 8) {
                src = ka + c * 8;
                n = 16;
            } else if (ok && c < ATT_DQK / 8) {
                src = kb + (c - ATT_DA / 8) * 8;
                n = 16;
            }
            cp_async16(base + 2 * swz(r, c, ATT_CQ), src, n);
        }
#if !ATT_V_IN_K
        const dt* vr = a.v + b * a.v_bs + slot * a.v_rs + (long long)h * a.v_hs;
        const unsigned vbase = smem_u32(sv);
        for (int c = tid % ATT_TPR; c < ATT_CV; c += ATT_TPR) {
            const bool in = ok && c < ATT_DV / 8;
            cp_async16(vbase + 2 * swz(r, c, ATT_CV), in ? (const void*)(vr + c * 8) : (const void*)a.ka, in ? 16 : 0);
        }
#endif
    }
}

extern "C" __global__ void __launch_bounds__(ATT_NT, 1) attn_mma(const AttnArgs a) {
    extern __shared__ __align__(128) unsigned char smem[];
    dt* sQ = reinterpret_cast<dt*>(smem);
    dt* sK = reinterpret_cast<dt*>(smem + ATT_SQ);
    dt* sV = reinterpret_cast<dt*>(smem + ATT_SQ + ATT_STAGES * ATT_SK);
    // sP and sAlpha are unused when P stays in registers
    [[maybe_unused]] dt* sP = reinterpret_cast<dt*>(smem + ATT_SQ + ATT_STAGES * (ATT_SK + ATT_SV));
    float* sMax = reinterpret_cast<float*>(smem + ATT_SQ + ATT_STAGES * (ATT_SK + ATT_SV) + ATT_SP);
    float* sSum = sMax;  // the epilogue's row sums reuse the loop's row-max exchange (after a barrier)
    [[maybe_unused]] float* sAlpha = sMax + ATT_SWN * ATT_BM;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % ATT_SWM, wn = warp / ATT_SWM;  // S phase (warps < ATT_SNW)
    const bool s_warp = warp < ATT_SNW;
    const int pm = warp % ATT_PWM, pn = warp / ATT_PWM;  // PV phase
    const int g = lane >> 2, t = lane & 3;
    const int b = blockIdx.z, tile = att_tile();
    const int n_keys = a.seq_lens ? a.seq_lens[b] : a.n_keys;
    const int* table = a.table ? a.table + b * a.table_bs : nullptr;
#if ATT_MQA
    const int kh = 0;  // every head reads the same key rows
#else
    const int kh = blockIdx.y;
#endif

    int lo, hi;
    att_key_range(a, n_keys, tile, &lo, &hi);
    att_fault_tail(lo, &hi, ATT_BN);
    const int n_tiles = hi > lo ? (hi - lo + ATT_BN - 1) / ATT_BN : 0;

    // Q tile (rows past the end are zero).
    {
        const unsigned base = smem_u32(sQ);
        for (int r = tid / ATT_TPR; r < ATT_BM; r += ATT_NT / ATT_TPR) {
            const RowInfo ri = att_row(a, tile, r, n_keys);
            const dt* qr = a.q + b * a.q_bs + (long long)ri.i * a.q_rs + (long long)ri.h * a.q_hs;
            for (int c = tid % ATT_TPR; c < ATT_CQ; c += ATT_TPR) {
                const bool in = ri.valid && c < ATT_DQK / 8;
                cp_async16(base + 2 * swz(r, c, ATT_CQ), in ? (const void*)(qr + c * 8) : (const void*)a.q, in ? 16 : 0);
            }
        }
    }
#pragma unroll
    for (int s = 0; s < ATT_STAGES - 1; ++s) {
        if (s < n_tiles) att_load_kv(a, b, kh, table, lo + s * ATT_BN, hi, sK + s * (ATT_SK / 2), sV + s * (ATT_SV / 2));
        cp_async_commit();
    }

    // S-phase rows of this thread: (m-tile mt, half e) -> row (wm*SMT + mt)*16 + g + 8e.
    int lim[ATT_SMT][2];
    float m[ATT_SMT][2], l[ATT_SMT][2];
#pragma unroll
    for (int mt = 0; mt < ATT_SMT; ++mt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            lim[mt][e] = att_row(a, tile, (wm * ATT_SMT + mt) * 16 + g + 8 * e, n_keys).lim;
            m[mt][e] = MLA_NEG_INF;
            l[mt][e] = 0.f;
        }
    float o[ATT_PVM][ATT_NTO][4];
#pragma unroll
    for (int mt = 0; mt < ATT_PVM; ++mt)
#pragma unroll
        for (int n = 0; n < ATT_NTO; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;

    const unsigned sQa = smem_u32(sQ);
    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<ATT_STAGES - 2>();
        __syncthreads();
        {
            const int nx = it + ATT_STAGES - 1;
            if (nx < n_tiles) {
                const int st = nx % ATT_STAGES;
                att_load_kv(a, b, kh, table, lo + nx * ATT_BN, hi, sK + st * (ATT_SK / 2), sV + st * (ATT_SV / 2));
            }
            cp_async_commit();
        }
        const int st = it % ATT_STAGES;
        const unsigned sKa = smem_u32(sK + st * (ATT_SK / 2));
        const int j0 = lo + it * ATT_BN;

        // S = Q Kᵀ for this warp's SMT·16 rows x ATT_BNW keys.
        float s[ATT_SMT][ATT_NTS][4];
#pragma unroll
        for (int mt = 0; mt < ATT_SMT; ++mt)
#pragma unroll
            for (int n = 0; n < ATT_NTS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
        if (s_warp) {
#pragma unroll ATT_SUNROLL
            for (int kk = 0; kk < ATT_DQKP / 16; ++kk) {
                unsigned qa[ATT_SMT][4];
#pragma unroll
                for (int mt = 0; mt < ATT_SMT; ++mt) {
                    const int row = (wm * ATT_SMT + mt) * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
                    ldsm_x4(sQa + 2 * swz(row, kk * 2 + (lane >> 4), ATT_CQ), qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3]);
                }
#pragma unroll
                for (int np = 0; np < ATT_NTS / 2; ++np) {
                    const int key = wn * ATT_BNW + np * 16 + (lane & 7) + 8 * (lane >> 4);
                    unsigned b0, b1, b2, b3;
                    ldsm_x4(sKa + 2 * swz(key, kk * 2 + ((lane >> 3) & 1), ATT_CQ), b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < ATT_SMT; ++mt) {
                        mma16816(s[mt][2 * np], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b0, b1);
                        mma16816(s[mt][2 * np + 1], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b2, b3);
                    }
                }
#if ATT_NTS % 2
                {
                    const int key = wn * ATT_BNW + (ATT_NTS - 1) * 8 + (lane & 7);
                    unsigned b0, b1;
                    ldsm_x2(sKa + 2 * swz(key, kk * 2 + ((lane >> 3) & 1), ATT_CQ), b0, b1);
#pragma unroll
                    for (int mt = 0; mt < ATT_SMT; ++mt)
                        mma16816(s[mt][ATT_NTS - 1], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b0, b1);
                }
#endif
            }
        }

        // Scale, mask, tile row max (per S-phase row: m-tile mt, half e).
        float tm[ATT_SMT][2];
#pragma unroll
        for (int mt = 0; mt < ATT_SMT; ++mt) {
            tm[mt][0] = tm[mt][1] = MLA_NEG_INF;
#pragma unroll
            for (int n = 0; n < ATT_NTS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = j0 + wn * ATT_BNW + n * 8 + 2 * t + (e & 1);
                    float v = s[mt][n][e] * a.scale_log2;
                    if (key >= hi || key > lim[mt][e >> 1] || ATT_FAULT_DROP(wn)) v = MLA_NEG_INF;
                    s[mt][n][e] = v;
                    tm[mt][e >> 1] = fmaxf(tm[mt][e >> 1], v);
                }
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                tm[mt][e] = fmaxf(tm[mt][e], __shfl_xor_sync(0xffffffffu, tm[mt][e], 1));
                tm[mt][e] = fmaxf(tm[mt][e], __shfl_xor_sync(0xffffffffu, tm[mt][e], 2));
            }
        }
#if ATT_SWN > 1
        if (s_warp && t == 0) {
#pragma unroll
            for (int mt = 0; mt < ATT_SMT; ++mt) {
                sMax[wn * ATT_BM + (wm * ATT_SMT + mt) * 16 + g] = tm[mt][0];
                sMax[wn * ATT_BM + (wm * ATT_SMT + mt) * 16 + g + 8] = tm[mt][1];
            }
        }
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < ATT_SMT; ++mt)
#pragma unroll
            for (int w = 0; w < ATT_SWN; ++w) {
                tm[mt][0] = fmaxf(tm[mt][0], sMax[w * ATT_BM + (wm * ATT_SMT + mt) * 16 + g]);
                tm[mt][1] = fmaxf(tm[mt][1], sMax[w * ATT_BM + (wm * ATT_SMT + mt) * 16 + g + 8]);
            }
#endif
        float al[ATT_SMT][2];
#pragma unroll
        for (int mt = 0; mt < ATT_SMT; ++mt) {
            float mu[2], rs[2] = {0.f, 0.f};
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float mn = fmaxf(m[mt][e], tm[mt][e]);
                mu[e] = mn == MLA_NEG_INF ? 0.f : mn;
                al[mt][e] = exp2f(m[mt][e] - mu[e]);
                m[mt][e] = mn;
            }
#pragma unroll
            for (int n = 0; n < ATT_NTS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[mt][n][e] = exp2f(s[mt][n][e] - mu[e >> 1]);
                    rs[e >> 1] += s[mt][n][e];
                }
            // per-thread partial; reduced over the quad and the key-group warps at the end
            l[mt][0] = l[mt][0] * al[mt][0] + rs[0];
            l[mt][1] = l[mt][1] * al[mt][1] + rs[1];
        }
#if !ATT_PSMEM
        // PV warp rows = S warp rows: rescale with this thread's own factors.
#pragma unroll
        for (int n = 0; n < ATT_NTO; ++n) {
            o[0][n][0] *= al[0][0];
            o[0][n][1] *= al[0][0];
            o[0][n][2] *= al[0][1];
            o[0][n][3] *= al[0][1];
        }
#else
        if (s_warp) {
#pragma unroll
            for (int mt = 0; mt < ATT_SMT; ++mt) {
                const int row = (wm * ATT_SMT + mt) * 16 + g;
                if (wn == 0 && t == 0) {
                    sAlpha[row] = al[mt][0];
                    sAlpha[row + 8] = al[mt][1];
                }
                // P (rounded to the storage type) → shared, so every warp can multiply all keys of the tile.
#pragma unroll
                for (int n = 0; n < ATT_NTS; ++n) {
                    const int col = wn * ATT_BNW + n * 8 + 2 * t;
                    *reinterpret_cast<unsigned*>(sP + row * ATT_PS + col) = pack2(s[mt][n][0], s[mt][n][1]);
                    *reinterpret_cast<unsigned*>(sP + (row + 8) * ATT_PS + col) = pack2(s[mt][n][2], s[mt][n][3]);
                }
            }
        }
        __syncthreads();
        const unsigned sPa = smem_u32(sP);
#endif
#if ATT_PSMEM
#pragma unroll
        for (int mt = 0; mt < ATT_PVM; ++mt) {
            const float f0 = sAlpha[(pm * ATT_PVM + mt) * 16 + g], f1 = sAlpha[(pm * ATT_PVM + mt) * 16 + g + 8];
#pragma unroll
            for (int n = 0; n < ATT_NTO; ++n) {
                o[mt][n][0] *= f0;
                o[mt][n][1] *= f0;
                o[mt][n][2] *= f1;
                o[mt][n][3] *= f1;
            }
        }
#endif
#if ATT_V_IN_K
        const unsigned sVa = sKa;
#else
        const unsigned sVa = smem_u32(sV + st * (ATT_SV / 2));
#endif
        // O += P V over the tile's keys, this PV warp's rows and value columns.
#pragma unroll
        for (int kk = 0; kk < ATT_BN / 16; ++kk) {
            unsigned pa[ATT_PVM][4];
#if ATT_PSMEM
#pragma unroll
            for (int mt = 0; mt < ATT_PVM; ++mt) {
                const int row = (pm * ATT_PVM + mt) * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
                ldsm_x4(sPa + 2 * (row * ATT_PS + kk * 16 + 8 * (lane >> 4)), pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3]);
            }
#else
            // The S accumulator layout of two adjacent n-tiles is the A operand layout of one k-step.
            pa[0][0] = pack2(s[0][2 * kk][0], s[0][2 * kk][1]);
            pa[0][1] = pack2(s[0][2 * kk][2], s[0][2 * kk][3]);
            pa[0][2] = pack2(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
            pa[0][3] = pack2(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
#endif
#pragma unroll
            for (int np = 0; np < ATT_NTO / 2; ++np) {
                const int key = kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
                const int chunk = (pn * ATT_DVW + np * 16) / 8 + (lane >> 4);
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(sVa + 2 * swz(key, chunk, ATT_CV), b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < ATT_PVM; ++mt) {
                    mma16816(o[mt][2 * np], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b0, b1);
                    mma16816(o[mt][2 * np + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b2, b3);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Row sums: over the quad, then over the key-group warps that share the rows (through shared
    // memory, which also hands them to the PV warps, whose rows may differ).
#pragma unroll
    for (int mt = 0; mt < ATT_SMT; ++mt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            l[mt][e] += __shfl_xor_sync(0xffffffffu, l[mt][e], 1);
            l[mt][e] += __shfl_xor_sync(0xffffffffu, l[mt][e], 2);
        }
    __syncthreads();
    if (s_warp && t == 0) {
#pragma unroll
        for (int mt = 0; mt < ATT_SMT; ++mt) {
            sSum[wn * ATT_BM + (wm * ATT_SMT + mt) * 16 + g] = l[mt][0];
            sSum[wn * ATT_BM + (wm * ATT_SMT + mt) * 16 + g + 8] = l[mt][1];
        }
    }
    __syncthreads();
    auto row_sum = [&](int row) {
        float x = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_SWN; ++w) x += sSum[w * ATT_BM + row];
        return x;
    };
    if (s_warp && wn == 0 && t == 0) {
#pragma unroll
        for (int mt = 0; mt < ATT_SMT; ++mt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int row = (wm * ATT_SMT + mt) * 16 + g + 8 * e;
                const RowInfo ri = att_row(a, tile, row, n_keys);
                const float L = row_sum(row);
                if (ri.valid) att_store_lse(a, b, ri, L > 0.f ? (m[mt][e] + log2f(L)) * MLA_LN2 : ATT_EMPTY_LSE);
            }
    }
#pragma unroll
    for (int mt = 0; mt < ATT_PVM; ++mt) {
        const int row = (pm * ATT_PVM + mt) * 16 + g;
        const RowInfo p0 = att_row(a, tile, row, n_keys), p1 = att_row(a, tile, row + 8, n_keys);
        const float L0 = row_sum(row), L1 = row_sum(row + 8);
        const float inv0 = L0 > 0.f ? 1.f / L0 : 0.f, inv1 = L1 > 0.f ? 1.f / L1 : 0.f;
#pragma unroll
        for (int n = 0; n < ATT_NTO; ++n) {
            const int col = pn * ATT_DVW + n * 8 + 2 * t;
            if (col < ATT_DV) {
                if (p0.valid) att_store(a, b, p0, col, o[mt][n][0] * inv0, o[mt][n][1] * inv0, 1);
                if (p1.valid) att_store(a, b, p1, col, o[mt][n][2] * inv1, o[mt][n][3] * inv1, 1);
            }
        }
    }
}
#endif  // tensor-core path
