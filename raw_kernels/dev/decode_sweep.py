"""Decode-size rows (T <= 64, where the fused launch runs) timed under several fused launch sizes.

An experiment kept outside the wheel: it sets the planner's ``FUSED_SHRINK_PER_SM`` /
``FUSED_EXPAND_PER_SM`` (blocks per multiprocessor a chunked fused launch gives its shrink and its
expand tasks) to each pair asked for, and with ``--unfused`` times the unfused pair too (its
kernels run tiles), on the bench's rows,
with the bench's timer (difference of graphs, 256 MB write flush), each row checked against the
float64 oracle first. On a tree whose planner has no such knobs it times the default alone (a
"before" run of an older checkout).

    PYTHONPATH=. python raw_kernels/dev/decode_sweep.py --json out.json [--pairs 4x4,2x2] [--label after]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

ROWS = [("core", T, 4096, (4096,), r, s) for T in (1, 16, 64) for r in (16, 64) for s in (1, 8, 32) if s <= T]
ROWS += [("shapes", T, i, sl, r, min(8, T)) for T in (1, 64)
         for i, sl in ((4096, (14336,)), (14336, (4096,)), (4096, (4096, 1024, 1024))) for r in (16, 64)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--pairs", default="4x4,2x2,4x2,2x4")
    ap.add_argument("--label", default="after")
    ap.add_argument("--unfused", action="store_true", help="also the unfused pair")
    ap.add_argument("--layer", action="store_true", help="also the bench's layer rows under each pair")
    args = ap.parse_args(argv)
    import torch

    from lora_cupy.backends import cupy as cb
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.bench import kernels as bench

    knobs = hasattr(cb, "FUSED_SHRINK_PER_SM")
    pairs = [tuple(int(v) for v in p.split("x")) for p in args.pairs.split(",")] if knobs else [None]
    timer = bench.Timer(10, "diff", "write")
    out, t0 = [], time.time()
    for i, (group, T, in_f, slices, r, s) in enumerate(ROWS):
        row = bench.Row(group, T, in_f, slices, (r,) * s, r)
        d = bench.build(row, 100 + i)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        res = {"label": row.label, "T": T, "r": r, "s": s, "group": group, "us": {}, "err": {}, "plan": {}}
        variants = [(f"{p[0]}x{p[1]}" if p else "default", p, {}) for p in pairs]
        if args.unfused:
            variants.append(("unfused", None, dict(fused=False)))
        for name, pair, kw in variants:
            if pair is not None:
                cb.FUSED_SHRINK_PER_SM, cb.FUSED_EXPAND_PER_SM = pair
                cb.plan_launch.cache_clear()
            be = cb.CupyBackend(d.spec, **kw)
            plan = be.plan(d.token_order.shape[0], w, row.dtype)
            d.y.copy_(d.y0)
            be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
            torch.cuda.synchronize()
            res["err"][name] = bench.oracle_error(d, d.y)
            res["us"][name] = timer(lambda: be.delta(d.y, d.x, w, d.token_order, d.slot_indptr))
            res["plan"][name] = f"{plan.tiles}u/s{plan.splits}/cpb{plan.cpb}/{plan.shrink_blocks}+{plan.expand_blocks}"
            del be
        out.append(res)
        print(f"[{time.time() - t0:5.0f}s] {row.label}: " + " ".join(f"{k} {v:.1f}" for k, v in res["us"].items()),
              file=sys.stderr, flush=True)
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "rows": out}, f, indent=1)
    layer = {}
    if args.layer and hasattr(bench, "run_layer"):
        warm = bench.Timer(10, "diff", "none")
        for p in pairs:
            name = f"{p[0]}x{p[1]}" if p else "default"
            if p is not None:
                cb.FUSED_SHRINK_PER_SM, cb.FUSED_EXPAND_PER_SM = p
                cb.plan_launch.cache_clear()
            layer[name] = [bench.run_layer(T, k, warm, timer, 7) for T, k in bench.LAYER_GOALS_US]
            print(f"[layer {name}] " + " ".join(f"{r['warm_us']:.1f}/{r['flushed_us']:.1f}" for r in layer[name]),
                  file=sys.stderr, flush=True)
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "rows": out, "layer": layer}, f, indent=1)
    names = list(out[0]["us"])
    print(f"{args.label}: {'row':36s} " + " ".join(f"{n:>9s}" for n in names))
    for r in out:
        bad = [n for n in names if r["err"][n] > cb.TOLERANCE["bfloat16"]]
        print(f"{args.label}: {r['label'][:36]:36s} " + " ".join(f"{r['us'][n]:9.1f}" for n in names)
              + (f"  ERR {bad}" if bad else ""))
    for name, rows in layer.items():
        print(f"{args.label}: layer {name}: " + "; ".join(
            f"T{r['T']}/{r['adapters']} warm {r['warm_us']:.1f} flushed {r['flushed_us']:.1f} "
            f"({' '.join(f'{v:.1f}' for v in r['calls_warm_us'].values())}){'' if r['ok'] else ' ERR'}"
            for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
