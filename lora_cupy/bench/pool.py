"""``lora-cupy bench pool``: the pool's host-side cost per step and per layer call.

Per step, in the steady state: every row already holds its slot, as on every step after a
request's first, so ``admit`` is one set check and ``plan`` groups the rows by slot into the
fixed host buffer and queues its copy to the device (the copy's issue counts; its transfer does
not). Per layer call (on CUDA): the host time of one eager ``LoraLayerDelta`` call on torch
tensors, beside CuPy launching as many empty RawKernels as that call launches and a torch
``add_``, measured in the same run. Medians over many steps and calls. Adapters are random
weights made in memory (no files), served from startup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib

import numpy as np

from ..adapter import AdapterWeights, TargetWeights
from ..dtypes import numpy_dtype
from ..engine.resource import LoraStep, ResourceReqConfig, StepContext
from ..pool import LoraAdapterPool
from ..spec import LoraSpec, LoraTarget
from . import wait_host_copies

#: The targets of the benchmark: what a layer's weights are does not change host time.
_TARGETS = (LoraTarget("qkv_proj", 256, 384, 2), LoraTarget("o_proj", 256, 256, 2))


def _reader(rank: int):
    """Random adapters of ``rank`` at every target, made in memory (seeded by name)."""

    def read(path, spec: LoraSpec, name=None) -> AdapterWeights:
        rng = np.random.default_rng(zlib.crc32(str(name).encode()))  # str hash() differs per process
        dt = numpy_dtype(spec.dtype)
        targets = {}
        for t in spec.targets:
            L, n = t.num_layers, t.num_slices
            inl, outl = t.local_in_features(spec.tp_size), t.local_out_features(spec.tp_size)
            targets[t.name] = TargetWeights(
                a=(rng.standard_normal((L, n, rank, inl)) / np.sqrt(inl)).astype(dt),
                b=(rng.standard_normal((L, outl, rank)) / np.sqrt(rank)).astype(dt),
                ranks=np.full((L, n), rank, np.int32), scaling=np.ones((L, n), np.float32))
        return AdapterWeights(str(name), str(path), f"bench-{name}", targets)

    return read


def measure(device: str = "cpu", rows: int = 256, slots: int = 32, steps: int = 2000, tokens: int = 1,
            rank: int = 16, warmup: int = 50) -> dict:
    """Medians (microseconds) of a steady-state admit and plan; ``slots`` adapters, each in a slot."""
    spec = LoraSpec(_TARGETS, num_slots=slots + 1, max_rank=rank, dtype="float16")
    adapters = {f"a{i}": f"memory://a{i}" for i in range(slots)}
    pool = LoraAdapterPool(spec, device, adapters=adapters, reader=_reader(rank))
    try:
        rids = list(range(rows))
        for rid in rids:
            pool.ingest_request(rid, ResourceReqConfig(f"a{rid % slots}"))
        wait_host_copies(pool, adapters, 60)
        for rid in rids:
            pool.reserve(rid, spec.node, (spec.node,), False)
        step = LoraStep(rids, np.full(rows, tokens), node=spec.node)
        out = pool.admit(step, StepContext())
        if not out.ok:
            raise RuntimeError(f"the benchmark's first admit failed: {out.failed}")
        admit_ns, plan_ns = [], []
        clock = time.perf_counter_ns
        for i in range(warmup + steps):
            ctx = StepContext(seq=i)
            t0 = clock()
            pool.admit(step, ctx)
            t1 = clock()
            pool.plan(step, ctx)
            t2 = clock()
            pool.commit(step, ctx)
            if i >= warmup:
                admit_ns.append(t1 - t0)
                plan_ns.append(t2 - t1)
        pool.device.synchronize()
        return {
            "device": device, "rows": rows, "slots": slots, "tokens_per_row": tokens, "steps": steps,
            "admit_us_median": statistics.median(admit_ns) / 1e3,
            "plan_us_median": statistics.median(plan_ns) / 1e3,
            "admit_us_p90": statistics.quantiles(admit_ns, n=10)[-1] / 1e3,
            "plan_us_p90": statistics.quantiles(plan_ns, n=10)[-1] / 1e3,
        }
    finally:
        pool.close()


_EMPTY = 'extern "C" __global__ void lora_bench_empty() {}'


def measure_layer_call(device: str = "cuda:0", tokens: int = 64, adapters: int = 8, features: int = 4096,
                       rank: int = 16, calls: int = 3000, batch: int = 100) -> dict:
    """Medians (microseconds of host time) of one eager layer call with torch tensors, of CuPy
    launching as many empty RawKernels, and of a torch ``y.add_(x)``, each call timed alone, in
    batches of ``batch`` that take turns (the device synchronized between batches, untimed)."""
    import cupy
    import torch

    spec = LoraSpec((LoraTarget("o_proj", features, features, 1),), num_slots=adapters + 1, max_rank=rank,
                    dtype="bfloat16")
    pool = LoraAdapterPool(spec, device, adapters={f"a{i}": f"memory://a{i}" for i in range(adapters)},
                           reader=_reader(rank))
    try:
        rids = list(range(tokens))
        for rid in rids:
            pool.ingest_request(rid, ResourceReqConfig(f"a{rid % adapters}"))
        wait_host_copies(pool, [f"a{i}" for i in range(adapters)], 60)
        step, ctx = LoraStep(rids, np.ones(tokens, np.int32), node=spec.node), StepContext()
        if not pool.admit(step, ctx).ok:
            raise RuntimeError("the benchmark's admit failed")
        pool.plan(step, ctx)
        delta = pool.layer_delta("o_proj", 0)
        tdev = torch.device(device)
        x = torch.randn(tokens, features, device=tdev, dtype=torch.bfloat16)
        y = torch.randn(tokens, features, device=tdev, dtype=torch.bfloat16)
        delta(y, x)  # packs the bucket's launch
        layer = pool.backend.prepare(delta.weights)  # the same preparation, to count its kernels
        views = pool.current_plan().launch[1]
        layer(y, x, views, tokens)
        kernels = len(layer.packed(views).calls)
        empty = cupy.RawKernel(_EMPTY, "lora_bench_empty")
        stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream(tdev))

        def empties():
            for _ in range(kernels):
                empty((1,), (1,), ())

        fns = {"layer": lambda: delta(y, x), "empty": empties, "add": lambda: y.add_(x)}
        ns: dict[str, list[int]] = {k: [] for k in fns}
        clock = time.perf_counter_ns
        with stream:
            for fn in fns.values():
                for _ in range(3):  # warm-up
                    fn()
            for _ in range(calls // batch):  # batches of each in turn, so drift reaches all alike
                for k, fn in fns.items():
                    torch.cuda.synchronize(tdev)
                    for _ in range(batch):
                        t0 = clock()
                        fn()
                        ns[k].append(clock() - t0)
            torch.cuda.synchronize(tdev)
        layer_ns, empty_ns, add_ns = ns["layer"], ns["empty"], ns["add"]
        med = lambda v: statistics.median(v) / 1e3  # noqa: E731
        return {"device": device, "tokens": tokens, "adapters": adapters, "features": features, "rank": rank,
                "kernels_per_call": kernels, "calls": calls, "layer_call_us_median": med(layer_ns),
                "empty_launches_us_median": med(empty_ns), "torch_add_us_median": med(add_ns),
                "layer_over_empty": med(layer_ns) / med(empty_ns)}
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora-cupy bench pool", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default: cpu)")
    p.add_argument("--rows", type=int, default=256, help="rows (requests) per step (default: 256)")
    p.add_argument("--slots", type=int, default=32, help="adapter slots, all held (default: 32)")
    p.add_argument("--tokens", type=int, default=1, help="tokens per row (default: 1, decode)")
    p.add_argument("--steps", type=int, default=2000, help="measured steps (default: 2000)")
    p.add_argument("--layer-tokens", type=int, default=64, help="tokens of the layer-call step (default: 64)")
    p.add_argument("--layer-adapters", type=int, default=8, help="adapters of the layer-call step (default: 8)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    args = p.parse_args(argv)
    r = measure(args.device, args.rows, args.slots, args.steps, args.tokens)
    print(f"pool on {r['device']}: {r['rows']} rows x {r['tokens_per_row']} token(s) over {r['slots']} slots, "
          f"{r['steps']} steps")
    print(f"  admit (steady state)      median {r['admit_us_median']:8.2f} us   p90 {r['admit_us_p90']:8.2f} us")
    print(f"  plan (copy issue incl.)   median {r['plan_us_median']:8.2f} us   p90 {r['plan_us_p90']:8.2f} us")
    if args.device.startswith("cuda"):
        lc = r["layer_call"] = measure_layer_call(args.device, args.layer_tokens, args.layer_adapters)
        print(f"layer call, torch tensors, bf16 {lc['features']}->{lc['features']} r{lc['rank']}, "
              f"{lc['tokens']} tokens over {lc['adapters']} adapters ({lc['kernels_per_call']} kernel(s)), host time:")
        print(f"  LoraLayerDelta call        median {lc['layer_call_us_median']:8.2f} us")
        print(f"  {lc['kernels_per_call']} empty RawKernel launch(es) median {lc['empty_launches_us_median']:8.2f} us"
              f"   -> {lc['layer_over_empty']:.2f}x")
        print(f"  torch y.add_(x)            median {lc['torch_add_us_median']:8.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
