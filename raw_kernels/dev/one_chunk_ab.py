"""The bench's layer rows with every call on ``lora_one`` in chunks of ``ONE_M`` positions
(``expand="one"`` forced) beside the default plans, alternated in one process, and ``lora_one``
with other cluster counts (``--clusters``: ``ONE_CHUNK_CLUSTERS``): warm and flushed us, each call
alone warm, the plans and whether every target matched the float64 oracle.

    PYTHONPATH=. python raw_kernels/dev/one_chunk_ab.py [--rounds 2] [--rows 64x8,64x32,256x32] [--clusters 16,64]
"""

from __future__ import annotations

import argparse

from lora_cupy.backends import cupy as cb
from lora_cupy.bench.kernels import Timer, run_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rows", default="16x8,64x8,64x32,256x32", help="comma-separated TOKENSxADAPTERS")
    ap.add_argument("--clusters", default="", help="comma-separated ONE_CHUNK_CLUSTERS to time besides the default")
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    rows = [tuple(int(v) for v in r.split("x")) for r in args.rows.split(",")]
    default = cb.ONE_CHUNK_CLUSTERS
    variants = [("default", {}, default), (f"one x{default}", dict(expand="one"), default)]
    variants += [(f"one x{c}", dict(expand="one"), int(c)) for c in filter(None, args.clusters.split(","))]
    print(f"{'row':7s} {'variant':9s} {'warm':>6s} {'flushed':>7s}  calls warm (qkv o gate_up down)  plans  ok")
    for _ in range(args.rounds):
        for T, adapters in rows:
            for name, kw, clusters in variants:
                cb.ONE_CHUNK_CLUSTERS = clusters
                cb.plan_launch.cache_clear()  # plans are memoized: the new count applies from here
                r = run_layer(T, adapters, warm, flushed, 1000, kw)
                calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
                plans = " | ".join(f"{p}" for p in r["plans"].values())
                print(f"{T:3d}x{adapters:<3d} {name:9s} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  {plans}  "
                      f"{r['ok']}", flush=True)
    cb.ONE_CHUNK_CLUSTERS = default
    cb.plan_launch.cache_clear()


if __name__ == "__main__":
    main()
