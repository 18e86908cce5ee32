"""Where the e2e prefill row's adapter step spends its device time, phase by phase, under
host-tier variants (dev tool, not shipped). Each timed step of ``e2e.prefill_row`` gets CUDA
events at its phase boundaries: start; admit and plan done (the device idles until here: host
work before the first launch); the forward's tokens read (a sync); the step's end (host work
after the sync: commit, slot state, finishing the requests). Medians over the row's adapter steps
and base steps, in ms, with the host's own time of each phase (perf_counter).

``VARIANTS`` (comma-separated, in order):
- ``fresh``: the tier reads the eight copies again each round (``hold=False``);
- ``held``: the copies held for the whole row (the row's default);
- ``held-cold``: held, and a 64 MB copy in the main thread at the start of each step (inside
  the step the row times, so its ``ms`` include the copy; the phase events do not);
- ``fresh-pin``/``held-pin``: the main thread pinned to one CPU, the reader thread to the rest;
- ``held-idle``: held, and the device left idle before each adapter step (not the base steps) for
  as long as the last ``fresh`` variant's rounds waited for their reads (median);
- ``held-idle-both``: the same idle before the base steps too;
- ``held-spin``: held, and the main thread spinning in Python (no sleep) for that long before each
  adapter step; ``held-spin-both``: before the base steps too;
- ``fresh-busy``: fresh, with the device kept busy (bf16 matmuls) while the reads run, then
  synchronized, so the timed step does not start on a device that idled through the reads.

    PYTHONPATH=. VARIANTS=fresh,held,held-idle,held-idle-both python raw_kernels/dev/prefill_phases.py
    PYTHONPATH=. VARIANTS=fresh,held,held-spin,held-spin-both python raw_kernels/dev/prefill_phases.py
"""
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lora_cupy.bench import e2e
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

VARIANTS = os.environ.get("VARIANTS", "fresh,held,held-idle,held-idle-both,held-spin,held-spin-both").split(",")
PHASES = ("pre", "fwd", "post")
records: list[dict] = []
cold = {"on": False}
scratch = [np.ones(8 << 20), np.empty(8 << 20)]  # 64 MB each


def instrument(gen):
    """Events and host clocks at the step's phase boundaries (prefill steps only)."""
    real_step, real_forward = gen.step, gen._forward
    wrap(gen, "_admit_new")

    def step():
        if cold["on"]:
            np.copyto(scratch[1], scratch[0])
        rec = {"ev": [torch.cuda.Event(enable_timing=True)], "t": [time.perf_counter()]}
        rec["ev"][0].record()
        current["rec"] = rec
        out = real_step()
        current["rec"] = None
        rec["ev"].append(torch.cuda.Event(enable_timing=True))
        rec["ev"][-1].record()
        rec["t"].append(time.perf_counter())
        if len(rec["ev"]) == 4:
            records.append(rec)
        return out

    def forward(row0, inputs):
        rec = current["rec"]
        mark("forward>")
        rec["ev"].append(torch.cuda.Event(enable_timing=True))
        rec["ev"][-1].record()
        rec["t"].append(time.perf_counter())
        got = real_forward(row0, inputs)
        rec["ev"].append(torch.cuda.Event(enable_timing=True))
        rec["ev"][-1].record()
        rec["t"].append(time.perf_counter())
        rec["adapter"] = any(gen.records[r].request.adapter is not None for r in gen.running)
        return got

    gen.step, gen._forward = step, forward
    return gen


current = {"rec": None}


def mark(label: str) -> None:
    rec = current["rec"]
    if rec is not None:
        rec.setdefault("m", []).append((label, time.perf_counter()))


def wrap(obj, name: str) -> None:
    """Host marks around ``obj.name`` (an instance attribute shadows the method)."""
    real = getattr(obj, name)

    def wrapped(*a, **k):
        mark(f"{name}>")
        try:
            return real(*a, **k)
        finally:
            mark(f"{name}<")

    setattr(obj, name, wrapped)


def at_layer(module, args):
    mark("layer>")
    rec = current["rec"]
    if rec is not None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        rec.setdefault("layers", []).append((ev, time.perf_counter()))


real_wait = e2e.wait_host_copies
waits: list[float] = []
mode = {"idle_s": 0.0, "busy": False, "both": False, "spin": False}


def wait(pool, names):
    """The bench's wait for the host copies, timed; then the variant's idle or busy device."""
    t0 = time.perf_counter()
    adapter = any(n is not None for n in names)
    if mode["busy"] and adapter:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        copies = [pool.store.get(n) for n in set(names) if n is not None]
        while not all(c is None or c.done.is_set() for c in copies):
            for _ in range(4):
                a @ a
            torch.cuda.synchronize()
    real_wait(pool, names)
    if adapter:
        waits.append(time.perf_counter() - t0)
    if mode["idle_s"] and (adapter or mode["both"]):
        if mode["spin"]:
            end = time.perf_counter() + mode["idle_s"]
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(mode["idle_s"])
    if mode["busy"]:
        torch.cuda.synchronize()


