"""The bench's layer rows on the shipped default (lora_pair at the decode buckets): the four calls back
to back warm, each call alone warm, and each call's shrink alone and expand alone (each launch
repeated in a graph, the bench's Timer), to tell which of the pair's launches a call waits on.

    PYTHONPATH=. python raw_kernels/dev/pair_alone.py [--rows 64x8,64x32]
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def main() -> None:
    import torch

    from lora_cupy.addressing import group_by_slot
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import CupyBackend, check_call
    from lora_cupy.bench.kernels import LAYER_RANK, LAYER_SLOTS, LAYER_TARGETS, Timer
    from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64x8,64x32")
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    warm = Timer(args.replays, "diff", "none")
    S, R = LAYER_SLOTS, LAYER_RANK
    targets = tuple(LoraTarget(nm, i, sum(sl), 1, tuple(LoraSlice(f"{nm}{j}", o) for j, o in enumerate(sl)))
                    for nm, i, sl in LAYER_TARGETS)
    spec = LoraSpec(targets, num_slots=S, max_rank=R, dtype="bfloat16")
    be = CupyBackend(spec, early_reads=True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for row in args.rows.split(","):
        T, adapters = (int(v) for v in row.split("x"))
        order, indptr = group_by_slot(1 + (np.arange(T) * adapters) // T, S)
        to, ip = torch.as_tensor(order, device="cuda"), torch.as_tensor(indptr, device="cuda")
        calls = []
        for t in targets:
            n, out, in_f = t.num_slices, t.out_features, t.in_features
            a = (torch.randn(S, n, R, in_f, device="cuda", generator=gen) / math.sqrt(in_f)).bfloat16()
            b = (torch.randn(S, out, R, device="cuda", generator=gen) / math.sqrt(8)).bfloat16()
            w = LayerWeights(a, b, torch.full((S, n), 2.0, device="cuda"),
                             torch.full((S, n), R, dtype=torch.int32, device="cuda"), t.out_offsets())
            x = torch.randn(T, in_f, device="cuda", generator=gen).bfloat16()
            y = torch.zeros(T, out, device="cuda").bfloat16()
            call = check_call(be.limits, y, x, w, to, ip)
            calls.append((t.name, call, (a, b, w, x, y)))
        parts = {"call": ("shrink", "expand"), "shrink": ("shrink",), "expand": ("expand",)}

        def layer():
            for _, c, _ in calls:
                be._run(c)

        line = f"{row:7s} layer {warm(layer):6.1f} |"
        for nm, c, _ in calls:
            got = [warm(lambda c=c, p=p: be._run(c, p)) for p in parts.values()]
            line += f" {nm} {c.plan.expand} " + "/".join(f"{v:.1f}" for v in got)
        print(line, flush=True)


if __name__ == "__main__":
    main()
