"""A/B (outside the package): ``lora_expand_v`` with and without programmatic dependent launch
inside ``bench e2e``'s CUDA-graph decode steps (the attachment's default path), alternating in one
process: base, then for each row PDL on, off, on, off (``pool.backend.pdl``), each a fresh
generator whose decode graph is captured anew, medians of ``--reps`` replays.

    PYTHONPATH=. python raw_kernels/dev/pdl_ab.py --reps 30
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from pathlib import Path

import torch

from lora_cupy.bench.e2e import MODEL, build_model, decode_row, write_adapters
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

ROWS = (("decode b1 graphs 1 adapter", 1, 1), ("decode b64 graphs 8 adapters", 64, 8),
        ("decode b64 graphs 32 adapters", 64, 32))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model = build_model(MODEL, "bfloat16", "cuda")
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
          f"commit {os.environ.get('COMMIT', '?')}: `python raw_kernels/dev/pdl_ab.py --reps {args.reps}`\n")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(model, Path(tmp), 32, 16)
        spec = spec_for_adapters(model, adapters, num_slots=33)
        pool = LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in adapters.items()})
        names = sorted(adapters)
        supported = pool.backend.pdl
        print("| case | base ms | PDL on ms (ratio) | PDL off ms (ratio) | PDL on, each run | PDL off, each run |")
        print("|---|---|---|---|---|---|")
        try:
            for case, batch, k in ROWS:
                base = decode_row(model, pool, batch, [None], True, args.reps)["ms"]
                on, off = [], []
                for _ in range(args.rounds):
                    for flag, got in ((supported, on), (False, off)):
                        pool.backend.pdl = flag
                        got.append(decode_row(model, pool, batch, names[:k], True, args.reps)["ms"])
                pool.backend.pdl = supported
                med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
                each = lambda v: ", ".join(f"{a:.3f}" for a in v)  # noqa: E731
                print(f"| {case} | {base:.3f} | {med(on):.3f} ({med(on) / base:.3f}x) | "
                      f"{med(off):.3f} ({med(off) / base:.3f}x) | {each(on)} | {each(off)} |", flush=True)
        finally:
            pool.close()


if __name__ == "__main__":
    main()
