"""``lora_pair`` (raw_kernels/pair.cuh: the decode buckets' delta as a shrink launch adding into v and an
expand launch reading it, both overlapping the call before under programmatic dependent launch) against
the float64 oracle on fresh random data: both 16-bit dtypes, odd `in` (element-wise x and A, a k-block
past `in`), odd ranks with NaN past them, 1 to 8 slices (every instantiation of the shrink) with rank-0
ones, a slot of more positions than a chunk, 513 slots, padding positions, `in` long enough that a split
takes several rounds, a pool of a larger max_rank planned for rank 16, both instantiations through a
prepared layer, each member of a fused target alone, positions with nothing to add (y bit-exact), pairs
of y's columns with one zero delta (added at L2: that column's bits kept), calls back to back on one
stream, and a CUDA graph replayed under new addressing. At rank width 64 (one or two slices): odd ranks
and `in`, max_rank off 8 (B's element-wise path), capped splits, padding, both instantiations, a pool of
max_rank 128 planned for 64. v and the counters stay at zero (the pair's v, a workspace of its own,
too)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lora_cupy.backends import cupy as cb
from lora_cupy.backends.reference import dense_delta64

from conftest import _finite, assert_odd_columns_kept, with_zero_odd_deltas
from test_kernels import (_gpu_count, backend_for, check_clean, cp, dev, dev_weights, graph_replays_new_addressing,
                          host, run_cupy, run_members, run_prepared)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]

DTYPES = ("bfloat16", "float16")
PAIR = dict(expand="pair")
CASES = {
    "T3-odd": dict(T=3, in_f=77, slices=(61,), max_rank=13, ranks=(1, 8, 13), mix="distinct"),
    "T20-identical": dict(T=20, in_f=264, slices=(136,), max_rank=16, ranks=(16,), mix="identical"),
    "T40-qkv": dict(T=40, in_f=1032, slices=(96, 40, 24), max_rank=16, ranks=(0, 1, 8, 13, 16), mix="zipf",
                    num_slots=17, active=12),
    "T61-many-slots": dict(T=61, in_f=264, slices=(136, 40), max_rank=16, ranks=(1, 8, 16), mix="distinct",
                           num_slots=513, active=500),
    "T64-5-slices": dict(T=64, in_f=520, slices=(40, 24, 17, 8, 32), max_rank=16, ranks=(0, 3, 16), mix="skewed",
                         num_slots=9, active=6),
    "T30-8-slices-rounds": dict(T=30, in_f=5000, slices=(20, 12, 16, 8, 24, 16, 4, 28), max_rank=16,
                                ranks=(2, 9, 16), mix="distinct", num_slots=17, active=10),
    "T50-pad-wide": dict(T=50, in_f=4104, slices=(3000, 1000), max_rank=16, ranks=(5, 16), mix="zipf",
                         num_slots=33, active=20, pad_to=64),
    "T200-down": dict(T=200, in_f=14336, slices=(520,), max_rank=16, ranks=(7, 16), mix="skewed", num_slots=33,
                      active=32),
    # shares of whole tiles (the ALIGNED expand's own path) with a pool of max_rank 8 (B's ranks past 8
    # never read), and with chunks of one or two positions (the rows past m neither read nor written)
    "T24-r8-whole": dict(T=24, in_f=264, slices=(256, 128), max_rank=8, ranks=(1, 5, 8), mix="uniform",
                         num_slots=9, active=5),
    "T5-whole-rows": dict(T=5, in_f=256, slices=(384,), max_rank=16, ranks=(16,), mix="distinct", num_slots=5,
                          active=3),
}

#: rank width 64: one or two slices
CASES64 = {
    "T5-odd-r61": dict(T=5, in_f=77, slices=(61,), max_rank=61, ranks=(1, 17, 40, 61), mix="distinct"),
    "T20-identical-r64": dict(T=20, in_f=264, slices=(136,), max_rank=64, ranks=(64,), mix="identical"),
    "T64-two-slices-r64": dict(T=64, in_f=1032, slices=(96, 40), max_rank=64, ranks=(0, 5, 33, 64), mix="zipf",
                               num_slots=17, active=12),
    "T33-rounds-r48": dict(T=33, in_f=5000, slices=(40, 24), max_rank=48, ranks=(2, 30, 48), mix="distinct",
                           num_slots=17, active=10),
    "T200-down-r64": dict(T=200, in_f=14336, slices=(520,), max_rank=64, ranks=(7, 64), mix="skewed", num_slots=33,
                          active=32),
    "T250-pad-wide-r64": dict(T=250, in_f=4104, slices=(3000, 1000), max_rank=64, ranks=(16, 64), mix="zipf",
                              num_slots=33, active=20, pad_to=256),
}
#: the rank-64 cases the pair serves by default (up to PAIR_WIDE_RANK_TO positions, `in` in one round)
DEFAULT64 = {"T5-odd-r61", "T20-identical-r64", "T64-two-slices-r64"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES) + list(CASES64))
def test_pair_matches_oracle(make_case, check, name, dtype):
    """Twice on one backend (the second call on fresh data): v starts from zero again."""
    kw = CASES.get(name) or CASES64[name]
    case = make_case(dtype=dtype, **kw)
    be = backend_for(case.spec, **PAIR)
    T = case.token_order.shape[0]
    plan = be.plan(T, dev_weights(case.w), dtype)
    assert (plan.expand, plan.bm) == ("pair", cb.PAIR_M) and plan.col_blocks >= plan.tiles
    assert plan.rank_width == (16 if name in CASES else 64)
    default = T >= cb.PAIR_FROM if name in CASES else name in DEFAULT64
    assert (backend_for(case.spec).plan(T, dev_weights(case.w), dtype).expand == "pair") == default
    check(case, run_cupy(be, case), dtype)
    case2 = make_case(dtype=dtype, **kw)
    check(case2, run_cupy(be, case2), dtype)


@pytest.mark.parametrize("name,rw", [("T30-8-slices-rounds", 16), ("T33-rounds-r48", 64), ("T200-down-r64", 64)])
def test_pair_splits_are_capped_where_in_is_long(name, rw):
    """The cases above whose splits are capped (PAIR_MAX_SPLITS): each split of the shrink walks more of
    `in` than one round of its warps' k-blocks, the path that loads A after the wait."""
    kw = CASES.get(name) or CASES64[name]
    in_f, n = kw["in_f"], len(kw["slices"])
    assert cb.pair_width(kw["max_rank"]) == rw
    per = cb.PAIR_SW * cb.pair_kb(n, rw) * 32
    assert cb.pair_splits(in_f, n, rw) == cb.PAIR_MAX_SPLITS and cb.PAIR_MAX_SPLITS * per < in_f


