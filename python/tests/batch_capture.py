"""Write a batched capture through mla_diff.capture from two single-request captures `mla-diff run
--write-capture` wrote on the same schedule: request 0 from A, request 1 from B, left-padded batch
rows (NaN in every padding row: a reader that reads one fails), the decode-only stages tapped per
row with rows=, bf16 where the values are bf16 (exactly), f32 elsewhere.

    python batch_capture.py MODEL.gguf A B OUT
"""

import json
import os
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from mla_diff import capture


def load(cap):
    with open(os.path.join(cap, "manifest.json")) as f:
        m = json.load(f)
    files = {(e["layer"], e["step"]): load_file(os.path.join(cap, e["file"])) for e in m["layers"]}
    return m, files


def as_stored(a):
    """bf16 when that is exact (the mirror's stored stages), else the f32 values."""
    b = a.astype(ml_dtypes.bfloat16)
    return b if np.array_equal(b.astype(np.float32), a, equal_nan=True) else a


def main(model, a_dir, b_dir, out):
    ma, fa = load(a_dir)
    mb, fb = load(b_dir)
    assert [s["rows"] for s in ma["steps"]] == [s["rows"] for s in mb["steps"]], "same schedule"
    ra, rb = ma["requests"][0], mb["requests"][0]
    with capture.session(out, model_file=model, engine="batch-test", engine_version="1", dtype="bf16") as s:
        s.request(ra["tokens"], positions=ra["positions"], prefill=ra["prefill"])
        s.request(rb["tokens"], positions=rb["positions"], prefill=rb["prefill"])
        layers = sorted({l for l, _ in fa})
        for st in ma["steps"]:
            n = len(st["rows"])
            pos = [r[1] for r in st["rows"]]
            pad = 2 if st["kind"] == "prefill" else 1
            # [pad…, request 1's rows…, pad, request 0's rows…]
            rows = [None] * pad + [(1, p) for p in pos] + [None] + [(0, p) for p in pos]
            i1 = list(range(pad, pad + n))
            i0 = list(range(pad + n + 1, pad + 2 * n + 1))
            s.step(st["kind"], rows)
            for layer in layers:
                ta, tb = fa[(layer, st["step"])], fb[(layer, st["step"])]
                for name in ta:
                    a, b = ta[name], tb[name]
                    if name in ("q_absorbed", "attn_latent"):
                        # Decode-only: each request's rows tapped apart, merged by the writer.
                        capture.tap(name, as_stored(b), layer=layer, rows=i1)
                        capture.tap(name, as_stored(a), layer=layer, rows=i0)
                        continue
                    full = np.full((len(rows),) + a.shape[1:], np.nan, dtype=np.float32)
                    full[i1] = b
                    full[i0] = a
                    capture.tap(name, full if name == "x" else as_stored(full), layer=layer)


if __name__ == "__main__":
    main(*sys.argv[1:5])
