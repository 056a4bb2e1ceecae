// kernels/v4 compiled for the host (tests/it/v4_kernels_host.rs): DeepSeek-V4's compressor, indexer and
// attention kernels run without a GPU against a naive fp64 restatement of the CPU mirror's math (the
// storage type f32, so no rounding between stages; within 1e-4 relative), CUDA emulated by kernels_host.h.
// The .inc files are the kernels with their includes and dynamic shared arrays
// rewritten by the test. Exit 1 with "MISMATCH" on the first value off.
#include "kernels_host.h"
#include "v4.inc"
#include "attn.inc"
#include "compress.inc"
#include "indexer.inc"
static double rnd() { static unsigned long long s = 88172645463325252ull; s ^= s << 13; s ^= s >> 7; s ^= s << 17; return (double)(s >> 11) / (1ull << 53) * 2 - 1; }
static double worst = 0;
static void cmp(const char* what, double ref, double got) {
    double e = fabs(ref - got) / max(1.0, fabs(ref));
    if (!(e <= 1e-4)) { printf("MISMATCH %s: ref %g got %g\n", what, ref, got); exit(1); }
    worst = max(worst, e);
}
int main() {
    const int T = 16, W = 8, H = 2, D = V4_D, R = 16, HI = 2, DI = 32, K = 3;
    const float eps = 1e-6f, scale = 1.f / sqrtf((float)D);
    std::vector<float> cosT(T * R / 2), sinT(T * R / 2);
    for (int p = 0; p < T; ++p) for (int i = 0; i < R / 2; ++i) { double th = p * pow(10000.0, -2.0 * i / R); cosT[p * R / 2 + i] = cos(th); sinT[p * R / 2 + i] = sin(th); }
    auto fill = [](int n, double s) { std::vector<float> v(n); for (auto& x : v) x = (float)(rnd() * s); return v; };
    // Compressors: CSA main (m 4, d D) and indexer (m 4, d DI), HCA (m 8 here, d D).
    struct C { int m, d, csa; std::vector<float> kv, gate, ape, norm, out; };
    std::vector<C> cs = {{4, D, 1}, {4, DI, 1}, {8, D, 0}};
    for (auto& c : cs) {
        int cw = (c.csa ? 2 : 1) * c.d; c.kv = fill(T * cw, 1); c.gate = fill(T * cw, 2); c.ape = fill(c.m * cw, 1); c.norm = fill(c.d, 1);
        int ne = T / c.m; c.out.assign(ne * c.d, NAN);
        // passes: 0..13, 13..30, then single steps: closed_in(a..b) = (a/m)..(b/m)
        int ps[] = {0, 5, 11, 12, 13, 14, 15, 16, 16, 16, 16, 16, 16};
        for (int i = 0; i + 1 < 13; ++i) { int a = ps[i], b = ps[i + 1], w0 = a / c.m, n = b / c.m - w0;
            if (n > 0) run(n, 1, 128, [&] { v4_compress(c.kv.data(), c.gate.data(), c.ape.data(), c.norm.data(), c.out.data(), w0, c.d, c.m, c.csa, a, R, cosT.data(), sinT.data(), eps); }); }
        for (int w = 0; w < ne; ++w) { std::vector<double> v(c.d); double ss = 0;
            for (int j = 0; j < c.d; ++j) { std::vector<std::pair<double, double>> sl;
                if (c.csa && w > 0) for (int t = (w - 1) * c.m; t < w * c.m; ++t) sl.push_back({(double)c.gate[t * cw + j] + c.ape[(t % c.m) * cw + j], c.kv[t * cw + j]});
                int h = c.csa ? c.d : 0;
                for (int t = w * c.m; t < (w + 1) * c.m; ++t) sl.push_back({(double)c.gate[t * cw + h + j] + c.ape[(t % c.m) * cw + h + j], c.kv[t * cw + h + j]});
                double mx = -1e300, z = 0, a = 0; for (auto& s : sl) mx = max(mx, s.first); for (auto& s : sl) { z += exp(s.first - mx); a += exp(s.first - mx) * s.second; }
                v[j] = a / z; ss += v[j] * v[j]; }
            double r = 1 / sqrt(ss / c.d + eps); for (int j = 0; j < c.d; ++j) v[j] *= r * c.norm[j];
            int off = c.d - R, p = w * c.m; for (int i = 0; i < R / 2; ++i) { double x0 = v[off + 2 * i], x1 = v[off + 2 * i + 1], co = cosT[p * R / 2 + i], si = sinT[p * R / 2 + i]; v[off + 2 * i] = x0 * co - x1 * si; v[off + 2 * i + 1] = x0 * si + x1 * co; }
            for (int j = 0; j < c.d; ++j) cmp("compress", v[j], c.out[w * c.d + j]); }
    }
    printf("compress ok (worst %.2e)\n", worst);
    // Indexer: scores and top-k over CSA entries (cs[1]).
    int NE = T / 4; auto iq = fill(T * HI * DI, 1), iw = fill(T * HI, 1); std::vector<float> sc(T * NE, NAN); std::vector<int> tk(T * K, -7);
    run(T, (NE + 7) / 8, 256, [&] { v4_index_scores(iq.data(), iw.data(), cs[1].out.data(), sc.data(), 0, NE, 4, HI, DI); });
    run(T, 1, 32, [&] { v4_index_topk(sc.data(), tk.data(), 0, NE, 4, K); });
    for (int t = 0; t < T; ++t) { int vis = (t + 1) / 4; std::vector<std::pair<double, int>> o;
        for (int e = 0; e < NE; ++e) { if (e >= vis) { if (!std::isinf(sc[t * NE + e])) { printf("MISMATCH score past visible\n"); return 1; } continue; }
            double s = 0; for (int h = 0; h < HI; ++h) { double d = 0; for (int i = 0; i < DI; ++i) d += (double)iq[(t * HI + h) * DI + i] * cs[1].out[e * DI + i]; s += iw[t * HI + h] / sqrt((double)HI) * max(d, 0.0) / sqrt((double)DI); }
            cmp("score", s, sc[t * NE + e]); o.push_back({-sc[t * NE + e], e}); }
        std::sort(o.begin(), o.end());
        for (int r = 0; r < K; ++r) { int want = r < (int)o.size() ? o[r].second : -1; if (tk[t * K + r] != want) { printf("MISMATCH topk t %d r %d: %d vs %d\n", t, r, tk[t * K + r], want); return 1; } } }
    printf("indexer ok\n");
    // Attention: CSA (selection tk) and HCA (visible entries of cs[2], m 8), window W, sinks.
    auto q = fill(T * H * D, 1), rows = fill(T * D, 1), sinks = fill(H, 2);
    for (int kind = 0; kind < 3; ++kind) {  // 0 window, 1 CSA, 2 HCA
        std::vector<float> out(T * H * D, NAN), lse(T * H, NAN);
        const float* comp = kind == 1 ? cs[0].out.data() : kind == 2 ? cs[2].out.data() : nullptr;
        const int* sel = kind == 1 ? tk.data() : nullptr; int ksel = kind == 1 ? K : 0, m = kind == 2 ? 8 : kind == 1 ? 4 : 0;
        int t0 = 0; for (int nq : {11, 5}) { run((nq * H + 3) / 4, 1, 128, [&] { v4_attn(q.data(), rows.data(), comp, sel, ksel, sinks.data(), out.data(), lse.data(), t0, nq, H, W, m, scale); }); t0 += nq; }
        for (int t = 0; t < T; ++t) for (int h = 0; h < H; ++h) {
            std::vector<const float*> ks; for (int s = max(0, t - (W - 1)); s <= t; ++s) ks.push_back(&rows[s * D]);
            if (kind == 1) for (int j = 0; j < K; ++j) { int e = tk[t * K + j]; if (e >= 0) ks.push_back(&cs[0].out[e * D]); }
            if (kind == 2) for (int e = 0; e < (t + 1) / 8; ++e) ks.push_back(&cs[2].out[e * D]);
            std::vector<double> s; double mx = sinks[h]; for (auto k : ks) { double d = 0; for (int i = 0; i < D; ++i) d += (double)q[(t * H + h) * D + i] * k[i]; s.push_back(d * scale); mx = max(mx, s.back()); }
            double l = exp(sinks[h] - mx); std::vector<double> acc(D, 0); for (size_t j = 0; j < ks.size(); ++j) { double p = exp(s[j] - mx); l += p; for (int i = 0; i < D; ++i) acc[i] += p * ks[j][i]; }
            for (int i = 0; i < D; ++i) cmp("attn", acc[i] / l, out[(t * H + h) * D + i]);
            cmp("lse", mx + log(l), lse[t * H + h]); }
        printf("attn kind %d ok (worst %.2e)\n", kind, worst);
    }
}
