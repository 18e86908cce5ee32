"""Programmatic dependent launch (PDL) of the tensor-core kernels: each waits for the grid queued
before it and lets the next one start, so back-to-back calls overlap their launches. These tests
chain calls whose inputs are the outputs of the kernels just before them (a torch kernel writes x
and y over NaN, a LoRA call writes y, the next LoRA call reads that y as its x): a kernel that read
anything of its predecessor's before the wait would read NaN or a stale value and miss the float64
oracle. The plans the decode buckets take (lora_one at one position, lora_pair above it), with and
without ``EARLY_READS``, eager and captured in a graph replayed on fresh inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lora_cupy.addressing import group_by_slot
from lora_cupy.backends import cupy as cb
from lora_cupy.backends.base import LayerWeights
from lora_cupy.planning import LaunchViews
from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget

from test_kernels import _gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]

S, R = 9, 16
#: a chain of three targets: the first's y is the second's x, the second's y the third's x
DIMS = ((1032, (520, 200, 96)), (816, (1024,)), (1024, (4104,)))


def _chain(torch, gen, T, adapters):
    targets = [LoraTarget(f"t{i}", in_f, sum(sl), 1, tuple(LoraSlice(f"t{i}{j}", o) for j, o in enumerate(sl)))
               for i, (in_f, sl) in enumerate(DIMS)]
    spec = LoraSpec(tuple(targets), num_slots=S, max_rank=R, dtype="bfloat16")
    ws = []
    for t in targets:
        n, out, in_f = t.num_slices, t.out_features, t.in_features
        a = (torch.randn(S, n, R, in_f, device="cuda", generator=gen) / math.sqrt(in_f)).bfloat16()
        b = (torch.randn(S, out, R, device="cuda", generator=gen) / 4).bfloat16()
        ranks = torch.randint(1, R + 1, (S, n), dtype=torch.int32, device="cuda", generator=gen)
        scaling = torch.full((S, n), 0.5, dtype=torch.float32, device="cuda")
        ranks[0], scaling[0] = 0, 0.0
        ws.append(LayerWeights(a, b, scaling, ranks, t.out_offsets()))
    slots = 1 + (np.arange(T) * adapters) // T
    order, indptr = group_by_slot(slots, S)
    return spec, targets, ws, torch.as_tensor(order, device="cuda"), torch.as_tensor(indptr, device="cuda"), slots


def _oracle(torch, ws, slots, x0, y0s):
    """The chain in float64: y_i = y0_i + delta_i(x_i), x_{i+1} = y_i rounded to bf16 (as the kernels
    store it)."""
    x = x0.double()
    outs = []
    rows = torch.as_tensor(slots, device="cuda")
    for w, y0 in zip(ws, y0s):
        y = y0.double().clone()
        offs = w.out_offsets
        for j in range(len(offs) - 1):
            a = w.a[rows, j].double()  # [T, R, in]
            b = w.b[rows, offs[j]:offs[j + 1]].double()  # [T, cols, R]
            r = w.ranks[rows, j].long()
            mask = (torch.arange(R, device="cuda")[None, :] < r[:, None]).double()
            v = torch.einsum("tri,ti->tr", a, x) * mask * w.scaling[rows, j].double()[:, None]
            y[:, offs[j]:offs[j + 1]] += torch.einsum("tcr,tr->tc", b, v)
        outs.append(y)
        x = y.bfloat16().double()
    return outs


@pytest.mark.parametrize("early", (False, True))
@pytest.mark.parametrize("T,adapters", ((1, 1), (16, 4), (64, 8), (256, 8)))
def test_chained_calls_read_only_their_predecessors_finished_output(T, adapters, early):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(1234 + T)
    spec, targets, ws, to, ip, slots = _chain(torch, gen, T, adapters)
    be = cb.CupyBackend(spec, early_reads=early)
    major = int(torch.cuda.get_device_capability()[0])
    assert be.pdl == (major >= 9), "the tensor-core kernels take PDL where the device has it"
    plans = [be.plan(T, w, "bfloat16") for w in ws]
    if T == 1 and major >= 9:
        assert all(p.expand == "one" for p in plans), plans
    launches = [be.prepare(w) for w in ws]
    src = torch.randn(T, DIMS[0][0], device="cuda", generator=gen).bfloat16()
    base = [(torch.randn(T, sum(sl), device="cuda", generator=gen) * 0.1).bfloat16() for _, sl in DIMS]
    x = torch.empty_like(src)
    ys = [torch.empty_like(b) for b in base]
    views = LaunchViews(T, 0, to, ip)  # one capture bucket: the same object every step

    def step():
        x.fill_(float("nan"))
        torch.mul(src, 1, out=x)  # a kernel writes x just before the first call
        for y, b, launch, xin in zip(ys, base, launches, [x, *ys[:-1]]):
            y.fill_(float("nan"))
            torch.mul(b, 1, out=y)  # ... and y just before each call
            launch(y, xin, views, T)

    def check():
        torch.cuda.synchronize()
        want = _oracle(torch, ws, slots, src, base)
        for i, (y, w) in enumerate(zip(ys, want)):
            err = float(torch.linalg.norm(y.double() - w) / torch.linalg.norm(w))
            assert err < cb.TOLERANCE["bfloat16"], f"target {i} (plan {plans[i]}): relative error {err:.2e}"

    step()
    check()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        step()  # warm on the capture stream
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        src.copy_(torch.randn(T, DIMS[0][0], device="cuda", generator=gen).bfloat16())
        for b in base:
            b.copy_((torch.randn(b.shape, device="cuda", generator=gen) * 0.1).bfloat16())
        graph.replay()
        check()