@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_in_a_pool_of_a_larger_rank_planned_for_16(make_case, check, dtype):
    """A pool of max_rank 64 whose step's adapters are all of rank 16 or less (rank_bound=16): A's and B's
    strides are 64, the kernels read 16 ranks."""
    case = make_case(T=40, in_f=264, slices=(136, 40), max_rank=64, ranks=(1, 8, 16), dtype=dtype, mix="zipf",
                     num_slots=17, active=12)
    be = backend_for(case.spec)
    w = dev_weights(case.w)
    assert be.plan(40, w, dtype, rank_bound=16).expand == "pair"
    y = dev(case.y0)
    be.delta(y, dev(case.x), w, dev(case.token_order), dev(case.slot_indptr), rank_bound=16)
    cp().cuda.get_current_stream().synchronize()
    check_clean(be)
    check(case, host(y, dtype), dtype)


@pytest.mark.parametrize("route", ("aligned", "x_misaligned", "y_misaligned", "aligned_off"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rw", (16, 64))
def test_pair_instantiations_through_a_prepared_layer(make_case, check, dtype, route, rw):
    """The engine's path: every 16-byte path allowed runs the ALIGNED instantiations; x or y off
    alignment, or ``aligned=False``, the ones reading the flags."""
    slices, ranks = ((200, 56, 24), (0, 1, 5, 13, 16)) if rw == 16 else ((200, 56), (0, 1, 21, 50, 64))
    case = make_case(T=24, in_f=328, slices=slices, max_rank=rw, ranks=ranks, dtype=dtype,
                     mix="distinct", num_slots=17, active=9)
    be = backend_for(case.spec, **PAIR, **(dict(aligned=False) if route == "aligned_off" else {}))
    y, packed, _, _ = run_prepared(be, case, route, 24)
    assert [c.name for c in packed.calls] == ["pair_shrink", "pair_expand"]
    assert packed.aligned == (route == "aligned")
    check_clean(be)
    check(case, host(y, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_in_a_pool_of_rank_128_planned_for_64(make_case, check, dtype):
    """A pool of max_rank 128 whose step's adapters are of rank 64 or less (rank_bound=64): A's and B's
    strides are 128, the kernels read 64 ranks (the pair at rank width 64)."""
    case = make_case(T=40, in_f=264, slices=(136, 40), max_rank=128, ranks=(1, 20, 64), dtype=dtype, mix="zipf",
                     num_slots=17, active=12)
    be = backend_for(case.spec)
    w = dev_weights(case.w)
    plan = be.plan(40, w, dtype, rank_bound=64)
    assert (plan.expand, plan.rank_width) == ("pair", 64)
    y = dev(case.y0)
    be.delta(y, dev(case.x), w, dev(case.token_order), dev(case.slot_indptr), rank_bound=64)
    cp().cuda.get_current_stream().synchronize()
    check_clean(be)
    check(case, host(y, dtype), dtype)


def test_pair_serves_each_member_of_a_fused_target(make_case, check):
    """Each slice alone into an output of its width, B read as a view: the others have no columns."""
    case = make_case(T=30, in_f=328, slices=(200, 56, 24), max_rank=16, ranks=(1, 5, 13, 16), dtype="float16",
                     mix="zipf", num_slots=17, active=9)
    check(case, run_members(backend_for(case.spec, **PAIR), case, "float16", expand="pair"), "float16")


@pytest.mark.parametrize("where", ("slot0", "zero-ranks"))
def test_pair_keeps_y_where_there_is_nothing_to_add(make_case, check, where):
    """Every position on slot 0 (no chunk at all: both launches find no work), or a slot whose every rank
    is zero beside others: its rows of y bit-exact, the others' deltas written."""
    case = make_case(T=30, in_f=264, slices=(136, 40), max_rank=16, ranks=(16,), dtype="bfloat16", mix="uniform",
                     num_slots=9, active=8)
    be = backend_for(case.spec, **PAIR)
    if where == "slot0":
        S = case.spec.num_slots
        ip = np.full(S + 1, 30, np.int32)
        ip[0] = 0  # slot 0's range holds every position
        case.slot_indptr = ip
        y = run_cupy(be, case)
        assert np.array_equal(y.view(np.uint16), case.y0.view(np.uint16))
        return
    ip = case.slot_indptr
    s = next(s for s in range(1, len(ip) - 1) if ip[s + 1] > ip[s])
    case.w.ranks[s] = 0
    ref = case.y0.astype(np.float64) + dense_delta64(case.x, _finite(case.w), case.row_slots)
    case = replace(case, ref=ref)
    check(case, run_cupy(be, case), "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_rank,slices", [(16, (256, 128)), (64, (256,))])
def test_pair_keeps_y_bits_where_one_delta_of_a_pair_is_zero(make_case, check, dtype, max_rank, slices):
    """B's odd columns zero, so every pair of y's columns an expand lane adds gets an exact-zero delta beside
    a nonzero one (whole tiles: one reduction at L2 a pair, the zero added as -0): the odd columns keep
    their bits, -0 and +0 among them, on every row; the even ones match the oracle."""
    case = with_zero_odd_deltas(make_case(T=24, in_f=264, slices=slices, max_rank=max_rank, ranks=(5, max_rank),
                                          dtype=dtype, mix="uniform", num_slots=9, active=5))
    y = run_cupy(backend_for(case.spec, **PAIR), case)
    assert_odd_columns_kept(case, y)
    check(case, y, dtype)


def test_pair_calls_back_to_back_on_one_stream(make_case, check):
    """Four calls queued back to back on fresh data and addressing (each launch waits only for the one
    before it, v shared), each y against its oracle: no call reads another's v."""
    cases = [make_case(T=T, in_f=1032, slices=(96, 40, 24), max_rank=16, ranks=(3, 16), dtype="bfloat16", mix=mix,
                       num_slots=17, active=12)
             for T, mix in ((64, "zipf"), (9, "distinct"), (64, "identical"), (50, "uniform"))]
    be = backend_for(cases[0].spec, **PAIR)
    outs = []
    for case in cases:
        y = dev(case.y0)
        be.delta(y, dev(case.x), dev_weights(case.w), dev(case.token_order), dev(case.slot_indptr))
        outs.append(y)
    cp().cuda.get_current_stream().synchronize()
    for case, y in zip(cases, outs):
        check(case, host(y, "bfloat16"), "bfloat16")


def test_pair_graph_replays_new_addressing(make_case, check):
    """The bucket of 64 captured once, replayed with other numbers of chunks a step (1 to 64 slots)."""
    first = dict(T=64, in_f=1032, slices=(392, 136), max_rank=16, ranks=(1, 8, 16), dtype="bfloat16",
                 mix="distinct", num_slots=65, active=64)
    case = make_case(**first)
    assert backend_for(case.spec).plan(64, dev_weights(case.w), "bfloat16").expand == "pair"
    graph_replays_new_addressing(make_case, check, PAIR, first,
                                 ((64, "identical"), (64, "zipf"), (40, "distinct"), (64, "skewed")))
