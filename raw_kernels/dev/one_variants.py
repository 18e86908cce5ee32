"""lora_one variants beside the shipped kernel at one position, in one process: dev modules of their
own (lora_mma.cu with one.cuh in place of the shipped header, its ONE_ROWS or cluster size
changed, and a copy of the kernel built for more threads a block), bf16, ALIGNED. For each row and
variant: the call's us (the bench's Timer, flushed and warm) and the relative difference of its y
from the shipped kernel's (tests/gpu/test_one_gpu.py checks the shipped kernel against float64).

    PYTHONPATH=. python raw_kernels/dev/one_variants.py [--variants one:128x4,one:256x2,one16:128x4]

A variant is SOURCE:THREADSxROWS: `one` (one.cuh), or `one16` in clusters of 16 blocks (a non-portable size: the function's attribute is set,
the grid rounded up to whole clusters; each block sums a sixteenth of `in`), threads a block, rows
(slice, rank) a warp sums at once.
"""


from __future__ import annotations

import argparse
import dataclasses

#: CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (CUfunction_attribute)
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14

KERNEL = r"""
template <typename T, int RW, bool ALIGNED, int THREADS>
__global__ void __cluster_dims__(lora::ONE_CLUSTER, 1, 1) __launch_bounds__(THREADS) lora_one_v(LORA_PARAMS) {
  __shared__ lora::OneStep st;
  __shared__ float part[lora::ONE_SLICES * RW], vs[lora::ONE_SLICES * RW];
  LORA_ARGS;
  if (!lora::one_setup(g, st)) return;
  lora::OneCol<T, RW, ALIGNED> pc;
  lora::one_prefetch<T, RW, ALIGNED>(g, st, blockIdx.x, gridDim.x, pc);
  lora::one_shrink<T, RW, ALIGNED>(g, st, part, lora::cluster_rank());
  lora::cluster_arrive();
  lora::cluster_wait();
  lora::one_sum<RW>(n_slices, st, vs, [&](int b, int e) { return lora::cluster_load(part, b, e); });
  lora::cluster_arrive();
  __syncthreads();
  lora::one_expand<T, RW, ALIGNED>(g, st, vs, blockIdx.x, gridDim.x, pc);
  lora::cluster_wait();
}
"""
def variant_source(source: str, rows: int) -> str:
    """lora_mma.cu with one.cuh (its ONE_ROWS set to ``rows``; clusters of 16 for ``one16``) in place
    of the include, and lora_one_v."""
    from lora_cupy import kernels as K

    kd = K.kernel_dir()
    one = (kd / "one.cuh").read_text()
    want = "constexpr int ONE_ROWS = 4;"
    assert want in one, "one.cuh's ONE_ROWS changed: update the variant source"
    one = one.replace(want, f"constexpr int ONE_ROWS = {rows};")
    if source.endswith("16"):
        cl = "constexpr int ONE_CLUSTER = 8;"
        assert cl in one, "one.cuh's ONE_CLUSTER changed: update the variant source"
        one = one.replace(cl, "constexpr int ONE_CLUSTER = 16;")
    return (kd / "lora_mma.cu").read_text().replace('#include "one.cuh"', one) + KERNEL


def module(source: str, rows: int, threads: list[int]):
    """The dev module of one source and ONE_ROWS: lora_one_v at each thread count, rank widths 16 and 64."""
    from lora_cupy import kernels as K

    names = [f"lora_one_v<__nv_bfloat16, {rw}, true, {t}>" for rw in (16, 64) for t in threads]
    return K.source_module(variant_source(source, rows), "lora_one_v.cu", names)


def main() -> None:
    import cupy
    import torch

    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import CupyBackend, PackedLaunch, check_call
    from lora_cupy.bench.kernels import Row, Timer, build

    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="one:128x4,one:256x2,one16:128x4")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rows", default="", help="comma-separated row labels to time (default: all)")
    args = ap.parse_args()
    variants = [(v.split(":")[0], *(int(k) for k in v.split(":")[1].split("x"))) for v in args.variants.split(",")]
    mods = {(src, rows): module(src, rows, sorted({t for s_, t, r in variants if (s_, r) == (src, rows)}))
            for src, rows in {(s_, r) for s_, _, r in variants}}
    rows_ = [("o r16", Row("core", 1, 4096, (4096,), (16,), 16)),
             ("qkv r16", Row("shapes", 1, 4096, (4096, 1024, 1024), (16,), 16)),
             ("gate_up r16", Row("layer", 1, 4096, (14336, 14336), (16,), 16)),
             ("down r16", Row("shapes", 1, 14336, (4096,), (16,), 16)),
             ("o r64", Row("core", 1, 4096, (4096,), (64,), 64)),
             ("down r64", Row("shapes", 1, 14336, (4096,), (64,), 64))]
    if args.rows:
        rows_ = [(lb, r) for lb, r in rows_ if lb in args.rows.split(",")]
    flushed, warm = Timer(args.replays, "diff", "write"), Timer(args.replays, "diff", "none")
    print(f"{'row':12s} " + " ".join(f"{'shipped' if v is None else f'{v[0]}:{v[1]}x{v[2]}':>17s}"
                                     for v in [None, *variants])
          + "   (us flushed / warm; * = y off the shipped kernel's by more than 1e-3)")
    for label, row in rows_:
        d = build(row, 0)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        be = CupyBackend(d.spec, expand="one")
        call = check_call(be.limits, d.y, d.x, w, d.token_order, d.slot_indptr)
        kc = be._kernels(call)[0]
        rw = 16 if d.spec.max_rank <= 16 else 64
        launches = [PackedLaunch([kc])]
        for src, t, r in variants:
            fn = mods[(src, r)].get_function(f"lora_one_v<__nv_bfloat16, {rw}, true, {t}>")
            grid = kc.grid
            if src.endswith("16"):  # clusters of 16: the attribute, and whole clusters
                cupy.cuda.driver.funcSetAttribute(fn.kernel.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                grid = (-(-grid[0] // 16) * 16, 1, 1)
            launches.append(PackedLaunch([dataclasses.replace(kc, fn=fn, fn_aligned=fn, block=(t, 1, 1), grid=grid)]))
        ys, cells = [], []
        for pl in launches:
            d.y.copy_(d.y0)
            pl.run(torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            ys.append(d.y.double() - d.y0.double())
            def fn(pl=pl):
                pl.run(torch.cuda.current_stream().cuda_stream)
            cells.append((flushed(fn), warm(fn)))
        ref = ys[0]
        errs = [float(torch.linalg.norm(y - ref) / torch.linalg.norm(ref)) for y in ys]
        print(f"{label:12s} " + " ".join(f"{f:7.1f} / {w_:5.1f}{'*' if e > 1e-3 else ' '}  " for (f, w_), e in
                                        zip(cells, errs)), flush=True)


if __name__ == "__main__":
    main()
