// kernels/kpool.cu compiled for the host (tests/it/kpool_kernels_host.rs), CUDA emulated by kernels_host.h; the
// test writes the inputs src/backend/cuda/kpool.rs prepares, with the launch geometry it would use, and checks
// what comes back against the CPU mirror. kpool.inc is the kernel with its include and dynamic shared array
// rewritten by the test; KP_H, KP_D, KP_N and MLA_DTYPE (and any MLA_FAULT_…) come from the command line.
//
//   kpool_kernels_host VARIANT pool IN OUT     kpool_pool: writes the pooled keys [n_pools][KP_D] f32
//   kpool_kernels_host VARIANT select IN OUT   kpool_scores then kpool_topk on IN's q and pooled keys: writes
//                                              the scores [T][n_pools] f32, then the rows [T][width] i32
// VARIANT: clean, or the kernel fault compiled into that copy (no_ape, softmax_channels, no_tail).
// IN: 16 i32: T, n_pools, origin, budget, tail, width, then the launches as kpool.rs's `Geometry` has them
// (kpool_pool's grid x and block; kpool_scores' grid x, grid y and block; kpool_topk's grid x and block), 3
// unused; then f32 arrays q [T][KP_H][KP_D], k [T][KP_D], g [T][KP_D], ape [KP_N][KP_D], w [T][KP_H] and
// pooled [n_pools][KP_D] (what select scores; ignored by pool).
#include <string>
#include "kernels_host.h"
// One copy of the kernels per variant: clean, then each kernel fault defined before its copy.
namespace clean {
#include "kpool.inc"
}
#define MLA_FAULT_KPOOL_NO_APE 1
namespace no_ape {
#include "kpool.inc"
}
#undef MLA_FAULT_KPOOL_NO_APE
#define MLA_FAULT_KPOOL_SOFTMAX_CHANNELS 1
namespace softmax_channels {
#include "kpool.inc"
}
#undef MLA_FAULT_KPOOL_SOFTMAX_CHANNELS
#define MLA_FAULT_KPOOL_NO_TAIL 1
namespace no_tail {
#include "kpool.inc"
}
#undef MLA_FAULT_KPOOL_NO_TAIL

struct Kernels {
    decltype(&clean::kpool_pool) pool;
    decltype(&clean::kpool_scores) scores;
    decltype(&clean::kpool_topk) topk;
};
#define KERNELS(ns) {#ns, {ns::kpool_pool, ns::kpool_scores, ns::kpool_topk}}
static const std::pair<const char*, Kernels> VARIANTS[] = {KERNELS(clean), KERNELS(no_ape), KERNELS(softmax_channels),
                                                           KERNELS(no_tail)};

static std::vector<float> take(FILE* f, size_t n) {
    std::vector<float> v(n);
    if (fread(v.data(), 4, n, f) != n) { fprintf(stderr, "short input\n"); exit(2); }
    return v;
}

int main(int argc, char** argv) {
    if (argc != 5) { fprintf(stderr, "usage: %s VARIANT pool|select IN OUT\n", argv[0]); return 2; }
    const Kernels* kn = nullptr;
    for (auto& v : VARIANTS) if (std::string(argv[1]) == v.first) kn = &v.second;
    if (!kn) { fprintf(stderr, "no variant %s\n", argv[1]); return 2; }
    FILE* in = fopen(argv[3], "rb");
    if (!in) { fprintf(stderr, "cannot open %s\n", argv[3]); return 2; }
    int h[16];
    if (fread(h, 4, 16, in) != 16) { fprintf(stderr, "short header\n"); return 2; }
    const int T = h[0], np = h[1], origin = h[2], budget = h[3], tail = h[4], width = h[5];
    auto q = take(in, (size_t)T * KP_H * KP_D), k = take(in, (size_t)T * KP_D), g = take(in, (size_t)T * KP_D);
    auto ape = take(in, KP_N * KP_D), w = take(in, (size_t)T * KP_H), pooled = take(in, (size_t)np * KP_D);
    fclose(in);
    FILE* out = fopen(argv[4], "wb");
    if (std::string(argv[2]) == "pool") {
        std::fill(pooled.begin(), pooled.end(), NAN);
        run(h[6], 1, h[7], [&] { kn->pool(k.data(), g.data(), ape.data(), pooled.data(), origin); });
        fwrite(pooled.data(), 4, pooled.size(), out);
    } else {
        std::vector<float> scores((size_t)T * np + 1, NAN);
        std::vector<int> rows((size_t)T * width, -7);
        if (np > 0)
            run(h[8], h[9], h[10], [&] { kn->scores(q.data(), pooled.data(), w.data(), scores.data(), np, origin); });
        run(h[11], 1, h[12], [&] { kn->topk(scores.data(), rows.data(), np, origin, budget, tail); });
        fwrite(scores.data(), 4, (size_t)T * np, out);
        fwrite(rows.data(), 4, rows.size(), out);
    }
    fclose(out);
    return 0;
}
