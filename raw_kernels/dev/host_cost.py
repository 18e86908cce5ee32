"""What a step costs on the host (dev tool, not shipped): the e2e bench's eager prefill step (8 x 512
tokens) and eager decode step (batch 64, 8 adapters) under cProfile, with and without adapters;
prints each step's host ms and the functions that take the most time of their own, then the host
us of one delta call alone (no sync between calls) per kernel route.

    PYTHONPATH=. python raw_kernels/dev/host_cost.py
"""
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lora_cupy.bench import e2e
from lora_cupy.integrations import GenerationRequest
from lora_cupy.integrations.attach import as_backend_array
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

model = e2e.build_model(e2e.MODEL, "bfloat16", "cuda")


def report(label, prof, top=22):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    print(f"== {label}")
    for ln in lines[:top + 8]:
        print("  " + ln[:150])


with tempfile.TemporaryDirectory() as tmp:
    adapters = e2e.write_adapters(model, Path(tmp), 8, 16)
    spec = spec_for_adapters(model, adapters, num_slots=33)
    pool = LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in adapters.items()})
    names = sorted(adapters)
    rng = np.random.default_rng(2)
    for label, ads in (("base", [None]), ("adapters", names)):
        gen = e2e.generator(model, pool, max_batch=8, max_len=520, max_prefill=8, cuda_graphs=False)
        n = [0]

        def submit():
            for i in range(8):
                gen.submit(GenerationRequest(f"{label}{n[0]}", rng.integers(0, 1000, 512).tolist(), ads[i % len(ads)],
                                             max_new_tokens=1))
                n[0] += 1
            e2e.wait_host_copies(gen.pool, ads)

        for _ in range(2):
            submit(); gen.step()
        submit()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        gen.step()
        prof.disable()
        torch.cuda.synchronize()
        print(f"prefill {label}: {(time.perf_counter() - t0) * 1e3:.2f} ms wall under cProfile")
        report(f"prefill {label}", prof)
        gen.close()
    # one delta call's host time per route, the queue kept deep (no sync)
    gen = e2e.generator(model, pool, max_batch=64, max_len=200, max_prefill=64, cuda_graphs=False)
    e2e.fill(gen, 64, 128, names, 40)
    for T in (64,):  # the plan of the last decode step (64 rows)
        for t in pool.spec.targets:
            d = pool.layer_delta(t.name, 0)
            x = torch.randn(T, t.local_in_features(1), dtype=torch.bfloat16, device="cuda")
            y = torch.zeros(T, t.local_out_features(1), dtype=torch.bfloat16, device="cuda")
            xa, ya = as_backend_array(x, True), as_backend_array(y, True)
            for _ in range(5):
                d(ya, xa)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                d(ya, xa)
            host = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for _ in range(200):
                as_backend_array(x, True), as_backend_array(y, True)
            conv = (time.perf_counter() - t1) / 200 * 1e6
            print(f"delta call host: T={T} {t.name}: {host:.1f} us a call; as_backend_array x2: {conv:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        d(ya, xa)
    prof.disable()
    torch.cuda.synchronize()
    report("200 delta calls", prof, 18)
    gen.close()
    pool.close()
