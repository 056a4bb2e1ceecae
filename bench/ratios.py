#!/usr/bin/env python3
"""One line per report for bench/gpu-check.sh: how close a run came to failing, as the ratio of each check to
what decides it (>= 1 fails), so that the three summaries the GPU calls print read a check one way.

Usage: ratios.py local REPORT    the largest stage-local ratio over every mode, layer and check, and where
       ratios.py runner REPORT   each @runner check's largest ratio over the first mode's layers: the
                                 stage-local view's where it judges the check, else the end-to-end one
       ratios.py v4 REPORT       a V4 report: verdict, the largest end-to-end ratio and where, backend, kernels
"""
import json
import sys


def end_to_end(c):
    """A check against its end-to-end tolerance: rel-L2 over its bound, and the elementwise factor where the
    check is elementwise; a non-finite mismatch is infinitely far (NaN never passes)."""
    x, t = c["metrics"], c["tolerance"]
    if x.get("nonfinite", {}).get("mismatches", 0) > 0:
        return float("inf")
    q = x["rel_l2"] / t["rel_l2"] if t["rel_l2"] > 0 else 0.0
    if c.get("elementwise"):
        q = max(q, x.get("tol_factor_needed", 0.0))
    return q


def deciding(c):
    """The ratio that decides the check: the stage-local view's where it judges it, else end to end."""
    lo = c.get("local")
    return lo["ratio"] if isinstance(lo, dict) else end_to_end(c)


def local(r):
    best = (0.0, "-")
    for m in r["modes"]:
        for l in m["layers"]:
            for c in l["checks"]:
                lo = c.get("local")
                if lo and lo["ratio"] > best[0]:
                    best = (lo["ratio"], f'layer {l["layer"]} {c["check"]}')
    return f"worst local ratio {best[0]:.3f} at {best[1]}"


def runner(r):
    worst = {}
    for m in r["modes"][:1]:
        for l in m["layers"]:
            for c in l["checks"]:
                if c["check"].endswith("@runner"):
                    worst[c["check"]] = max(worst.get(c["check"], 0.0), deciding(c))
    return "    @runner worst/tolerance: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items()))


def v4(r):
    m = r["modes"][0]
    worst = (0.0, "-")
    for l in m["layers"]:
        for c in l["checks"]:
            q = end_to_end(c)
            if q > worst[0] or worst[1] == "-":
                worst = (q, f'layer {l["layer"]} {c["check"]}')
    v = m["verdict"]
    return (f'first {v.get("first_layer")}/{v.get("first_check")}; worst {worst[0]:.3g} at {worst[1]}; '
            f'{r["environment"]["backend"]}; {r["coverage"]["kernels"][0]["label"][:40]}')


if __name__ == "__main__":
    kinds = {"local": local, "runner": runner, "v4": v4}
    if len(sys.argv) != 3 or sys.argv[1] not in kinds:
        sys.exit(__doc__)
    print(kinds[sys.argv[1]](json.load(open(sys.argv[2]))))
