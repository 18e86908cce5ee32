"""A/B (outside the package): programmatic dependent launch (PDL) of the tensor-core kernels, in one
process, alternating: every kernel launched the usual way (``pdl=False``), with PDL (each waits for
the grid before it at its start), and with PDL and ``early_reads`` (lora_one at one position reads
the addressing, ranks and first B rows before its wait, as the pool's backend does).

Two parts: ``bench kernels``' layer rows (warm and flushed us, each call alone warm, the oracle
check) and a few of its core rows (flushed, graphs of 20 calls, the oracle check).

    PYTHONPATH=. python raw_kernels/dev/pdl_kernels_ab.py [--rounds 2] [--layer 1x1,64x8,64x32,256x32] [--core LABELS]
"""

from __future__ import annotations

import argparse

import torch

from lora_cupy.backends import cupy as cb
from lora_cupy.backends.base import LayerWeights
from lora_cupy.bench.kernels import Timer, build, oracle_error, rows, run_layer

CORE = ("core T1 4096->4096 r16 s1 bf16,core T16 4096->4096 r64 s1 bf16,core T64 4096->4096 r64 s1 bf16,"
        "core T64 4096->4096 r16 s8 bf16,core T1024 4096->4096 r64 s1 bf16,shapes T1 14336->4096 r16 s1 bf16,"
        "core T256 4096->4096 r16 s32 bf16,core T4096 4096->4096 r16 s1 bf16,shapes T1 4096->6144/3 r64 s1 bf16,"
        "shapes T1024 4096->6144/3 r64 s8 bf16")


VARIANTS = (("off", dict(pdl=False)), ("pdl", dict(early_reads=False)), ("early", dict(early_reads=True)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--layer", default="1x1,64x8,64x32,256x32")
    ap.add_argument("--core", default=CORE)
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    layer = [tuple(int(v) for v in r.split("x")) for r in filter(None, args.layer.split(","))]
    want = set(filter(None, args.core.split(",")))
    core = [r for r in rows() if r.label in want]
    print(f"{'row':40s} {'variant':6s} {'warm':>6s} {'flushed':>7s}  calls warm  ok")
    for _ in range(args.rounds):
        for T, adapters in layer:
            for name, kw in VARIANTS:
                r = run_layer(T, adapters, warm, flushed, 1000, kw)
                calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
                print(f"{f'layer {T}x{adapters}':40s} {name:6s} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  "
                      f"{r['ok']}", flush=True)
        for row in core:
            d = build(row, 1000)
            w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
            for name, kw in VARIANTS:
                be = cb.CupyBackend(d.spec, **kw)
                d.y.copy_(d.y0)
                be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
                torch.cuda.synchronize()
                err = oracle_error(d, d.y)
                us = flushed(lambda: be.delta(d.y, d.x, w, d.token_order, d.slot_indptr))
                print(f"{row.label:40s} {name:6s} {'':6s} {us:7.1f}  err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
