"""One unfused delta call of a bench row, for Nsight Compute: each expand kernel once, after a warm-up
(``--kinds default``: the planner's own plan; ``chunk``: lora_chunk by ticket).

    ncu --kernel-name regex:lora_expand --launch-skip 3 --launch-count 3 --section SpeedOfLight \
        --section WarpStateStats python raw_kernels/dev/expand_profile.py --T 4096 --ranks 16 --slots 1

Runs ``expand``, ``expand_stream`` and ``expand_ring`` in that order, each twice (a warm-up, then the
call to profile), on the bench's data of the row (core group, ``--in-features`` -> ``--out``, bf16).
``--early`` runs the backend with early reads, as the bench's and the pool's do (lora_one's staged A in
``dev/one_stage_a.patch`` takes that path only).
"""

from __future__ import annotations

import argparse

import torch

from lora_cupy.backends.base import LayerWeights
from lora_cupy.backends.cupy import CupyBackend
from lora_cupy.bench.kernels import Row, build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--out", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--in-features", type=int, default=4096)
    ap.add_argument("--kinds", default="expand,expand_stream,expand_ring",
                    help="comma-separated expand kernels, or default (the planner's plan)")
    ap.add_argument("--early", action="store_true",
                    help="early_reads=True, as the bench's and the pool's backends (lora_one, lora_chunk and "
                         "lora_pair read the addressing and weights before their wait)")
    args = ap.parse_args()
    row = Row("core", args.T, args.in_features, (args.out,), (args.ranks,) * args.slots, args.ranks)
    d = build(row, 0)
    w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
    for expand in args.kinds.split(","):
        kw = dict(early_reads=args.early) | ({} if expand == "default" else dict(fused=False, expand=expand))
        be = CupyBackend(d.spec, **kw)
        for _ in range(2):
            be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
