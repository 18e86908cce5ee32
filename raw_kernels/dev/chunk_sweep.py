"""``lora_chunk`` (chunk.cuh) under several plans, beside the unfused pair, on the bench's rows.

An experiment kept outside the wheel, run against the checkout on ``PYTHONPATH``. The plan of
``lora_chunk`` cuts each chunk of one slot into parts: about ``CHUNK_BLOCKS_PER_SM`` blocks a
multiprocessor when a step fills its bucket, at most ``CHUNK_MAX_PARTS`` parts. ``--plans`` sets
each pair (``BxP``: blocks a multiprocessor, most parts) in turn; every row is also timed with the
unfused pair (``lora_shrink``, then the bucket's expand) and the default. Rows: core shapes
(4096 -> 4096) at T 128 / 256 / 512 / 1024 / 2048 / 4096, rank 16 / 64, 1 / 8 / 32 adapters, plus the wide
shapes of a Llama-8B layer at T 1024 and pools of rank 64 and 128 running rank-16 adapters; each checked
against the float64 oracle, timed with the bench's timer (difference of graphs of 20 calls, 256 MB
write flush). ``--decode``: the rank-64 rows of 1, 16 and 64 positions instead (lora_chunk by
ticket beside the default).

    PYTHONPATH=. python raw_kernels/dev/chunk_sweep.py --plans 4x32,4x16,2x32 [--match T1024] [--heights] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

ROWS = [("core", T, 4096, (4096,), r, s, r) for T in (128, 256, 512, 1024, 2048, 4096) for r in (16, 64)
        for s in (1, 8, 32)]
ROWS += [("shapes", 1024, i, (o,), r, 8, r) for i, o in ((4096, 14336), (14336, 4096)) for r in (16, 64)]
ROWS += [("shapes", 1024, 14336, (4096,), 64, s, 64) for s in (1, 32)]  # the deep target's heights by slots
ROWS += [("poolrank", T, 4096, (4096,), 16, 8, pool) for T in (1024, 4096) for pool in (64, 128)]
ROWS += [("shapes", 4096, i, (o,), 64, 8, 64) for i, o in ((4096, 14336), (14336, 4096))]
DECODE_ROWS = [("core", 1, 4096, (4096,), 64, 1, 64), ("shapes", 1, 14336, (4096,), 64, 1, 64),
               ("shapes", 1, 4096, (14336,), 64, 1, 64)]
DECODE_ROWS += [("core", T, 4096, (4096,), 64, s, 64) for T in (16, 64) for s in (1, 8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default="4x32", help="comma-separated BxP: blocks a multiprocessor x most parts")
    ap.add_argument("--match", default="", help="only rows whose label holds one of these texts (comma-separated)")
    ap.add_argument("--heights", action="store_true",
                    help="also lora_chunk with chunks of 16, 32, 64 and 128 positions (rank widths above 16) at every bucket")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--decode", action="store_true", help="the rank-64 decode rows instead")
    args = ap.parse_args(argv)

    import torch

    from lora_cupy.backends import cupy as cb
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.bench.kernels import Row, Timer, build, oracle_error

    timer = Timer()
    plans = [tuple(int(v) for v in p.split("x")) for p in args.plans.split(",") if p]
    results = []
    for group, T, in_f, slices, r, s, pool in (DECODE_ROWS if args.decode else ROWS):
        row = Row(group, T, in_f, slices, (r,) * s, pool)
        if args.match and not any(m in row.label for m in args.match.split(",")):
            continue
        d = build(row, 0)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        cells = {}

        def time_it(name, **kw):
            be = cb.CupyBackend(d.spec, **kw)
            plan = be.plan(T, w, row.dtype)
            d.y.copy_(d.y0)
            be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
            torch.cuda.synchronize()
            err = oracle_error(d, d.y)
            us = timer(lambda: be.delta(d.y, d.x, w, d.token_order, d.slot_indptr))
            cells[name] = dict(us=us, err=err, splits=plan.splits, expand=plan.expand, bm=plan.bm)

        time_it("default")
        if not args.decode:
            time_it("pair", expand=cb.default_expand(d.spec.bucket_for(T)))
        saved = (cb.CHUNK_BLOCKS_PER_SM, cb.CHUNK_MAX_PARTS)
        for b, p in plans:
            cb.CHUNK_BLOCKS_PER_SM, cb.CHUNK_MAX_PARTS = b, p
            cb.plan_launch.cache_clear()
            try:
                time_it(f"{b}x{p}", expand="chunk", fused=False)
            finally:
                cb.CHUNK_BLOCKS_PER_SM, cb.CHUNK_MAX_PARTS = saved
                cb.plan_launch.cache_clear()
        if args.heights and cb.rank_width(pool) > 16:
            saved_from = (cb.CHUNK_NARROW_TO, cb.CHUNK_WIDE_FROM, cb.CHUNK_DEEP_WIDE_FROM, cb.CHUNK_TALL_FROM)
            never = 1 << 30
            for name, froms in (("bm16", (never, never, never, never)), ("bm32", (0, never, never, never)),
                                ("bm64", (0, 1, 1, never)), ("bm128", (0, 1, 1, 1))):
                cb.CHUNK_NARROW_TO, cb.CHUNK_WIDE_FROM, cb.CHUNK_DEEP_WIDE_FROM, cb.CHUNK_TALL_FROM = froms
                cb.plan_launch.cache_clear()
                try:
                    time_it(name, fused=False, expand="chunk")
                finally:
                    cb.CHUNK_NARROW_TO, cb.CHUNK_WIDE_FROM, cb.CHUNK_DEEP_WIDE_FROM, cb.CHUNK_TALL_FROM = saved_from
                    cb.plan_launch.cache_clear()
        bad = [n for n, c in cells.items() if not c["err"] < cb.TOLERANCE[row.dtype]]
        line = f"{row.label:40s} " + " ".join(f"{n} {c['us']:6.1f}/p{c['splits']}" for n, c in cells.items())
        print(line + (f"  ERR {bad}" if bad else ""), flush=True)
        results.append(dict(row=row.label, cells=cells))
        d = w = None  # free the row's tensors before the next
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
