"""Probe (#14): where a CUDA split_out row's error comes from. Loads a `--dump-dir` layer folder and, for
given rows, compares the GPU's split partial with fp64 from its own stored inputs, and with emulations of
P's rounding (global max; the kernel's per-64-key-tile running max). Usage:
  python3 split_row.py DIR SCALE DTYPE PROMPT_LEN TOKEN:HEAD:SPLIT:K0:K1 ..."""
import sys
import numpy as np

d, scale, dt, pl = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
ld = lambda n: np.load(f"{d}/{n}.opt.npy")
qa, qpe, cache, so = ld("q_absorbed"), ld("q_pe"), ld("cache_rows"), ld("split_out")
lkv = qa.shape[-1]
if dt == "fp16":
    rnd = lambda x: x.astype(np.float16).astype(np.float64)
else:
    import torch
    rnd = lambda x: torch.tensor(x, dtype=torch.float64).to(torch.bfloat16).to(torch.float64).numpy()
for spec in sys.argv[5:]:
    tok, head, split, k0, k1 = map(int, spec.split(":"))
    di = tok - pl
    q = np.concatenate([qa[di, head], qpe[tok, head]])
    K = cache[k0:k1]
    s = (K @ q) * scale
    m = s.max()
    p = np.exp(s - m)
    l = p.sum()
    V = K[:, :lkv]
    out = p @ V / l
    gpu = so[di, head, split]
    err = gpu - out
    nrm = np.linalg.norm
    # Emulations: P rounded against the global max, and against each 64-key tile's running max.
    e_glob = rnd(p) @ V / l - out
    run_m = np.maximum.accumulate(np.array([s[i:i + 64].max() for i in range(0, len(s), 64)]))
    pt = np.concatenate([rnd(np.exp(s[i:i + 64] - run_m[i // 64])) * np.exp(run_m[i // 64] - m)
                         for i in range(0, len(s), 64)])
    e_tile = pt @ V / l - out
    c = V.mean(0)
    top = np.argsort(-p)[:5]
    print(f"row tok {tok} head {head} split {split} keys {k0}..{k1}: n {len(s)} argmax {int(np.argmax(s))} "
          f"top p {np.round(p[top], 4).tolist()} at {top.tolist()}; l {l:.3f}")
    print(f"  |err|/|out| {nrm(err) / nrm(out):.3e}; emulated global-max {nrm(e_glob) / nrm(out):.3e}, "
          f"tile-max {nrm(e_tile) / nrm(out):.3e}; |err - e_tile|/|err| {nrm(err - e_tile) / nrm(err):.3f}, "
          f"|err - e_glob|/|err| {nrm(err - e_glob) / nrm(err):.3f}")
    print(f"  err along out {np.dot(err, out) / nrm(out) / nrm(err):+.3f}, along mean(V) "
          f"{np.dot(err, c) / nrm(c) / nrm(err):+.3f}; energy share of the largest 16 |err| elements "
          f"{np.sort(err ** 2)[-16:].sum() / (err ** 2).sum():.3f}")
