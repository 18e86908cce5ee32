"""What ``lora_expand_glu`` saves a prefill's gated MLP (dev tool, not shipped): one Llama-8B-shaped
gate_up target (4096 -> 14336 / 14336, rank 16), 8 requests x 512 rows on 8 adapters, CUDA events,
median of ``REPS`` calls after warm-up, us:

- with adapters: the target's shrink, then either its two member expands in place (``lora_expand_ring``)
  followed by the model's ``silu(g) * u`` in torch, or one ``lora_expand_glu`` into h;
- base: torch's ``silu(g) * u`` against ``lora_expand_glu`` with no addressing (the plain activation).

Each figure: 10 calls captured in one CUDA graph, device time per call (host work left out).

    PYTHONPATH=. python raw_kernels/dev/glu_probe.py
"""
import os

import numpy as np
import torch
import torch.nn.functional as F

from lora_cupy.addressing import group_by_slot
from lora_cupy.backends.base import LayerWeights, member_weights
from lora_cupy.backends.cupy import CupyBackend
from lora_cupy.bench.overlap import graph_us
from lora_cupy.planning import LaunchViews
from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget

REPS = int(os.environ.get("REPS", "30"))
T, IN, INTER, R, S = 8 * 512, 4096, 14336, 16, 9
dt = torch.bfloat16
target = LoraTarget("gate_up_proj", IN, 2 * INTER, 1, (LoraSlice("gate_proj", INTER), LoraSlice("up_proj", INTER)))
spec = LoraSpec((target,), num_slots=S, max_rank=R, dtype="bfloat16", capture_buckets=(64, T))
be = CupyBackend(spec)
gen = torch.Generator(device="cuda").manual_seed(0)
a = torch.randn(S, 2, R, IN, device="cuda", generator=gen).to(dt) / 64
b = torch.randn(S, 2 * INTER, R, device="cuda", generator=gen).to(dt) / 4
scaling = torch.full((S, 2), 2.0, device="cuda")
ranks = torch.full((S, 2), R, dtype=torch.int32, device="cuda")
a[0].zero_(), b[0].zero_(), scaling[0].zero_(), ranks[0].zero_()
w = LayerWeights(a, b, scaling, ranks, target.out_offsets())
whole = be.prepare(w)
members = [be.prepare(member_weights(w, j)) for j in range(2)]
order, indptr = group_by_slot(np.repeat(np.arange(1, 9), 512), S)
views = LaunchViews(T, 0, torch.from_numpy(order).cuda(), torch.from_numpy(indptr).cuda())
x = torch.randn(T, IN, device="cuda", generator=gen).to(dt)
g0 = torch.randn(T, INTER, device="cuda", generator=gen).to(dt)
u0 = torch.randn(T, INTER, device="cuda", generator=gen).to(dt)
g, u, h = g0.clone(), u0.clone(), torch.empty_like(g0)


def timed(fn) -> float:
    """Device us per call: 10 calls captured in one CUDA graph, median over REPS replays."""
    return graph_us(fn, calls=10, reps=REPS)


def unfused():
    whole.half("shrink", x, views, T)
    for j, out in enumerate((g, u)):
        members[j].half("expand", out, views, T)
    return F.silu(g) * u


def fused():
    whole.half("shrink", x, views, T)
    whole.glu(g0, u0, h, views, T)


rows = {
    "shrink alone (then v cleared)": timed(lambda: (whole.half("shrink", x, views, T), be.clear_v())),
    "adapters: shrink + 2 ring expands + torch silu*mul": timed(unfused),
    "adapters: shrink + lora_expand_glu": timed(fused),
    "base: torch silu(g) * u": timed(lambda: F.silu(g0) * u0),
    "base: lora_expand_glu, no addressing": timed(lambda: whole.glu(g0, u0, h, None, T)),
}
# correctness spot check against float64 on a few rows
fused()
torch.cuda.synchronize()
for name, us in rows.items():
    print(f"| {name} | {us:.1f} |")
gb = (2 * T * INTER * 2 + T * INTER * 2) / 1e9
print(f"fused activation bytes {gb:.3f} GB: {gb / (rows['base: lora_expand_glu, no addressing'] * 1e-6) / 1e3:.2f} TB/s plain, "
      f"{gb / ((rows['adapters: shrink + lora_expand_glu'] - rows['shrink alone (then v cleared)']) * 1e-6) / 1e3:.2f} TB/s with the delta")
rs = [0, 511, 512, 2047, 4095]
t_idx = torch.tensor(rs, device="cuda")
slots = torch.from_numpy(np.repeat(np.arange(1, 9), 512)[rs]).cuda()
xs = x[t_idx].double()
dg = torch.stack([2.0 * (xs[i] @ a[slots[i], 0].double().T) @ b[slots[i], :INTER].double().T for i in range(len(rs))])
du = torch.stack([2.0 * (xs[i] @ a[slots[i], 1].double().T) @ b[slots[i], INTER:].double().T for i in range(len(rs))])
ref = F.silu(g0[t_idx].double() + dg) * (u0[t_idx].double() + du)
err = float((h[t_idx].double() - ref).norm() / ref.norm())
print(f"spot check, rows {rs}: relative error {err:.2e} against float64")
