"""Calls planned for a step's rank bound (``rank_bound``, ``LaunchViews.rank_bound``): a pool of a
large maximum rank whose step holds only smaller adapters runs the kernels of a narrower pool,
reading A and B with the pool's strides. Every kernel against the float64 oracle on fresh random
data, the weights past each slot's rank poisoned with NaN (a kernel reading past the width shows);
and a slot above a broken bound has its delta cut to the planned width, with nothing written
outside y's addressed rows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lora_cupy.backends.base import LayerWeights
from lora_cupy.backends.cupy import planned_rank, rank_width
from lora_cupy.backends.reference import dense_delta64
from lora_cupy.planning import LaunchViews

from conftest import _finite
from test_kernels import _gpu_count, backend_for, check_clean, cp, dev, dev_weights, host

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]

DTYPES = ("bfloat16", "float16", "float32")
#: (pool's maximum rank, the adapters' ranks, the bound the pool's planner would hand out)
POOLS = {"r128-16": (128, (0, 3, 16), 16), "r128-64": (128, (5, 16, 40, 64), 64), "r64-16": (64, (1, 13, 16), 16),
         "r48-16": (48, (4, 16), 16)}
#: every launch a bounded call may take, forced (bf16): (backend options, what the plan must say)
FORCED = {"simt": (dict(kernel="simt"), {}),
          "fused-tiles": (dict(fused=True, chunks=False, tile=16), dict(fused=True, chunks=False)),
          "fused-chunks": (dict(fused=True, chunks=True, tile=64), dict(fused=True, chunks=True)),
          "expand": (dict(fused=False, expand="expand"), dict(fused=False, expand="expand")),
          "expand_stream": (dict(fused=False, expand="expand_stream"), dict(fused=False, expand="expand_stream")),
          "expand_ring": (dict(fused=False, expand="expand_ring", tile=64), dict(fused=False, expand="expand_ring")),
          "chunk": (dict(fused=False, expand="chunk"), dict(expand="chunk")),
          "one": (dict(expand="one"), dict(expand="one")),
          "pair": (dict(expand="pair"), dict(expand="pair"))}
#: the forced launches' shapes: three slices on lora_chunk's 128-column boundaries, and one slice
FORCED_SLICES = {"qkv": (256, 128, 128), "one-slice": (200,)}


def _forced_cases():
    """(variant, shape, T) where the forced launch serves a pool of rank 128 bounded at 16 (the
    planner refuses or replaces the others: lora_one at one position only, lora_pair up to 256
    positions, lora_chunk in chunks of 16 at decode buckets)."""
    from lora_cupy.backends import cupy as cb
    from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget

    out = []
    for name, (kw, want) in FORCED.items():
        for shape, sl in FORCED_SLICES.items():
            t = LoraTarget("t", 264, sum(sl), 1, tuple(LoraSlice(f"s{j}", o) for j, o in enumerate(sl)))
            for T in ((1,) if name == "one" else (16, 64, 300)):
                if kw.get("kernel") == "simt":
                    out.append((name, shape, T))
                    continue
                opts = {k: v for k, v in kw.items() if k != "kernel"}
                try:
                    p = cb.plan_launch(LoraSpec((t,), num_slots=17, max_rank=16).bucket_for(T), 264, sum(sl),
                                       len(sl), 16, "bfloat16", num_slots=17, live_slices=len(sl),
                                       slice_align=cb.slice_alignment(t.out_offsets()), **opts)
                except ValueError:
                    continue
                if all(getattr(p, k) == v for k, v in want.items()):
                    out.append((name, shape, T))
    return out


def _case(make_case, T: int, pool: str, dtype: str):
    R, ranks, _ = POOLS[pool]
    return make_case(T=T, in_f=264, slices=(200, 56, 40), max_rank=R, ranks=ranks, dtype=dtype, mix="uniform",
                     num_slots=17, active=min(8, T))


def _run(be, case, bound, prepared: bool):
    y = dev(case.y0)
    x, w, to, ip = dev(case.x), dev_weights(case.w), dev(case.token_order), dev(case.slot_indptr)
    if prepared:  # as a pool's layer calls it: the bound rides on the step's launch views
        be.prepare(w)(y, x, LaunchViews(len(case.token_order), 0, to, ip, bound), case.x.shape[0])
    else:
        be.delta(y, x, w, to, ip, rank_bound=bound)
    cp().cuda.get_current_stream().synchronize()
    check_clean(be)
    return host(y, case.spec.dtype)


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("T", [1, 5, 16, 64, 300, 1024])
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_bounded_call_matches_oracle(make_case, check, dtype, pool, T, prepared):
    case = _case(make_case, T, pool, dtype)
    R, _, bound = POOLS[pool]
    assert planned_rank(R, bound) == bound < R
    check(case, _run(backend_for(case.spec), case, bound, prepared), dtype)


@pytest.mark.parametrize("variant,shape,T", _forced_cases())
def test_every_kernel_under_a_bound(make_case, check, variant, shape, T):
    kw, want = FORCED[variant]
    case = make_case(T=T, in_f=264, slices=FORCED_SLICES[shape], max_rank=128, ranks=(0, 3, 16), dtype="bfloat16",
                     mix="uniform", num_slots=17, active=min(8, T))
    be = backend_for(case.spec, **kw)
    plan = be.plan(T, dev_weights(case.w), "bfloat16", rank_bound=16)
    assert all(getattr(plan, k) == v for k, v in want.items()), plan  # the launch asked for, planned for rank 16
    check(case, _run(be, case, 16, False), "bfloat16")


@pytest.mark.parametrize("T", [16, 64, 256])
def test_a_rank16_step_of_a_rank128_pool_takes_the_rank16_plan(make_case, T):
    """The point of the bound: lora_pair (a rank-16 pool's decode kernels), not lora_chunk at rank 128
    (one slice: lora_chunk serves several only on its column blocks)."""
    case = make_case(T=T, in_f=264, slices=(200,), max_rank=128, ranks=(0, 3, 16), dtype="bfloat16", mix="uniform",
                     num_slots=17, active=8)
    be, w = backend_for(case.spec), dev_weights(case.w)
    narrow, wide = be.plan(T, w, "bfloat16", rank_bound=16), be.plan(T, w, "bfloat16")
    assert narrow.expand == "pair" and wide.expand == "chunk"
    assert be.plan(T, w, "bfloat16", rank_bound=128) == wide


@pytest.mark.parametrize("T", [1, 64, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_broken_bound_cuts_the_delta_to_the_width(make_case, check, dtype, T):
    """A slot of rank 64 in a call bounded at 16: its delta is that of its first 16 ranks, and no row
    past the step's or slice past the width is touched (the kernels clamp every rank to the width)."""
    case = _case(make_case, T, "r128-64", dtype)
    ranks = case.w.ranks
    assert (ranks > 16).any()
    cut = LayerWeights(case.w.a, case.w.b, case.w.scaling, np.minimum(ranks, rank_width(16)), case.w.out_offsets)
    want = replace(case, ref=case.y0.astype(np.float64) + dense_delta64(case.x, _finite(cut), case.row_slots))
    check(replace(want, w=cut), _run(backend_for(case.spec), case, 16, False), dtype)


def test_every_forced_launch_has_a_case():
    """The list above is computed from the planner: no launch may drop out of it unnoticed."""
    assert {v for v, _, _ in _forced_cases()} == set(FORCED)
