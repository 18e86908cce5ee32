"""The bench's layer rows of the decode buckets (T=16 and 64 with 8 and 32 adapters: lora_chunk's
chunks of 16) with lora_chunk in clusters (lora_chunk_cl, the default on an H200) and by ticket
(``cluster=False``), alternated in one process: warm and flushed us, each call alone warm, the
plans and whether every target matched the float64 oracle.

    PYTHONPATH=. python raw_kernels/dev/chunk_cl_layer_ab.py [--rounds 2] [--rows 64x8,64x32,16x8]
"""

from __future__ import annotations

import argparse

from lora_cupy.bench.kernels import Timer, run_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rows", default="64x8,64x32,16x8", help="comma-separated TOKENSxADAPTERS")
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    rows = [tuple(int(v) for v in r.split("x")) for r in args.rows.split(",")]
    variants = [("cluster", {}), ("ticket", dict(cluster=False))]
    print(f"{'row':7s} {'variant':8s} {'warm':>6s} {'flushed':>7s}  calls warm (qkv o gate_up down)  plans  ok")
    for _ in range(args.rounds):
        for T, adapters in rows:
            for name, kw in variants:
                r = run_layer(T, adapters, warm, flushed, 1000, kw)
                calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
                plans = " | ".join(f"{p}" for p in r["plans"].values())
                print(f"{T:3d}x{adapters:<3d} {name:8s} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  {plans}  "
                      f"{r['ok']}", flush=True)


if __name__ == "__main__":
    main()
