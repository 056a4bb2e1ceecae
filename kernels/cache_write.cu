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

// ---- quantized cache formats (run --kv-cache-dtype; src/kv_format/, docs/cache-formats.md) ----------
//
// MLA_KV_FORMAT (defined only for this module, only when the run stores a quantized cache):
//   1 = fp8              the row's width in e4m3 (rope included), one f32 scale per layer (`ts`)
//   2 = fp8_ds_mla       656 B: 512 e4m3 latent (4 tiles of 128, one f32 scale each) + 64 bf16 rope
//   3 = fp8_ds_mla_nope  656 B: as 2, the 128 tail bytes reserved (written 0), no rope
//   4 = fp8_v41          528 B: 512 e4m3 (rope included, 16 groups of 32) + 16 ue8m0 scales
//   5 = fp4_v41          288 B: 512 e2m1 (two per byte, column 2k low nibble) + 32 e4m3 scales (per 16)
// The per-tensor `fp8`'s scale is calibrated on every row of the layer (the host's pass over the dtype's
// cache, src/backend/cuda/trace.rs), so it comes in as the argument `ts`; the other formats ignore it.
//
// Design: the cache's bytes live in `kv` ([pool slots, KV_BYTES]); the paged pool the attention kernels
// read (`pool`, the run's dtype) is a staging copy of what a reader dequantizes from those bytes, written
// when the row is written (the bytes never change afterwards, so this is what dequantizing on every
// load would read). Every dequantized value is q·s with s a power of two (ds_mla, v41) or an e4m3 value
// times an e2m1 value (fp4): at most 6 significant bits, exact in bf16, fp16 and f32, so the staging
// copy holds exactly the f32 values src/kv_format/codec.rs `Codec::decode` gives, and every attention kernel
// (decode, the prefill context pass, sparse_attn, the aimed batches) reads the format unchanged. The
// per-tensor `fp8`'s q·s (an arbitrary f32 scale) is not exact in bf16 or fp16: its staging copy holds it
// rounded to the run's dtype, as vLLM's Triton decode reads its fp8 cache ((k·k_scale).to(q.dtype)); the
// judge bounds `cache_rows` by the format's rounding plus that one (src/compare/local/cache.rs).
//
// The arithmetic is src/kv_format/codec.rs's, operation for operation: x / s and q · s as IEEE f32 (__fdiv_rn,
// __fmul_rn: no contraction, no fast division), e4m3 round to nearest even saturating at 448.
#if defined(MLA_KV_FORMAT) && MLA_KV_FORMAT > 0

#if MLA_KV_FORMAT == 1
#define KV_BYTES MLA_ROW
#define KV_GROUP MLA_ROW
#define KV_QUANT MLA_ROW
#elif MLA_KV_FORMAT == 2 || MLA_KV_FORMAT == 3
#define KV_BYTES 656
#define KV_GROUP 128
#define KV_QUANT MLA_LKV  // quantized columns: the latent; the rope stays bf16 at byte 528
#elif MLA_KV_FORMAT == 4
#define KV_BYTES 528
#define KV_GROUP 32
#define KV_QUANT MLA_ROW
#elif MLA_KV_FORMAT == 5
#define KV_BYTES 288
#define KV_GROUP 16
#define KV_QUANT MLA_ROW
#else
#error "MLA_KV_FORMAT must be 1..5"
#endif
#define KV_NGROUPS (KV_QUANT / KV_GROUP)
#if KV_QUANT % KV_GROUP != 0 || (MLA_KV_FORMAT >= 4 && KV_QUANT != 512)
#error "the model's row does not fit MLA_KV_FORMAT (src/kv_format/mod.rs KvFormat::fits)"
#endif

