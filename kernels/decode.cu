// decode.cu — absorbed MQA over the paged latent cache with split-KV, and the LSE combine of the splits.
//
// q_full [query][head][Lkv+R] = [W_UKᵀ·q_nope | rope(q_pe)]; each cache row is [latent | k_pe]; the value
// of a key is its latent (the first Lkv columns of the same row). Split k of a step with seq_len keys
// covers keys [k·c, (k+1)·c) ∩ [0, seq_len), c = ceil(seq_len / num_splits), and writes its partial
// (out f32 [Lkv], lse f32); an empty split writes out 0, lse -inf. `combine_splits` merges them.
#define ATT_DA (MLA_LKV + MLA_R)
#define ATT_DB 0
#define ATT_DV MLA_LKV
#define ATT_MQA 1
#define ATT_V_IN_K 1
#define ATT_PAGED 1
#include "attention.cuh"
#include "sm90/decode/attn_wgmma.cuh"  // Hopper (sm_90a): the wgmma kernel attn_wgmma
#include "sm90/decode/attn_small.cuh"  // Hopper: attn_small, few heads, key tiles by TMA into a ring

// Planted bugs in the combine (src/faults.rs): the natural-log split LSEs merged as base 2; the last split
// dropped. Neither changes the partials, only what is merged from them.
#ifdef MLA_FAULT_LSE_LOG2_MERGE
#define COMBINE_EXP exp2f
#define COMBINE_LOG log2f
#else
#define COMBINE_EXP expf
#define COMBINE_LOG logf
#endif
#ifdef MLA_FAULT_SPLIT_DROP_LAST
#define COMBINE_USED(num_splits) ((num_splits) - 1)
#else
#define COMBINE_USED(num_splits) (num_splits)
#endif

// One block per (batch, query, head) row: out = Σ_k w_k·out_k / Σ_k w_k with w_k = exp(lse_k - max),
// rounded to the storage type; lse = max + ln Σ w_k. Splits with lse = -inf get weight 0.
extern "C" __global__ void combine_splits(const float* part_out, const float* part_lse, dt* out, long long out_rs,
                                          long long out_hs, float* lse, int n_heads, int num_splits) {
    const long long row = blockIdx.x;  // (b * n_q + i) * n_heads + h, with b folded into i for the layout
    const int h = (int)(row % n_heads);
    const long long i = row / n_heads;
    const float* pl = part_lse + row * num_splits;
    const int used = COMBINE_USED(num_splits);
    float mx = MLA_NEG_INF;
    for (int k = 0; k < used; ++k) mx = fmaxf(mx, pl[k]);
    float wsum = 0.f;
    for (int k = 0; k < used; ++k) wsum += pl[k] == MLA_NEG_INF ? 0.f : COMBINE_EXP(pl[k] - mx);
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    dt* o = out + i * out_rs + (long long)h * out_hs;
    for (int c = threadIdx.x; c < MLA_LKV; c += blockDim.x) {
        float acc = 0.f;
        for (int k = 0; k < used; ++k) {
            if (pl[k] == MLA_NEG_INF) continue;
            acc += COMBINE_EXP(pl[k] - mx) * part_out[(row * num_splits + k) * MLA_LKV + c];
        }
        o[c] = from_f(acc * inv);
    }
    if (threadIdx.x == 0) lse[row] = wsum > 0.f ? mx + COMBINE_LOG(wsum) : MLA_NEG_INF;
}
