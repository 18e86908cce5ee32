"""Where a prefill step's added time goes (dev tool, not shipped): one eager step prefilling 8
requests of 512 tokens on the e2e bench's Llama-shaped model, with and without adapters. Prints the
step's device time between CUDA events and its host phases (perf_counter: admission, the pool's
admit and plan, the forward's launches, the wait for the tokens), median of 5 steps; then, for one
more step under torch.profiler, the CUDA time per kernel name (largest first), the device's busy
time and its idle gaps; the Chrome trace of that step (CPU and CUDA) is written under ``$OUT``.
With ``CPROFILE=1`` the 5 timed steps also run under cProfile: the host functions with the most
time of their own (the forward's launches left out), and the time Python's collector took. With
``GARBAGE=1``, 3 more steps under ``gc.DEBUG_SAVEALL``: the types of what only the collector frees
(reference cycles made by a step, which set the collector off).

    PYTHONPATH=. OUT=/tmp/trace python raw_kernels/dev/prefill_profile.py
"""
import cProfile
import functools
import gc
import pstats
import os
import statistics
import tempfile
import time
from collections import Counter, defaultdict
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
use_cprofile = os.environ.get("CPROFILE") == "1"
use_garbage = os.environ.get("GARBAGE") == "1"
gc_ms = []


def gc_timer(phase, info, t0=[0.0]):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        gc_ms.append((info["generation"], (time.perf_counter() - t0[0]) * 1e3))


gc.callbacks.append(gc_timer)


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


def kernel_report(prof, label: str) -> None:
    rows, spans = {}, []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.key] = (t, e.count)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, end = 0.0, None
    for s, t in spans:
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    total = sum(t for t, _ in rows.values())
    span = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    print(f"== {label}: {total / 1000:.2f} ms of CUDA time, device busy {busy / 1e3:.2f} of {span:.2f} ms")
    for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"{t / 1000:8.3f} ms {c:4d}x  {k[:110]}")


with tempfile.TemporaryDirectory() as tmp:
    adapters = e2e.write_adapters(model, Path(tmp), 8, 16)
    spec = spec_for_adapters(model, adapters, num_slots=33)
    pool = LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in adapters.items()})
    names = sorted(adapters)
    rng = np.random.default_rng(2)
    for label, ads in (("base", [None]), ("adapters", names)):
        gen = e2e.generator(model, pool, max_batch=8, max_len=520, max_prefill=8, cuda_graphs=False)
        for attr in ("_admit_new", "_pool_step", "_forward", "_emit", "_count_slots", "_finish"):
            setattr(gen, attr, timed(attr, getattr(gen, attr)))
        for obj, attrs in ((pool, ("admit", "plan", "commit", "remove_request", "snapshot")),
                           (gen.queue, ("pump", "cancel")), (gen.cache, ("move_row", "begin"))):
            for attr in attrs:
                setattr(obj, attr, timed(f"{type(obj).__name__}.{attr}", getattr(obj, attr)))
        gen.decoder.forward = timed("decoder.forward", gen.decoder.forward)  # an instance attribute
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
        prof_host = cProfile.Profile() if use_cprofile else None
        gc_ms.clear()
        for _ in range(5):
            submit()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            if prof_host:
                prof_host.enable()
            gen.step()
            if prof_host:
                prof_host.disable()
            end.record()
            end.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
            dev.append(start.elapsed_time(end))
        print(f"== {label}: step device {statistics.median(dev):.2f} ms, host wall {statistics.median(wall):.2f} ms")
        for k, v in phases.items():  # per step: the median step's sum over its calls
            per = len(v) // 5
            sums = [sum(v[i * per:(i + 1) * per]) for i in range(5)] if per else [0.0]
            print(f"   {k:28s} {statistics.median(sums):8.3f} ms host  x{per}")
        print(f"   gc: {len(gc_ms)} collections in 5 steps, {sum(t for _, t in gc_ms):.3f} ms "
              f"(generations {sorted(g for g, _ in gc_ms)})")
        if prof_host:
            st = pstats.Stats(prof_host)
            st.sort_stats("tottime").print_stats(r"lora_cupy/(?!integrations/attach)|threading|cupy|numpy|queue", 28)
            st.sort_stats("cumulative").print_callees(r"_emit|_finish|remove_request|_admit_new|_pool_step")
        submit()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            gen.step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(out_dir / f"prefill_{label}.json"))
        kernel_report(prof, label)
        if use_garbage:  # what the collector finds unreachable after 3 more steps: reference cycles
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            for _ in range(3):
                submit()
                gen.step()
            gc.collect()
            kinds = Counter(type(o).__qualname__ for o in gc.garbage)
            print(f"   garbage after 3 steps: {len(gc.garbage)} objects: {kinds.most_common(12)}")
            seen = set()
            for o in gc.garbage:  # one example of each type that is not a plain container
                t = type(o).__qualname__
                if t in seen or t in ("dict", "list", "tuple", "set", "cell"):
                    continue
                seen.add(t)
                code = getattr(o, "f_code", None) or getattr(o, "__code__", None)
                print(f"     {type(o).__module__}.{t}: {code if code is not None else repr(o)[:160]}")
                if len(seen) >= 15:
                    break
            gc.set_debug(0)
            gc.garbage.clear()
        del gen.decoder.forward
        for obj, attrs in ((pool, ("admit", "plan", "commit", "remove_request", "snapshot")),):
            for attr in attrs:
                delattr(obj, attr)
        gen.close()
    pool.close()
