"""The decode pair prototype (pair_proto.cu) on the bench's layer rows, beside the shipped default,
alternated in one process; and the launch chain probe (how long a grid of 132 blocks that waits,
reads a word and writes it takes in a graph, with PDL released early, late, or launched plainly).

    PYTHONPATH=. python raw_kernels/dev/pair_proto.py [--rows 16x8,64x8,64x32,256x32] [--rounds 2]

Each layer line: warm and flushed us of the four calls back to back in one graph (the bench's
Timer), each call alone warm, and the largest relative error against float64.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
M, SW, EARLY, E_RELEASE, S_FIRST = 8, 4, 8, 16, 32
EXPANDS = ((8, 8), (4, 8), (8, 4), (4, 4))  # (U, EW)
KB_OF_RT = {1: 4, 2: 3, 3: 2}


def module():
    from lora_cupy.kernels import source_module

    names = [f"pp::pair_shrink<__nv_bfloat16,{rt},{kb}>" for rt, kb in KB_OF_RT.items()]
    names += [f"pp::pair_expand<__nv_bfloat16,{u},{w}>" for u, w in EXPANDS] + ["pp::chain_step"]
    src = (HERE / "pair_proto.cu").read_text()
    mod = source_module(src, "pair_proto.cu", names, include_dirs=[HERE])
    return mod, names


class Pair:
    """One target's pair of launches (every argument but y and x fixed)."""

    def __init__(self, mod, launcher, a, b, scaling, offs, to, ip, T, S, flags, emul=2, u=8, ew=8):
        import torch

        from lora_cupy.backends.cupy import PackedArgs

        n, R, in_f = a.shape[1], a.shape[2], a.shape[3]
        out = b.shape[1]
        assert R == 16 and in_f % 32 == 0 and n in KB_OF_RT
        kb = KB_OF_RT[n]
        self.splits = math.ceil(in_f // 32 / (SW * kb))
        bound = (T + (M - 1) * min(S - 1, T)) // M
        W = n * 16
        self.P = torch.empty(bound * self.splits * M * W, dtype=torch.float32, device="cuda")
        self.offs = torch.as_tensor(np.array(offs, np.int32), device="cuda")
        self.keep = (a, b, scaling, to, ip)
        self.fs = mod.get_function(f"pp::pair_shrink<__nv_bfloat16,{n},{kb}>")
        self.fe = mod.get_function(f"pp::pair_expand<__nv_bfloat16,{u},{ew}>")
        self.ew = ew
        i32, i64, u64 = np.int32, np.int64, np.uint64
        self.sargs = lambda x: PackedArgs((u64(x.data_ptr()), u64(a.data_ptr()), u64(self.P.data_ptr()),
                                           u64(to.data_ptr()), u64(ip.data_ptr()), i32(S), i32(in_f),
                                           i64(n * R * in_f), i32(self.splits), i32(flags)))
        self.eargs = lambda y: PackedArgs((u64(y.data_ptr()), u64(b.data_ptr()), u64(self.P.data_ptr()),
                                           u64(scaling.data_ptr()), u64(to.data_ptr()), u64(ip.data_ptr()),
                                           u64(self.offs.data_ptr()), i32(S), i32(out), i32(n), i64(out * R),
                                           i32(self.splits), i32(flags)))
        self.sgrid = bound * self.splits
        self.egrid = max(bound, emul * 132)
        self.smem = 8 * (S + 1)
        self.launcher = launcher

    def __call__(self, y, x, parts=(True, True)):
        import torch

        stream = torch.cuda.current_stream().cuda_stream
        sa, ea = self.sargs(x), self.eargs(y)
        self._hold = (sa, ea)
        if parts[0]:
            self.launcher(int(self.fs.kernel.ptr), (self.sgrid, 1, 1), (SW * 32, 1, 1), self.smem, stream, sa.ptr)
        if parts[1]:
            self.launcher(int(self.fe.kernel.ptr), (self.egrid, 1, 1), (self.ew * 32, 1, 1), self.smem, stream, ea.ptr)


def layer_pair(mod, launcher, T, adapters, warm, flushed, seed, flags, emul, u=8, ew=8):
    import torch

    from lora_cupy.addressing import group_by_slot
    from lora_cupy.bench.kernels import LAYER_RANK, LAYER_SLOTS, LAYER_TARGETS

    gen = torch.Generator(device="cuda").manual_seed(seed)
    S, R = LAYER_SLOTS, LAYER_RANK
    slots = 1 + (np.arange(T) * adapters) // T
    order, indptr = group_by_slot(slots, S)
    to, ip = torch.as_tensor(order, device="cuda"), torch.as_tensor(indptr, device="cuda")
    calls, errs = [], {}
    for name, in_f, sl in LAYER_TARGETS:
        n, out = len(sl), sum(sl)
        offs = [0, *np.cumsum(sl).tolist()]
        a = (torch.randn(S, n, R, in_f, device="cuda", generator=gen) / math.sqrt(in_f)).bfloat16()
        b = (torch.randn(S, out, R, device="cuda", generator=gen) / math.sqrt(8)).bfloat16()
        scaling = torch.full((S, n), 2.0, dtype=torch.float32, device="cuda")
        scaling[0], a[0], b[0] = 0.0, 0, 0
        x = torch.randn(T, in_f, device="cuda", generator=gen).bfloat16()
        y0 = (torch.randn(T, out, device="cuda", generator=gen) * 0.1).bfloat16()
        y = y0.clone()
        p = Pair(mod, launcher, a, b, scaling, offs, to, ip, T, S, flags, emul, u, ew)
        p(y, x)
        torch.cuda.synchronize()
        ref = y0.double()
        for s in range(1, adapters + 1):
            rows = torch.as_tensor(order[indptr[s]:indptr[s + 1]].astype(np.int64), device="cuda")
            for j in range(n):
                v = x[rows].double() @ a[s, j].double().T
                ref[rows, offs[j]:offs[j + 1]] += 2.0 * (v @ b[s, offs[j]:offs[j + 1]].double().T)
        errs[name] = float(torch.linalg.norm(y.double() - ref) / torch.linalg.norm(ref))
        calls.append((name, lambda p=p, y=y, x=x: p(y, x)))

    def layer():
        for _, c in calls:
            c()

    alone = {nm: warm(c) for nm, c in calls}
    for nm, c in calls:  # the shrink alone, the expand alone (each repeated)
        alone[nm + " s"] = warm(lambda c=c: c.__defaults__[0](c.__defaults__[1], c.__defaults__[2], (True, False)))
        alone[nm + " e"] = warm(lambda c=c: c.__defaults__[0](c.__defaults__[1], c.__defaults__[2], (False, True)))
    return {"warm_us": warm(layer), "flushed_us": flushed(layer), "calls_warm_us": alone, "err": max(errs.values())}


def chain(mod, launcher, warm, release, pdl, n=20):
    import cupy
    import torch

    from lora_cupy.backends.cupy import PackedArgs

    f = mod.get_function("pp::chain_step")
    bufs = [torch.zeros(132, dtype=torch.int32, device="cuda") for _ in range(n + 1)]
    args = [PackedArgs((np.uint64(bufs[i].data_ptr()), np.uint64(bufs[i + 1].data_ptr()), np.int32(release)))
            for i in range(n)]

    def run():
        stream = torch.cuda.current_stream().cuda_stream
        for a in args:
            if pdl:
                launcher(int(f.kernel.ptr), (132, 1, 1), (128, 1, 1), 0, stream, a.ptr)
            else:
                cupy.cuda.driver.launchKernel(int(f.kernel.ptr), 132, 1, 1, 128, 1, 1, 0, stream, a.ptr, 0)

    return warm(run) / n


def main() -> None:
    from lora_cupy.backends.launch_ex import PdlLauncher
    from lora_cupy.bench.kernels import Timer, run_layer

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16x8,64x8,64x32,256x32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--chain", action="store_true", help="the launch chain probe first")
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    mod, _ = module()
    launcher = PdlLauncher()
    if args.chain:
        for name, release, pdl in (("plain", 0, False), ("pdl, no release", 0, True),
                                   ("pdl, release after wait", 1, True), ("pdl, release first", 2, True)):
            print(f"chain {name:26s} {chain(mod, launcher, warm, release, pdl):6.2f} us a grid", flush=True)
    rel = EARLY | E_RELEASE
    variants = [("u4 e2 sf", rel | S_FIRST, 2, 4, 8), ("u4 e3 sf", rel | S_FIRST, 3, 4, 8)]
    rows = [tuple(int(v) for v in r.split("x")) for r in args.rows.split(",")]
    print(f"{'row':7s} {'variant':10s} {'warm':>6s} {'flushed':>7s}  calls warm (qkv o gate_up down; pair: then each's shrink, expand alone)  err")
    for _ in range(args.rounds):
        for T, adapters in rows:
            r = run_layer(T, adapters, warm, flushed, 1000)
            calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
            print(f"{T:3d}x{adapters:<3d} {'default':10s} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  "
                  f"{max(r['err'].values()):.1e}", flush=True)
            for name, flags, emul, u, ew in variants:
                r = layer_pair(mod, launcher, T, adapters, warm, flushed, 1000, flags, emul, u, ew)
                calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
                print(f"{T:3d}x{adapters:<3d} {name:10s} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  "
                      f"{r['err']:.1e}", flush=True)


if __name__ == "__main__":
    main()
