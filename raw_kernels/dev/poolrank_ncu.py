"""The poolrank row at T positions (32 rank-16 adapters, 4096 -> 4096) in a pool of maximum rank 128
planned for its bound (rank 16), then the same adapters in a pool of maximum rank 16: one call
each, checked against float64, for Nsight Compute to compare what each reads. Both take the same
plan (lora_one in chunks of 8 at T=64), so a difference is the bytes' layout: A is
``[S, n, R, in]`` (a rank-16 adapter's rows contiguous either way), B ``[S, out, R]`` (at R = 128 each
column's 16 ranks are 32 bytes of a 256-byte row). Written for the next GPU session:

    ncu --kernel-name regex:lora_one --section MemoryWorkloadAnalysis --section SourceCounters \\
        --print-summary per-kernel python raw_kernels/dev/poolrank_ncu.py --T 64

(launch 0: the rank-128 pool, launch 1: the rank-16 pool; ncu flushes the caches before each
launch by default, as the bench's flushed figure does.) The SourceCounters section's L2 and DRAM
traffic per SASS line tells the expand's B loads from the shrink's A loads.
"""

from __future__ import annotations

import argparse


def main() -> None:
    import torch

    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import TOLERANCE, CupyBackend
    from lora_cupy.bench.kernels import Row, build, oracle_error

    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for pool_rank in (128, 16):
        row = Row("poolrank" if pool_rank > 16 else "core", args.T, 4096, (4096,), (16,) * 32, pool_rank)
        d = build(row, args.seed)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        be = CupyBackend(d.spec)  # as the bench rows build it
        plan = be.plan(d.token_order.shape[0], w, row.dtype, rank_bound=16)
        d.y.copy_(d.y0)
        be.delta(d.y, d.x, w, d.token_order, d.slot_indptr, rank_bound=16)
        torch.cuda.synchronize()
        err = oracle_error(d, d.y)
        print(f"{row.label}: plan {plan.expand} bm {plan.bm} blocks {plan.blocks}, error {err:.1e} "
              f"({'ok' if err < TOLERANCE[row.dtype] else 'WRONG'})")


if __name__ == "__main__":
    main()
