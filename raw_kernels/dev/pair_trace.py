"""Where a decode layer's time goes, launch by launch and phase by phase (dev tool, not shipped).

The bench's layer rows (`--layer 1x1,64x8,...`: the four LoRA calls of one Llama-8B-shaped layer,
rank 16; each call `lora_pair`'s shrink then expand, or at one position one `lora_one` launch) run from
a traced copy of the kernels: `pair.cuh` and `lora_mma.cu` as this tree has them, with `%globaltimer`
stamps written at fixed places of `pair_shrink`, `pair_expand` and `lora_one` into a device array of
the module (`pair_trace_buf`), built here in a module of its own (the shipped sources are not
touched; every place is found by its text, and a place that is not found stops the tool). Two
layers are captured in one CUDA graph, as the bench's warm figure runs them back to back; after each
replay the second layer's stamps are read back. Per launch, medians over the replays of each block's
stamp less the layer's first block's entry (us):

- entry: the first block's start, and the median block's;
- scan: slot_indptr read and the step's chunks counted (`pair_scan`; lora_one: its setup);
- wait: the weights' first loads issued (A; B), just before the wait for the grid before, and
  just after it returns;
- work: the shrink's MMAs issued (x has arrived); the expand's v ready in shared memory (the
  splits' parts read, summed and scaled; y's first tiles asked for); lora_one's v summed through
  the cluster (its shrink and the cluster barrier before it);
- exit: the median working block's last warp, and the last one of the launch.

A tree with `dev/pair_ready_count.patch` applied is traced too (run from its root): the expand's wait is
then its poll of the chunk's count, and the shrink's exit comes after the split's count.

Stamps are thread 0's, but for the exit (the block's last warp, an atomicMax of each warp's);
blocks past the step's items leave after the scan and count only in the entries. The stamps cost a
few stores a block; each call's y is checked against float64 before the timing, as the bench does.
The call of a launch is told by its target's shape (q/k/v three slices, gate_up two, down `in` >
4096, o the rest), so it serves the bench's layer, and (`--core LABEL`) a bench row's one call, two in
a graph, whose launches then read under that name (a one-slice row of `in` 4096 as o).

    PYTHONPATH=. python raw_kernels/dev/pair_trace.py --layer 64x8,64x32 --json $OUT/trace.json
    PYTHONPATH=. python raw_kernels/dev/pair_trace.py --layer "" --core "T64 4096->4096 r64 s32"
    python raw_kernels/dev/pair_trace.py --plot trace.png --from trace.json   # no GPU: the picture
    python raw_kernels/dev/pair_trace.py --prebuild out/pb                    # the traced CUBIN, no GPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

CALLS = ("qkv", "o", "gate_up", "down")  # the layer's order; a launch's call: HEAD's pair_trace_row
KINDS = ("shrink", "expand", "one")  # lora_pair's two launches; lora_one (one position)
STAMPS = ("entry", "scan", "pre-wait", "post-wait", "work", "exit")
BLOCKS = 2048  # the most blocks of a launch that are traced

HEAD = r"""
__device__ unsigned long long pair_trace_buf[%(kinds)d * 4 * %(blocks)d * %(stamps)d];
namespace lora {
__device__ __forceinline__ unsigned long long pair_trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t)::"memory");
  return t;
}
// The row of this block of launch (kind, call): call 0 q/k/v (three slices), 2 gate_up (two), 3 down
// (in > 4096), 1 o.
template <typename T>
__device__ __forceinline__ unsigned long long* pair_trace_row(const Args<T>& g, int kind) {
  const int call = g.n_slices == 3 ? 0 : g.n_slices == 2 ? 2 : g.in_features > 4096 ? 3 : 1;
  return pair_trace_buf + ((size_t)(kind * 4 + call) * %(blocks)d + blockIdx.x) * %(stamps)d;
}
template <typename T>
__device__ __forceinline__ void pair_trace_entry(const Args<T>& g, int kind) {
  if (threadIdx.x != 0 || blockIdx.x >= %(blocks)d) return;
  unsigned long long* r = pair_trace_row(g, kind);
  r[0] = pair_trace_now();
  for (int i = 1; i < %(stamps)d; ++i) r[i] = 0;
}
template <typename T>
__device__ __forceinline__ void pair_trace_stamp(const Args<T>& g, int kind, int i) {
  if (threadIdx.x == 0 && blockIdx.x < %(blocks)d) pair_trace_row(g, kind)[i] = pair_trace_now();
}
template <typename T>
__device__ __forceinline__ void pair_trace_exit(const Args<T>& g, int kind) {
  if ((threadIdx.x & 31) == 0 && blockIdx.x < %(blocks)d)
    atomicMax(pair_trace_row(g, kind) + %(stamps)d - 1, pair_trace_now());
}
}  // namespace lora
""" % {"kinds": len(KINDS), "blocks": BLOCKS, "stamps": len(STAMPS)}

# (file, text in it, the text that replaces it[, another text, its replacement]): each must occur exactly
# once; where a place has another text (a dev patch's form of it), exactly one of the two occurs.
PLACES = [
    ("pair.cuh", "#pragma once\n", "#pragma once\n" + HEAD),
    # the shrink
    ("pair.cuh", "  __shared__ __align__(16) float red[PAIR_SW][PAIR_M][W];\n",
     "  __shared__ __align__(16) float red[PAIR_SW][PAIR_M][W];\n  pair_trace_entry(g, 0);\n"),
    ("pair.cuh", "  const int chunks = pair_scan(g.slot_indptr, S, sip, cpre, [] {});\n",
     "  const int chunks = pair_scan(g.slot_indptr, S, sip, cpre, [] {});\n  pair_trace_stamp(g, 0, 1);\n"),
    ("pair.cuh", "    if (early) wait_prior_grid();\n#pragma unroll\n    for (int rt = 0; rt < RT; ++rt)  // past r_j",
     "    pair_trace_stamp(g, 0, 2);\n    if (early) wait_prior_grid();\n    pair_trace_stamp(g, 0, 3);\n"
     "#pragma unroll\n    for (int rt = 0; rt < RT; ++rt)  // past r_j"),
    ("pair.cuh", "    if (early) wait_prior_grid();\n    const int per = (kbs + splits - 1) / splits",
     "    pair_trace_stamp(g, 0, 2);\n    if (early) wait_prior_grid();\n    pair_trace_stamp(g, 0, 3);\n"
     "    const int per = (kbs + splits - 1) / splits"),
    ("pair.cuh", "#pragma unroll\n  for (int rt = 0; rt < RT; ++rt) {  // D: rows",
     "  pair_trace_stamp(g, 0, 4);\n#pragma unroll\n  for (int rt = 0; rt < RT; ++rt) {  // D: rows"),
    ("pair.cuh", "    red_add4(vc + e, s);\n  }\n}\n",
     "    red_add4(vc + e, s);\n  }\n  pair_trace_exit(g, 0);\n}\n",
     # or, with dev/pair_ready_count.patch, after the split's count
     "    atomicAdd(g.counters + item / splits, 1);\n  }\n}\n",
     "    atomicAdd(g.counters + item / splits, 1);\n  }\n  pair_trace_exit(g, 0);\n}\n"),
    # the expand
    ("pair.cuh", "  __shared__ int off[9], tpre[9], rks[8];\n",
     "  __shared__ int off[9], tpre[9], rks[8];\n  pair_trace_entry(g, 1);\n"),
    ("pair.cuh", "    tpre[n] = run;\n  });\n", "    tpre[n] = run;\n  });\n  pair_trace_stamp(g, 1, 1);\n"),
    ("pair.cuh", "  if (early) wait_prior_grid();\n  unsigned yv[U][2];",
     "  pair_trace_stamp(g, 1, 2);\n  if (early) wait_prior_grid();\n  pair_trace_stamp(g, 1, 3);\n  unsigned yv[U][2];",
     # or, with dev/pair_ready_count.patch, around the wait for the chunk's count
     "  if (early) {  // the chunk's splits all counted: each after its own wait, so the grid before them has finished\n"
     "    if (threadIdx.x == 0)\n      while (load_acquire(g.counters + chunk) < g.splits) __nanosleep(32);\n"
     "    __syncthreads();\n  }\n",
     "  pair_trace_stamp(g, 1, 2);\n  if (early) {\n"
     "    if (threadIdx.x == 0)\n      while (load_acquire(g.counters + chunk) < g.splits) __nanosleep(32);\n"
     "    __syncthreads();\n  }\n  pair_trace_stamp(g, 1, 3);\n"),
    ("pair.cuh", "  __syncthreads();\n  // the block's reads of v are done",
     "  __syncthreads();\n  pair_trace_stamp(g, 1, 4);\n  // the block's reads of v are done"),
    ("pair.cuh", "      return;\n    }\n  }\n  unsigned short part = 0;",
     "      pair_trace_exit(g, 1);\n      return;\n    }\n  }\n  unsigned short part = 0;"),
    ("pair.cuh", "  release();\n}\n\n}  // namespace lora",
     "  release();\n  pair_trace_exit(g, 1);\n}\n\n}  // namespace lora"),
    # lora_one (lora_mma.cu's kernel body): setup done, the wait, v summed through the cluster, exit
    ("lora_mma.cu", "  LORA_ARGS;\n  // EARLY_READS: the addressing, ranks and the first B rows before the wait",
     "  LORA_ARGS;\n  lora::pair_trace_entry(g, 2);\n  // EARLY_READS: the addressing, ranks and the first B rows before the wait"),
    ("lora_mma.cu", "  lora::OneCol<T, RW, ALIGNED> pc;", "  lora::pair_trace_stamp(g, 2, 1);\n  lora::OneCol<T, RW, ALIGNED> pc;"),
    ("lora_mma.cu", "    if (sa == nullptr) lora::one_prefetch_a<T>(g, st, lora::cluster_rank());\n    lora::wait_prior_grid();\n",
     "    if (sa == nullptr) lora::one_prefetch_a<T>(g, st, lora::cluster_rank());\n    lora::pair_trace_stamp(g, 2, 2);\n"
     "    lora::wait_prior_grid();\n    lora::pair_trace_stamp(g, 2, 3);\n"),
    ("lora_mma.cu", "  lora::cluster_arrive();  // done reading the others' part: they may leave once all have said so\n"
     "  __syncthreads();\n",
     "  lora::cluster_arrive();  // done reading the others' part: they may leave once all have said so\n"
     "  __syncthreads();\n  lora::pair_trace_stamp(g, 2, 4);\n"),
    ("lora_mma.cu", "  lora::one_expand<T, RW, ALIGNED>(g, st, vs, blockIdx.x, gridDim.x, pc);\n  lora::cluster_wait();\n",
     "  lora::one_expand<T, RW, ALIGNED>(g, st, vs, blockIdx.x, gridDim.x, pc);\n  lora::pair_trace_exit(g, 2);\n"
     "  lora::cluster_wait();\n"),
]


def traced_dir(src: Path) -> Path:
    """A copy of the kernel directory `src` whose pair.cuh and lora_mma.cu carry the stamps."""
    out = Path(tempfile.mkdtemp(prefix="pair_trace_"))
    for p in src.iterdir():
        if p.is_file():
            shutil.copy(p, out / p.name)
    for name in sorted({place[0] for place in PLACES}):
        text = (src / name).read_text()
        for f, *forms in PLACES:
            if f != name:
                continue
            pairs = list(zip(forms[0::2], forms[1::2]))
            found = [(old, new) for old, new in pairs if text.count(old)]
            if len(found) != 1 or text.count(found[0][0]) != 1:
                raise SystemExit(f"pair_trace: a stamp's place does not occur exactly once in {name}: "
                                 + " or ".join(repr(old.strip()[:70]) for old, _ in pairs))
            text = text.replace(*found[0])
        (out / name).write_text(text)
    return out


def use_traced_kernels() -> None:
    """Make lora_cupy build its kernels from the traced copy (before any module is loaded)."""
    from lora_cupy import kernels

    d = traced_dir(kernels.kernel_dir())
    kernels.kernel_dir = lambda: d


def read_stamps(mod) -> np.ndarray:
    import cupy

    from lora_cupy.kernels import PrebuiltModule

    raw = mod._module if isinstance(mod, PrebuiltModule) else mod
    return cupy.ndarray((len(KINDS), 4, BLOCKS, len(STAMPS)), dtype=cupy.uint64,
                        memptr=raw.get_global("pair_trace_buf"))


def summarize(buf: np.ndarray, t0: int) -> dict:
    """One replay's stamps: per launch (kind, call), us after t0."""
    out = {}
    for k, kind in enumerate(KINDS):
        for c, call in enumerate(CALLS):
            rows = buf[k, c].astype(np.int64)
            live = rows[rows[:, 0] > 0]
            if not len(live):
                continue
            work = live[live[:, -1] > 0]
            rel = lambda v: (v - t0) / 1000.0  # noqa: E731
            d = {"blocks": int(len(live)), "working": int(len(work)),
                 "first entry": rel(live[:, 0].min()), "entry": rel(np.median(live[:, 0]))}
            for i, name in enumerate(STAMPS[1:], start=1):
                vals = work[:, i][work[:, i] > 0] if len(work) else np.array([])
                if len(vals):
                    d[name] = rel(np.median(vals))
            if len(work):
                d["last exit"] = rel(work[:, -1].max())
            out[f"{call} {kind}"] = d
    return out


