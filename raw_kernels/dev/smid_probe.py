"""Which multiprocessor each block of a one-wave grid lands on (dev probe, outside the wheel).

lora_chunk's blocks that share a multiprocessor share its L1, which its stage copies go through
(NOTES.md, "cp.async through L1"); whether an item order can make them read the same rows of A and B
depends on where the hardware puts block b. This launches a grid of `--blocks-per-sm` x SMs blocks of
128 threads, each holding `--smem` bytes of dynamic shared memory (so that many fit a multiprocessor,
as lora_chunk's plan sizes its grid), each spinning a little so that all are resident at once, and
records %smid per block; it prints how often blocks b and b + SMs share a multiprocessor, and the
first blocks' placement.

    PYTHONPATH=. python raw_kernels/dev/smid_probe.py [--blocks-per-sm 4] [--smem 42496]
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

SRC = r"""
extern "C" __global__ void probe(int* smid, long long spin) {
  extern __shared__ char pad[];
  if (threadIdx.x == 0) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    smid[blockIdx.x] = (int)s;
    pad[0] = (char)s;
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {}
  }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks-per-sm", type=int, default=4)
    ap.add_argument("--smem", type=int, default=42496, help="dynamic shared memory a block (bytes)")
    ap.add_argument("--spin", type=int, default=200000, help="clock cycles each block waits before it leaves")
    args = ap.parse_args()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    fn = cp.RawKernel(SRC, "probe")
    fn.max_dynamic_shared_size_bytes = args.smem
    n = sms * args.blocks_per_sm
    out = cp.full(n, -1, dtype=cp.int32)
    for _ in range(2):  # the first launch warms the module
        fn((n,), (128,), (out, np.int64(args.spin)), shared_mem=args.smem)
    cp.cuda.runtime.deviceSynchronize()
    s = out.get()
    per_sm = np.bincount(s, minlength=sms)
    same = np.mean([s[b] == s[b + sms] for b in range(n - sms)])
    print(f"{sms} SMs, {n} blocks, blocks a multiprocessor min {per_sm.min()} max {per_sm.max()}; "
          f"blocks b and b + {sms} on one multiprocessor: {same:.2f} of them")
    print("block -> smid, the first 40:", " ".join(str(v) for v in s[:40]))
    for k in range(args.blocks_per_sm):
        print(f"blocks {k * sms}..{k * sms + 7}:", " ".join(str(v) for v in s[k * sms:k * sms + 8]))


if __name__ == "__main__":
    main()
