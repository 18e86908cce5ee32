"""``lora-cupy bench lane``: the decode chain's throughput alone, with codec windows on the side
lane, and with the same windows run on the chain.

The decode chain is the engine's test model (``engine/decode_model.py``): an LLM node whose
layers add each request's LoRA delta through the pool, its state in a paged KV cache, every
request decoding ``--tokens`` tokens; every ``--window`` tokens a request's window goes to the
codec node. Chain throughput is the chain's decode tokens over the span from its first step's
start to its last step's landing (CUDA events on cuda, host time on the cpu), so codec work that
runs after the chain is done does not count, and codec steps run on the chain do. Each mode is
warmed up once (kernels compile, graphs are captured), then the modes run interleaved,
``--repeats`` times; the run of median throughput is reported per mode, and beside it the median
over rounds of each round's ratio to that round's chain alone (interleaved runs share the
machine's drift, so the ratio varies less than either run).

The target: with windows on the side lane the chain keeps at least 95% of its throughput alone,
while the same windows on the chain cost it their full time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time

from ..engine.streams import CHAIN_PRIORITY
from . import commit, parse

MODES = ("alone", "side", "on_chain")


def _engine(args, side_lane: bool):
    from ..device import Device
    from ..engine.decode_model import RandomAdapters, decode_engine, decode_spec
    from ..pool import LoraAdapterPool

    adapters = {f"a{i}": args.rank for i in range(args.adapters)}
    spec = decode_spec(args.hidden, args.layers, num_slots=args.adapters + 1, max_rank=args.rank,
                       buckets=tuple(sorted({8, 16, 32, 64, 128, 256, args.requests})))
    stream = None
    if args.device.startswith("cuda"):
        import cupy

        with cupy.cuda.Device(int(args.device.partition(":")[2] or 0)):
            stream = cupy.cuda.Stream(non_blocking=True, priority=CHAIN_PRIORITY)  # its own, for capture; first
    pool = LoraAdapterPool(spec, Device(args.device, stream=stream), reader=RandomAdapters(adapters),
                           adapters={n: f"memory:{n}" for n in adapters})
    pages_each = -(-args.tokens // args.page_size)
    eng = decode_engine(pool, num_pages=args.requests * pages_each + 1, page_size=args.page_size,
                        side_lane=side_lane, graphs=not args.no_graphs, codec_width=args.codec_width,
                        codec_layers=args.codec_layers, vocab=min(64, args.hidden), max_window=max(1, args.window))
    eng.worker.marks = type(eng.worker.marks)(maxlen=1 << 20)
    return eng


def run_once(args, eng, mode: str, tag: str) -> dict:
    """One run of a mode on its engine: every request decodes ``args.tokens`` tokens."""
    from ..engine.scheduler import CHAIN_LANE, SIDE_LANE
    from ..engine.worker import Request

    w = eng.worker
    window = 0 if mode == "alone" else args.window
    w.marks.clear()
    before = w.stats["steps_codec"]
    names = [None] + [f"a{i}" for i in range(args.adapters)]
    futs = [w.submit(Request(f"{tag}-{i}", names[i % len(names)], prompt=i, max_new_tokens=args.tokens,
                             window=window)) for i in range(args.requests)]
    t0 = time.perf_counter()
    w.drain(timeout=args.timeout)
    wall = time.perf_counter() - t0
    for f in futs:
        f.result()
    chain = [(s, e) for lane, _seq, s, e in w.marks if lane == CHAIN_LANE]
    side = [(s, e) for lane, _seq, s, e in w.marks if lane == SIDE_LANE]
    t_first = chain[0][0]
    span = chain[-1][1].seconds_since(t_first)
    inside = 0.0  # side-step time that falls inside the chain's span
    for s, e in side:
        inside += max(0.0, min(span, e.seconds_since(t_first)) - max(0.0, s.seconds_since(t_first)))
    return {"mode": mode, "requests": args.requests, "tokens": args.tokens, "window": window,
            "chain_steps": len(chain), "side_steps": len(side), "codec_steps": w.stats["steps_codec"] - before,
            "chain_span_s": span, "chain_tokens_per_s": args.requests * args.tokens / span,
            "chain_busy_s": sum(e.seconds_since(s) for s, e in chain),
            "side_busy_s": sum(e.seconds_since(s) for s, e in side), "side_inside_chain_s": inside,
            "wall_s": wall, "graphs_captured": len(w.chain.graphs)}


def run_modes(args) -> dict:
    """Every mode on an engine of its own: one warm-up run each (kernels compile, graphs are
    captured), then ``args.repeats`` rounds, the modes interleaved in each so that drift in the
    machine's speed falls on all of them (the order turns round by round, so that no mode always
    runs first, and each run starts from a collected heap); per mode, the run of median chain
    throughput, and every run's figures."""
    engines = {m: _engine(args, side_lane=(m == "side")) for m in MODES}
    try:
        for m in MODES:
            run_once(args, engines[m], m, "warm")
        runs = {m: [] for m in MODES}
        for rep in range(args.repeats):
            for k in range(len(MODES)):
                m = MODES[(rep + k) % len(MODES)]
                gc.collect()
                runs[m].append(run_once(args, engines[m], m, f"r{rep}"))
        out = {}
        for m in MODES:
            ranked = sorted(runs[m], key=lambda r: r["chain_tokens_per_s"])
            out[m] = {**ranked[len(ranked) // 2], "runs": [r["chain_tokens_per_s"] for r in runs[m]]}
        return out
    finally:
        for eng in engines.values():
            eng.close()


def summarize(results: dict) -> dict:
    """The target's figures: each mode's median run against alone's, and, steadier against drift,
    the median over rounds of each round's ratio to that round's alone run."""
    alone = results["alone"]
    summary = {}
    for m in ("side", "on_chain"):
        rounds = [x / a for x, a in zip(results[m]["runs"], alone["runs"])]
        summary[f"{m}_vs_alone"] = results[m]["chain_tokens_per_s"] / alone["chain_tokens_per_s"]
        summary[f"{m}_vs_alone_rounds"] = rounds
        summary[f"{m}_vs_alone_median_of_rounds"] = statistics.median(rounds)
    summary["on_chain_extra_s"] = results["on_chain"]["chain_span_s"] - alone["chain_span_s"]
    summary["codec_time_s"] = results["side"]["side_busy_s"]
    return summary


def side_host_cost(windows: int = 14, steps: int = 2000, warmup: int = 200, window: int = 16) -> dict:
    """The side lane's host work per side step on the cpu, every thread's part run inline, in
    microseconds (medians over ``steps``): ``cut`` (the chain's postprocess cutting the step's
    ``windows`` windows and queueing them), ``launch`` (take, the batch, submit; the GPU thread's
    part not counted), ``execute`` (the GPU thread's part: marks, staging, copies, launch; the
    codec's own device work not counted), ``finish`` (postprocess, once landed). The executor
    and the lane's host stream run their work at once, on the calling thread, so that no wait
    and no thread handoff is counted: what is left is the Python that every side step puts on
    the chain's critical path (the main loop's thread and the GPU thread share one interpreter)."""
    from concurrent.futures import Future

    from ..device import HostEvent
    from ..engine.scheduler import SIDE_LANE
    from ..engine.worker import Request, _Live

    args = argparse.Namespace(device="cpu", requests=windows, tokens=window, window=window, hidden=32, layers=1,
                              rank=4, adapters=1, page_size=16, codec_width=16, codec_layers=1, no_graphs=True)
    eng = _engine(args, side_lane=True)
    w, model = eng.worker, eng.model
    lane = w.side_lanes[SIDE_LANE]
    timed = {"execute": 0.0, "device": 0.0}

    class Inline:  # an executor and a host stream that run their work now
        def submit(self, fn, *a):
            f = Future()
            t0 = time.perf_counter()
            f.set_result(fn(*a))
            timed["execute"] = time.perf_counter() - t0
            return f

        def enqueue(self, fn, *a):
            fn(*a)

        def record(self):
            ev = HostEvent()
            ev._set()
            return ev

        def close(self):
            pass

    lane.stream.stream.close()
    lane.stream.stream = inline = Inline()
    forward = model.codec_forward

    def timed_forward(bufs):
        t0 = time.perf_counter()
        forward(bufs)
        timed["device"] = time.perf_counter() - t0
    model.codec_forward = timed_forward
    total = steps + warmup
    lives = []
    for i in range(windows):
        req = Request(f"h{i}", None, prompt=i, max_new_tokens=window * (total + 1), window=window)
        lives.append(w._live.setdefault(req.rid, _Live(req, Future())))
    out = {k: [] for k in ("cut", "launch", "execute", "finish", "total")}
    try:
        for step in range(total):
            for live in lives:
                live.tokens.extend(range(window))
            t0 = time.perf_counter()
            cut = []
            for live in lives:
                if len(live.tokens) == live.next_cut:
                    w._cut_window(live, cut)
            w.scheduler.put_many(cut)
            t1 = time.perf_counter()
            lane.launch(inline)
            t2 = time.perf_counter()
            lane.finish(block=True)
            t3 = time.perf_counter()
            if step >= warmup:
                execute = timed["execute"] - timed["device"]
                parts = (t1 - t0, t2 - t1 - timed["execute"], execute, t3 - t2)
                for k, v in zip(out, parts + (sum(parts),)):
                    out[k].append(v * 1e6)
        assert all(len(live.windows) == total for live in lives), "every window postprocessed once"
    finally:
        eng.close()
    return {k: statistics.median(v) for k, v in out.items()}


def _meta(argv) -> dict:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "lora-cupy bench lane " + " ".join(argv)}
    meta["commit"] = commit()
    meta["device"] = "cpu"
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora-cupy bench lane", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default: cuda:0)")
    p.add_argument("--requests", type=int, default=64, help="requests decoding at once (default 64)")
    p.add_argument("--tokens", type=int, default=256, help="tokens each request decodes (default 256)")
    p.add_argument("--window", type=int, default=16, help="a codec window every this many tokens (default 16)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--codec-width", type=int, default=2048)
    p.add_argument("--codec-layers", type=int, default=96, help="codec work per window batch (default 96 layers)")
    p.add_argument("--no-graphs", action="store_true", help="run the chain's steps eagerly")
    p.add_argument("--repeats", type=int, default=7, help="measured rounds after a warm-up (default 7)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--side-host-cost", type=int, metavar="WINDOWS",
                   help="instead: the side lane's host work per side step of WINDOWS windows, on the cpu, "
                        "every thread's part run inline (side_host_cost)")
    args, _ = parse(p, argv)
    if args.side_host_cost:
        cost = side_host_cost(args.side_host_cost, window=max(1, args.window))
        print(f"side lane host work per side step of {args.side_host_cost} windows (us, cpu, inline): " +
              ", ".join(f"{k} {v:.1f}" for k, v in cost.items()))
        return 0
    meta = _meta(argv)
    if args.device.startswith("cuda"):
        import cupy

        idx = int(args.device.split(":")[1]) if ":" in args.device else 0
        meta["device"] = cupy.cuda.runtime.getDeviceProperties(idx)["name"].decode()
    results = run_modes(args)
    summary = summarize(results)
    print(f"{'mode':<10} {'tokens/s':>12} {'chain span s':>13} {'chain steps':>12} {'side steps':>11}  rounds (tokens/s)")
    for m in MODES:
        r = results[m]
        print(f"{m:<10} {r['chain_tokens_per_s']:12.0f} {r['chain_span_s']:13.4f} {r['chain_steps']:12d} "
              f"{r['side_steps']:11d}  {' / '.join(f'{x:.0f}' for x in r['runs'])}")
    print(f"side lane keeps {100 * summary['side_vs_alone']:.1f}% of the chain's throughput (target >= 95%; "
          f"median of the rounds' ratios {100 * summary['side_vs_alone_median_of_rounds']:.1f}%); "
          f"windows on the chain keep {100 * summary['on_chain_vs_alone']:.1f}% "
          f"({100 * summary['on_chain_vs_alone_median_of_rounds']:.1f}%; "
          f"+{summary['on_chain_extra_s']:.4f} s for {summary['codec_time_s']:.4f} s of codec work)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "args": vars(args), "results": results, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
