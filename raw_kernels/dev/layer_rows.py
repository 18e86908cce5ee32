"""The bench's layer rows and a few of its core rows for the tree this is run from, one line a row,
for A/B runs of two trees in one GPU session (run each from its own root, alternating, as
ab_bench.sh does; ``python -m`` and ``PYTHONPATH=.`` import the tree of the working directory):

    (cd before && PYTHONPATH=. python ../raw_kernels/dev/layer_rows.py --tag before)
    PYTHONPATH=. python raw_kernels/dev/layer_rows.py --tag after --layer 1x1 --core "T1 "

Each line: the tag, the row, warm and flushed us (the bench's Timer: graphs of 20 calls, diff
method; the layer's four calls also each alone warm), and the oracle check. ``--b-layout both`` runs
each core / poolrank row with B ``[S, out, R]`` and rank-blocked in turn (the backend takes either):

    PYTHONPATH=. python raw_kernels/dev/layer_rows.py --layer "" --core r64 --b-layout both
    PYTHONPATH=. python raw_kernels/dev/layer_rows.py --layer "" --core pool128 --b-layout both
"""

from __future__ import annotations

import argparse
from dataclasses import replace


def main() -> None:
    import torch

    from lora_cupy.backends import cupy as cb
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.bench.kernels import Timer, build, oracle_error, rows, run_layer
    from lora_cupy.spec import pool_layout_b

    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="tree")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--layer", default="1x1", help="TxADAPTERS,... (empty: none)")
    ap.add_argument("--core", default="T1 ", help="the core and shapes rows (bf16) whose label contains this (empty: none)")
    ap.add_argument("--max-t", type=int, default=None, help="only the core rows of at most this many positions")
    ap.add_argument("--layer-expand", default=None, help="the layer rows with this expand kernel forced (e.g. pair)")
    ap.add_argument("--expand", default=None, help="the core rows also with this expand kernel forced (e.g. one)")
    ap.add_argument("--b-layout", default="pool", choices=("pool", "plain", "blocked", "both"),
                    help="B of the core, shapes and poolrank rows as a pool of the row's max_rank holds it (as the "
                         "bench; b_layout 'auto'), as [S, out, R], rank-blocked, or [S, out, R] and rank-blocked in "
                         "turn (an A/B of the layout)")
    args = ap.parse_args()
    warm, flushed = Timer(args.replays, "diff", "none"), Timer(args.replays, "diff", "write")
    for spec in filter(None, args.layer.split(",")):
        T, adapters = (int(v) for v in spec.split("x"))
        r = run_layer(T, adapters, warm, flushed, 1000, {"expand": args.layer_expand} if args.layer_expand else None)
        calls = " ".join(f"{k} {v:.1f}" for k, v in r["calls_warm_us"].items())
        tag = args.tag + (f" [{args.layer_expand}]" if args.layer_expand else "")
        print(f"{tag:8s} layer {T}x{adapters:<32d} warm {r['warm_us']:6.1f} flushed {r['flushed_us']:6.1f}  "
              f"{calls}  ok {r['ok']}", flush=True)
    for row in rows():
        group = row.label.split()[0]
        if (not args.core or args.core not in row.label or group not in ("core", "shapes", "poolrank")
                or row.dtype != "bfloat16"):
            continue
        if args.max_t is not None and row.T > args.max_t:
            continue
        d = build(row, 1000)
        bound = max(row.ranks) if max(row.ranks) < row.pool_rank else None  # a pool's planner's rank bound
        layouts = ("plain", "blocked") if args.b_layout == "both" else (args.b_layout,)
        for layout, expand in [(lo, e) for lo in layouts for e in ((None, args.expand) if args.expand else (None,))]:
            label = row.label + (f" [{expand}]" if expand else "") + (f" B {layout}" if len(layouts) > 1 else "")
            # B as the row's pool stores it, or as a pool of the same max_rank with b_layout "plain" / "blocked"
            spec = d.spec if layout == "pool" else replace(d.spec, b_layout=layout)
            w = LayerWeights(d.a, pool_layout_b(d.b, spec), d.scaling, d.ranks, d.offsets)
            be = cb.CupyBackend(d.spec, early_reads=True, **({"expand": expand} if expand else {}))
            d.y.copy_(d.y0)
            try:
                be.delta(d.y, d.x, w, d.token_order, d.slot_indptr, rank_bound=bound)
            except ValueError as e:  # a forced kernel that cannot serve the row says why
                print(f"{args.tag:8s} {label:46s} refused: {e}", flush=True)
                continue
            torch.cuda.synchronize()
            err = oracle_error(d, d.y)

            def call(be=be, w=w):
                be.delta(d.y, d.x, w, d.token_order, d.slot_indptr, rank_bound=bound)

            print(f"{args.tag:8s} {label:46s} warm {warm(call):6.1f} flushed {flushed(call):6.1f}  err {err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
