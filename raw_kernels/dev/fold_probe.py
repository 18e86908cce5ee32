"""What folding a prefill's expand into the base GEMM would cost (dev probe, not shipped).

A prefill's expand reads and writes the whole output y (gate/up at 4096 rows: 235 MB each). With
``y = [x | V] @ [W | B_c]^T`` (V: each row's scaled v in its slot's column block, zeros elsewhere;
B_c: the step's slots' B side by side) the base GEMM adds the delta on its way and y is written
once. This times, with torch on one GPU, each piece against the base GEMM for the e2e bench's
shapes at T rows (medians of CUDA-event timings, every call eager as a prefill runs):

- ``base``: ``x @ W.T``; ``base_pitch``: the same with W a view of ``[out, in + P]``;
- ``fold``: ``[x | V] @ [W | B_c]^T`` (K = in + P);
- ``pack``: x copied into the wider buffer; ``mask``: V written from every slot's v (one-hot rows);
- ``addmm``: ``y += V @ B_c^T`` through cuBLAS (the read-modify-write the fold avoids);
- ``ext_rows``: ``x @ [A_c ; W]^T`` (every step slot's v beside y in one GEMM) and ``vgemm`` alone.

    PYTHONPATH=. python raw_kernels/dev/fold_probe.py [--rows 4096] [--reps 50]
"""
import argparse
import statistics

import torch


def timeit(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    T, kb, R = args.rows, args.slots, args.rank
    P = kb * R
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"T={T}, {kb} slots, rank {R} (P={P} columns), bf16, us (median of {args.reps})")
    print(f"{'shape':22s} {'base':>7s} {'pitch':>7s} {'fold':>7s} {'pack':>7s} {'mask':>7s} {'addmm':>7s} "
          f"{'ext_rows':>8s} {'vgemm':>7s}")
    for name, inf, out, n in (("q 4096->4096", 4096, 4096, 3), ("k 4096->1024", 4096, 1024, 3),
                              ("gate 4096->14336", 4096, 14336, 2), ("o 4096->4096", 4096, 4096, 1),
                              ("down 14336->4096", 14336, 4096, 1)):
        x = torch.randn(T, inf, device=dev, dtype=dt, generator=g)
        We = torch.randn(out, inf + P, device=dev, dtype=dt, generator=g) * 0.02
        W = We[:, :inf].contiguous()
        Xe = torch.zeros(T, inf + P, device=dev, dtype=dt)
        Xe[:, :inf].copy_(x)
        V = torch.randn(T, P, device=dev, dtype=dt, generator=g)
        Bc = torch.randn(out, P, device=dev, dtype=dt, generator=g)
        y = torch.empty(T, out, device=dev, dtype=dt)
        Wr = torch.randn(n * P + out, inf, device=dev, dtype=dt, generator=g) * 0.02
        vall = torch.randn(T, kb, n, R, device=dev, dtype=dt, generator=g)
        onehot = torch.zeros(T, kb, 1, 1, device=dev, dtype=dt)
        onehot[torch.arange(T, device=dev), torch.randint(0, kb, (T,), device=dev, generator=g)] = 1
        Vv = Xe[:, inf:].view(T, kb, R)
        t = {
            "base": timeit(lambda: torch.mm(x, W.t(), out=y), args.reps),
            "pitch": timeit(lambda: torch.mm(x, We[:, :inf].t(), out=y), args.reps),
            "fold": timeit(lambda: torch.mm(Xe, We.t(), out=y), args.reps),
            "pack": timeit(lambda: Xe[:, :inf].copy_(x), args.reps),
            "mask": timeit(lambda: torch.mul(vall[:, :, 0:1, :], onehot, out=Vv.unsqueeze(2)), args.reps),
            "addmm": timeit(lambda: y.addmm_(V, Bc.t()), args.reps),
            "ext_rows": timeit(lambda: torch.mm(x, Wr.t()), args.reps),
            "vgemm": timeit(lambda: torch.mm(x, Wr[:n * P].t()), args.reps),
        }
        print(f"{name:22s} " + " ".join(f"{t[k]:7.1f}" if k != "ext_rows" else f"{t[k]:8.1f}" for k in t))
        del x, We, W, Xe, V, Bc, y, Wr, vall, onehot
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
