"""lora_pair's expand grid (blocks a multiprocessor: ``PAIR_EXPAND_PER_SM`` for outputs narrower than
``PAIR_WIDE`` columns, ``PAIR_EXPAND_PER_SM_WIDE`` from it) under several settings, on the bench's layer
rows, alternated in one process: warm and flushed us, each call alone warm, the oracle check.

    PYTHONPATH=. python raw_kernels/dev/pair_grid_ab.py [--grids 2x3,2x2,3x3] [--rows 16x8,64x8,64x32,256x32]
"""

from __future__ import annotations

import argparse

from lora_cupy.backends import cupy as cb
from lora_cupy.bench.kernels import Timer, run_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grids", default="2x3,2x2,3x3,1x3,2x4", help="NARROWxWIDE blocks a multiprocessor")
    ap.add_argument("--rows", default="16x8,64x8,64x32,256x32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    default = (cb.PAIR_EXPAND_PER_SM, cb.PAIR_EXPAND_PER_SM_WIDE)
    grids = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",")]
    rows = [tuple(int(v) for v in r.split("x")) for r in args.rows.split(",")]
    print(f"{'row':7s} {'grid':5s} {'warm':>6s} {'flushed':>7s}  calls warm (qkv o gate_up down)  ok")
    for _ in range(args.rounds):
        for T, adapters in rows:
            for narrow, wide in grids:
                cb.PAIR_EXPAND_PER_SM, cb.PAIR_EXPAND_PER_SM_WIDE = narrow, wide
                cb.plan_launch.cache_clear()  # plans are memoized: the new grid applies from here
                r = run_layer(T, adapters, warm, flushed, 1000)
                calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
                print(f"{T:3d}x{adapters:<3d} {narrow}x{wide:<3d} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  "
                      f"{r['ok']}", flush=True)
    cb.PAIR_EXPAND_PER_SM, cb.PAIR_EXPAND_PER_SM_WIDE = default
    cb.plan_launch.cache_clear()


if __name__ == "__main__":
    main()
