"""One gate_up call of the layer (4096 -> 2 x 14336, rank 16, T positions over `adapters`) through the
shipped lora_pair and through the prototype's pair (pair_proto.cu, its best variant), each launched
eagerly a few times, for Nsight Compute to set the two expands side by side:

    ncu --kernel-name regex:pair_expand --launch-skip 2 --launch-count 4 \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        python raw_kernels/dev/pair_ncu.py [--T 64 --adapters 32]
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def main() -> None:
    import torch

    from lora_cupy.addressing import group_by_slot
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import CupyBackend
    from lora_cupy.backends.launch_ex import PdlLauncher
    from lora_cupy.bench.kernels import LAYER_SLOTS
    from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget

    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--no-proto", action="store_true", help="the shipped kernels alone")
    args = ap.parse_args()
    S, R, T, in_f, sl = LAYER_SLOTS, 16, args.T, 4096, (14336, 14336)
    t = LoraTarget("gate_up", in_f, sum(sl), 1, tuple(LoraSlice(f"g{j}", o) for j, o in enumerate(sl)))
    spec = LoraSpec((t,), num_slots=S, max_rank=R, dtype="bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(3)
    order, indptr = group_by_slot(1 + (np.arange(T) * args.adapters) // T, S)
    to, ip = torch.as_tensor(order, device="cuda"), torch.as_tensor(indptr, device="cuda")
    a = (torch.randn(S, 2, R, in_f, device="cuda", generator=gen) / math.sqrt(in_f)).bfloat16()
    b = (torch.randn(S, sum(sl), R, device="cuda", generator=gen) / math.sqrt(8)).bfloat16()
    scaling = torch.full((S, 2), 2.0, device="cuda")
    w = LayerWeights(a, b, scaling, torch.full((S, 2), R, dtype=torch.int32, device="cuda"), t.out_offsets())
    x = torch.randn(T, in_f, device="cuda", generator=gen).bfloat16()
    y = torch.zeros(T, sum(sl), device="cuda").bfloat16()
    be = CupyBackend(spec, early_reads=True)
    proto = lambda y, x: None  # noqa: E731
    if not args.no_proto:
        import pair_proto as pp

        mod, _ = pp.module()
        proto = pp.Pair(mod, PdlLauncher(), a, b, scaling, [0, *np.cumsum(sl).tolist()], to, ip, T, S,
                        pp.EARLY | pp.E_RELEASE | pp.S_FIRST, 3, 4, 8)
    for _ in range(4):  # shipped, then the prototype, in turn
        be.delta(y, x, w, to, ip)
        proto(y, x)
    torch.cuda.synchronize()
    print("ran", T, "positions over", args.adapters, "adapters")


if __name__ == "__main__":
    main()
