"""Where an eager prefill step's wall time goes on the host (dev tool, not shipped): the e2e bench's
prefill step (8 requests x 512 tokens, Llama-shaped model) with and without adapters, host phases
timed with perf_counter (admission, the pool's admit and plan, the forward's launches, the wait for
the tokens), the step's device time between CUDA events beside them, and a torch.profiler trace of
each (CPU and CUDA activities) written as Chrome JSON under ``$OUT`` for a look at the device's idle gaps.

    PYTHONPATH=. OUT=/tmp/trace python raw_kernels/dev/step_trace.py
"""
import functools
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from lora_cupy.bench import e2e
from lora_cupy.integrations import GenerationRequest
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

out_dir = Path(os.environ.get("OUT", "."))
model = e2e.build_model(e2e.MODEL, "bfloat16", "cuda")
phases = defaultdict(list)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        with torch.profiler.record_function(name):
            try:
                return fn(*a, **k)
            finally:
                phases[name].append((time.perf_counter() - t0) * 1e3)
    return wrapper


with tempfile.TemporaryDirectory() as tmp:
    adapters = e2e.write_adapters(model, Path(tmp), 8, 16)
    spec = spec_for_adapters(model, adapters, num_slots=33)
    pool = LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in adapters.items()})
    names = sorted(adapters)
    rng = np.random.default_rng(2)
    for label, ads in (("base", [None]), ("adapters", names)):
        gen = e2e.generator(model, pool, max_batch=8, max_len=520, max_prefill=8, cuda_graphs=False)
        for attr in ("_admit_new", "_pool_step", "_forward", "_emit"):
            setattr(gen, attr, timed(attr, getattr(gen, attr)))
        gen.decoder.forward = timed("decoder.forward", gen.decoder.forward)
        gen.lm_head.forward = timed("lm_head", gen.lm_head.forward)
        n = [0]

        def submit():
            for i in range(8):
                gen.submit(GenerationRequest(f"{label}{n[0]}", rng.integers(0, 1000, 512).tolist(), ads[i % len(ads)],
                                             max_new_tokens=1))
                n[0] += 1
            e2e.wait_host_copies(gen.pool, ads)

        submit(); gen.step()
        phases.clear()
        dev, wall = [], []
        for _ in range(5):
            submit()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            gen.step()
            end.record()
            end.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
            dev.append(start.elapsed_time(end))
        print(f"== {label}: device {statistics.median(dev):.2f} ms, host wall {statistics.median(wall):.2f} ms")
        for k, v in phases.items():
            print(f"   {k:18s} {statistics.median(v):8.3f} ms  x{len(v) // 5}")
        submit()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            gen.step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(out_dir / f"prefill_{label}.json"))
        gen.close()
    pool.close()
