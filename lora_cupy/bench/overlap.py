"""``lora-cupy bench overlap``: does a LoRA delta on a side stream run beside its base GEMM?

One linear of ``bench e2e``'s Llama-shaped model (layer 0; gate_up 4096->28672 and o 4096->4096,
bfloat16, rank 16), at decode sizes (T=1 with one adapter, T=64 with eight), each way timed as a
CUDA graph of 20 calls (median of 50 replays, per call):

- ``gemm``: the base GEMM alone; ``delta``: the pool's delta alone; ``add``: ``y += d`` alone;
- ``serial``: GEMM then delta on one stream (the attachment's in-line path);
- ``forked``: the delta into a zeroed scratch on a side stream forked before the GEMM, joined
  after it, then the add (the attachment's ``overlap`` path), with the side stream at the
  highest priority and at the default one.

If the delta ran beside the GEMM, ``forked`` would be near ``gemm + add``; if the GEMM holds every
multiprocessor until it is done, near ``gemm + delta + add`` less the launch gaps it hides.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
from pathlib import Path

from . import commit, emit, parse, wait_host_copies

CASES = ((1, 1), (64, 8))  # (rows, adapters)
TARGETS = ("gate_up_proj", "o_proj")


def graph_us(fn, calls: int = 20, reps: int = 50) -> float:
    """Median device microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _weight(model, target: str):
    import torch

    layer = model.model.layers[0]
    if target == "gate_up_proj":
        return torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
    return layer.self_attn.o_proj.weight


def run(args) -> dict:
    import torch

    from ..engine import LoraStep, ResourceReqConfig, StepContext
    from ..integrations.hf import spec_for_adapters
    from ..pool import LoraAdapterPool
    from .e2e import MODEL, build_model, write_adapters

    torch.set_grad_enabled(False)
    model = build_model({**MODEL, "num_hidden_layers": 1}, "bfloat16", "cuda").requires_grad_(False)
    hi, lo = torch.cuda.Stream(priority=-100), torch.cuda.Stream(priority=0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora-cupy-overlap-") as tmp:
        adapters = write_adapters(model, Path(tmp), max(a for _, a in CASES), 16)
        names = sorted(adapters)
        spec = spec_for_adapters(model, adapters, num_slots=len(names) + 1)
        with LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in adapters.items()}) as pool:
            for seq, (T, count) in enumerate(CASES, start=1):
                rids = [f"t{T}-{i}" for i in range(T)]
                for i, rid in enumerate(rids):
                    pool.ingest_request(rid, ResourceReqConfig(names[i % count]))
                wait_host_copies(pool, names[:count])
                step, ctx = LoraStep(rids, [1] * T, seq=seq), StepContext(seq=seq)
                if not pool.admit(step, ctx).ok:
                    raise RuntimeError(f"T={T}: the step was refused at admit")
                pool.plan(step, ctx)
                for target in TARGETS:
                    delta, w = pool.layer_delta(target, 0), _weight(model, target)
                    x = torch.randn(T, delta.in_features, dtype=torch.bfloat16, device="cuda")
                    y = torch.zeros(T, delta.out_features, dtype=torch.bfloat16, device="cuda")
                    d = torch.zeros_like(y)

                    def forked(side):
                        def fn():
                            side.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(side):
                                d.zero_()
                                delta(d, x)
                            torch.mm(x, w.t(), out=y)
                            torch.cuda.current_stream().wait_stream(side)
                            y.add_(d)
                        return fn

                    ways = {"gemm": lambda: torch.mm(x, w.t(), out=y), "delta": lambda: delta(y, x),
                            "add": lambda: y.add_(d),
                            "serial": lambda: (torch.mm(x, w.t(), out=y), delta(y, x)),
                            "forked_high": forked(hi), "forked_default": forked(lo)}
                    got = {k: round(graph_us(fn), 2) for k, fn in ways.items()}
                    rows.append({"rows": T, "adapters": count, "target": target, **got})
                    print(f"T={T} adapters={count} {target}: " + "  ".join(f"{k} {v:.1f}" for k, v in got.items()),
                          file=sys.stderr, flush=True)
                pool.commit(step, ctx)
                for rid in rids:
                    pool.remove_request(rid)
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(0), "commit": commit(),
            "command": "lora-cupy bench overlap " + " ".join(args.argv), "rows": rows}


def markdown(result: dict) -> str:
    cols = ("gemm", "delta", "add", "serial", "forked_high", "forked_default")
    lines = [f"{result['date']}, {result['gpu']}, commit {result['commit']}: `{result['command']}`", "",
             "| rows | adapters | target | " + " | ".join(f"{c} us" for c in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for r in result["rows"]:
        lines.append(f"| {r['rows']} | {r['adapters']} | {r['target']} | "
                     + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora-cupy bench overlap", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="write every number here")
    p.add_argument("--report", metavar="FILE", help="print a saved run (--json) as markdown and exit (no GPU)")
    args, rc = parse(p, argv, markdown)
    if rc is not None:
        return rc
    import torch

    if not torch.cuda.is_available():
        p.error("bench overlap times CUDA streams and graphs: it needs a CUDA device")
    return emit(run(args), markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
