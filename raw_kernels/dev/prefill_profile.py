"""Where a prefill step's added time goes (dev tool, not shipped): one eager step prefilling 8
requests of 512 tokens on the e2e bench's Llama-shaped model, with and without adapters, under
torch.profiler; prints the CUDA time per kernel name, largest first, and the totals.

    PYTHONPATH=. python raw_kernels/dev/prefill_profile.py
"""
import tempfile
from pathlib import Path

import numpy as np
import torch

from lora_cupy.bench import e2e
from lora_cupy.integrations import GenerationRequest
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

model = e2e.build_model(e2e.MODEL, "bfloat16", "cuda")
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

        submit(); gen.step(); submit(); gen.step()
        submit()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gen.step()
            torch.cuda.synchronize()
        gen.close()
        rows = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t:
                rows[e.key] = (t, e.count)
        total = sum(t for t, _ in rows.values())
        print(f"== {label}: {total / 1000:.2f} ms of CUDA time")
        for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:14]:
            print(f"{t / 1000:8.3f} ms {c:4d}x  {k[:110]}")
    pool.close()
