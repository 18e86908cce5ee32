"""Decode-size rows (T <= 64, where the fused launch runs) timed under several launch variants.

An experiment kept outside the wheel, run against the checkout on ``PYTHONPATH`` (an older tree
too: options it does not have are left out, and said so). Variants of each row:

- ``--pairs``: the planner's ``FUSED_SHRINK_PER_SM`` / ``FUSED_EXPAND_PER_SM`` (blocks per
  multiprocessor a fused launch gives its shrink and its expand tasks; before 2026-12-01 a
  chunked one only) set to each pair,
  or ``default`` (the planner as it is);
- ``--unfused``: the unfused pair too (its kernels run tiles);
- ``--aligned-off``: the backend built with ``aligned=False`` too, so calls whose rows allow every
  16-byte path run the kernels' instantiation that reads the access flags rather than the
  ``ALIGNED`` one (the same kernels, timed in the same process: an A/B of code size alone).

Rows are the bench's, by group (``--rows core,large``; ``core``: T 1/16/64, rank 16/64, 1/8/32
adapters; ``shapes``: the layer's shapes at T 1/64; ``large``: T 256/1024/4096 over 32 adapters),
timed with the bench's timer (difference of graphs, 256 MB write flush), each
checked against the float64 oracle first; ``--layer`` adds the bench's layer rows (the four calls
of a Llama-8B layer in one graph) under each variant. ``--compare`` prints one table from the JSON
files of several runs (a ``before`` tree and this one, in alternating rounds), medians per cell.

    PYTHONPATH=. python raw_kernels/dev/decode_sweep.py --json out.json [--pairs 4x4,2x2] [--label after]
    python raw_kernels/dev/decode_sweep.py --compare before1.json after1.json before2.json after2.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

ROWS = [("core", T, 4096, (4096,), r, s) for T in (1, 16, 64) for r in (16, 64) for s in (1, 8, 32) if s <= T]
ROWS += [("shapes", T, i, sl, r, min(8, T)) for T in (1, 64)
         for i, sl in ((4096, (14336,)), (14336, (4096,)), (4096, (4096, 1024, 1024))) for r in (16, 64)]
#: Past decode (shrink and expand launched apart), where code size once cost whole microseconds.
ROWS += [("large", T, 4096, (4096,), r, 32) for T in (256, 1024, 4096) for r in (16, 64)]
GROUPS = ("core", "shapes", "large")


def _variants(args, cb) -> list[tuple[str, tuple | None, dict]]:
    """``(name, pair or None, backend options)`` of every variant this tree can run."""
    knobs = hasattr(cb, "FUSED_SHRINK_PER_SM")
    out = []
    for p in args.pairs.split(","):
        if p == "default" or not knobs:
            out.append(("default", None, {}))
        else:
            a, b = (int(v) for v in p.split("x"))
            out.append((f"{a}x{b}", (a, b), {}))
    out = list(dict((v[0], v) for v in out).values())
    if args.unfused:
        out.append(("unfused", None, dict(fused=False)))
    if args.aligned_off:
        if "aligned" in inspect.signature(cb.CupyBackend).parameters:
            out.append(("aligned_off", None, dict(aligned=False)))
        else:
            print("--aligned-off: this tree's backend has no `aligned` option (one instantiation per kernel)",
                  file=sys.stderr)
    return out


def _set_pair(cb, pair, default):
    cb.FUSED_SHRINK_PER_SM, cb.FUSED_EXPAND_PER_SM = pair or default
    cb.plan_launch.cache_clear()


def sweep(args) -> int:
    import torch

    from lora_cupy.backends import cupy as cb
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.bench import kernels as bench

    variants = _variants(args, cb)
    default = (cb.FUSED_SHRINK_PER_SM, cb.FUSED_EXPAND_PER_SM) if hasattr(cb, "FUSED_SHRINK_PER_SM") else None
    timer = bench.Timer(10, "diff", "write")
    groups = GROUPS if args.rows == "all" else args.rows.split(",")
    rows = [r for r in ROWS if r[0] in groups]
    out, t0 = [], time.time()

    def dump(layer=None):
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "rows": out, **({"layer": layer} if layer is not None else {})}, f, indent=1)

    for i, (group, T, in_f, slices, r, s) in enumerate(rows):
        row = bench.Row(group, T, in_f, slices, (r,) * s, r)
        d = bench.build(row, 100 + i)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        res = {"label": row.label, "T": T, "r": r, "s": s, "group": group, "us": {}, "err": {}, "plan": {},
               "flags": {}}
        for name, pair, kw in variants if i % 2 == 0 else variants[::-1]:  # neither always first
            if default is not None:
                _set_pair(cb, pair, default)
            be = cb.CupyBackend(d.spec, **kw)
            plan = be.plan(d.token_order.shape[0], w, row.dtype)
            call = cb.check_call(be.limits, d.y, d.x, w, d.token_order, d.slot_indptr)
            d.y.copy_(d.y0)
            be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
            torch.cuda.synchronize()
            res["err"][name] = bench.oracle_error(d, d.y)
            res["us"][name] = timer(lambda be=be: be.delta(d.y, d.x, w, d.token_order, d.slot_indptr))
            res["plan"][name] = f"{plan.tiles}u/s{plan.splits}/cpb{plan.cpb}/{plan.shrink_blocks}+{plan.expand_blocks}"
            res["flags"][name] = call.flags
            del be
        out.append(res)
        print(f"[{time.time() - t0:5.0f}s] {row.label}: " + " ".join(f"{k} {v:.1f}" for k, v in res["us"].items()),
              file=sys.stderr, flush=True)
        dump()
    layer = {}
    if args.layer and hasattr(bench, "run_layer"):
        warm = bench.Timer(10, "diff", "none")
        layer_kw = "backend_kw" in inspect.signature(bench.run_layer).parameters
        lv = [v for v in variants if layer_kw or not v[2]]  # an older bench builds its own backend
        for j, (T, k) in enumerate(bench.LAYER_GOALS_US):
            for name, pair, kw in lv if j % 2 == 0 else lv[::-1]:
                if default is not None:
                    _set_pair(cb, pair, default)
                extra = dict(backend_kw=kw) if kw else {}
                r = bench.run_layer(T, k, warm, timer, 7, **extra)
                layer.setdefault(name, []).append(r)
                print(f"[layer T{T}/{k} {name}] warm {r['warm_us']:.1f} flushed {r['flushed_us']:.1f}",
                      file=sys.stderr, flush=True)
            dump(layer)
    names = [v[0] for v in variants]
    print(f"{args.label}: {'row':36s} " + " ".join(f"{n:>11s}" for n in names))
    for r in out:
        bad = [n for n in names if r["err"][n] > cb.TOLERANCE["bfloat16"]]
        print(f"{args.label}: {r['label'][:36]:36s} " + " ".join(f"{r['us'][n]:11.1f}" for n in names)
              + (f"  ERR {bad}" if bad else ""))
    for name, rows_ in layer.items():
        print(f"{args.label}: layer {name}: " + "; ".join(
            f"T{r['T']}/{r['adapters']} warm {r['warm_us']:.1f} flushed {r['flushed_us']:.1f} "
            f"({' '.join(f'{v:.1f}' for v in r['calls_warm_us'].values())}){'' if r['ok'] else ' ERR'}"
            for r in rows_))
    return 0


def compare(files: list[str], out_json: str | None) -> int:
    """One table of several runs' JSON: a column per (label, variant), the median over the runs
    that share them (alternating rounds of a before and an after tree); the last column against
    the first, and (three columns or more) against the one before it."""
    cells: dict[tuple[str, str], dict[str, list[float]]] = {}  # (label, variant) -> row -> times
    bad: set[str] = set()
    order: dict[str, None] = {}

    def add(col, key, us, ok=True):
        order.setdefault(key)
        cells.setdefault(col, {}).setdefault(key, []).append(us)
        if not ok:
            bad.add(key)

    for path in files:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"compare: {path}: {e}", file=sys.stderr)
            continue
        label = data.get("label", path)
        for r in data.get("rows", []):
            for v, us in r["us"].items():
                add((label, v), r["label"], us, r["err"][v] <= 1e-2)
        for v, lrows in data.get("layer", {}).items():
            for lr in lrows:
                name = f"layer T{lr['T']}/{lr['adapters']}"
                add((label, v), f"{name} warm", lr["warm_us"], lr["ok"])
                add((label, v), f"{name} flushed", lr["flushed_us"], lr["ok"])
                for call, us in lr["calls_warm_us"].items():
                    add((label, v), f"{name} {call} alone warm", us)
    if not cells:
        print("compare: no rows")
        return 1
    # the before tree first; within a tree the shipped choice ("default") last
    cols = sorted(cells, key=lambda c: (c[0] != "before", c[1] == "default"))
    med = {c: {k: statistics.median(v) for k, v in cells[c].items()} for c in cols}
    runs = {c: max(len(v) for v in cells[c].values()) for c in cols}
    names = [f"{c[0]}:{c[1]}" for c in cols]
    two = len(cols) >= 3
    print(f"{'us, median of runs':38s} " + " ".join(f"{n[-17:]:>17s}" for n in names)
          + f" {'last/first':>10s}" + (f" {'last/prev':>9s}" if two else ""))
    print(f"{'(runs)':38s} " + " ".join(f"{runs[c]:>17d}" for c in cols))
    table = []
    for key in order:
        vals = [med[c].get(key) for c in cols]
        r1 = vals[-1] / vals[0] if vals[0] and vals[-1] else float("nan")
        r2 = vals[-1] / vals[-2] if two and vals[-2] and vals[-1] else float("nan")
        table.append({"row": key, **dict(zip(names, vals)), "last_over_first": r1,
                      **({"last_over_prev": r2} if two else {})})
        print(f"{key[:38]:38s} " + " ".join(f"{v:17.2f}" if v is not None else f"{'-':>17s}" for v in vals)
              + f" {r1:10.3f}" + (f" {r2:9.3f}" if two else "") + ("  ERR" if key in bad else ""))
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"files": files, "columns": names, "rows": table}, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="where this run's rows go (a sweep), or the merged table (--compare)")
    ap.add_argument("--pairs", default="4x4,2x2,4x2,2x4", help="NxM pairs, or default")
    ap.add_argument("--label", default="after")
    ap.add_argument("--rows", default="all", help=f"all, or groups of {GROUPS} joined by commas")
    ap.add_argument("--unfused", action="store_true", help="also the unfused pair")
    ap.add_argument("--aligned-off", action="store_true", help="also the backend with aligned=False")
    ap.add_argument("--layer", action="store_true", help="also the bench's layer rows under each variant")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="print one table of these runs and exit")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare, args.json)
    if not args.json:
        ap.error("--json is required for a sweep")
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