e2e.wait_host_copies = wait
real_generator = e2e.generator
e2e.generator = lambda *a, **k: instrument(real_generator(*a, **k))


def summarize(label: str, recs: list[dict]) -> None:
    torch.cuda.synchronize()
    for kind in (True, False):
        rs = [r for r in recs if r["adapter"] is kind]
        dev = {p: statistics.median(r["ev"][i].elapsed_time(r["ev"][i + 1]) for r in rs) for i, p in enumerate(PHASES)}
        host = {p: statistics.median((r["t"][i + 1] - r["t"][i]) * 1e3 for r in rs) for i, p in enumerate(PHASES)}
        tot = statistics.median(r["ev"][0].elapsed_time(r["ev"][3]) for r in rs)
        print(f"{label:12s} {'adapter' if kind else 'base':7s} n={len(rs):2d} device total {tot:7.3f} | "
              + " ".join(f"{p} {dev[p]:6.3f}/{host[p]:6.3f}" for p in PHASES) + "  (device/host ms)", flush=True)
        # each layer's start and the forward's last launch, from the step's start: when the
        # device reached it against when the host launched it (device >= host: it waited)
        marks = []
        for k in range(len(rs[0].get("layers", []))):
            d = statistics.median(r["ev"][0].elapsed_time(r["layers"][k][0]) for r in rs)
            h = statistics.median((r["layers"][k][1] - r["t"][0]) * 1e3 for r in rs)
            marks.append(f"L{k} {d:6.3f}/{h:6.3f}")
        # the host's time between consecutive marks up to the first layer (median, us)
        labels = [m[0] for m in rs[0]["m"]]
        upto = labels.index("layer>") + 1
        gaps = []
        for k in range(upto):
            g = statistics.median((r["m"][k][1] - (r["t"][0] if k == 0 else r["m"][k - 1][1])) * 1e6 for r in rs)
            gaps.append(f"{labels[k]} +{g:.0f}")
        print(f"{'':12s} {'':7s} host us to each mark: " + " ".join(gaps), flush=True)
        print(f"{'':12s} {'':7s} layer starts, device/host ms from the step's start: " + "  ".join(marks), flush=True)


model = e2e.build_model(e2e.MODEL, "bfloat16", "cuda")
for layer in model.get_decoder().layers:
    layer.register_forward_pre_hook(at_layer)
for sub in ("embed_tokens", "rotary_emb"):
    m = getattr(model.get_decoder(), sub)
    m.register_forward_pre_hook(lambda mod, args, sub=sub: mark(f"{sub}>"))
    m.register_forward_hook(lambda mod, args, out, sub=sub: mark(f"{sub}<"))
main_cpu = sorted(os.sched_getaffinity(0))[0]
all_cpus = set(os.sched_getaffinity(0))
with tempfile.TemporaryDirectory() as tmp:
    ads = e2e.write_adapters(model, Path(tmp), 8, 16)
    pool = LoraAdapterPool(spec_for_adapters(model, ads, num_slots=33), "cuda:0",
                           adapters={k: str(v) for k, v in ads.items()})
    names = sorted(ads)
    reader = pool.store._thread.native_id
    wrap(pool, "admit")
    wrap(pool, "plan")
    read_s = 0.05
    for label in VARIANTS:
        pin = label.endswith("-pin")
        if pin:
            os.sched_setaffinity(0, {main_cpu})
            os.sched_setaffinity(reader, all_cpus - {main_cpu})
        cold["on"] = label == "held-cold"
        mode["busy"] = label == "fresh-busy"
        mode["idle_s"] = read_s if label in ("held-idle", "held-idle-both", "held-spin", "held-spin-both") else 0.0
        mode["both"], mode["spin"] = label.endswith("-both"), label.startswith("held-spin")
        records.clear()
        waits.clear()
        r = e2e.prefill_row(model, pool, names, 20, hold=label.startswith("held"))
        cold["on"] = False
        if label == "fresh" and waits:
            read_s = statistics.median(waits)
        if pin:
            os.sched_setaffinity(0, all_cpus)
            os.sched_setaffinity(reader, all_cpus)
        idled = f", then idled {mode['idle_s'] * 1e3:.1f} ms" if mode["idle_s"] else ""
        print(f"{label}: {r['ms']:.3f} ms against base {r['base_ms']:.3f} ms: {r['ms'] / r['base_ms']:.3f}x, "
              f"paired {r['paired_ratio']:.3f}x; adapter rounds waited {statistics.median(waits) * 1e3:.1f} ms "
              f"(median) for their copies{idled}", flush=True)
        summarize(label, records[-40:])
    pool.close()
