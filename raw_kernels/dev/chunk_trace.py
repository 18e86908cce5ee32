"""Where a lora_chunk call's parts spend their time, phase by phase (dev tool, not shipped).

A bench core row (`--rows`, labels as the bench prints them) with its default plan, lora_chunk at
any height (chunks of 128 in blocks of 256 threads, as the shipped kernel), launched as a traced copy
(`lora_chunk_trace`, built here in a dev module of its own: lora_mma.cu plus a copy of `chunk_task` /
`chunk_items` with `%globaltimer` stamps written by each block's thread 0 into an extra argument). The call is captured in one CUDA graph and replayed;
after each replay the stamps are read back. Printed per row, medians over the replays:

- span: the first block's entry to the last block's exit;
- for the blocks that took an item, each phase's median and largest duration over the blocks, for
  the block's first item (item blockIdx.x): count (slot_indptr staged, the chunks counted), setup
  (the chunk's rows, ranks and passes), shrink (its stages, the adds into v, the fence and the ready
  count), wait (for the chunk's other parts: a spin on the ready count added here, before the
  expand, which then finds the count complete), expand (its column blocks and the release of v),
  rest (further items, the done count).

The extra wait moves the shipped kernel's first y and B loads after the wait (the shipped expand
issues them before it), so the expand phase here is an upper bound; the traced y is compared with the
shipped kernel's before any timing.

    PYTHONPATH=. python raw_kernels/dev/chunk_trace.py --rows "core T1024 4096->4096 r64 s1" [--replays 30]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

PHASES = ("count", "setup", "shrink", "wait", "expand", "rest")
STAMPS = len(PHASES) + 1
BLOCKS = 1024  # the most blocks a traced launch may have

KERNEL = r"""
__device__ __forceinline__ unsigned long long chunk_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
template <typename T, int RW, int BM, bool ALIGNED, bool SLICED>
__global__ void __launch_bounds__(lora::Chunk<T, RW, BM>::NTHREADS, lora::Chunk<T, RW, BM>::BLOCKS_PER_SM)
    lora_chunk_trace(LORA_PARAMS, unsigned long long* stamps) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::ChunkRows<BM> tr;
  __shared__ lora::ChunkScan cs;
  __shared__ lora::ChunkWork cw;
  __shared__ int ticket;
  unsigned long long ts[STAMPS] = {chunk_now()};
  LORA_ARGS;
  bool early = flags & lora::EARLY_READS;
  lora::enter_grid<true>(early);
  g.chunked = 1;
  constexpr int SMEM = lora::Chunk<T, RW, BM>::SMEM + lora::Chunk<T, RW, BM>::SUMS;
  int* s_indptr = reinterpret_cast<int*>(dsmem + SMEM);
  // chunk_task
  const int grid = gridDim.x;
  lora::count_chunks<BM, lora::Chunk<T, RW, BM>::NTHREADS>(cs, s_indptr, g.slot_indptr, g.num_slots, g.positions);
  ts[1] = chunk_now();
  const int parts = lora::chunk_parts(g, cs.chunks, grid), items = cs.chunks * parts;
  const int takers = min(grid, items);
  if ((int)blockIdx.x < takers) {
    // chunk_items, the first item stamped
    bool first = true;
    for (int it = blockIdx.x; it < items; first = false) {
      const int c = it / parts, q = it % parts;
      lora::chunk_setup<T, RW, BM, SLICED>(g, s_indptr, tr, cs, cw, c);
      if (early) {
        lora::wait_prior_grid();
        early = false;
      }
      if (first) ts[2] = chunk_now();
      lora::chunk_shrink<T, RW, BM, ALIGNED, SLICED>(g, dsmem, tr, cw, c, q, parts);
      if (first) ts[3] = chunk_now();
      if (threadIdx.x == 0) {
        const int* ready = g.counters + 2 + c;
        while (lora::load_acquire(ready) < parts) __nanosleep(32);
      }
      __syncthreads();
      if (first) ts[4] = chunk_now();
      lora::chunk_expand<T, RW, BM, ALIGNED, SLICED>(g, dsmem, tr, cw, c, q, parts);
      if (first) ts[5] = chunk_now();
      if (items <= grid) break;
      if (threadIdx.x == 0) ticket = grid + atomicAdd(g.counters, 1);
      __syncthreads();
      it = ticket;
      __syncthreads();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(g.counters + 1, 1) == takers - 1) {
        g.counters[0] = 0;
        g.counters[1] = 0;
        __threadfence();
      }
    }
  }
  ts[6] = chunk_now();
  if (threadIdx.x == 0)
    for (int i = 0; i < STAMPS; ++i) stamps[blockIdx.x * STAMPS + i] = ts[i];
}
""".replace("STAMPS", str(STAMPS))


def name_of(rw: int, bm: int, sliced: bool) -> str:
    return f"lora_chunk_trace<__nv_bfloat16, {rw}, {bm}, true, {'true' if sliced else 'false'}>"


def module(names):
    from lora_cupy import kernels as K

    src = (K.kernel_dir() / "lora_mma.cu").read_text() + KERNEL
    return K.source_module(src, "lora_chunk_trace.cu", list(names))  # sm_90a on Hopper, as the shipped family


def main() -> None:
    import cupy
    import torch

    from lora_cupy.backends import cupy as cb
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.bench.kernels import build, rows

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="core T1024 4096->4096 r64 s1,core T1024 4096->4096 r16 s1",
                    help="comma-separated bench labels (bf16 rows; a label is matched as a prefix)")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    wanted = [w.strip() for w in args.rows.split(",") if w.strip()]
    chosen = [r for r in rows() if r.dtype == "bfloat16" and any(r.label.startswith(w) for w in wanted)]
    for row in chosen:
        d = build(row, 1000)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        be = cb.CupyBackend(d.spec)
        orig = be._kernels
        plan = None
        stamps = cupy.zeros(BLOCKS * STAMPS, cupy.uint64)
        fns = {}

        def traced(call, parts=("shrink", "expand")):
            nonlocal plan
            plan = call.plan
            out_ = []
            for k in orig(call, parts):
                if k.name == "chunk":
                    if k.grid[0] > BLOCKS:
                        raise SystemExit(f"{k.grid[0]} blocks: the stamps have room for {BLOCKS}")
                    key = name_of(cb.rank_width(call.dims[2]), call.plan.bm, call.plan.sliced)
                    if key not in fns:
                        fns[key] = module([key]).get_function(key)
                    # this launch's shared memory (a later row of the same instantiation may take more)
                    fns[key].max_dynamic_shared_size_bytes = max(fns[key].max_dynamic_shared_size_bytes, k.smem)
                    k = dataclasses.replace(k, fn=fns[key], fn_aligned=fns[key],
                                            args=(*k.args, np.uint64(stamps.data.ptr)))
                out_.append(k)
            return out_

        y_ref = d.y0.clone()
        cb.CupyBackend(d.spec).delta(y_ref, d.x, w, d.token_order, d.slot_indptr)  # the shipped kernel's y
        be._kernels = traced
        y_tr = d.y0.clone()
        be.delta(y_tr, d.x, w, d.token_order, d.slot_indptr)
        torch.cuda.synchronize()
        if plan is None or plan.expand != "chunk":
            print(f"{row.label}: its default plan is not lora_chunk outside clusters ({plan}); skipped")
            continue
        r1, r2 = y_ref.double() - d.y0.double(), y_tr.double() - d.y0.double()
        rel = float(torch.linalg.norm(r2 - r1) / torch.linalg.norm(r1))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        y = d.y0.clone()
        with torch.cuda.stream(s):
            be.delta(y, d.x, w, d.token_order, d.slot_indptr)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            be.delta(y, d.x, w, d.token_order, d.slot_indptr)
        spans, ph = [], []
        for _ in range(args.replays):
            stamps.fill(0)
            g.replay()
            torch.cuda.synchronize()
            st = stamps.get().reshape(-1, STAMPS).astype(np.int64)
            st = st[st[:, 0] > 0]
            spans.append(st[:, -1].max() - st[:, 0].min())
            live = st[(st[:, 1:] > 0).all(axis=1)]
            dd = np.diff(live, axis=1)
            ph.append(np.stack([np.median(dd, axis=0), dd.max(axis=0)]))
        ph = np.median(np.stack(ph), axis=0)
        print(f"{row.label} (bm {plan.bm}, grid {plan.blocks}, splits {plan.splits}; traced y off the shipped "
              f"kernel's by {rel:.1e}): span {int(np.median(spans))} ns, {len(live)} blocks with an item; "
              f"phases median / largest (ns):")
        print("  " + "  ".join(f"{p} {int(m)}/{int(x)}" for p, m, x in zip(PHASES, ph[0], ph[1])), flush=True)
        be._kernels = orig
        del g, be


if __name__ == "__main__":
    main()
