"""The bench's layer rows of the decode buckets (T=16 and 64 with 8 and 32 adapters: lora_chunk's
chunks of 16) with lora_chunk in clusters (lora_chunk_cl, the default on an H200) and by ticket
(``cluster=False``), alternated in one process, lora_chunk_cl with its grid capped at other
cluster counts (``--clusters``), and the default with other caps on lora_chunk's grid and parts
(``--caps``: ``pN`` sets ``CHUNK_MAX_PARTS``, the most parts a chunk is cut into, ``cN``
``CHUNK_COL_PARTS``, the most at the decode buckets where the column blocks count, ``bN``
``CHUNK_BLOCKS_PER_SM``, the blocks a multiprocessor its grid counts; ``b5p64`` two): warm and
flushed us, each call alone warm, the plans and whether every target matched the float64 oracle.

    PYTHONPATH=. python raw_kernels/dev/chunk_cl_layer_ab.py [--rounds 2] [--rows 64x8,64x32,16x8] [--clusters 16,32] [--caps p64,b5,b5p64]
"""

from __future__ import annotations

import argparse
import re

from lora_cupy.backends import cupy as cb
from lora_cupy.bench.kernels import Timer, run_layer


def max_active_clusters(n_slices: int, max_rank: int, num_slots: int, dtype: str = "bfloat16") -> dict:
    """cuOccupancyMaxActiveClusters of lora_chunk_cl (both instantiations of the rank width) at the
    shared memory a call of ``n_slices`` slices takes: how many of its clusters the device holds at once."""
    from lora_cupy.backends.launch_ex import max_active_clusters as query
    from lora_cupy.spec import LoraSpec, LoraTarget

    spec = LoraSpec((LoraTarget("t", 64, 64 * n_slices, n_slices),), num_slots=num_slots, max_rank=max_rank,
                    dtype=dtype)
    be = cb.CupyBackend(spec)
    rw, smem = cb.chunk_geometry(max_rank)[0], cb.chunk_cl_smem(dtype, num_slots, n_slices, max_rank)
    return {("sliced" if sl else "one slice"): query(int(be._kernel_fn(dtype, ("chunk_cl", rw, sl, True)).kernel.ptr),
                                                     cb.THREADS, smem) for sl in (False, True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rows", default="64x8,64x32,16x8", help="comma-separated TOKENSxADAPTERS")
    ap.add_argument("--clusters", default="", help="comma-separated CHUNK_CL_MAX_CLUSTERS to time besides the default")
    ap.add_argument("--caps", default="", help="comma-separated pN / cN / bN, or several as bNpN "
                                               "(CHUNK_MAX_PARTS, CHUNK_COL_PARTS, CHUNK_BLOCKS_PER_SM)")
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    rows = [tuple(int(v) for v in r.split("x")) for r in args.rows.split(",")]
    default = dict(CHUNK_CL_MAX_CLUSTERS=cb.CHUNK_CL_MAX_CLUSTERS, CHUNK_MAX_PARTS=cb.CHUNK_MAX_PARTS,
                   CHUNK_BLOCKS_PER_SM=cb.CHUNK_BLOCKS_PER_SM, CHUNK_COL_PARTS=cb.CHUNK_COL_PARTS)
    names = {"p": "CHUNK_MAX_PARTS", "c": "CHUNK_COL_PARTS", "b": "CHUNK_BLOCKS_PER_SM"}
    variants = [("cluster", {}, {}), ("ticket", dict(cluster=False), {})]
    variants += [(f"cl x{c}", {}, dict(CHUNK_CL_MAX_CLUSTERS=int(c))) for c in filter(None, args.clusters.split(","))]
    variants += [(c, {}, {names[k]: int(v) for k, v in re.findall(r"([pcb])(\d+)", c)})
                 for c in filter(None, args.caps.split(","))]
    for n, R in ((1, 16), (3, 16), (2, 16), (1, 64)):
        print(f"max active clusters, {n} slice(s) rank {R}, smem {cb.chunk_cl_smem('bfloat16', 33, n, R)} B, "
              f"planned {cb.plan_launch(64, 4096, 4096 * n, n, R, 'bfloat16', num_slots=33, expand='chunk', fused=False, slice_align=128).blocks // 8}:"
              f" {max_active_clusters(n, R, 33)}", flush=True)
    print(f"{'row':7s} {'variant':8s} {'warm':>6s} {'flushed':>7s}  calls warm (qkv o gate_up down)  plans  ok")
    for _ in range(args.rounds):
        for T, adapters in rows:
            for name, kw, consts in variants:
                for k, v in {**default, **consts}.items():
                    setattr(cb, k, v)
                cb.plan_launch.cache_clear()  # plans are memoized: the new caps apply from here
                r = run_layer(T, adapters, warm, flushed, 1000, kw)
                calls = " ".join(f"{v:5.1f}" for v in r["calls_warm_us"].values())
                plans = " | ".join(f"{p}" for p in r["plans"].values())
                print(f"{T:3d}x{adapters:<3d} {name:8s} {r['warm_us']:6.1f} {r['flushed_us']:7.1f}  {calls}  {plans}  "
                      f"{r['ok']}", flush=True)
    for k, v in default.items():
        setattr(cb, k, v)
    cb.plan_launch.cache_clear()


if __name__ == "__main__":
    main()
