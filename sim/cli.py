"""``python -m sim``: play a trace (read or generated) through the simulator, for sizing slots.

Prints the summary (hit rate, evictions, mean and p99 admission wait, occupancy), writes a
plot PNG and, with --json, the summary and series as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import TraceError
from .player import PlayerConfig, play, sweep_slots
from .workload import DEFAULT_RANK_MIX, generate_trace, parse_rank_mix, read_trace


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def _float(text: str, *, zero_ok: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v >= 0 if zero_ok else v > 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number {'>=' if zero_ok else '>'} 0")
    return v


def _positive_float(text: str) -> float:
    return _float(text, zero_ok=False)


def _nonneg_float(text: str) -> float:
    return _float(text, zero_ok=True)


def _slot_list(text: str) -> list[int]:
    try:
        out = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of slot counts") from None
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: slot counts must be >= 2 (slot 0 included)")
    return out


def _rank_mix(text: str) -> dict[int, float]:
    try:
        return parse_rank_mix(text)
    except TraceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sim",
        description="Play a workload trace through the slot simulator: hit rate, evictions, "
                    "admission waits and slot occupancy for a pool of --slots slots.")
    src = p.add_argument_group("workload (a trace file, or a generated trace)")
    src.add_argument("--trace", metavar="FILE",
                     help="CSV (arrival,adapter,tokens[,rank]) or JSON trace; overrides generation")
    src.add_argument("--requests", type=_positive_int, default=2000, help="generated requests (2000)")
    src.add_argument("--rate", type=_positive_float, default=20.0, help="Poisson arrivals per second (20)")
    src.add_argument("--adapters", type=_positive_int, default=32, help="distinct adapters (32)")
    src.add_argument("--zipf", type=_nonneg_float, default=1.0,
                     help="zipf exponent of adapter popularity, 0 = uniform (1.0)")
    src.add_argument("--rank-mix", type=_rank_mix, default=DEFAULT_RANK_MIX, metavar="R:W,...",
                     help="adapter ranks and weights (8:0.5,16:0.3,64:0.2)")
    src.add_argument("--mean-tokens", type=_positive_float, default=64.0,
                     help="mean decode tokens per request (64)")
    src.add_argument("--base-fraction", type=_nonneg_float, default=0.0,
                     help="fraction of requests on the base model (0)")
    src.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    src.add_argument("--save-trace", metavar="FILE", help="also write the trace played (CSV or JSON)")
    pool = p.add_argument_group("pool and runner")
    pool.add_argument("--slots", type=_slot_list, default=[9], metavar="N",
                      help="slots, slot 0 included (9); a list such as 5,9,17 sweeps them "
                           "and plots hit rate against slot count (the report is for the last)")
    pool.add_argument("--max-batch", type=_positive_int, default=32, help="running requests per step (32)")
    pool.add_argument("--step-time", type=_positive_float, default=0.02, help="seconds per step (0.02)")
    pool.add_argument("--read-base", type=_nonneg_float, default=0.005, help="seconds per read (0.005)")
    pool.add_argument("--read-per-rank", type=_nonneg_float, default=0.0005,
                      help="extra read seconds per unit of rank (0.0005)")
    pool.add_argument("--admission", choices=("fifo", "pass"), default="fifo",
                      help="fifo: a request waiting for a slot holds back those behind it; "
                           "pass: they may pass it (fifo)")
    out = p.add_argument_group("output")
    out.add_argument("--plot", default="sim-report.png", metavar="PNG", help="plot file (sim-report.png)")
    out.add_argument("--json", metavar="FILE", help="write the summary and series as JSON")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.base_fraction > 1:
        parser.error(f"--base-fraction must lie in [0, 1], got {args.base_fraction}")
    if not args.plot.lower().endswith(".png"):
        parser.error(f"--plot must name a .png file, got {args.plot!r}")
    try:
        if args.trace:
            trace = read_trace(args.trace)
        else:
            trace = generate_trace(args.requests, rate=args.rate, num_adapters=args.adapters,
                                   zipf=args.zipf, rank_mix=args.rank_mix,
                                   mean_tokens=args.mean_tokens, base_fraction=args.base_fraction,
                                   seed=args.seed)
        if args.save_trace:
            trace.write(args.save_trace)
        config = PlayerConfig(num_slots=args.slots[-1], max_batch=args.max_batch,
                              step_time=args.step_time, read_base=args.read_base,
                              read_per_rank=args.read_per_rank, admission=args.admission)
    except TraceError as e:
        print(f"python -m sim: error: {e}", file=sys.stderr)
        return 2
    progress = False if args.no_progress else None
    sweep = sweep_slots(trace, args.slots[:-1], config, progress=progress) if len(args.slots) > 1 else []
    result = play(trace, config, progress=progress)
    if sweep:
        sweep.append(result)

    import matplotlib

    matplotlib.use("Agg")
    from .plots import save_report

    try:
        save_report(result, args.plot, sweep=sweep or None)
        if args.json:
            payload = result.to_dict()
            if sweep:
                payload["sweep"] = [r.summary() for r in sweep]
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1, allow_nan=True)
    except OSError as e:
        print(f"python -m sim: error: cannot write output: {e}", file=sys.stderr)
        return 2
    for r in sweep[:-1]:
        s = r.summary()
        print(f"slots {s['num_slots']:4d}: hit rate {s['hit_rate']:.3f}, evictions {s['evictions']}, "
              f"p99 wait {s['p99_wait_s']:.3f} s")
    for k, v in result.summary().items():
        print(f"{k:>18}: {v:.4g}" if isinstance(v, float) else f"{k:>18}: {v}")
    print(f"{'plot':>18}: {args.plot}")
    if args.json:
        print(f"{'json':>18}: {args.json}")
    return 0
