// prefill.cu — decompressed-form flash attention for one prefill chunk (qk head dim P+R, v head dim Dv),
// causal over the chunk's own keys or non-causal over the cached context, and the LSE merge of the two.
//
// q [token][head][P+R] = [q_nope | rope(q_pe)]; k_nope [key][head][P] = W_UK·latent; k_pe [key][R] (the
// roped shared key, inside the [latent | k_pe] rows); v [key][head][Dv] = W_UV·latent.
#define ATT_DA MLA_P
#define ATT_DB MLA_R
#define ATT_DV MLA_DV
#define ATT_MQA 0
#define ATT_V_IN_K 0
#define ATT_PAGED 0
#include "attention.cuh"
#include "sm90/prefill/attn_wgmma.cuh"  // Hopper (sm_90a): the wgmma kernel attn_wgmma

// vLLM merge_attn_states: prefix (cached context) and suffix (the chunk itself) results, merged by LSE.
// One block per (token, head); out/lse may alias the suffix buffers.
extern "C" __global__ void merge_states(const dt* p_out, const float* p_lse, const dt* s_out, const float* s_lse,
                                        dt* out, float* lse, int n_heads) {
    const long long row = blockIdx.x;
    float pl = p_lse[row], sl = s_lse[row];
#ifndef MLA_FAULT_EMPTY_CTX_LSE_INF
    // An empty side may report +inf (FA2); it must weigh nothing. The planted bug merges it as it is.
    pl = isinf(pl) ? MLA_NEG_INF : pl;
    sl = isinf(sl) ? MLA_NEG_INF : sl;
#endif
    const float mx = fmaxf(pl, sl);
    const float pse = expf(pl - mx), sse = expf(sl - mx), ose = pse + sse;
    const float ps = pse / ose, ss = sse / ose;
    const long long base = row * MLA_DV;
    for (int c = threadIdx.x; c < MLA_DV; c += blockDim.x)
        out[base + c] = from_f(to_f(p_out[base + c]) * ps + to_f(s_out[base + c]) * ss);
    __syncthreads();
    if (threadIdx.x == 0) lse[row] = logf(ose) + mx;
}