// e4m3fn code of y: nearest, ties to even, beyond ±448 saturating to ±448 (__NV_SATFINITE), NaN → 0x7f
// with y's sign. As the `float8` crate's conversion (cuda_fp8.hpp's).
__device__ __forceinline__ unsigned char e4m3_bits(float y) {
    const unsigned u = __float_as_uint(y);
    const unsigned sign = (u >> 24) & 0x80u;
    const float a = fabsf(y);
    if (a != a) return (unsigned char)(sign | 0x7fu);
    if (a >= 448.f) return (unsigned char)(sign | 0x7eu);
    if (a < 0.015625f) {
        // Below 2^-6 the codes are m·2^-9, m = 0..7 (m = 8 is 2^-6, code 0x08: the same bits). a·512 is
        // exact (a power of two); __float2int_rn rounds to nearest even.
        return (unsigned char)(sign | (unsigned)__float2int_rn(a * 512.f));
    }
    const unsigned b = __float_as_uint(a);
    unsigned e = (b >> 23) - 127u + 7u;  // e4m3's biased exponent, 1..15
    unsigned q = (b >> 20) & 7u;        // the top 3 mantissa bits
    const unsigned rem = b & 0xfffffu;  // the 20 bits dropped
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ++q;
    if (q == 8u) {
        q = 0u;
        ++e;
    }
    unsigned code = (e << 3) | q;
    if (code > 0x7eu) code = 0x7eu;
    return (unsigned char)(sign | code);
}

__device__ __forceinline__ float e4m3_value(unsigned char c) {
    const unsigned e = (c >> 3) & 0xfu, m = c & 7u;
    float v;
    if ((c & 0x7fu) == 0x7fu) v = __uint_as_float(0x7fc00000u);
    else if (e == 0u) v = (float)m * 0.001953125f;  // m·2^-9
    else v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -v : v;
}

// e2m1 magnitudes by code (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float e2m1_mag(unsigned c) {
    switch (c & 7u) {
    case 0: return 0.f;
    case 1: return 0.5f;
    case 2: return 1.f;
    case 3: return 1.5f;
    case 4: return 2.f;
    case 5: return 3.f;
    case 6: return 4.f;
    default: return 6.f;
    }
}
__device__ __forceinline__ float e2m1_value(unsigned c) { return (c & 8u) ? -e2m1_mag(c) : e2m1_mag(c); }
// Nearest magnitude, ties to the even code, saturating at ±6; NaN → 0 (e2m1 has none). As src/kv_format/e4m3.rs.
__device__ __forceinline__ unsigned e2m1_bits(float y) {
    const float a = fabsf(y);
    if (a != a) return 0u;
    unsigned best = 0u;
    for (unsigned c = 1u; c < 8u; ++c) {
        const float d = fabsf(e2m1_mag(c) - a), db = fabsf(e2m1_mag(best) - a);
        if (d < db || (d == db && (c & 1u) == 0u)) best = c;
    }
    return best | ((__float_as_uint(y) >> 31) ? 8u : 0u);
}

// 2^ceil(log2 s) for s > 0 normal: an exact power of two is its own ceiling.
__device__ __forceinline__ float pow2_ceil(float s) {
    const unsigned b = __float_as_uint(s);
    int e = (int)((b >> 23) & 0xffu) - 127;
    if (b & 0x7fffffu) ++e;
    return __uint_as_float((unsigned)(e + 127) << 23);
}

// A group's scale from its amax, the format's rule (src/kv_format/codec.rs `Codec::scales`).
__device__ __forceinline__ float kv_group_scale(float amax) {
#if MLA_KV_FORMAT == 5
    // NVFP4-style: amax / 6 stored in e4m3 (nearest).
    return e4m3_value(e4m3_bits(__fdiv_rn(amax, 6.f)));
#else
    // FlashMLA tests/quant.py: max(amax / 448, 1e-4) rounded up to a power of two (ue8m0 for V4.1).
    return pow2_ceil(fmaxf(__fdiv_rn(amax, 448.f), 1e-4f));
#endif
}

// Clamp keeping NaN (Rust's f32::clamp); the writer's saturation bound.
__device__ __forceinline__ float kv_clamp(float y, float m) { return y < -m ? -m : (y > m ? m : y); }
#ifdef MLA_FAULT_KV_SATURATE_240
// Planted bug: the writer saturates at e4m3fnuz's 240 (AMD's fp8) instead of e4m3fn's 448.
#define KV_SAT 240.f
#else
#define KV_SAT 448.f
#endif
__device__ __forceinline__ unsigned char kv_fp8(float x, float s) { return e4m3_bits(kv_clamp(__fdiv_rn(x, s), KV_SAT)); }

