"""The e2e bench's prefill row (8 requests x 512 tokens on 8 adapters, 20 rounds alternating with
base steps in one generator, ``e2e.prefill_row``) under host-tier variants, in one process (dev
tool, not shipped).

``VARIANTS`` (comma-separated, in order): ``fresh`` (each round's requests are the only ones
naming their adapters, so the host tier drops each copy with them and reads all eight again before
the next adapter step: ``prefill_row(..., hold=False)``); ``held`` (the copies held for the whole
row, the row's default); ``fresh-nogc`` (``fresh`` with Python's collector off for the row).
``PAUSE_S``: seconds to sleep after each round's copies are in, before its timed
step (base rounds too; the device idles meanwhile, which slows every step).

    PYTHONPATH=. VARIANTS=fresh,held,fresh,held python raw_kernels/dev/prefill_tier_ab.py
    PYTHONPATH=. VARIANTS=fresh-nogc,fresh,held python raw_kernels/dev/prefill_tier_ab.py
    PYTHONPATH=. PAUSE_S=0.05 VARIANTS=fresh,held python raw_kernels/dev/prefill_tier_ab.py
"""
import gc
import os
import tempfile
import time
from pathlib import Path

from lora_cupy.bench import e2e
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

VARIANTS = os.environ.get("VARIANTS", "fresh,held,fresh,held").split(",")
PAUSE_S = float(os.environ.get("PAUSE_S", "0"))
if PAUSE_S:
    real_wait = e2e.wait_host_copies
    e2e.wait_host_copies = lambda pool, names: (real_wait(pool, names), time.sleep(PAUSE_S))
model = e2e.build_model(e2e.MODEL, "bfloat16", "cuda")
with tempfile.TemporaryDirectory() as tmp:
    ads = e2e.write_adapters(model, Path(tmp), 8, 16)
    pool = LoraAdapterPool(spec_for_adapters(model, ads, num_slots=33), "cuda:0",
                           adapters={k: str(v) for k, v in ads.items()})
    names = sorted(ads)
    for label in VARIANTS:
        if label == "fresh-nogc":
            gc.collect()
            gc.disable()
        r = e2e.prefill_row(model, pool, names, 20, hold=label == "held")
        gc.enable()
        print(f"{label}{f', {PAUSE_S} s pause' if PAUSE_S else ''}: {r['ms']:.3f} ms against base "
              f"{r['base_ms']:.3f} ms: {r['ms'] / r['base_ms']:.3f}x, paired {r['paired_ratio']:.3f}x", flush=True)
    pool.close()
