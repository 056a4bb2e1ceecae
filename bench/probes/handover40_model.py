#!/usr/bin/env python3
"""A toy timeline model of one attn_wgmma_pairs CTA per key pair (bench/probes/handover40.md).

Not a measurement: a way to rank orderings of the two warpgroups' steps before spending device time.
Units are SM cycles. The tensor pipe is shared by the two warpgroups (each one's MMA groups run in issue
order; when both have a group running, each goes at half speed). A TMA load lands `lat` cycles after
its issue plus its bytes at `bw` bytes per cycle, the bandwidth shared by the loads in flight. CUDA-core
steps (softmax, barriers) have fixed costs. MMA costs: 2048 bf16 MACs per cycle per SM (H100 SXM,
989 TFLOP/s at 1.83 GHz), so one m64n64k16 k-step is 32 cycles and one P·V half (4 × m64n256k16) 512.

    python3 bench/probes/handover40_model.py     # cycles per pair for the landed order and the probe
"""

KSTEP = 32  # m64n64k16
PV = 512  # P·V over 64 keys for 256 value columns
SOFTMAX = 450  # mask + max + 32 ex2 + P stores, per warpgroup
OWN = 40  # a warpgroup's own mbarrier round trip
LEFT, RIGHT = 32 * 1024, 40 * 1024  # a stage's left (blocks 0-3) and right (4-8) halves, bytes


def run(prog0, prog1, lat, bw, pairs=24):
    progs = [prog0(pairs), prog1(pairs)]
    pc, busy, mma = [0, 0], [0, 0], [[], []]
    ev = {("s0L", 0): 0, ("s0R", 0): 0, ("s1L", 0): 0, ("s1R", 0): 0}
    loads, marks, t = [], [], 0
    while True:
        for w in (0, 1):
            while pc[w] < len(progs[w]) and busy[w] <= t:
                op = progs[w][pc[w]]
                if op[0] == "cpu":
                    busy[w] = t + op[1]
                elif op[0] == "mma":
                    mma[w].append(op[1])
                elif op[0] == "waitq":  # wgmma.wait_group op[1]
                    if len(mma[w]) > op[1]:
                        break
                elif op[0] == "wait":  # an mbarrier
                    if ev.get(op[1], float("inf")) > t:
                        break
                    busy[w] = t + 20
                elif op[0] == "sig":
                    ev[op[1]] = t + 20
                elif op[0] == "load":
                    loads.append([op[1], op[2], t + lat])
                elif op[0] == "mark":
                    marks.append(t)
                pc[w] += 1
        if all(pc[w] >= len(progs[w]) for w in (0, 1)) and not mma[0] and not mma[1]:
            break
        act = [w for w in (0, 1) if mma[w]]
        for w in act:
            mma[w][0] -= 1.0 / len(act)
            if mma[w][0] <= 0:
                mma[w].pop(0)
        moving = [x for x in loads if x[2] <= t]
        for x in moving:
            x[0] -= bw / len(moving)
            if x[0] <= 0:
                ev[x[1]] = t
                loads.remove(x)
        t += 1
    return (marks[-1] - marks[4]) / (len(marks) - 5)


def wg0(n):  # warpgroup 0, both versions: S_A, softmax A, P_A·V_A(left), refill, READY_B, P_B·V_B(left), next S_A
    p = [("wait", ("s0L", 0)), ("wait", ("s0R", 0)), ("mma", 36 * KSTEP), ("waitq", 0)]
    for k in range(n):
        p += [("cpu", SOFTMAX), ("sig", ("A", k)), ("mma", PV), ("waitq", 0), ("cpu", OWN),
              ("load", LEFT, ("s0L", k + 1)), ("wait", ("B", k)), ("wait", ("s1L", k)), ("mma", PV),
              ("wait", ("s0L", k + 1)), ("mma", 16 * KSTEP), ("waitq", 1), ("cpu", OWN),
              ("load", LEFT, ("s1L", k + 1)), ("wait", ("s0R", k + 1)), ("mma", 20 * KSTEP), ("waitq", 0)]
    return p


def wg1_landed(n):  # S_B, READY_A, P_A·V_A(right) with softmax B under it, refill, READY_B, P_B·V_B(right), refill
    p = []
    for k in range(n):
        p += [("mark",), ("wait", ("s1L", k)), ("mma", 16 * KSTEP), ("wait", ("s1R", k)), ("mma", 20 * KSTEP),
              ("waitq", 0), ("wait", ("A", k)), ("wait", ("s0R", k)), ("mma", PV), ("cpu", SOFTMAX),
              ("waitq", 0), ("cpu", OWN), ("load", RIGHT, ("s0R", k + 1)), ("cpu", 60), ("sig", ("B", k)),
              ("mma", PV), ("waitq", 0), ("cpu", OWN), ("load", RIGHT, ("s1R", k + 1))]
    return p


def wg1_pafirst(n):  # the probe: READY_A, P_A·V_A(right), S_B in its wake, refill, softmax B, READY_B, ...
    p = []
    for k in range(n):
        p += [("mark",), ("wait", ("A", k)), ("wait", ("s0R", k)), ("cpu", 40), ("mma", PV),
              ("wait", ("s1L", k)), ("mma", 16 * KSTEP), ("wait", ("s1R", k)), ("mma", 20 * KSTEP),
              ("waitq", 1), ("cpu", OWN), ("load", RIGHT, ("s0R", k + 1)), ("waitq", 0), ("cpu", SOFTMAX),
              ("cpu", 60), ("sig", ("B", k)), ("mma", PV), ("waitq", 0), ("cpu", OWN),
              ("load", RIGHT, ("s1R", k + 1))]
    return p


if __name__ == "__main__":
    print("lat  bw(B/cycle)  landed  probe (WA_PAFIRST)   cycles per pair")
    for lat in (400, 800, 1200):
        for bw in (16, 18, 20, 22, 26, 32, 64):
            a = run(wg0, wg1_landed, lat, bw)
            b = run(wg0, wg1_pafirst, lat, bw)
            print(f"{lat:4d} {bw:4d}         {a:6.0f}  {b:6.0f} ({(b / a - 1) * 100:+5.1f} %)")
