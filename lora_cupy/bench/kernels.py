"""``lora-cupy bench kernels [--json FILE]``: the CUDA delta checked, then timed against baselines.

Each row is checked against a float64 oracle first, then timed with CUDA events on CUDA graphs of
20 calls, a 256 MB L2 flush before each call, median over many replays: by default a call's time
is (graph of flush + call, 20 times) minus (graph of the 20 flushes alone), over 20, which reads an
empty kernel at ~0.5-0.9 us; ``--method events`` records events around each call inside the
graph instead, which adds ~3 us of event-node overhead to every call (both are calibrated in
every run). Baselines are
timed the same way in the same run: a torch loop over slot segments (PEFT's way), torch bmm on
equal segments, and one adapter's two cuBLAS GEMMs over every token. The device-to-device copy
bandwidth is measured in the same run, and each row's byte floor (x read once, y read and
written once, each active slot's A and B read once at its rank) is taken at that bandwidth.
Progress goes to stderr, the table to stdout, every number to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..dtypes import itemsize
from . import parse

CALLS_PER_GRAPH = 20
FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class Row:
    """One benchmark shape. ``ranks`` are the active slots' ranks; ``pool_rank`` the pool's maximum."""

    group: str
    T: int  # tokens with an adapter or on slot 0 (the rows that are real)
    in_f: int
    slices: tuple[int, ...]
    ranks: tuple[int, ...]
    pool_rank: int
    dtype: str = "bfloat16"
    mix: str = "uniform"  # uniform | skew
    bucket: int | None = None  # rows of the capture bucket when it is larger than T (padding)

    @property
    def out(self) -> int:
        return sum(self.slices)

    @property
    def slots(self) -> int:
        return len(self.ranks)

    @property
    def label(self) -> str:
        r = f"r{self.ranks[0]}" if len(set(self.ranks)) == 1 else f"r{min(self.ranks)}-{max(self.ranks)}"
        shape = f"{self.in_f}->{self.out}" + (f"/{len(self.slices)}" if len(self.slices) > 1 else "")
        pad = f" in {self.bucket}" if self.bucket else ""
        pool = f" pool{self.pool_rank}" if self.pool_rank != max(self.ranks) else ""
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.dtype]
        return f"{self.group} T{self.T}{pad} {shape} {r}{pool} s{self.slots} {short}"


def rows() -> list[Row]:
    """The shapes of the issue: core, skew, mixed ranks, shapes, dtypes, padding, pool rank."""
    out: list[Row] = []
    for T in (1, 16, 64, 256, 1024, 4096):
        for r in (16, 64):
            for s in (1, 8, 32):
                if s <= T:
                    out.append(Row("core", T, 4096, (4096,), (r,) * s, r))
    for T in (64, 4096):
        out.append(Row("skew", T, 4096, (4096,), (16,) * 32, 16, mix="skew"))
    mixed = (8, 16, 32, 64, 128, 24, 48, 96)
    for T in (16, 4096):
        for s in (8, 32):
            s = min(s, T)  # at most one slot per token
            out.append(Row("mixed", T, 4096, (4096,), tuple(mixed[k % len(mixed)] for k in range(s)), 128))
    for T in (1, 64, 1024):
        for in_f, slices in ((4096, (14336,)), (14336, (4096,)), (4096, (4096, 1024, 1024))):
            for r in (16, 64):
                out.append(Row("shapes", T, in_f, slices, (r,) * min(8, T), r))
    for dt in ("float16", "float32"):
        for T in (64, 4096):
            out.append(Row("dtypes", T, 4096, (4096,), (16,) * 8, 16, dtype=dt))
    out.append(Row("padding", 100, 4096, (4096,), (16,) * 8, 16, bucket=128))
    out.append(Row("padding", 3000, 4096, (4096,), (16,) * 8, 16, bucket=4096))
    for T in (64, 1024, 4096):
        out.append(Row("poolrank", T, 4096, (4096,), (16,) * 32, 128))
    return out


def byte_floor(row: Row, tokens_on_adapters: int) -> int:
    """Bytes the delta must move: x read once, adapter rows of y read and written once, and each
    active slot's A and B read once at its rank."""
    isz = itemsize(row.dtype)
    weights = sum(r * row.in_f * len(row.slices) + row.out * r for r in row.ranks)
    return isz * (tokens_on_adapters * row.in_f + 2 * tokens_on_adapters * row.out + weights)


def bars(row: Row, us: float, floor_us: float, best_baseline_us: float | None) -> dict[str, bool]:
    """Each of the issue's bars that applies to a row, met or not: ``latency`` (T <= 256: within
    max(5 us, 1.5x floor)), ``70%`` (T >= 1024: at least 70% of the floor's bandwidth) and
    ``baseline`` (faster than the best baseline of the same run, where one was timed)."""
    out = {}
    if row.T <= 256:
        out["latency"] = us <= max(5.0, 1.5 * floor_us)
    if row.T >= 1024:
        out["70%"] = floor_us / us >= 0.7
    if best_baseline_us is not None:
        out["baseline"] = us < best_baseline_us
    return out


def targets_met(row: Row, us: float, floor_us: float, best_baseline_us: float | None) -> bool:
    """Whether a row meets every bar of :func:`bars` that applies to it."""
    return all(bars(row, us, floor_us, best_baseline_us).values())