def replay_twice(fn, stamps, replays: int) -> list[dict]:
    """``fn`` twice in one CUDA graph, replayed ``replays`` times; after each, the stamps (the second
    run's: every traced block rewrites its row) summarized from the replay's first block."""
    import cupy
    import torch

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
        fn()
    per = []
    for _ in range(replays):
        torch.cuda.synchronize()
        stamps.fill(0)
        cupy.cuda.Device().synchronize()
        g.replay()
        torch.cuda.synchronize()
        buf = cupy.asnumpy(stamps)
        live = buf[..., 0][buf[..., 0] > 0]
        if len(live):
            per.append(summarize(buf, int(live.min())))
    return per


def trace_layer(T: int, adapters: int, replays: int, seed: int) -> dict:
    import torch

    from lora_cupy import kernels
    from lora_cupy.bench.kernels import layer_calls

    calls, errs, plans, be = layer_calls(T, adapters, seed)
    stamps = read_stamps(kernels.load_module(kernels.mma_family("bfloat16")))

    def layer():
        for _, c in calls:
            c()

    layer()
    torch.cuda.synchronize()
    per = replay_twice(layer, stamps, replays)
    del be
    return {"T": T, "adapters": adapters, "replays": len(per), "errs": errs, "plans": plans, "launches": _medians(per)}


