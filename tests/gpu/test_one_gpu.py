"""``lora_one`` (raw_kernels/one.cuh: the delta of the capture bucket of one position in clusters of 8
blocks, v's partial sums met in distributed shared memory) against the float64 oracle on fresh
random data: every dtype and rank width, odd `in` and ranks with NaN past them, three slices with
rank-0 ones, 513 slots, columns over several clusters, both instantiations through a prepared
layer, each member of a fused target alone, a position on no adapter (y bit-exact), and a CUDA
graph replayed under new addressing. It uses no workspace and no counters: both stay at zero."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.backends import cupy as cb

from test_kernels import (_gpu_count, backend_for, check_clean, dev_weights, graph_replays_new_addressing,
                          host, run_cupy, run_members, run_prepared)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]

DTYPES = ("bfloat16", "float16", "float32")
ONE = dict(expand="one")  # forced: by default only where a block's share of A is small (one_max_share)
#: one position: odd `in` (element-wise x and A) and ranks, three slices with rank-0 ones, a pool
#: of 513 slots (the slot search runs past one pass of the block), rank widths 64 and 128 with odd
#: ranks, `in` long enough that every block of a cluster has a share, columns over several clusters
CASES = {
    "odd": dict(in_f=77, slices=(61,), max_rank=13, ranks=(1, 8, 13), mix="distinct"),
    "qkv-r64": dict(in_f=1032, slices=(96, 40, 24), max_rank=64, ranks=(0, 1, 8, 13, 64), mix="distinct",
                    active=8),
    "many-slots": dict(in_f=264, slices=(136, 40), max_rank=32, ranks=(1, 8, 16, 32), mix="distinct",
                       num_slots=513, active=500),
    "r128": dict(in_f=1000, slices=(64, 72), max_rank=128, ranks=(1, 80, 128), mix="identical"),
    "wide": dict(in_f=4104, slices=(3000, 1000), max_rank=16, ranks=(5, 16), mix="distinct", active=8),
    "down": dict(in_f=14336, slices=(520,), max_rank=64, ranks=(17, 64), mix="distinct", active=8),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_one_matches_oracle(make_case, check, name, dtype):
    case = make_case(T=1, dtype=dtype, **CASES[name])
    be = backend_for(case.spec, **ONE)
    plan = be.plan(1, dev_weights(case.w), dtype)
    assert plan.expand == "one" and plan.blocks % cb.ONE_CLUSTER == 0
    S, n, R, in_f = case.w.a.shape
    by_default = cb.one_share(in_f, n, R, dtype) <= cb.one_max_share(dtype)
    assert (backend_for(case.spec).plan(1, dev_weights(case.w), dtype).expand == "one") == by_default
    check(case, run_cupy(be, case), dtype)  # run_cupy: v and the counters untouched (zero)
    case2 = make_case(T=1, dtype=dtype, **CASES[name])
    check(case2, run_cupy(be, case2), dtype)


@pytest.mark.parametrize("route", ("aligned", "x_misaligned", "y_misaligned", "aligned_off"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_one_instantiations_through_a_prepared_layer(make_case, check, dtype, route):
    """The engine's path: every 16-byte path allowed runs the ALIGNED instantiation; x or y off
    alignment, or ``aligned=False``, the one reading the flags."""
    T = 1
    case = make_case(T=T, in_f=328, slices=(264,), max_rank=48, ranks=(1, 5, 13, 40, 48), dtype=dtype,
                     mix="distinct", num_slots=17, active=9)
    be = backend_for(case.spec, **ONE, **(dict(aligned=False) if route == "aligned_off" else {}))
    y, packed, _, _ = run_prepared(be, case, route, T)
    assert [c.name for c in packed.calls] == ["one"]
    assert packed.aligned == (route == "aligned")
    check_clean(be)
    check(case, host(y, dtype), dtype)


#: with early reads (the pool's backend) the ALIGNED 16-bit instantiation copies each block's share of
#: A into shared memory by the bulk copy engine before it waits for the grid before (one.cuh,
#: one_stage_a): q/k/v at rank 16 with a rank-0 slice, rank 64 at `in` = 1000 (125 pieces: the
#: cluster's last share 13 of 16), the down projection's `in` (224 pieces a block), `in` = 24 (3
#: pieces: five blocks of the cluster copy nothing and only arrive); "past-max" asks for more than
#: ``ONE_STAGE_MAX``, so the launch gets no shared memory and the kernel reads A's share from global
#: memory as without it
STAGED = {
    "qkv": dict(in_f=4096, slices=(136, 40, 24), max_rank=16, ranks=(0, 5, 16), active=8),
    "r64": dict(in_f=1000, slices=(264,), max_rank=64, ranks=(1, 17, 64), active=8),
    "down": dict(in_f=14336, slices=(520,), max_rank=16, ranks=(3, 16), active=8),
    "tiny": dict(in_f=24, slices=(200,), max_rank=16, ranks=(3, 16), active=8),
    "past-max": dict(in_f=4096, slices=(200, 56, 24), max_rank=64, ranks=(9, 40, 64), active=8),
}


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("name", list(STAGED))
def test_one_stages_its_share_of_a_with_early_reads(make_case, check, name, dtype):
    for _ in range(2):  # fresh data each time, the same launch shape
        case = make_case(T=1, dtype=dtype, mix="distinct", **STAGED[name])
        be = backend_for(case.spec, early_reads=True, **ONE)
        y, packed, _, _ = run_prepared(be, case, "aligned", 1)
        (call,) = packed.calls
        S, n, R, in_f = case.w.a.shape
        assert call.name == "one" and packed.aligned
        assert call.smem == cb.one_stage_smem(in_f, n, cb.built_width(cb.ONE_RW, R), dtype)
        assert (call.smem == 0) == (name == "past-max")
        check_clean(be)
        check(case, host(y, dtype), dtype)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_one_serves_each_member_of_a_fused_target(make_case, check, dtype):
    """Each slice alone into an output of its width, B read as a view: the others have no columns."""
    case = make_case(T=1, in_f=328, slices=(200, 56, 24), max_rank=48, ranks=(1, 5, 13, 40, 48), dtype=dtype,
                     mix="distinct", num_slots=17, active=9)
    check(case, run_members(backend_for(case.spec, **ONE), case, dtype, expand="one"), dtype)


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_one_reads_its_row_from_token_order(make_case, check, row_at, dtype):
    """x and y of several rows, the one position on row 3: only that row moves (y's others bit-exact)."""
    case = row_at(make_case(T=1, in_f=264, slices=(136, 40), max_rank=16, ranks=(5, 16), dtype=dtype,
                            mix="distinct"), 5, 3)
    check(case, run_cupy(backend_for(case.spec, **ONE), case), dtype)


@pytest.mark.parametrize("where", ("slot0", "zero-ranks"))
def test_one_position_with_nothing_to_add_keeps_y(make_case, where):
    """The position on slot 0 (no adapter), or on a slot whose every rank is zero: y bit-exact."""
    case = make_case(T=1, in_f=264, slices=(136, 40), max_rank=16, ranks=(16,), dtype="bfloat16", mix="distinct",
                     num_slots=9, active=4)
    S = case.spec.num_slots
    if where == "slot0":
        ip = np.ones(S + 1, np.int32)
        ip[0] = 0  # slot 0's range holds the position
        case.slot_indptr = ip
    else:
        s = int(np.searchsorted(case.slot_indptr, 0, side="right") - 1)
        case.w.ranks[s] = 0
    y = run_cupy(backend_for(case.spec, **ONE), case)
    assert np.array_equal(y.view(np.uint16), case.y0.view(np.uint16))


@pytest.mark.parametrize("R", [16, 64])
def test_one_graph_replays_new_addressing(make_case, check, R):
    """The bucket of one position captured once, replayed with the position on other slots."""
    first = dict(T=1, in_f=1032, slices=(392, 136), max_rank=R, ranks=(1, 8, R), dtype="bfloat16", mix="distinct",
                 num_slots=65, active=64)
    case = make_case(**first)
    assert backend_for(case.spec, **ONE).plan(1, dev_weights(case.w), "bfloat16").expand == "one"
    graph_replays_new_addressing(make_case, check, ONE, first,
                                 ((1, "distinct"), (1, "identical"), (1, "zipf"), (1, "distinct")))
