"""How a graph decode step's deltas sit beside the base model's kernels (dev tool, not shipped):
the e2e bench's decode step (batch 64, ~128 cached tokens, CUDA graphs, 8 or 32 adapters) replayed
under torch.profiler, with the deltas forked to the side stream (the default) and in line. Prints,
per run, the replay's device span, the LoRA kernels' own time, how much of it ran while a kernel
of the base model ran too (overlap), and the base kernels' time; Chrome traces go under ``$OUT``.

    PYTHONPATH=. OUT=/tmp/trace python raw_kernels/dev/decode_trace.py [adapters ...]
"""
import os
import sys
import tempfile
from pathlib import Path

import torch

from lora_cupy.bench import e2e
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

out_dir = Path(os.environ.get("OUT", "."))
counts = [int(a) for a in sys.argv[1:]] or [8, 32]
model = e2e.build_model(e2e.MODEL, "bfloat16", "cuda")


def merged(spans):
    spans = sorted(spans)
    out = []
    for s, t in spans:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return out


def inter(a, b):
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def analyse(prof, label):
    lora, base = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        (lora if e.name.startswith("lora_") or "lora_" in e.name[:40] else base).append(
            (e.time_range.start, e.time_range.end))
    ml, mb = merged(lora), merged(base)
    span = max(t for _, t in lora + base) - min(s for s, _ in lora + base)
    own = sum(t - s for s, t in ml)
    print(f"{label}: span {span:8.1f} us | LoRA kernels {len(lora):3d}, {own:7.1f} us, beside a base kernel "
          f"{inter(ml, mb):7.1f} us | base kernels {len(base):4d}, {sum(t - s for s, t in mb):7.1f} us")


with tempfile.TemporaryDirectory() as tmp:
    adapters = e2e.write_adapters(model, Path(tmp), max(counts), 16)
    spec = spec_for_adapters(model, adapters, num_slots=33)
    pool = LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in adapters.items()})
    names = sorted(adapters)
    for count in counts:
        for overlap in (True, False):
            gen = e2e.generator(model, pool, max_batch=64, max_len=192, max_prefill=8, cuda_graphs=True,
                                overlap=None if overlap else False)
            e2e.fill(gen, 64, 128, names[:count], 60)
            for _ in range(70):
                gen.step()
                if len(gen.running) == 64 and len(gen.history) >= 3 and all(h.decode_rows == 64 for h in gen.history[-3:]):
                    break
            graph = gen.graphs.last
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            label = f"{count} adapters, {'forked' if overlap else 'in line'}"
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(out_dir / f"decode_{count}_{'forked' if overlap else 'inline'}.json"))
            analyse(prof, label)
            gen.close()
            for rid in list(gen.running):
                pool.remove_request(rid)
    pool.close()