def trace_row(label: str, replays: int, seed: int) -> list[dict]:
    """Each bench row's call (bf16 core or shapes rows whose label contains ``label``), as trace_layer:
    two calls in one graph, the second's stamps. A one-slice row's launches read as "o" (down where
    ``in`` > 4096), a fused one's as its slice count says."""
    import torch

    from lora_cupy import kernels
    from lora_cupy.backends import cupy as cb
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.bench.kernels import _plan_label, build, oracle_error, rows

    picked = [r for r in rows() if label in r.label and r.dtype == "bfloat16" and r.label.split()[0] in ("core", "shapes")]
    if not picked:
        raise SystemExit(f"pair_trace: no bf16 core or shapes row's label contains {label!r}")
    out = []
    for row in picked:
        d = build(row, seed)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        be = cb.CupyBackend(d.spec, early_reads=True)
        plan = _plan_label(be.plan(row.T, w, "bfloat16"))

        def call():
            be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)

        d.y.copy_(d.y0)
        call()
        torch.cuda.synchronize()
        err = oracle_error(d, d.y)
        stamps = read_stamps(kernels.load_module(kernels.mma_family("bfloat16")))
        per = replay_twice(call, stamps, replays)
        out.append({"T": row.label, "adapters": "", "replays": len(per), "errs": {"call": err},
                    "plans": {"call": plan}, "launches": _medians(per)})
    return out