// bf16 bits of v, round to nearest even on the f32 bits (the `half` crate's conversion); NaN stays a
// quiet NaN. By hand: cuda_bf16.h is included only in bf16 modules.
__device__ __forceinline__ unsigned kv_bf16_bits(float v) {
    const unsigned u = __float_as_uint(v);
    if (v != v) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// The reader: group g's scale from a row's bytes (`fp8`: the layer's, `ts`).
__device__ __forceinline__ float kv_scale_at(const unsigned char* B, int g, float ts) {
#if MLA_KV_FORMAT == 1
    (void)B, (void)g;
    return ts;
#elif MLA_KV_FORMAT == 2 || MLA_KV_FORMAT == 3
    const unsigned char* p = B + 512 + 4 * g;  // f32, little-endian
    return __uint_as_float((unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24));
#elif MLA_KV_FORMAT == 4
    (void)ts;
    return __uint_as_float((unsigned)B[512 + g] << 23);  // ue8m0: 2^(b - 127)
#else
    (void)ts;
    return e4m3_value(B[256 + g]);
#endif
}

// The reader: column i of a row's bytes as the f32 value a kernel computes with (src/kv_format/codec.rs
// `Codec::decode`, its reader faults at the same lines).
__device__ __forceinline__ float kv_read(const unsigned char* B, int i, float ts) {
    if (i >= KV_QUANT) {
        // fp8_ds_mla's rope: bf16 at byte 528, not quantized.
        const int k = 528 + 2 * (i - KV_QUANT);
        return __uint_as_float(((unsigned)B[k] | ((unsigned)B[k + 1] << 8)) << 16);
    }
    int g = i / KV_GROUP;
#ifdef MLA_FAULT_KV_SCALE_WRONG_GROUP
    // Planted bug: the next group's scale (an off-by-one scale index).
    g = (g + 1) % KV_NGROUPS;
#endif
    const float s = kv_scale_at(B, g, ts);
#if MLA_KV_FORMAT == 5
    const float q = e2m1_value((B[i / 2] >> (4 * (i % 2))) & 0xfu);
#else
    const float q = e4m3_value(B[i]);
#endif
#if defined(MLA_FAULT_KV_SCALE_TWICE)
    // Planted bug: the scale applied twice (q·s·s).
    return __fmul_rn(__fmul_rn(q, s), s);
#elif defined(MLA_FAULT_KV_SCALE_INVERTED)
    // Planted bug: the scale used as a divisor (q/s).
    return __fdiv_rn(q, s);
#else
    return __fmul_rn(q, s);
#endif
}

// One block per token: rows [n, MLA_ROW] for tokens t0..t0+n (as cache_write) quantized into the row's
// KV_BYTES bytes at its slot of `kv`, then read back from those bytes into the pool row the attention
// kernels read. The slot and row-order faults as in cache_write. `first_req_rows`: the launch's rows of
// its first request (blocks past it are later requests' rows, a write launch over a batch); the run's
// own launches are one request each and pass n. `ts`: the per-tensor `fp8`'s scale (unused otherwise).
extern "C" __global__ void cache_write_format(const dt* rows, dt* pool, unsigned char* kv, const int* table, int t0,
                                              int first_req_rows, float ts) {
    __shared__ float x[MLA_ROW];
    __shared__ float scale[KV_NGROUPS];
    __shared__ unsigned char b[KV_BYTES];
    const long long t = t0 + blockIdx.x;
    const dt* src = rows + (long long)blockIdx.x * MLA_ROW;
    long long slot = cache_slot(table, t);
#ifdef MLA_FAULT_PAGE_OFF_BY_ONE
    if (t > 0) slot = (long long)table[(t - 1) / MLA_PAGE] * MLA_PAGE + t % MLA_PAGE;
#endif
    for (int c = threadIdx.x; c < MLA_ROW; c += blockDim.x) {
#ifdef MLA_FAULT_CACHE_PE_FIRST
        x[(c + MLA_R) % MLA_ROW] = to_f(src[c]);
#else
        x[c] = to_f(src[c]);
#endif
    }
    for (int i = threadIdx.x; i < KV_BYTES; i += blockDim.x) b[i] = 0;
    __syncthreads();
#if MLA_KV_FORMAT == 1
    if (threadIdx.x == 0) scale[0] = ts;
#else
    // Scales: one thread per group, amax in column order (fmaxf skips NaN, as Rust's f32::max).
    for (int g = threadIdx.x; g < KV_NGROUPS; g += blockDim.x) {
        float amax = 0.f;
        for (int i = 0; i < KV_GROUP; ++i) amax = fmaxf(amax, fabsf(x[g * KV_GROUP + i]));
        scale[g] = kv_group_scale(amax);
    }
#endif
    __syncthreads();
#if MLA_KV_FORMAT == 5
    // fp4: byte k holds columns 2k (low nibble) and 2k+1 (high); a zero scale stores code 0.
    for (int k = threadIdx.x; k < MLA_ROW / 2; k += blockDim.x) {
        const float s = scale[(2 * k) / KV_GROUP];
        const unsigned lo = s > 0.f ? e2m1_bits(__fdiv_rn(x[2 * k], s)) : 0u;
        const unsigned hi = s > 0.f ? e2m1_bits(__fdiv_rn(x[2 * k + 1], s)) : 0u;
        b[k] = (unsigned char)(lo | (hi << 4));
    }
    for (int g = threadIdx.x; g < KV_NGROUPS; g += blockDim.x) b[256 + g] = e4m3_bits(scale[g]);
#else
    for (int i = threadIdx.x; i < KV_QUANT; i += blockDim.x) b[i] = kv_fp8(x[i], scale[i / KV_GROUP]);
#if MLA_KV_FORMAT == 4
    for (int g = threadIdx.x; g < KV_NGROUPS; g += blockDim.x) b[512 + g] = (unsigned char)(__float_as_uint(scale[g]) >> 23);
#elif MLA_KV_FORMAT == 2 || MLA_KV_FORMAT == 3
    for (int g = threadIdx.x; g < KV_NGROUPS; g += blockDim.x) {
        const unsigned u = __float_as_uint(scale[g]);
        for (int j = 0; j < 4; ++j) b[512 + 4 * g + j] = (unsigned char)(u >> (8 * j));
    }
    // The rope (fp8_ds_mla only; fp8_ds_mla_nope has none): bf16, round to nearest even.
    for (int i = threadIdx.x; i < MLA_ROW - KV_QUANT; i += blockDim.x) {
        float v = x[KV_QUANT + i];
#ifdef MLA_FAULT_KV_ROPE_QUANTIZED
        // Planted bug: the rope quantized to e4m3 with the last latent tile's scale (a tile loop run on
        // over the row's tail) before it is stored as bf16.
        const float s = scale[KV_NGROUPS - 1];
        v = __fmul_rn(e4m3_value(kv_fp8(v, s)), s);
#endif
        const unsigned h = kv_bf16_bits(v);
        b[528 + 2 * i] = (unsigned char)(h & 0xffu);
        b[529 + 2 * i] = (unsigned char)(h >> 8);
    }
#endif
#endif
    __syncthreads();
    unsigned char* B = kv + slot * KV_BYTES;
#ifdef MLA_FAULT_KV_SCALE_UNWRITTEN
    // Planted bug: the scale stores guarded as if the launch held one request: a later request's row
    // keeps its slot's unwritten scale bytes (0xff: NaN). As kv_format's `Codec::encode_in_launch`.
#if MLA_KV_FORMAT == 5
    const int s0 = 256, s1 = 288;
#else
    const int s0 = 512, s1 = 528;
#endif
    const bool keep = (int)blockIdx.x >= first_req_rows;
    for (int i = threadIdx.x; i < KV_BYTES; i += blockDim.x)
        if (!keep || i < s0 || i >= s1) B[i] = b[i];
#else
    (void)first_req_rows;
    for (int i = threadIdx.x; i < KV_BYTES; i += blockDim.x) B[i] = b[i];
#endif
    __syncthreads();  // the block's global writes visible to the block's reads below
    dt* dst = pool + slot * MLA_ROW;
    for (int c = threadIdx.x; c < MLA_ROW; c += blockDim.x) dst[c] = from_f(kv_read(B, c, ts));
}
#endif
