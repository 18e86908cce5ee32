"""The layer of one position (the bench's layer row T=1, one adapter) with lora_one (the default on
an H200 where a block's share of A is small) and with the fused kernel (on tiles), alternated in
one process, and lora_one with other cluster counts (``--clusters``: the most clusters a launch
takes, each at least one column a block): warm and flushed us, each call alone warm, the plans and
whether every target matched the float64 oracle.

    PYTHONPATH=. python raw_kernels/dev/one_layer_ab.py [--rounds 2] [--clusters 2,4,8,16]
"""

from __future__ import annotations

import argparse

from lora_cupy.backends import cupy as cb
from lora_cupy.bench.kernels import Timer, run_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--clusters", default="", help="comma-separated ONE_MAX_CLUSTERS to time besides the default")
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    default = (cb.ONE_MAX_CLUSTERS, cb.ONE_COLS)
    variants = [("one", {}, default), ("fused", dict(fused=True, chunks=False), default)]
    variants += [(f"one c{c}", {}, (int(c), 1)) for c in filter(None, args.clusters.split(","))]
    print(f"{'variant':8s} {'warm':>6s} {'flushed':>7s}  calls warm (qkv o gate_up down)  plans  ok")
    for _ in range(args.rounds):
        for name, kw, (clusters, cols) in variants:
            cb.ONE_MAX_CLUSTERS, cb.ONE_COLS = clusters, cols
            cb.plan_launch.cache_clear()  # plans are memoized: the new constants apply from here
            r = run_layer(1, 1, warm, flushed, 1000, kw)
            calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
            plans = " ".join(f"{p}" for p in r["plans"].values())
            print(f"{name:8s} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  {plans}  {r['ok']}", flush=True)
    cb.ONE_MAX_CLUSTERS, cb.ONE_COLS = default
    cb.plan_launch.cache_clear()


if __name__ == "__main__":
    main()
