// v4/compress.cu — DeepSeek-V4's compressors (docs/deepseek-v4.md, step 6): each entry closed in a forward
// pass pooled from the stored projections of its window's tokens, RMS-normed and roped, in one CTA.
//
//   C_w = round(rope(round(RMSNorm(Σ_j softmax_j(Z_j + ape_j) ⊙ K_j) · norm)))   at position w·m
//
// kv and gate [token][coff·d] hold round(attn_in·W_kvᵀ) and round(attn_in·W_gateᵀ) of every token fed so
// far (the compressor's carried state: the tokens of the unclosed window and CSA's previous window); ape
// [m][coff·d]. Per dim an f32 softmax over the window's slots of gate + ape (CSA, coff 2: the previous
// window's tokens on the first d columns — its Ca half — then this window's on the last d — its Cb half;
// entry 0 has no Ca half; HCA, coff 1: this window's tokens), the kv pooled with it in f32 (llama.cpp's
// F32 state, as the CPU mirror), then RMSNorm with the compressor's norm and rope on the trailing rd dims
// (interleaved pairs) at the window's first position w·m, each rounded to the storage type.
//
// The windows and their tokens come from kernels/v4/v4.cuh (its planted bugs: the group shift and the
// state dropped at a forward pass boundary).
#include "common.cuh"
#include "v4/v4.cuh"

// Grid (entries w0 .. w0 + gridDim.x), block 128, dynamic shared memory d floats.
// cos_t/sin_t: the compress rope's f32 tables [position][rd/2].
extern "C" __global__ void v4_compress(const dt* kv, const dt* gate, const dt* ape, const dt* norm, dt* out,
                                       int w0, int d, int m, int csa, int pass_start, int rd,
                                       const float* cos_t, const float* sin_t, float eps) {
    extern __shared__ float row[];
    __shared__ float red[32];
    const int w = w0 + blockIdx.x;
    const int cw = csa ? 2 * d : d;  // row width of kv, gate and ape
    const int lo = v4_state_from(pass_start);
    const int a = max(v4_first(w, m), lo), b = v4_close(w, m);
    // CSA's previous window (its Ca half), empty for entry 0 or when dropped.
    const int pa = (csa && w > 0) ? max(v4_first(w - 1, m), lo) : 0;
    const int pb = (csa && w > 0) ? v4_close(w - 1, m) : -1;
    const int half = csa ? d : 0;
    float ss = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float mx = MLA_NEG_INF;
        for (int t = pa; t <= pb; ++t)
            mx = fmaxf(mx, to_f(gate[(long long)t * cw + c]) + to_f(ape[v4_slot(t, m) * cw + c]));
        for (int t = a; t <= b; ++t)
            mx = fmaxf(mx, to_f(gate[(long long)t * cw + half + c]) + to_f(ape[v4_slot(t, m) * cw + half + c]));
        float z = 0.f, acc = 0.f;
        for (int t = pa; t <= pb; ++t) {
            const float p = expf(to_f(gate[(long long)t * cw + c]) + to_f(ape[v4_slot(t, m) * cw + c]) - mx);
            z += p;
            acc += p * to_f(kv[(long long)t * cw + c]);
        }
        for (int t = a; t <= b; ++t) {
            const long long i = (long long)t * cw + half + c;
            const float p = expf(to_f(gate[i]) + to_f(ape[v4_slot(t, m) * cw + half + c]) - mx);
            z += p;
            acc += p * to_f(kv[i]);
        }
        const float v = acc / z;
        row[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) row[c] = round_dt(row[c] * inv * to_f(norm[c]));
    __syncthreads();
    const int hr = rd / 2, off = d - rd;
    const long long pos = (long long)w * m;
    dt* o = out + (long long)w * d;
    for (int c = threadIdx.x; c < off; c += blockDim.x) o[c] = from_f(row[c]);
    for (int i = threadIdx.x; i < hr; i += blockDim.x) {
        const float cs = cos_t[pos * hr + i], sn = sin_t[pos * hr + i];
        const float x0 = row[off + 2 * i], x1 = row[off + 2 * i + 1];
        o[off + 2 * i] = from_f(x0 * cs - x1 * sn);
        o[off + 2 * i + 1] = from_f(x0 * sn + x1 * cs);
    }
}