# ---- device side ---------------------------------------------------------------------------------
@dataclass
class Built:
    """One row's device data: torch tensors, the spec, the addressing and host-side segments."""

    row: Row
    spec: object
    x: object
    y: object
    y0: object
    a: object
    b: object
    scaling: object
    ranks: object
    token_order: object
    slot_indptr: object
    offsets: tuple[int, ...]
    segments: list = field(default_factory=list)  # (slot, row index tensor) per active slot
    adapter_rows: int = 0


def build(row: Row, seed: int) -> Built:
    import torch

    from ..addressing import group_by_slot
    from ..dtypes import torch_dtype
    from ..spec import LoraSlice, LoraSpec, LoraTarget

    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch_dtype(row.dtype)
    S, n, R = row.slots + 1, len(row.slices), row.pool_rank
    target = LoraTarget("t", row.in_f, row.out, 1, tuple(LoraSlice(f"s{j}", o) for j, o in enumerate(row.slices)))
    spec = LoraSpec((target,), num_slots=S, max_rank=R, dtype=row.dtype)
    ranks = np.zeros((S, n), np.int32)
    ranks[1:] = np.asarray(row.ranks, np.int32)[:, None]
    a = torch.randn(S, n, R, row.in_f, device="cuda", generator=gen) / math.sqrt(row.in_f)
    b = torch.randn(S, row.out, R, device="cuda", generator=gen) / math.sqrt(8)
    for s in range(S):  # a slot's weights beyond its rank are zero, slot 0 all zero
        a[s, :, ranks[s, 0]:] = 0
        b[s, :, ranks[s, 0]:] = 0
    rows_ = row.bucket or row.T
    if row.mix == "skew":
        k = np.minimum(rng.zipf(1.5, row.T), row.slots)
        slots = k.astype(np.int64)
        slots[rng.random(row.T) < 0.25] = 0
        slots = np.sort(slots)
    else:  # equal contiguous segments where T divides
        slots = 1 + (np.arange(row.T) * row.slots) // row.T
    token_order, indptr = group_by_slot(slots, S)
    if row.bucket:
        token_order = np.concatenate([token_order, np.arange(row.T, row.bucket, dtype=np.int32)])
    scaling = np.full((S, n), 2.0, np.float32)
    scaling[0] = 0
    x = torch.randn(rows_, row.in_f, device="cuda", generator=gen).to(dt)
    y0 = (torch.randn(rows_, row.out, device="cuda", generator=gen) * 0.1).to(dt)
    segs = []
    for s in range(1, S):
        lo, hi = int(indptr[s]), int(indptr[s + 1])
        if hi > lo:
            segs.append((s, torch.as_tensor(token_order[lo:hi].astype(np.int64), device="cuda")))
    return Built(row, spec, x, y0.clone(), y0, a.to(dt), b.to(dt), torch.as_tensor(scaling, device="cuda"),
                 torch.as_tensor(ranks, device="cuda"), torch.as_tensor(token_order, device="cuda"),
                 torch.as_tensor(indptr, device="cuda"), target.out_offsets(), segs,
                 int(indptr[-1] - indptr[1]))


def oracle_error(d: Built, y) -> float:
    """||y - (y0 + delta64)|| / ||y0 + delta64|| over the rows on adapters, in float64 on the device."""
    import torch

    ref = d.y0.double().clone()
    x64 = d.x.double()
    for s, idx in d.segments:
        for j in range(len(d.offsets) - 1):
            r, c0, c1 = int(d.row.ranks[s - 1]), d.offsets[j], d.offsets[j + 1]
            v = x64[idx] @ d.a[s, j, :r].double().T
            ref[idx, c0:c1] += float(d.scaling[s, j]) * (v @ d.b[s, c0:c1, :r].double().T)
    idx = torch.cat([i for _, i in d.segments])
    return float(torch.linalg.norm(y.double()[idx] - ref[idx]) / torch.linalg.norm(ref[idx]))


def baselines(d: Built):
    """``{name: fn}`` of the torch baselines that apply to this row, each ``y += delta`` in place."""
    row, offs = d.row, d.offsets
    n = len(offs) - 1
    segs = [(s, idx, int(row.ranks[s - 1])) for s, idx in d.segments]

    def loop():  # PEFT: each adapter's rows gathered, through its two linears, added back
        for s, idx, r in segs:
            xs = d.x.index_select(0, idx)
            for j in range(n):
                c0, c1 = offs[j], offs[j + 1]
                delta = (xs @ d.a[s, j, :r].T) @ d.b[s, c0:c1, :r].T
                d.y[idx, c0:c1] += delta * 2.0

    fns = {"loop": loop}
    counts = {int(i.numel()) for _, i in d.segments}
    equal = (len(counts) == 1 and len(set(row.ranks)) == 1 and row.mix == "uniform" and not row.bucket
             and sum(int(i.numel()) for _, i in d.segments) == row.T)
    if equal:  # bmm over equal, contiguous segments
        m, r, k = counts.pop(), row.ranks[0], row.slots
        at = [d.a[1:, j, :r].transpose(1, 2) for j in range(n)]  # [k, in, r]
        bt = [(d.b[1:, offs[j]:offs[j + 1], :r] * 2.0).transpose(1, 2) for j in range(n)]  # [k, r, out_j]
        x3 = d.x.view(k, m, row.in_f)
        y3 = d.y.view(k, m, row.out)

        def bmm():
            for j in range(n):
                v = torch_bmm(x3, at[j])
                y3[:, :, offs[j]:offs[j + 1]].baddbmm_(v, bt[j])

        fns["bmm"] = bmm
    r1 = int(row.ranks[0])

    def gemm():  # one adapter over every token: two cuBLAS GEMMs per slice
        for j in range(n):
            c0, c1 = offs[j], offs[j + 1]
            v = d.x @ d.a[1, j, :r1].T
            d.y[:, c0:c1].addmm_(v, d.b[1, c0:c1, :r1].T, alpha=2.0)

    fns["gemm"] = gemm
    return fns


