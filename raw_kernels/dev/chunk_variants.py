"""lora_chunk (the ticket launch) with a patch to chunk.cuh beside the shipped kernel, in one process,
under several caps on a chunk's parts.

An experiment kept outside the wheel, run against the checkout on ``PYTHONPATH``. The patch (a
unified diff of raw_kernels/chunk.cuh, as ``git diff`` writes it) is applied to the header's text
and built into a dev module of its own (lora_mma.cu with the patched header in place of its
include; bf16, ALIGNED, the instantiations the rows' plans name). For each row (bf16, the bench's
data, the ticket kernel) and each cap ``P`` of ``--parts`` (``CHUNK_MAX_PARTS``,
the most parts a chunk is cut into): the shipped kernel and the patched one under the same plan,
each checked against the float64 oracle and timed with the bench's timer (difference of graphs of
20 calls, 256 MB write flush), us the call and the blocks of its grid. ``--stages N``: the patch
gives the ticket launch N stages (``chunk_stages4.patch``), so the variant launches with the shared
memory of N stages (its grid stays the shipped plan's: pick rows where as many blocks still fit).

    PYTHONPATH=. python raw_kernels/dev/chunk_variants.py --patch raw_kernels/dev/chunk_one_pass_sums.patch --parts 32,64
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

#: group, T, in, slices, rank, adapters: the decode rows of rank 64 that goal 1 misses, and beside them
#: the same at rank 16 and at 256 and 1024 positions
ROWS = [("core", T, 4096, (4096,), r, s) for T in (16, 64) for r in (16, 64) for s in (1, 8, 32)]
ROWS += [("shapes", 64, i, (o,), 64, 8) for i, o in ((4096, 14336), (14336, 4096))]
ROWS += [("core", T, 4096, (4096,), 64, s) for T in (256, 1024) for s in (1, 8)]
#: the layer's targets other than o (rank 16) at 64 positions, each alone
ROWS += [("layer", 64, i, o, 16, s) for s in (8, 32)
         for i, o in ((4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (14336, (4096,)))]


def apply_patch(text: str, diff: str) -> str:
    """``text`` with the hunks of a one-file unified diff applied, each found by its old lines
    (context and removals) at or after the previous hunk's end; a hunk not found is an error."""
    hunks = re.split(r"^@@[^\n]*@@[^\n]*\n", diff, flags=re.M)[1:]
    if not hunks:
        raise ValueError("the patch has no hunks")
    lines, at = text.split("\n"), 0
    for h in hunks:
        body = [ln for ln in h.split("\n") if ln[:1] in (" ", "+", "-") and not ln.startswith(("---", "+++"))]
        old = [ln[1:] for ln in body if ln[:1] in (" ", "-")]
        new = [ln[1:] for ln in body if ln[:1] in (" ", "+")]
        for i in range(at, len(lines) - len(old) + 1):
            if lines[i:i + len(old)] == old:
                lines[i:i + len(old)] = new
                at = i + len(new)
                break
        else:
            raise ValueError(f"a hunk of the patch does not apply: {old[:3]}")
    return "\n".join(lines)


def module(patch: Path, names: list[str]):
    """The dev module: lora_mma.cu with the patched chunk.cuh in place of its include (sm_90a on Hopper,
    as the shipped family)."""
    from lora_cupy import kernels as K

    kd = K.kernel_dir()
    chunk = apply_patch((kd / "chunk.cuh").read_text(), patch.read_text())
    src = (kd / "lora_mma.cu").read_text()
    assert '#include "chunk.cuh"' in src, "lora_mma.cu no longer includes chunk.cuh: update the script"
    src = src.replace('#include "chunk.cuh"', chunk)
    return K.source_module(src, "lora_chunk_variant.cu", names)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patch", type=Path, required=True, help="a unified diff of raw_kernels/chunk.cuh")
    ap.add_argument("--parts", default="32", help="comma-separated caps on a chunk's parts (CHUNK_MAX_PARTS)")
    ap.add_argument("--match", default="", help="only rows whose label holds this text")
    ap.add_argument("--stages", type=int, default=3, help="the stages the patched kernel has (its shared memory)")
    args = ap.parse_args(argv)

    import torch

    from lora_cupy import kernels as K
    from lora_cupy.backends import cupy as cb
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.bench.kernels import Row, Timer, build, oracle_error

    timer = Timer()
    caps = [int(p) for p in args.parts.split(",") if p]
    rows = [Row(g, T, i, o, (r,) * s, r) for g, T, i, o, r, s in ROWS]
    rows = [r for r in rows if args.match in r.label]
    saved = cb.CHUNK_MAX_PARTS

    def kernel_call(d, w, cap):
        """lora_chunk's call of row d under cap (the ticket launch, at every bucket), and the backend
        whose workspace and counters its arguments point at (keep it while launching)."""
        cb.CHUNK_MAX_PARTS = cap
        cb.plan_launch.cache_clear()
        try:
            be = cb.CupyBackend(d.spec, fused=False, expand="chunk")
            call = cb.check_call(be.limits, d.y, d.x, w, d.token_order, d.slot_indptr)
            (kc,) = be._kernels(call)
        finally:
            cb.CHUNK_MAX_PARTS = saved
            cb.plan_launch.cache_clear()
        assert call.plan.expand == "chunk" and not call.plan.cluster, call.plan
        name = K.chunk_name(cb.CUDA_TYPES[d.spec.dtype], cb.chunk_geometry(d.spec.max_rank)[0], call.plan.bm,
                            aligned=True, sliced=call.plan.sliced)
        return kc, call.plan, name, be

    # every instantiation the rows' plans launch, built into one module
    names = set()
    for row in rows:
        d = build(row, 0)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        names.update(kernel_call(d, w, cap)[2] for cap in caps)
    mod = module(args.patch, sorted(names))
    print(f"patch {args.patch.name}; us the call / blocks of the grid (!: off the float64 oracle past the tolerance)")
    print(f"{'row':40s} " + " ".join(f"{'p' + str(c) + ' shipped':>12s} {'p' + str(c) + ' patched':>12s}" for c in caps))
    for row in rows:
        d = build(row, 0)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        cells = []
        for cap in caps:
            kc, plan, name, be = kernel_call(d, w, cap)
            fn = mod.get_function(name)
            R, bm = d.spec.max_rank, plan.bm
            smem = kc.smem - cb.chunk_smem(row.dtype, R, bm) + cb.chunk_smem(row.dtype, R, bm, args.stages)
            fn.max_dynamic_shared_size_bytes = smem
            for pl in (cb.PackedLaunch([kc]), cb.PackedLaunch([dataclasses.replace(kc, fn=fn, fn_aligned=fn, smem=smem)])):
                assert pl.aligned, "the bench's data takes the ALIGNED instantiation"
                run = lambda pl=pl: pl.run(torch.cuda.current_stream().cuda_stream)  # noqa: E731
                d.y.copy_(d.y0)
                run()
                torch.cuda.synchronize()
                bad = not oracle_error(d, d.y) < cb.TOLERANCE[row.dtype]
                cells.append(f"{timer(run):6.1f}/{plan.blocks}{'!' if bad else ' '}")
        print(f"{row.label:40s} " + " ".join(f"{c:>12s}" for c in cells), flush=True)
        del be  # the backend (workspace, counters) of the last cap's launches
        d = w = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
