"""``lora_chunk`` (raw_kernels/chunk.cuh: a large step's whole delta in one launch, shrink and expand
of each chunk of one slot in the same blocks) against the float64 oracle on fresh random data:
both instantiations, bf16 and fp16, each rank width it is built for, skewed / padded / many-slot
steps, one member of a fused target served alone, an inf in x, y's bits where a delta is exactly zero,
and a CUDA graph replayed under new addressing. Each call leaves v and the counters at zero."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy import kernels
from lora_cupy.backends import cupy as cb

from conftest import assert_odd_columns_kept, with_zero_odd_deltas
from test_kernels import (_gpu_count, backend_for, check_clean, dev_weights, graph_replays_new_addressing,
                          host, run_cupy, run_members, run_prepared)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]

DTYPES = ("bfloat16", "float16")
CHUNK = dict(fused=False, expand="chunk")
#: one-slice targets: odd `in` (element-wise x and A), rank 0 / odd ranks with NaN past them,
#: padding, zipf and skewed popularity, a pool of 513 slots, and 4096 positions
CASES = {
    "T3-odd": dict(T=3, in_f=77, slices=(61,), max_rank=13, ranks=(1, 8, 13), mix="distinct"),
    "T100-pad": dict(T=100, in_f=256, slices=(256,), max_rank=16, ranks=(0, 16), mix="uniform", pad_to=128),
    "T300-zipf-r64": dict(T=300, in_f=264, slices=(200,), max_rank=64, ranks=(0, 1, 13, 16, 48, 64), mix="zipf",
                          num_slots=17, active=12),
    "T1000-r16": dict(T=1000, in_f=520, slices=(776,), max_rank=16, ranks=(5, 16), mix="uniform", num_slots=33,
                      active=8),
    "T61-many-slots": dict(T=61, in_f=264, slices=(136,), max_rank=32, ranks=(0, 1, 8, 16, 32), mix="distinct",
                           num_slots=513, active=61),
    "T700-pool128": dict(T=700, in_f=520, slices=(392,), max_rank=128, ranks=(8, 16, 65, 128), mix="zipf",
                         num_slots=17, active=12),
    "T4096-skew": dict(T=4096, in_f=1024, slices=(512,), max_rank=64, ranks=(8, 16, 64), mix="skewed",
                       num_slots=33, active=32),
    # rank width 16 at 4096 positions (chunks of 32, y's sums added at L2)
    "T4096-r16": dict(T=4096, in_f=264, slices=(264,), max_rank=16, ranks=(0, 3, 16), mix="zipf", num_slots=17,
                      active=12),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_oracle(make_case, check, name, dtype):
    case = make_case(dtype=dtype, **CASES[name])
    be = backend_for(case.spec, **CHUNK)
    assert be.plan(case.token_order.shape[0], dev_weights(case.w), dtype).expand == "chunk"
    check(case, run_cupy(be, case), dtype)
    case2 = make_case(dtype=dtype, **CASES[name])  # the same backend again: its counters reset
    check(case2, run_cupy(be, case2), dtype)


#: one-slice steps at rank width 64 in chunks of 32 whose chunks are cut into an even number of parts,
#: so the shrink splits the ranks between pairs of parts (chunk.cuh's chunk_shrink_rs): ranks past a
#: part's half (0, 5, 17), inside it and short of a tile; `in` of 1000 and 1001 (the second unaligned,
#: element-wise), a pool of rank 50. "T300-zipf-r64" above (5 stages of `in`) keeps the unsplit shrink.
SPLIT_CASES = {
    "split-r64": dict(T=300, in_f=1000, slices=(200,), max_rank=64, ranks=(0, 5, 17, 33, 64), mix="skewed",
                      num_slots=9, active=5),
    "split-r50-odd": dict(T=130, in_f=1001, slices=(72,), max_rank=50, ranks=(3, 20, 50), mix="zipf", num_slots=9,
                          active=3),
}


def chunk_parts(plan, slot_indptr) -> int:
    """The parts chunk.cuh's chunk_parts cuts each chunk of a step into: as many as fill the plan's
    grid for the step's chunks of ``plan.bm``, at most ``plan.splits``."""
    chunks = sum(-(-int(n) // plan.bm) for n in np.diff(np.asarray(slot_indptr)))
    return max(1, min(plan.splits, plan.blocks // max(chunks, 1)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_chunk_rank_split(make_case, check, name, dtype):
    case = make_case(dtype=dtype, **SPLIT_CASES[name])
    be = backend_for(case.spec, **CHUNK)
    plan = be.plan(case.token_order.shape[0], dev_weights(case.w), dtype)
    assert (plan.expand, plan.bm, plan.sliced) == ("chunk", kernels.CHUNK_BM, False)
    assert chunk_parts(plan, case.slot_indptr) % kernels.CHUNK_RSPLIT == 0
    check(case, run_cupy(be, case), dtype)
    case2 = make_case(dtype=dtype, **SPLIT_CASES[name])  # the same backend again: v and the counts were reset
    check(case2, run_cupy(be, case2), dtype)


def test_the_unsplit_case_keeps_the_unsplit_shrink(make_case):
    """The rank split is taken only where a chunk's parts are even: T300-zipf-r64's are not."""
    case = make_case(dtype="bfloat16", **CASES["T300-zipf-r64"])
    plan = backend_for(case.spec, **CHUNK).plan(case.token_order.shape[0], dev_weights(case.w), "bfloat16")
    assert plan.bm == kernels.CHUNK_BM and chunk_parts(plan, case.slot_indptr) % kernels.CHUNK_RSPLIT != 0


def b_share_bytes(plan, slot_indptr, out: int, max_rank: int) -> int:
    """Bytes of B one part of the step reads (chunk.cuh's chunk_expand: its column blocks of BN at the
    pool's rank width), the figure lora_chunk compares with CHUNK_B_L1_MAX."""
    rw, _, bn, _ = cb.chunk_geometry(max_rank)
    per = -(-(-(-out // bn)) // chunk_parts(plan, slot_indptr))
    return per * bn * rw * 2


#: one-slice steps at rank width 64 whose parts read more of B than CHUNK_B_L1_MAX, so lora_chunk copies
#: B through L2 only (cp_async16_l2): wide outputs in chunks of 32 (one of them unaligned, element-wise)
#: and of 128; WIDE_B_BELOW stays under it, through L1.
WIDE_B_CASES = {
    "wideb-T1000": dict(T=1000, in_f=256, slices=(8200,), max_rank=64, ranks=(7, 40, 64), mix="uniform", num_slots=9,
                        active=8),
    "wideb-T600-odd": dict(T=600, in_f=130, slices=(16001,), max_rank=64, ranks=(0, 33, 64), mix="zipf",
                           num_slots=9, active=6),
    "wideb-T4096": dict(T=4096, in_f=264, slices=(4104,), max_rank=64, ranks=(16, 50, 64), mix="skewed",
                        num_slots=5, active=4),
}
WIDE_B_BELOW = dict(T=1000, in_f=4096, slices=(1032,), max_rank=64, ranks=(7, 40, 64), mix="uniform", num_slots=9,
                    active=8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(WIDE_B_CASES))
def test_chunk_wide_b_through_l2_only(make_case, check, name, dtype):
    case = make_case(dtype=dtype, **WIDE_B_CASES[name])
    be = backend_for(case.spec, **CHUNK)
    plan = be.plan(case.token_order.shape[0], dev_weights(case.w), dtype)
    assert plan.expand == "chunk" and not plan.sliced
    assert b_share_bytes(plan, case.slot_indptr, case.spec.targets[0].out_features, 64) > kernels.CHUNK_B_L1_MAX
    check(case, run_cupy(be, case), dtype)
    case2 = make_case(dtype=dtype, **WIDE_B_CASES[name])
    check(case2, run_cupy(be, case2), dtype)


def test_wide_b_below_stays_under_the_threshold(make_case):
    """WIDE_B_BELOW's parts read at most CHUNK_B_L1_MAX of B (each WIDE_B_CASES case asserts it reads more), so
    b_share_bytes separates the two paths wherever the plan's parts move."""
    case = make_case(dtype="bfloat16", **WIDE_B_BELOW)
    plan = backend_for(case.spec, **CHUNK).plan(case.token_order.shape[0], dev_weights(case.w), "bfloat16")
    assert 0 < b_share_bytes(plan, case.slot_indptr, case.spec.targets[0].out_features, 64) <= kernels.CHUNK_B_L1_MAX


@pytest.mark.parametrize("R,in_f,out", [(64, 4104, 1000), (128, 3080, 4104)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_position_above_rank_16_runs_lora_chunk_by_default(make_case, check, dtype, R, in_f, out):
    """At one position and rank widths above 16 the default plan is lora_chunk by ticket, its chunk
    cut into as many parts as it has stages of `in` or column blocks (up to CHUNK_FEW_PARTS), here
    more than the grid's share of other buckets; odd ranks, NaN past them, a slot per call."""
    kw = dict(T=1, in_f=in_f, slices=(out,), max_rank=R, ranks=(1, 13, R - 3, R), dtype=dtype, mix="distinct",
              num_slots=17, active=9)
    case = make_case(**kw)
    be = backend_for(case.spec)
    plan = be.plan(1, dev_weights(case.w), dtype)
    assert (plan.expand, plan.fused) == ("chunk", False)
    assert plan.splits > cb.CHUNK_MAX_PARTS
    check(case, run_cupy(be, case), dtype)
    check_clean(be)
    case2 = make_case(**kw)  # fresh data on the same backend: its counters were reset
    check(case2, run_cupy(be, case2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,max_rank", [(1000, 16), (300, 64), (4096, 16)])
def test_chunk_keeps_y_bits_where_a_delta_is_zero(make_case, check, dtype, T, max_rank):
    """B's odd columns zero, so every 16-byte piece of y gets exact-zero deltas beside nonzero ones: the
    odd columns keep their bits, -0 and +0 among them (y's sums added at L2, a zero as -0; chunks of 32 at
    rank widths 16 and 64); the even ones match the oracle."""
    case = with_zero_odd_deltas(make_case(T=T, in_f=264, slices=(256,), max_rank=max_rank, ranks=(5, max_rank),
                                          dtype=dtype, mix="zipf", num_slots=9, active=6))
    be = backend_for(case.spec, **CHUNK)
    assert be.plan(T, dev_weights(case.w), dtype).expand == "chunk"
    y = run_cupy(be, case)
    assert_odd_columns_kept(case, y)
    check(case, y, dtype)


@pytest.mark.parametrize("route", ("aligned", "x_misaligned", "y_misaligned", "aligned_off"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_instantiations_through_a_prepared_layer(make_case, check, dtype, route):
    """The engine's path: every 16-byte path allowed runs the ALIGNED instantiation; x or y off
    alignment, or ``aligned=False``, the one reading the flags (element-wise loads and stores)."""
    case = make_case(T=300, in_f=328, slices=(264,), max_rank=48, ranks=(0, 1, 5, 13, 16, 40, 48), dtype=dtype,
                     mix="zipf", num_slots=17, active=9, pad_to=512)
    be = backend_for(case.spec, **CHUNK, **(dict(aligned=False) if route == "aligned_off" else {}))
    y, packed, _, _ = run_prepared(be, case, route, 512)
    assert [c.name for c in packed.calls] == ["chunk"]
    assert packed.aligned == (route == "aligned")
    check_clean(be)
    check(case, host(y, dtype), dtype)


@pytest.mark.parametrize("T", [45, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_serves_one_member_of_a_fused_target(make_case, check, dtype, T):
    """Each slice of a fused target alone into an output of its width, B read as a view (a
    member served as a whole call; the attachment's prefill serves q/k/v members in halves)."""
    case = make_case(T=T, in_f=328, slices=(200, 56, 24), max_rank=48, ranks=(0, 1, 5, 13, 16, 40, 48), dtype=dtype,
                     mix="zipf", num_slots=17, active=9)
    check(case, run_members(backend_for(case.spec, **CHUNK), case, dtype, expand="chunk"), dtype)


#: fused targets lora_chunk serves whole: every slice's columns start on a column block (128 at
#: rank width 16, 64 above); ranks 0 (a slice with nothing to add at a slot) and odd ones
SLICED = {
    "qkv-r16": dict(slices=(256, 128, 128), max_rank=16, ranks=(0, 1, 5, 16)),
    "gate_up-r64": dict(slices=(192, 192), max_rank=64, ranks=(0, 3, 16, 33, 64)),
    "three-r128": dict(slices=(128, 64, 192), max_rank=128, ranks=(0, 16, 65, 128)),
}


@pytest.mark.parametrize("T,mix", [(3, "distinct"), (64, "zipf"), (1000, "skewed"), (1000, "identical"),
                                   (2500, "zipf")])
@pytest.mark.parametrize("name", list(SLICED))
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_serves_a_fused_target_whole(make_case, check, dtype, name, T, mix):
    """Several slices in one launch: each chunk's shrink runs through every slice's rank blocks,
    each column block takes its own slice's v, rank and scaling; by default from CHUNK_SLICES_FROM
    positions at rank width 16 (test_kernel_backend_cpu checks which)."""
    case = make_case(T=T, in_f=200, dtype=dtype, mix=mix, num_slots=17, active=9, **SLICED[name])
    be = backend_for(case.spec)
    b, R, n = case.spec.bucket_for(T), case.spec.max_rank, len(SLICED[name]["slices"])
    first = (cb.default_one(b, True, cb.one_share(200, n, R, dtype), dtype)  # lora_one, lora_pair first
             or cb.default_pair(b, dtype, R, n, 200))
    by_default = cb.default_chunk(b, R, n) and not first
    assert (be.plan(T, dev_weights(case.w), dtype).expand == "chunk") == by_default
    be = backend_for(case.spec, **CHUNK)
    check(case, run_cupy(be, case), dtype)


def test_chunk_an_inf_in_x_stays_in_its_row(make_case, check, inf_in_x):
    """An inf in one adapter token's row of x: v and the counters end at zero and every other row
    matches the oracle (the inf row is inf / NaN by design)."""
    case = make_case(T=300, in_f=264, slices=(200,), max_rank=16, ranks=(1, 5, 13, 16), dtype="bfloat16", mix="zipf",
                     num_slots=17, active=9)
    case.x, row = inf_in_x(case)
    be = backend_for(case.spec, **CHUNK)
    y = run_cupy(be, case)  # checks v and the counters at zero
    y[row] = case.ref[row].astype(np.float32).astype(y.dtype)
    check(case, y, "bfloat16")


#: steps at rank widths above 16 (T, mix, active adapters) whose buckets take every height from 32
WIDE_STEPS = [(1000, "identical", 40), (1000, "skewed", 8), (700, "zipf", 12), (2000, "zipf", 40),
              (2048, "identical", 3), (1500, "distinct", 40), (3000, "skewed", 8), (4000, "distinct", 64),
              (4096, "zipf", 40)]


@pytest.mark.parametrize("R", [64, 128])
@pytest.mark.parametrize("T,mix,active", WIDE_STEPS)
def test_chunk_wide_ranks_take_the_height_of_their_bucket(make_case, check, R, T, mix, active):
    """At rank widths above 16 a step is cut into chunks of 32 below CHUNK_WIDE_FROM positions, of
    64 from there, and of 128 (blocks of 8 warps) from CHUNK_TALL_FROM (A and B read once for 64 or
    128 rows): full, or many short runs each in a chunk of its own, whose m-tiles past its rows run
    no MMA (the one-slice cases of 100 and 300 positions run chunks of 32, those of 3 and 61 chunks
    of 16)."""
    case = make_case(T=T, in_f=200, slices=(264,), max_rank=R, ranks=(1, 17, 64, R), dtype="bfloat16", mix=mix,
                     num_slots=65, active=active)
    be = backend_for(case.spec, **CHUNK)
    bucket = case.spec.bucket_for(T)
    want = 128 if bucket >= cb.CHUNK_TALL_FROM else 64 if bucket >= cb.CHUNK_WIDE_FROM else 32
    assert be.plan(T, dev_weights(case.w), "bfloat16").bm == want
    check(case, run_cupy(be, case), "bfloat16")


@pytest.mark.parametrize("R", [64, 128])
@pytest.mark.parametrize("T,mix,active", [(1000, "identical", 8), (1000, "zipf", 40), (900, "skewed", 5),
                                          (300, "zipf", 12)])
def test_chunk_a_deep_target_takes_chunks_of_64_sooner(make_case, check, R, T, mix, active):
    """A target whose `in` is at least CHUNK_DEEP times its `out` (Llama's down) takes chunks of 64
    from CHUNK_DEEP_WIDE_FROM positions at rank width 64 (chunks of 32 below it, and at rank width
    128): full, short runs and one slot of many rows, against the oracle."""
    case = make_case(T=T, in_f=600, slices=(264,), max_rank=R, ranks=(1, 17, 64, R), dtype="bfloat16", mix=mix,
                     num_slots=65, active=active)
    be = backend_for(case.spec, **CHUNK)
    bucket = case.spec.bucket_for(T)
    assert 600 >= cb.CHUNK_DEEP * 264
    want = 64 if R == 64 and cb.CHUNK_DEEP_WIDE_FROM <= bucket < cb.CHUNK_TALL_FROM else 32
    assert be.plan(T, dev_weights(case.w), "bfloat16").bm == want
    check(case, run_cupy(be, case), "bfloat16")


def test_wide_steps_reach_every_height(make_case):
    """WIDE_STEPS keeps covering chunks of 32, 64 and 128 wherever the thresholds move."""
    spec = make_case(T=1, in_f=200, slices=(264,), max_rank=64, ranks=(64,), dtype="bfloat16", mix="identical").spec
    assert {cb.chunk_bm(spec.bucket_for(T), 64) for T, _, _ in WIDE_STEPS} == {32, 64, 128}


@pytest.mark.parametrize("R", [16, 64])
def test_chunk_graph_replays_new_addressing(make_case, check, R):
    """The bucket of 1024 positions (chunks of 32), whatever the replayed step holds."""
    graph_replays_new_addressing(
        make_case, check, CHUNK,
        dict(T=1000, in_f=264, slices=(392,), max_rank=R, ranks=(1, 8, R), dtype="bfloat16", mix="uniform",
             num_slots=17, active=6),
        ((1000, "identical"), (900, "zipf"), (300, "skewed"), (1, "identical"), (1000, "distinct")))


def test_chunk_graph_replays_new_addressing_in_chunks_of_128(make_case, check):
    """The bucket of 4096 positions at rank 64: chunks of 128 (blocks of 256 threads), whatever the
    replayed step holds."""
    graph_replays_new_addressing(
        make_case, check, CHUNK,
        dict(T=4096, in_f=136, slices=(264,), max_rank=64, ranks=(1, 8, 64), dtype="bfloat16", mix="uniform",
             num_slots=17, active=6),
        ((4096, "identical"), (3000, "zipf"), (2100, "skewed"), (1, "identical"), (4000, "distinct")))


@pytest.mark.parametrize("R", [16, 64])
def test_chunk_graph_replays_new_addressing_at_decode(make_case, check, R):
    """The bucket of 64 positions: chunks of 16, from one slot a position to one position, each
    replay's step with its own count of items (and so of blocks that take tickets)."""
    first = dict(T=64, in_f=264, slices=(392,), max_rank=R, ranks=(1, 8, R), dtype="bfloat16", mix="distinct",
                 num_slots=65, active=64)
    case = make_case(**first)
    assert backend_for(case.spec, **CHUNK).plan(64, dev_weights(case.w), "bfloat16").bm == 16
    graph_replays_new_addressing(make_case, check, CHUNK, first,
                                 ((64, "distinct"), (37, "zipf"), (1, "identical"), (64, "skewed"), (64, "identical")))


#: decode buckets (chunks of 16): odd `in` and ranks; 513 slots; `in` of 1000-2040 (two stages or
#: more a part); several slices (q/k/v, a rank-128 pool whose adapters above 64 take two rank
#: blocks); 1032 columns at rank 64 (17 column blocks)
DECODE_CASES = {
    "T3-odd": CASES["T3-odd"],
    "T61-many-slots": CASES["T61-many-slots"],
    "T64-qkv-long-in": dict(T=64, in_f=2040, slices=(256, 128, 128), max_rank=16, ranks=(0, 5, 16), mix="distinct",
                            num_slots=17, active=9),
    "T16-r64-wide": dict(T=16, in_f=1000, slices=(1032,), max_rank=64, ranks=(3, 33, 64), mix="zipf", num_slots=9,
                         active=4),
    "T40-r128-sliced": dict(T=40, in_f=1000, slices=(192, 128), max_rank=128, ranks=(0, 16, 80, 128),
                            mix="skewed", num_slots=9, active=4, pad_to=64),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_chunk_decode_buckets(make_case, check, name, dtype):
    """lora_chunk at the decode buckets (chunks of 16 positions), where it is asked for: the default
    there only where lora_one and lora_pair do not take the call (rank widths above 16 past the pair's
    bounds, test_kernel_backend_cpu checks which)."""
    kw = DECODE_CASES[name]
    case = make_case(dtype=dtype, **kw)
    T, n, R = case.token_order.shape[0], len(kw["slices"]), kw["max_rank"]
    b = case.spec.bucket_for(T)
    first = (cb.default_one(b, True, cb.one_share(kw["in_f"], n, R, dtype), dtype)
             or cb.default_pair(b, dtype, R, n, kw["in_f"]))
    assert (backend_for(case.spec).plan(T, dev_weights(case.w), dtype).expand == "chunk") == (
        cb.default_chunk(b, R, n) and not first
        and cb.chunk_fits(dtype, R, n, None, cb.slice_alignment(np.cumsum((0,) + kw["slices"]))) is None)
    be = backend_for(case.spec, **CHUNK)
    assert be.plan(T, dev_weights(case.w), dtype).bm == 16
    check(case, run_cupy(be, case), dtype)
    case2 = make_case(dtype=dtype, **DECODE_CASES[name])  # the same backend again
    check(case2, run_cupy(be, case2), dtype)