def _medians(per: list[dict]) -> dict:
    launches = {}
    for name in per[0] if per else {}:
        keys = set.intersection(*(set(p.get(name, {})) for p in per))
        launches[name] = {k: float(np.median([p[name][k] for p in per])) for k in keys}
    return launches


def print_layer(r: dict) -> None:
    cols = ("blocks", "working", "first entry", "entry", "scan", "pre-wait", "post-wait", "work", "exit", "last exit")
    what = f"layer {r['T']}x{r['adapters']}" if r["adapters"] != "" else r["T"]
    print(f"\n{what} ({r['replays']} replays; errors "
          + ", ".join(f"{k} {v:.1e}" for k, v in r["errs"].items()) + ")")
    print("plans: " + "; ".join(f"{k} {v}" for k, v in r["plans"].items()))
    print(f"{'launch':16s}" + "".join(f"{c:>12s}" for c in cols))
    order = [f"{c} {k}" for c in CALLS for k in KINDS]
    for name in order:
        d = r["launches"].get(name)
        if d is None:
            continue
        cells = []
        for c in cols:
            v = d.get(c)
            cells.append("-" if v is None else (f"{int(v)}" if c in ("blocks", "working") else f"{v:.2f}"))
        print(f"{name:16s}" + "".join(f"{x:>12s}" for x in cells))