def torch_bmm(a, b):
    import torch

    return torch.bmm(a, b)


class Timer:
    """Median time of one call in graphs of CALLS_PER_GRAPH calls, an L2 flush before each call:
    ``"diff"`` = (graph of calls and flushes - graph of flushes) / calls, ``"events"`` = CUDA
    events around each call inside the graph (falls back to ``"diff"`` where that fails)."""

    def __init__(self, replays: int = 10, method: str = "diff", flush: str = "write"):
        import torch

        if flush not in ("write", "read", "none"):
            raise ValueError(f"flush must be 'write', 'read' or 'none', got {flush!r}")
        self.replays = replays
        self.flush_buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self.flush_out = torch.zeros((), dtype=torch.int64, device="cuda")
        self.flush_kind = flush
        self.events_in_graphs = method == "events"

    def flush(self) -> None:
        """Push the previous call's data out of L2: ``write`` zeroes FLUSH_BYTES (L2 is left full of
        dirty lines, which the next call's misses write back to DRAM), ``read`` sums them (clean);
        ``none`` leaves L2 as the last call left it (warm)."""
        import torch

        if self.flush_kind == "none":
            return
        if self.flush_kind == "write":
            self.flush_buf.zero_()
        else:
            torch.sum(self.flush_buf, dim=0, dtype=torch.int64, out=self.flush_out)

    def __call__(self, fn) -> float:
        import torch

        fn()  # warm: compiles, loads, creates handles
        torch.cuda.synchronize()
        if self.events_in_graphs:
            try:
                return self._events(fn)
            except Exception as e:  # noqa: BLE001 - fall back, say so
                print(f"  events inside graphs failed ({e!r}); timing by difference", file=sys.stderr)
                self.events_in_graphs = False
        return self._difference(fn)

    def _capture(self, body):
        import torch

        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            body()
        return g

    def _events(self, fn) -> float:
        import torch

        starts = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(CALLS_PER_GRAPH)]
        ends = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(CALLS_PER_GRAPH)]

        def body():
            for s, e in zip(starts, ends):
                self.flush()
                s.record()
                fn()
                e.record()

        g = self._capture(body)
        samples = []
        for _ in range(self.replays):
            g.replay()
            torch.cuda.synchronize()
            samples += [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        del g
        if min(samples) <= 0:
            raise RuntimeError("non-positive event times")
        return statistics.median(samples)

    def _difference(self, fn) -> float:
        def with_calls():
            for _ in range(CALLS_PER_GRAPH):
                self.flush()
                fn()

        def flushes():
            for _ in range(CALLS_PER_GRAPH):
                self.flush()

        total = self._replay_median(self._capture(with_calls))
        if self.flush_kind == "none":  # warm: nothing to take off
            return total / CALLS_PER_GRAPH
        return (total - self._replay_median(self._capture(flushes))) / CALLS_PER_GRAPH

    def _replay_median(self, g) -> float:
        """Median time (us) of one replay of graph ``g``, which is released afterwards."""
        import torch

        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(self.replays):
            t0.record()
            g.replay()
            t1.record()
            torch.cuda.synchronize()
            ts.append(t0.elapsed_time(t1) * 1e3)
        del g
        return statistics.median(ts)


def copy_bandwidth() -> float:
    """Bytes read plus written per second of a 1 GiB device-to-device copy (median of 20)."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    ts = []
    for _ in range(20):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        dst.copy_(src)
        t1.record()
        torch.cuda.synchronize()
        ts.append(t0.elapsed_time(t1) * 1e-3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(ts)


_CHASE = r"""
extern "C" __global__ void chase(const long long* p, int k, long long* out) {
  long long i = 0;
  for (int s = 0; s < k; ++s) i = p[i];  // each load waits for the one before
  *out = i;
}
"""


def dependent_round_us(timer: Timer, rounds: int = 8) -> float:
    """What one round of dependent loads costs a kernel right after the flush (us): one thread
    follows a chain through ``rounds`` more loads, each in a page 2 MiB + 4 KiB from the last, and
    the time of a one-load chain is taken off. The floor under any kernel whose loads depend on
    earlier ones (addressing, then ranks, then data, then the other kernel's results)."""
    import cupy
    import torch

    stride = ((2 << 20) + 4096) // 8  # int64 elements
    n = rounds + 1
    host = torch.zeros(n * stride, dtype=torch.int64)
    for i in range(n - 1):
        host[i * stride] = (i + 1) * stride
    chain = host.to("cuda")
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    fn = cupy.RawKernel(_CHASE, "chase")

    def run(k):
        def call():
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn((1,), (1,), (chain.data_ptr(), np.int32(k), out.data_ptr()))
        return call

    t1, tk = timer(run(1)), timer(run(1 + rounds))
    del chain, out
    return (tk - t1) / rounds


# ---- one decoder layer in situ -------------------------------------------------------------------
#: The LoRA targets of one Llama-8B-shaped decoder layer, in the order a step runs them:
#: (name, in features, output slices).
LAYER_TARGETS = (("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)),
                 ("gate_up", 4096, (14336, 14336)), ("down", 14336, (4096,)))
#: (tokens, adapters) of the layer rows and the issue's goal for each, warm (us).
LAYER_GOALS_US = {(1, 1): 15.0, (64, 8): 18.0, (64, 32): 46.0, (256, 32): 46.0}
LAYER_RANK = 16
#: Slots of the layer's pool (slot 0 included): 32 adapters resident, whatever a row addresses.
LAYER_SLOTS = 33


def layer_calls(T: int, adapters: int, seed: int, backend_kw: dict | None = None):
    """The four LoRA calls of one Llama-8B-shaped layer (``LAYER_TARGETS``, rank ``LAYER_RANK``, a
    pool of ``LAYER_SLOTS``), T positions over ``adapters`` adapters in equal runs, on fresh random
    data: ``(calls, errs, plans, backend)``, ``calls`` a list of (target name, zero-argument call)
    in the layer's order, ``errs`` each target's relative error against float64 after one call.
    ``backend_kw``: options of the backend (``CupyBackend(spec, **backend_kw)``; ``early_reads`` True
    unless given, as the pool's backend)."""
    import torch

    from ..addressing import group_by_slot
    from ..backends.base import LayerWeights
    from ..backends.cupy import CupyBackend
    from ..spec import LoraSlice, LoraSpec, LoraTarget

    gen = torch.Generator(device="cuda").manual_seed(seed)
    S, R = LAYER_SLOTS, LAYER_RANK
    targets = tuple(LoraTarget(name, in_f, sum(sl), 1, tuple(LoraSlice(f"{name}{j}", o) for j, o in enumerate(sl)))
                    for name, in_f, sl in LAYER_TARGETS)
    spec = LoraSpec(targets, num_slots=S, max_rank=R, dtype="bfloat16")
    be = CupyBackend(spec, **{"early_reads": True, **(backend_kw or {})})  # as the pool builds it
    slots = 1 + (np.arange(T) * adapters) // T
    order, indptr = group_by_slot(slots, S)
    to, ip = torch.as_tensor(order, device="cuda"), torch.as_tensor(indptr, device="cuda")
    calls, errs, plans = [], {}, {}
    for t in targets:
        n, out, in_f = t.num_slices, t.out_features, t.in_features
        a = (torch.randn(S, n, R, in_f, device="cuda", generator=gen) / math.sqrt(in_f)).bfloat16()
        b = (torch.randn(S, out, R, device="cuda", generator=gen) / math.sqrt(8)).bfloat16()
        ranks = torch.full((S, n), R, dtype=torch.int32, device="cuda")
        scaling = torch.full((S, n), 2.0, dtype=torch.float32, device="cuda")
        ranks[0], scaling[0], a[0], b[0] = 0, 0.0, 0, 0
        x = torch.randn(T, in_f, device="cuda", generator=gen).bfloat16()
        y0 = (torch.randn(T, out, device="cuda", generator=gen) * 0.1).bfloat16()
        y = y0.clone()
        w = LayerWeights(a, b, scaling, ranks, t.out_offsets())
        be.delta(y, x, w, to, ip)
        torch.cuda.synchronize()
        ref = y0.double()
        offs = t.out_offsets()
        for s in range(1, adapters + 1):
            rows = torch.as_tensor(order[indptr[s]:indptr[s + 1]].astype(np.int64), device="cuda")
            for j in range(n):
                v = x[rows].double() @ a[s, j].double().T
                ref[rows, offs[j]:offs[j + 1]] += 2.0 * (v @ b[s, offs[j]:offs[j + 1]].double().T)
        errs[t.name] = float(torch.linalg.norm(y.double() - ref) / torch.linalg.norm(ref))
        calls.append((t.name, lambda y=y, x=x, w=w: be.delta(y, x, w, to, ip)))
        plans[t.name] = _plan_label(be.plan(T, w, "bfloat16"))
    return calls, errs, plans, be


def run_layer(T: int, adapters: int, warm: Timer, flushed: Timer, seed: int, backend_kw: dict | None = None) -> dict:
    """The four LoRA calls of one layer back to back in one graph, as a model's step runs them:
    ``warm`` (no flush: what the layer's own earlier calls left in L2) and ``flushed`` (one flush
    before the layer); each call alone warm; each target checked against the float64 oracle.
    ``backend_kw``: as ``layer_calls``'s, for A/B runs."""
    from ..backends.cupy import TOLERANCE

    calls, errs, plans, be = layer_calls(T, adapters, seed, backend_kw)
    S, R = LAYER_SLOTS, LAYER_RANK

    def layer():
        for _, c in calls:
            c()

    res = {"T": T, "adapters": adapters, "slots": S, "rank": R, "goal_us": LAYER_GOALS_US.get((T, adapters)),
           "err": errs, "ok": all(e < TOLERANCE["bfloat16"] for e in errs.values()),
           "warm_us": warm(layer), "flushed_us": flushed(layer),
           "calls_warm_us": {name: warm(c) for name, c in calls},
           "plans": plans}
    del be
    return res


def _plan_label(plan) -> str:
    """A launch plan in a few characters: tile, fused, chunks, splits and (unfused) the expand."""
    label = f"{plan.bm}{'f' if plan.fused else ''}{'c' if plan.chunks else ''}/s{plan.splits}"
    if plan.expand == "one":  # clusters of ONE_CLUSTER blocks
        return label + f" one x{plan.blocks // plan.splits}"
    if plan.expand == "pair":  # the shrink's and the expand's grids
        return label + f" pair {plan.blocks}+{plan.col_blocks}"
    return label if plan.fused else label + f" {plan.expand}"


def layer_table(layer: list[dict]) -> str:
    """The layer rows: warm and flushed time of the four calls, the goal, each call alone."""
    names = [n for n, _, _ in LAYER_TARGETS]
    head = (f"{'layer (Llama-8B, r16, one graph)':34s} {'warm':>6s} {'flushed':>7s} {'goal':>5s} met  "
            + " ".join(f"{n:>7s}" for n in names) + "  (each call alone, warm)")
    lines = [head]
    for r in layer:
        met = r["goal_us"] is not None and r["warm_us"] <= r["goal_us"] and r["ok"]
        lines.append(f"{'T=%d, %d adapter%s' % (r['T'], r['adapters'], '' if r['adapters'] == 1 else 's'):34s} "
                     f"{r['warm_us']:6.1f} {r['flushed_us']:7.1f} {r['goal_us'] or math.nan:5.0f} "
                     f"{'yes' if met else 'NO ':3s}  " + " ".join(f"{r['calls_warm_us'][n]:7.1f}" for n in names)
                     + ("" if r["ok"] else "  ERR " + str(r["err"])))
    return "\n".join(lines)


# ---- the run --------------------------------------------------------------------------------------
VARIANTS = {"default": {}, **{f"t{t}{'f' if f else ''}": dict(tile=t, fused=f)
                              for t in (16, 32, 64) for f in (False, True)}}
#: Launches timed side by side with the default, by the names of what they run: on rows whose
#: bucket launches shrink and expand apart, each expand kernel after lora_shrink; on decode rows (a
#: fused launch by default), the fused kernel on chunks and on tiles, and the unfused pair; and on
#: both, lora_chunk (shrink and expand in one launch) wherever it serves the row; on rows of one
#: position, lora_one (backends/cupy.py default_one); on the decode buckets the pair serves, lora_pair.
VERSIONS = {"expand": dict(expand="expand"), "expand_stream": dict(expand="expand_stream"),
            "expand_ring": dict(expand="expand_ring"), "chunk": dict(expand="chunk"),
            "one": dict(expand="one"), "pair": dict(expand="pair")}
#: The versions that run shrink and expand in one launch, or (lora_pair) a pair of their own: no
#: kernel timed alone.
ONE_LAUNCH = ("chunk", "one", "pair")
DECODE_VERSIONS = {"fused_chunks": dict(fused=True, chunks=True), "fused_tiles": dict(fused=True, chunks=False),
                   "unfused": dict(fused=False)}


def kernel_variants(row: Row, sweep: bool, clusters: bool = True) -> dict[str, dict]:
    """The backend options timed on one row: the default, then each expand kernel (unfused
    buckets) or the unfused launches (fused buckets). ``clusters``: the device has thread-block
    clusters (sm_90; lora_one needs them)."""
    from ..backends.cupy import chunk_fits, default_fused, one_fits, pair_fits, slice_alignment
    from ..spec import LoraSpec, LoraTarget

    out = dict(VARIANTS) if sweep else {"default": {}}
    spec = LoraSpec((LoraTarget("t", row.in_f, row.out, 1),), num_slots=row.slots + 1, max_rank=row.pool_rank)
    fits = chunk_fits(row.dtype, row.pool_rank, len(row.slices), None,
                      slice_alignment(np.cumsum((0,) + tuple(row.slices)))) is None
    bucket = spec.bucket_for(row.bucket or row.T)
    chunk = {"chunk": dict(VERSIONS["chunk"], fused=False)} if fits else {}
    if default_fused(bucket):
        out.update(DECODE_VERSIONS)
        out.update(chunk)  # lora_chunk serves any bucket where it is asked for (and the launch is unfused)
    else:
        out.update({k: v for k, v in VERSIONS.items() if k not in ONE_LAUNCH})
        out.update(chunk)
    if clusters and one_fits(bucket, row.pool_rank) is None:  # one position
        out["one"] = VERSIONS["one"]
    if pair_fits(bucket, row.dtype, row.pool_rank, len(row.slices)) is None:  # the decode buckets' pair
        out["pair"] = VERSIONS["pair"]
    return out


def run_row(row: Row, timer: Timer, bw: float, seed: int, sweep: bool) -> dict:
    import torch

    from ..backends.base import LayerWeights
    from ..spec import pool_layout_b
    from ..backends.cupy import TOLERANCE, CupyBackend, check_call, default_tile

    d = build(row, seed)
    w = LayerWeights(d.a, pool_layout_b(d.b, d.spec), d.scaling, d.ranks, d.offsets)  # B as a pool holds it
    # the rank bound a pool's planner hands its launches: the step's slots' largest rank (only a
    # poolrank row, a pool of maximum rank 128 running rank-16 adapters, plans narrower for it)
    rb = max(row.ranks)
    result = {"row": asdict(row), "label": row.label, "adapter_rows": d.adapter_rows}
    floor_bytes = byte_floor(row, d.adapter_rows)
    result["floor_bytes"] = floor_bytes
    result["floor_us"] = floor_us = floor_bytes / bw * 1e6
    kernels, seen, parts = {}, {}, {}
    for name, kw in kernel_variants(row, sweep, torch.cuda.get_device_capability()[0] >= 9).items():
        be = CupyBackend(d.spec, **kw)
        plan = be.plan(d.token_order.shape[0], w, row.dtype, rank_bound=rb)
        if plan in seen:  # the same launch as a variant already timed
            kernels[name] = dict(kernels[seen[plan]], same_as=seen[plan])
            continue
        seen[plan] = name
        d.y.copy_(d.y0)
        be.delta(d.y, d.x, w, d.token_order, d.slot_indptr, rank_bound=rb)
        torch.cuda.synchronize()
        err = oracle_error(d, d.y)
        us = timer(lambda: be.delta(d.y, d.x, w, d.token_order, d.slot_indptr, rank_bound=rb))
        kernels[name] = {"us": us, "err": err, "ok": err < TOLERANCE[row.dtype],
                         "plan": {k: getattr(plan, k) for k in ("bm", "bn", "splits", "k_split", "fused", "cpb",
                                                                  "expand", "chunks", "tiles", "blocks")}}
        call = check_call(be.limits, d.y, d.x, w, d.token_order, d.slot_indptr, rb)
        kernels[name]["occupancy"] = be.occupancy(call)
        if (row.group in ("core", "poolrank") and row.T >= 1024 and plan.bm == default_tile(plan.bucket)
                and plan.expand != "chunk"):
            # each kernel alone
            for part, kernel in (("shrink", "shrink"), ("expand", plan.expand)):
                if kernel not in parts:
                    parts[kernel] = timer(lambda: be._run(call, (part,)))
            be.workspace.fill(0)  # the shrink alone leaves its sums in v
            be.counters.fill(0)
        del be
    result["kernels"] = kernels
    result["parts"] = parts
    if rb < row.pool_rank:  # the same call planned for the pool's maximum rank, as before the bound
        be = CupyBackend(d.spec)  # the default variant's backend
        d.y.copy_(d.y0)
        be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
        torch.cuda.synchronize()
        if oracle_error(d, d.y) < TOLERANCE[row.dtype]:
            result["unbounded_us"] = timer(lambda: be.delta(d.y, d.x, w, d.token_order, d.slot_indptr))
        del be
    base = {}
    for name, fn in baselines(d).items():
        base[name] = timer(fn)
    result["baselines"] = base
    k = kernels["default"]
    best = min(base.values()) if base else None
    result["us"] = k["us"]
    result["share_of_floor"] = floor_us / k["us"]
    result["best_baseline_us"] = best
    result["target_ok"] = targets_met(row, k["us"], floor_us, best) and k["ok"]
    return result


def _plan_and_occupancy(k: dict) -> tuple[str, str]:
    """A default launch's short plan (tile, fused, splits, versions) and blocks per SM of its kernels."""
    p = k["plan"]
    plan = f"{p['bm']}{'f' if p['fused'] else ''}{'c' if p.get('chunks') else ''}/s{p['splits']}"
    if not p["fused"]:
        plan += f" {p['expand']}" + ("_cl" if p.get("cluster") else "")  # lora_chunk_cl: reports of earlier runs
    occ = "/".join(str(o["blocks_per_sm"]) for o in k.get("occupancy", {}).values()) or "-"
    return plan, occ


def _table(results: list[dict], bw: float) -> str:
    head = (f"{'row':44s} {'plan':>14s} {'us':>7s} {'floor':>6s} {'%fl':>4s} {'loop':>7s} {'bmm':>7s} "
            f"{'gemm':>7s} {'err':>8s} {'occ':>5s} ok")
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s", head, "-" * len(head)]
    for r in results:
        k = r["kernels"]["default"]
        plan, occ = _plan_and_occupancy(k)
        b = r["baselines"]
        bs = [f"{b[n]:7.1f}" if n in b else f"{'-':>7s}" for n in ("loop", "bmm", "gemm")]
        lines.append(f"{r['label']:44s} {plan:>14s} {r['us']:7.1f} {r['floor_us']:6.1f} "
                     f"{100 * r['share_of_floor']:4.0f} {' '.join(bs)} {k['err']:8.1e} {occ:>5s} "
                     f"{'yes' if r['target_ok'] else 'NO'}")
    return "\n".join(lines)


def _versions_table(results: list[dict]) -> str:
    """The launches timed side by side (``VERSIONS`` / ``DECODE_VERSIONS``): full-call times, the
    kernels alone where timed, the best launch, the best baseline, and whether the best meets the
    issue's bars."""
    names = ["default", *VERSIONS, *DECODE_VERSIONS]
    alone_keys = ["shrink", *(v for v in VERSIONS if v not in ONE_LAUNCH)]
    short = {"default": "default", "expand": "expand", "expand_stream": "stream", "expand_ring": "ring",
             "chunk": "chunk", "one": "one", "pair": "pair", "fused_chunks": "chunks",
             "fused_tiles": "tiles",
             "unfused": "unfused"}
    head = (f"{'row':40s} " + " ".join(f"{short[n]:>7s}" for n in names)
            + f" {'best':>7s} {'base':>6s} {'floor':>6s} bars | alone: " + " ".join(alone_keys))
    lines = ["launches side by side (us; ERR = over tolerance, '-' = not run)", head]
    for r in results:
        ks = r["kernels"]
        if len(ks) < 2:
            continue
        cells, best_name, best_us = [], None, math.inf
        for n in names:
            k = ks.get(n)
            if k is None:
                cells.append(f"{'-':>7s}")
            elif not k["ok"]:
                cells.append(f"{'ERR':>7s}")
            else:
                cells.append(f"{k['us']:7.1f}")
                if k["us"] < best_us:
                    best_name, best_us = n, k["us"]
        row = _row_of(r)
        base = r["best_baseline_us"]
        met = best_name is not None and targets_met(row, best_us, r["floor_us"], base)
        p = r.get("parts", {})
        alone = " ".join(f"{p[k]:.1f}" if k in p else "-" for k in alone_keys)
        lines.append(f"{r['label'][:40]:40s} " + " ".join(cells)
                     + f" {short.get(best_name, '-'):>7s} {base if base is not None else math.nan:6.1f} "
                       f"{r['floor_us']:6.1f} {'yes' if met else 'no':>4s} | {alone}")
    return "\n".join(lines)


def _row_of(r: dict) -> Row:
    return Row(**{**r["row"], "slices": tuple(r["row"]["slices"]), "ranks": tuple(r["row"]["ranks"])})


def markdown_report(data: dict) -> str:
    """A saved run (``--json``) as markdown: every row with its plan, time, floor, baselines and
    bars; the bars met per kind; the rank-128 pool against the rank-16 one; the kernel versions."""
    rows, meta = data["rows"], data["meta"]
    calib = meta.get("calibration_us", {})
    lines = [f"{meta['device']}, torch {meta['torch']}; copy bandwidth **{meta['copy_bw'] / 1e12:.2f} TB/s**; "
             f"timing `{meta['method']}`, flush `{meta.get('flush', 'write')}`."]
    if "diff" in calib:
        lines[0] += (f" Calibration: an empty kernel reads {calib['diff']['empty_kernel']:.2f} us"
                     + (f"; one round of dependent loads after the flush {calib['dependent_round']:.2f} us"
                        if "dependent_round" in calib else "") + ".")
    lines += ["", "| row | plan | us | floor us | % of floor | loop | bmm | gemm | err | blocks/SM | bars met |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    met, total = {}, {}
    for r in rows:
        k = r["kernels"]["default"]
        plan, occ = _plan_and_occupancy(k)
        b = r["baselines"]
        cells = [f"{b[n]:.1f}" if n in b else "-" for n in ("loop", "bmm", "gemm")]
        bs = bars(_row_of(r), r["us"], r["floor_us"], r["best_baseline_us"])
        for name, ok in bs.items():
            total[name] = total.get(name, 0) + 1
            met[name] = met.get(name, 0) + int(ok and k["ok"])
        lines.append(f"| {r['label']} | {plan} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                     f"{100 * r['floor_us'] / r['us']:.0f} | {' | '.join(cells)} | {k['err']:.1e} | {occ} | "
                     + ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in bs.items()) + " |")
    lines += ["", "Bars met: " + ", ".join(f"{n} {met[n]} of {total[n]}" for n in total) + "."]
    pr = [f"T={r['row']['T']}: {r['vs_pool16']:.2f}x" for r in rows if "vs_pool16" in r]
    if pr:
        lines.append("A pool of maximum rank 128 runs rank-16 adapters at " + ", ".join(pr)
                     + " the time of a pool of maximum rank 16 (bar: 1.2x), planned for the step's rank bound"
                     + ("; planned for rank 128 (no bound): " + ", ".join(
                         f"T={r['row']['T']}: {r['unbounded_us']:.1f} us" for r in rows if "unbounded_us" in r)
                        if any("unbounded_us" in r for r in rows) else "") + ".")
    if data.get("layer"):
        names = [n for n, _, _ in LAYER_TARGETS]
        lines += ["", "One Llama-8B-shaped decoder layer in situ: its four LoRA calls (rank 16, a pool of "
                  f"{LAYER_SLOTS - 1} adapters) back to back in one graph, warm and with one flush before the layer (us):",
                  "", "| tokens | adapters | warm | flushed | goal (warm) | met | " + " | ".join(names)
                  + " (each alone, warm) | plans |", "|---|---|---|---|---|---|" + "---|" * len(names) + "---|"]
        for r in data["layer"]:
            met = r["goal_us"] is not None and r["warm_us"] <= r["goal_us"] and r["ok"]
            lines.append(f"| {r['T']} | {r['adapters']} | {r['warm_us']:.1f} | {r['flushed_us']:.1f} | "
                         f"{r['goal_us']:.0f} | {'yes' if met else 'no'} | "
                         + " | ".join(f"{r['calls_warm_us'][n]:.1f}" for n in names)
                         + " | " + ", ".join(f"{k} {v}" for k, v in r["plans"].items()) + " |")
    versions = _versions_table(rows).splitlines()[1:]
    if len(versions) > 1:
        lines += ["", "Launches side by side, whole call (us), and each kernel alone where timed:", "", "```"]
        lines += versions + ["```"]
    return "\n".join(lines)


def compile_modules(dtypes, load=None) -> float:
    """Compile (or fetch from CuPy's cache) and load the tensor-core module of each of ``dtypes``
    before any row is timed, so a row's first call does not spend a deadline's seconds in NVRTC
    (a dtype's module is about 40 s to build on an H200 host); the seconds it took. ``load``:
    ``kernels.load_module`` (tests pass a stand-in)."""
    from .. import kernels as k

    load = load or k.load_module
    kind, bm, bn, chunks = next(iter(k.mma_kernels()))
    t = time.time()
    for dt in sorted(set(dtypes)):
        load(k.mma_family(dt)).get_function(k.mma_name(k.CUDA_TYPES[dt], kind, bm, bn=bn, chunks=chunks,
                                                       aligned=False))
    return time.time() - t


def _deadline(args) -> float:
    """When to stop starting rows: --deadline-s from now, or BENCH_END_AT (epoch seconds) less 20 s."""
    import os

    ends = [time.time() + args.deadline_s] if args.deadline_s else []
    if os.environ.get("BENCH_END_AT"):
        ends.append(float(os.environ["BENCH_END_AT"]) - 20.0)
    return min(ends) if ends else math.inf


def _sweep_table(results: list[dict]) -> str:
    names = list(VARIANTS)
    lines = [f"{'row':44s} " + " ".join(f"{n:>7s}" for n in names)]
    for r in results:
        ks = r["kernels"]
        lines.append(f"{r['label']:44s} " + " ".join(
            f"{ks[n]['us']:7.1f}" if ks[n]["ok"] else f"{'ERR':>7s}" for n in names))
    return "\n".join(lines)


def main(argv=None) -> int:
    """Check, time and tabulate every row; returns 0 when every row passed its check."""
    ap = argparse.ArgumentParser(prog="lora-cupy bench kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write every number here")
    ap.add_argument("--groups", default="", help="comma-separated row groups to run, \"layer\" for the layer rows (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also time every tile / fused variant")
    ap.add_argument("--replays", type=int, default=10, help="graph replays per timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", choices=("events", "diff"), default="diff",
                    help="events around each call inside the graph, or (calls + flushes - flushes) / calls")
    ap.add_argument("--match", default="", help="only rows whose label holds this text")
    ap.add_argument("--max-tokens", type=int, default=0, help="only rows of at most this many tokens")
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="L2 flush before each call: zero 256 MB (dirty lines, the default) or read them")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no row after this many seconds (also: env BENCH_END_AT, epoch seconds)")
    ap.add_argument("--report", metavar="FILE", help="print a saved run (--json) as markdown and exit (no GPU)")
    args, rc = parse(ap, argv, markdown_report)
    if rc is not None:
        return rc
    import torch

    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA device", file=sys.stderr)
        return 2
    groups = set(filter(None, args.groups.split(",")))
    todo = [r for r in rows() if (not groups or r.group in groups) and args.match in r.label
            and (not args.max_tokens or r.T <= args.max_tokens)]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {len(todo)} rows", file=sys.stderr)
    timer = Timer(args.replays, args.method, args.flush)
    import torch as _t

    calib = {}
    for m in ("events", "diff"):  # what the method reads for nothing at all, and for an empty kernel
        t = Timer(args.replays, m, args.flush)
        calib[m] = {"nothing": t(lambda: None), "empty_kernel": t(lambda: _t.cuda._sleep(0))}
    calib["dependent_round"] = dependent_round_us(Timer(args.replays, "diff", args.flush))
    print(f"calibration (us): {calib}", file=sys.stderr)
    took = compile_modules(r.dtype for r in todo)
    print(f"kernel modules of {sorted({r.dtype for r in todo})} loaded in {took:.0f} s (before the deadline's "
          "clock)", file=sys.stderr)
    results, skipped = [], []
    t0, stop = time.time(), _deadline(args)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bw": bw,
            "method": "events" if timer.events_in_graphs else "diff", "flush": args.flush, "calibration_us": calib}
    layer = []
    if not groups or "layer" in groups:
        warm = Timer(args.replays, "diff", "none")
        for i, (T, k) in enumerate(LAYER_GOALS_US):
            layer.append(run_layer(T, k, warm, timer, args.seed + 1000 + i))
            print(f"[layer] T={T} adapters={k}: warm {layer[-1]['warm_us']:.1f} us, "
                  f"flushed {layer[-1]['flushed_us']:.1f} us", file=sys.stderr)
        del warm
    for i, row in enumerate(todo):
        if time.time() > stop:
            skipped.append(row.label)
            continue
        res = run_row(row, timer, bw, args.seed + i, args.sweep)
        results.append(res)
        vs = " ".join(f"{n} {k['us']:.1f}" for n, k in res["kernels"].items() if n != "default")
        print(f"[{i + 1}/{len(todo)} {time.time() - t0:5.0f}s] {row.label}: {res['us']:.1f} us "
              f"(floor {res['floor_us']:.1f}, best baseline {res['best_baseline_us']:.1f}) {vs}", file=sys.stderr)
        if args.json:  # after every row, so a run cut short still leaves its numbers
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "layer": layer, "rows": results, "partial": True}, f, indent=1)
    if skipped:
        print(f"deadline: {len(skipped)} rows not run: {', '.join(skipped)}", file=sys.stderr)
    by_label = {r["label"]: r for r in results}
    for r in results:  # a pool of max rank 128 against the same adapters in a pool of max 16
        if r["row"]["group"] == "poolrank":
            twin = by_label.get(r["label"].replace("poolrank", "core").replace(" pool128", ""))
            if twin:
                r["vs_pool16"] = r["us"] / twin["us"]
    print(_table(results, bw))
    print("timing calibration (us): " + "; ".join(
        f"{m}: nothing {c['nothing']:.2f}, empty kernel {c['empty_kernel']:.2f}" for m, c in calib.items()
        if isinstance(c, dict)) + f"; one round of dependent loads after the flush {calib['dependent_round']:.2f}")
    pr = [f"T{r['row']['T']}: {r['vs_pool16']:.2f}x" + (f" (no bound {r['unbounded_us']:.1f} us)" if "unbounded_us" in r
                                                        else "") for r in results if "vs_pool16" in r]
    if pr:
        print("pool max 128 vs max 16, rank-16 adapters: " + ", ".join(pr))
    if args.sweep:
        print(_sweep_table(results))
    if skipped:
        print(f"not run (deadline): {', '.join(skipped)}")
    print(_versions_table(results))
    if layer:
        print(layer_table(layer))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "layer": layer, "rows": results, "skipped": skipped}, f, indent=1)
    return 0 if all(k["ok"] for r in results for k in r["kernels"].values()) and all(r["ok"] for r in layer) else 1


if __name__ == "__main__":
    sys.exit(main())
