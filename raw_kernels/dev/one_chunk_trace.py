"""Where a decode layer's lora_one calls spend their time, phase by phase (dev tool, not shipped).

The bench's layer (T positions over ADAPTERS adapters, the four targets at rank 16, bf16) with
lora_one in chunks launched as a traced copy (`lora_one_trace`, built here in a dev module of its
own: lora_mma.cu plus the chunk branch of `lora_one` with `%globaltimer` stamps written by each
block's thread 0 into the `ws` argument, which lora_one does not use). The layer is captured in one
CUDA graph as a model's step runs it (programmatic dependent launch, early reads) and replayed;
after each replay the stamps are read back. Printed per call, medians over the replays:

- span: the call's first block's entry to its last block's exit; gap: its first entry less the
  previous call's last exit (negative: the launches overlap);
- ramp: the last block's entry less the first's;
- each phase's median and largest duration over the blocks: entry (the arguments and
  `enter_grid`), count (slot_indptr read into shared memory and the chunks counted), setup (the first
  item's addressing), wait (for the grid before), shrink, the cluster barrier after it, the sum of
  the parts, the expand, the closing barrier.

    PYTHONPATH=. python raw_kernels/dev/one_chunk_trace.py --layer 64x8,64x32 [--replays 50] [--clusters 16,32]

The traced kernel must mirror `lora_one`'s chunk branch in lora_mma.cu (checked: its y is compared
with the shipped kernel's before any timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

PHASES = ("entry", "count", "setup", "wait", "shrink", "barrier", "sum", "expand", "close")
STAMPS = len(PHASES) + 1
BLOCKS = 512  # the most blocks a traced launch may have (ONE_CHUNK_CLUSTERS x ONE_CLUSTER is 256)

KERNEL = r"""
__device__ __forceinline__ unsigned long long one_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
template <typename T, int RW, bool ALIGNED, int M>
__global__ void __cluster_dims__(lora::ONE_CLUSTER, 1, 1) __launch_bounds__(128, 3) lora_one_trace(LORA_PARAMS) {
  unsigned long long* stamp = reinterpret_cast<unsigned long long*>(ws) + blockIdx.x * STAMPS;
  unsigned long long t0 = one_now();
  LORA_ARGS;
  const bool early = flags & lora::EARLY_READS;
  lora::enter_grid<lora::ONE_CHUNK_RELEASE>(early);
  const unsigned long long t1 = one_now();
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::ChunkScan cs;
  __shared__ lora::OneChunk<M> st;
  constexpr int CH = 16 / sizeof(T);
  const int vf = M * n_slices * RW, per = ((in_features + CH - 1) / CH + lora::ONE_CLUSTER - 1) / lora::ONE_CLUSTER;
  const int xbytes = sizeof(T) == 4 ? 16 * M * per : 0;
  float* part = reinterpret_cast<float*>(dsmem);
  float* vs = part + vf;
  T* xs = reinterpret_cast<T*>(vs + vf);
  int* s_indptr = reinterpret_cast<int*>(dsmem + 8 * vf + xbytes);
  lora::count_chunks<M>(cs, s_indptr, slot_indptr, num_slots, positions);
  const unsigned long long t2 = one_now();
  const int clusters = gridDim.x / lora::ONE_CLUSTER, u = blockIdx.x / lora::ONE_CLUSTER, q = lora::cluster_rank();
  const int shares = max(1, clusters / max(cs.chunks, 1)), items = cs.chunks * shares;
  bool waited = !early;
  unsigned long long ts[STAMPS] = {t0, t1, t2};
  bool first = true;
  for (int it = u; it < items; it += clusters) {
    const bool live = lora::one_chunk_setup<T, M>(g, s_indptr, cs, st, it / shares);
    if (first) ts[3] = one_now();
    if (!waited) {
      lora::wait_prior_grid();
      waited = true;
    }
    if (first) ts[4] = one_now();
    if (!live) continue;
    const int blk = (it % shares) * lora::ONE_CLUSTER + q, blocks = shares * lora::ONE_CLUSTER;
    lora::one_chunk_shrink<T, RW, ALIGNED, M>(g, st, part, xs, q);
    if (first) ts[5] = one_now();
    lora::cluster_arrive();
    lora::cluster_wait();
    if (first) ts[6] = one_now();
    lora::one_chunk_sum<RW, M>(n_slices, st, vs, [&](int b, int f) { return lora::cluster_load4(part, b, f); });
    lora::cluster_arrive();
    __syncthreads();
    if (first) ts[7] = one_now();
    lora::one_chunk_expand<T, RW, ALIGNED, M>(g, st, vs, blk, blocks);
    if (first) ts[8] = one_now();
    lora::cluster_wait();
    if (first) ts[9] = one_now();
    first = false;
  }
  if (threadIdx.x == 0)
    for (int i = 0; i < STAMPS; ++i) stamp[i] = ts[i];
}
""".replace("STAMPS", str(STAMPS))


def module():
    import cupy

    from lora_cupy import kernels as K

    src = (K.kernel_dir() / "lora_mma.cu").read_text() + KERNEL
    opts = (*K.run_options(), *(f"-I{d}" for d in K.cuda_include_dirs()), f"-I{K.kernel_dir()}")
    return cupy.RawModule(code=src, options=opts,
                          name_expressions=["lora_one_trace<__nv_bfloat16, 16, true, 8>"])


def main() -> None:
    import cupy
    import torch

    from lora_cupy.addressing import group_by_slot
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import CupyBackend
    from lora_cupy.bench.kernels import LAYER_RANK, LAYER_SLOTS, LAYER_TARGETS
    from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget

    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", default="64x8,64x32", help="TxADAPTERS,...")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--clusters", default="", help="comma-separated ONE_CHUNK_CLUSTERS (default: the shipped one)")
    args = ap.parse_args()
    from lora_cupy.backends import cupy as cb
    fn = module().get_function("lora_one_trace<__nv_bfloat16, 16, true, 8>")
    S, R = LAYER_SLOTS, LAYER_RANK
    targets = tuple(LoraTarget(name, in_f, sum(sl), 1, tuple(LoraSlice(f"{name}{j}", o) for j, o in enumerate(sl)))
                    for name, in_f, sl in LAYER_TARGETS)
    spec = LoraSpec(targets, num_slots=S, max_rank=R, dtype="bfloat16")
    runs_of = [(spec_, int(c)) for spec_ in args.layer.split(",")
               for c in (args.clusters.split(",") if args.clusters else [cb.ONE_CHUNK_CLUSTERS])]
    for spec_, clusters in runs_of:
        T, adapters = (int(v) for v in spec_.split("x"))
        cb.ONE_CHUNK_CLUSTERS = clusters
        cb.plan_launch.cache_clear()  # plans are memoized: the new count applies from here
        be = CupyBackend(spec, early_reads=True)
        slots = 1 + (np.arange(T) * adapters) // T
        order, indptr = group_by_slot(slots, S)
        to, ip = torch.as_tensor(order, device="cuda"), torch.as_tensor(indptr, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(7)
        calls, bufs = [], []
        for t in targets:
            n, out, in_f = t.num_slices, t.out_features, t.in_features
            a = (torch.randn(S, n, R, in_f, device="cuda", generator=gen) / math.sqrt(in_f)).bfloat16()
            b = (torch.randn(S, out, R, device="cuda", generator=gen) / math.sqrt(8)).bfloat16()
            ranks = torch.full((S, n), R, dtype=torch.int32, device="cuda")
            scaling = torch.full((S, n), 2.0, dtype=torch.float32, device="cuda")
            x = torch.randn(T, in_f, device="cuda", generator=gen).bfloat16()
            y0 = (torch.randn(T, out, device="cuda", generator=gen) * 0.1).bfloat16()
            calls.append((t.name, LayerWeights(a, b, scaling, ranks, t.out_offsets()), x, y0))
        orig = be._kernels

        def traced(call, parts, buf):  # the backend's kernels, lora_one's swapped for the traced copy
            ks = orig(call, parts)
            out_ = []
            for k in ks:
                if "one" in k.name:
                    if k.grid[0] > BLOCKS:
                        raise SystemExit(f"{k.grid[0]} blocks: the stamps have room for {BLOCKS}")
                    a_ = list(k.args)
                    a_[9] = np.uint64(buf.data.ptr)
                    k = dataclasses.replace(k, fn=fn, fn_aligned=fn, args=tuple(a_))
                out_.append(k)
            return out_

        # the shipped kernel's y, then the traced kernel's, compared
        for name, w, x, y0 in calls:
            y1, y2 = y0.clone(), y0.clone()
            be.delta(y1, x, w, to, ip)
            buf = cupy.zeros(BLOCKS * STAMPS, cupy.uint64)
            bufs.append(buf)
            be._kernels = lambda c, p=("shrink", "expand"), buf=buf: traced(c, p, buf)
            be.delta(y2, x, w, to, ip)
            be._kernels = orig
            torch.cuda.synchronize()
            d1, d2 = y1.double() - y0.double(), y2.double() - y0.double()
            rel = float(torch.linalg.norm(d2 - d1) / torch.linalg.norm(d1))
            print(f"layer {T}x{adapters} {name}: traced y off the shipped kernel's by {rel:.1e} (relative; the "
                  f"shrink's shared atomics add in any order)", flush=True)
        ys = [y0.clone() for _, _, _, y0 in calls]

        def layer(be=be):
            for (name, w, x, _), y, buf in zip(calls, ys, bufs):
                be._kernels = lambda c, p=("shrink", "expand"), buf=buf: traced(c, p, buf)
                be.delta(y, x, w, to, ip)
            be._kernels = orig

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer()
        runs = []
        for _ in range(args.replays):
            for buf in bufs:
                buf.fill(0)
            g.replay()
            torch.cuda.synchronize()
            runs.append([buf.get().reshape(-1, STAMPS).astype(np.int64) for buf in bufs])
        print(f"layer {T}x{adapters}, {clusters} clusters: medians over {args.replays} replays (ns; phase: median / largest over blocks)")
        print(f"  {'call':8s} {'span':>6s} {'gap':>6s} {'ramp':>6s} " + " ".join(f"{p:>13s}" for p in PHASES))
        for i, (name, *_rest) in enumerate(calls):
            span, gap, ramp, ph = [], [], [], []
            for run in runs:
                st = run[i]
                st = st[st[:, 0] > 0]
                live = st[(st[:, 1:] > 0).all(axis=1)]
                span.append(st.max() - st[:, 0].min())
                ramp.append(st[:, 0].max() - st[:, 0].min())
                if i:
                    prev = run[i - 1]
                    prev = prev[prev[:, 0] > 0]
                    gap.append(st[:, 0].min() - prev.max())
                d = np.diff(live, axis=1) if len(live) else np.zeros((1, len(PHASES)), np.int64)
                ph.append(np.stack([np.median(d, axis=0), d.max(axis=0)]))
            ph = np.median(np.stack(ph), axis=0)
            cells = " ".join(f"{int(m):6d}/{int(x):6d}" for m, x in zip(ph[0], ph[1]))
            print(f"  {name:8s} {int(np.median(span)):6d} {int(np.median(gap)) if gap else 0:6d} "
                  f"{int(np.median(ramp)):6d} {cells}", flush=True)
        del g, be


if __name__ == "__main__":
    main()