def plot(runs: list[dict], path: str) -> None:
    """One panel a layer: a bar a launch from its first block's entry to its last exit, the median
    working block's phases drawn over it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = (("entry", "scan", "#bbbbbb", "scan"), ("scan", "pre-wait", "#9ecae1", "setup, first loads"),
              ("pre-wait", "post-wait", "#fdae6b", "wait for the grid before"),
              ("post-wait", "work", "#e6550d", "x / parts and v"), ("work", "exit", "#31a354", "MMAs, stores"))
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.2 + 0.45 * 8 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        order = [f"{c} {k}" for c in CALLS for k in KINDS if f"{c} {k}" in r["launches"]]
        for i, name in enumerate(order):
            d = r["launches"][name]
            y = len(order) - 1 - i
            if "last exit" in d:
                ax.barh(y, d["last exit"] - d["first entry"], left=d["first entry"], height=0.8, color="#eeeeee",
                        edgecolor="#999999")
            for a, b, color, label in phases:
                if a in d and b in d and d[b] >= d[a]:
                    ax.barh(y, d[b] - d[a], left=d[a], height=0.45, color=color, label=label if i == 0 else None)
        ax.set_yticks(range(len(order)), list(reversed(order)))
        ax.set_xlabel("us after the layer's first block (medians over replays)")
        what = f"layer {r['T']} positions x {r['adapters']} adapters" if r["adapters"] != "" else r["T"]
        ax.set_title(f"{what}: the launches")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", default="64x8", help="TxADAPTERS,... (the bench's layer rows that run lora_pair)")
    ap.add_argument("--core", default="", help="also the bf16 core / shapes rows whose label contains this")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--json", help="write the runs here")
    ap.add_argument("--plot", help="a PNG of the runs (with --from: no GPU)")
    ap.add_argument("--from", dest="src", help="a JSON written by --json, to plot")
    ap.add_argument("--prebuild", help="build the traced bf16 family's CUBIN into this directory (no GPU)")
    args = ap.parse_args()
    if args.src:
        runs = json.loads(Path(args.src).read_text())
        for r in runs:
            print_layer(r)
        if args.plot:
            plot(runs, args.plot)
        return
    use_traced_kernels()
    if args.prebuild:
        from lora_cupy import kernels

        print(kernels.prebuild(args.prebuild, "sm_90a", [kernels.mma_family("bfloat16")]))
        return
    runs = []
    for spec in filter(None, args.layer.split(",")):
        T, adapters = (int(v) for v in spec.split("x"))
        r = trace_layer(T, adapters, args.replays, args.seed)
        print_layer(r)
        runs.append(r)
    for r in trace_row(args.core, args.replays, args.seed) if args.core else []:
        print_layer(r)
        runs.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
