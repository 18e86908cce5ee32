"""Host-side logic of the CUDA backend, with no GPU: kernel families, shared-memory sizes against
the CUDA source, launch plans per bucket, workspace sizing, and argument validation."""

from __future__ import annotations

import re

import numpy as np
import pytest

from lora_cupy import kernels
from lora_cupy.backends import cupy as cb
from lora_cupy.backends.base import LayerWeights, member_offsets
from lora_cupy.bench import kernels as bench
from lora_cupy.spec import DEFAULT_CAPTURE_BUCKETS, LoraSlice, LoraSpec, LoraTarget

DTYPES = ("bfloat16", "float16", "float32")


def _nvrtc_ready() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
    except Exception:
        return False
    return bool(kernels.cuda_include_dirs())


needs_nvrtc = pytest.mark.skipif(not _nvrtc_ready(), reason="NVRTC or the CUDA headers are not installed")


# -- families --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_the_backend_loads_is_a_name_expression(dtype):
    names = set(kernels.FAMILIES[kernels.mma_family(dtype)].name_expressions)
    ct = kernels.CUDA_TYPES[dtype]
    wanted = set()
    for al in ("false", "true"):  # each kernel's ALIGNED instantiation and the one reading the flags
        wanted |= {f"lora_shrink<{ct}, {bm}, {al}>" for bm in kernels.MMA_SHRINK_BM}
        wanted |= {f"lora_expand<{ct}, {bm}, {bn}, {al}>" for bm, bn in kernels.MMA_TILES}
        wanted |= {f"lora_fused<{ct}, {bm}, {bn}, {c}, {al}>" for bm, bn in kernels.MMA_TILES for c in ("false", "true")}
        wanted |= {f"lora_expand_stream<{ct}, {bm}, {al}>" for bm, _ in kernels.MMA_TILES}
        wanted.add(f"lora_expand_ring<{ct}, {al}>")
    if dtype in kernels.GLU_DTYPES:  # the gated activation with the gate / up expand: 16-bit only
        wanted |= {f"lora_expand_glu<{ct}, {ks}>" for ks in kernels.GLU_KS}
    if dtype in kernels.CHUNK_DTYPES:  # a large step's whole delta in one launch: 16-bit only
        wanted |= {f"lora_chunk<{ct}, {rw}, {bm}, {al}, {sl}>" for rw, bm in kernels.CHUNK_SHAPES
                   for al in ("false", "true") for sl in ("false", "true")}
        # the decode buckets' pair at rank width 16 (the shrink for 1, 2, 3, 4 or 8 slices) and 64 (1 or 2
        # slices), the expand at each
        wanted |= {f"lora_pair_shrink<{ct}, {rt}, 16, {al}>" for rt in (1, 2, 3, 4, 8) for al in ("false", "true")}
        wanted |= {f"lora_pair_shrink<{ct}, {rt}, 64, {al}>" for rt in (1, 2) for al in ("false", "true")}
        wanted |= {f"lora_pair_expand<{ct}, {rw}, {al}>" for rw in (16, 64) for al in ("false", "true")}
    # one position in thread-block clusters (sm_90): every dtype, each rank width
    wanted |= {f"lora_one<{ct}, {rw}, {al}>" for rw in kernels.ONE_RW for al in ("false", "true")}
    assert wanted == names  # one kernel per role, and each a default somewhere: nothing else ships
    simt = set(kernels.FAMILIES["lora_delta"].name_expressions)
    assert {f"lora_shrink_simt<{ct}>", f"lora_expand_simt<{ct}>"} <= simt
    # every tile the planner can pick has a shrink of the same height (fused needs both)
    assert {bm for bm, _ in kernels.MMA_TILES} <= set(kernels.MMA_SHRINK_BM)


@needs_nvrtc
def test_tensor_core_family_compiles_to_mma_and_cp_async():
    ptx = kernels.compile_family(kernels.mma_family("bfloat16"), "sm_90")
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx, "a register array was demoted to local memory"


@needs_nvrtc
def test_python_shared_memory_sizes_match_the_cuda_source():
    """The launch's dynamic shared memory comes from Python: NVRTC checks it against the source."""
    lines = ['#include "lora_mma.cu"']
    for dtype in DTYPES:
        ct = kernels.CUDA_TYPES[dtype]
        for bm in kernels.MMA_SHRINK_BM:
            lines.append(f"static_assert(lora::Shrink<{ct}, {bm}>::SMEM == {cb.shrink_smem(dtype, bm)}, "
                         f"\"shrink {dtype} {bm}\");")
        for bm, bn in kernels.MMA_TILES:
            lines.append(f"static_assert(lora::Expand<{ct}, {bm}, {bn}>::SMEM == "
                         f"{cb.expand_smem(dtype, bm, bn)}, \"expand {dtype} {bm}\");")
            lines.append(f"static_assert(lora::fused_smem<{ct}, {bm}, {bn}>() == "
                         f"{cb.fused_smem(dtype, bm, bn)}, \"fused {dtype} {bm}\");")
        lines.append(f"static_assert(lora::Stream<{ct}>::BN == {kernels.STREAM_BN}, \"expand_stream {dtype}\");")
        lines.append(f"static_assert(lora::Ring<{ct}>::SMEM == {cb.ring_smem(dtype)}, \"expand_ring {dtype}\");")
        lines.append(f"static_assert(lora::Ring<{ct}>::BM == {kernels.RING_BM} && lora::Ring<{ct}>::BN == "
                     f"{kernels.RING_BN}, \"expand_ring tile {dtype}\");")
        if dtype in kernels.CHUNK_DTYPES:
            for rw, bm in kernels.CHUNK_SHAPES:
                g, c = cb.chunk_geometry(rw), f"lora::Chunk<{ct}, {rw}, {bm}>"
                lines.append(f"static_assert({c}::SMEM + {c}::SUMS == {cb.chunk_smem(dtype, rw, bm)} && {c}::KC == {g[1]} && "
                             f"{c}::BN == {g[2]} && {c}::RB == {g[3]} && {c}::BM == {bm} && "
                             f"{c}::NTHREADS == {kernels.chunk_threads(bm)} && {c}::BLOCKS_PER_SM == "
                             f"{cb.CHUNK_TALL_BLOCKS_PER_SM if bm == kernels.CHUNK_TALL_BM else cb.CHUNK_BLOCKS_PER_SM}, "
                             f"\"chunk {dtype} {rw} {bm}\");")
                split = kernels.CHUNK_RSPLIT if (rw, bm) == (64, kernels.CHUNK_BM) else 1
                lines.append(f"static_assert({c}::RSPLIT == {split}, \"chunk rank split {dtype} {rw} {bm}\");")
    lines.append(f"static_assert(lora::MAX_SLICES == {cb.MAX_SLICES}, \"slices\");")
    lines.append(f"static_assert(lora::CHUNK_B_L1_MAX == {kernels.CHUNK_B_L1_MAX}, \"chunk B through L1\");")
    lines.append(f"static_assert(lora::CHUNK_STATIC_SMEM == {cb.CHUNK_STATIC_SMEM} && "
                 f"lora::CHUNK_TALL_STATIC_SMEM == {cb.CHUNK_TALL_STATIC_SMEM}, \"chunk static\");")
    for bm in sorted({bm for _, bm in kernels.CHUNK_SHAPES}):
        lines.append(f"static_assert(sizeof(lora::ChunkRows<{bm}>) + sizeof(lora::ChunkScan) + sizeof(lora::ChunkWork) "
                     f"+ 2 * sizeof(int) <= {cb.chunk_static_smem(bm)}, \"chunk static {bm}\");")
    lines.append(f"static_assert(lora::Shrink<float, 16>::RB == {cb.RANK_BLOCK}, \"rank block\");")
    kernels.compile_source("\n".join(lines) + "\n", "smem_check.cu", "sm_90")


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_memory_fits_a_block_with_the_slot_table(dtype):
    extra = 4 * (cb.MAX_SLOTS + 1)
    for bm, bn in kernels.MMA_TILES:
        assert cb.fused_smem(dtype, bm, bn) + extra <= 227 * 1024
        assert cb.fused_smem(dtype, bm, bn) >= max(cb.shrink_smem(dtype, bm), cb.expand_smem(dtype, bm, bn))
    assert cb.ring_smem(dtype) + extra <= 227 * 1024
    if dtype in kernels.CHUNK_DTYPES:
        # what __launch_bounds__(128, CHUNK_BLOCKS_PER_SM) (in chunks of 128: (256,
        # CHUNK_TALL_BLOCKS_PER_SM)) is built for fits beside the slot table of a pool of 256 slots
        # and the static shared memory; a pool of 4096 slots gets fewer blocks, and its grid is one
        # wave of those
        for rw, bm in kernels.CHUNK_SHAPES:
            most = cb.CHUNK_TALL_BLOCKS_PER_SM if bm == kernels.CHUNK_TALL_BM else cb.CHUNK_BLOCKS_PER_SM
            assert cb.chunk_blocks_per_sm(dtype, rw, bm, 256) == most
            per = cb.chunk_smem(dtype, rw, bm) + 4 * 4097 + cb.chunk_static_smem(bm) + cb.BLOCK_RESERVED_SMEM
            assert cb.chunk_blocks_per_sm(dtype, rw, bm, 4096) == min(most, cb.SM_SMEM // per)
        for rw in kernels.CHUNK_RW:
            p = cb.plan_launch(4096, 4096, 4096, 1, rw, dtype, num_slots=4096, expand="chunk")
            assert p.blocks == cb.chunk_blocks_per_sm(dtype, rw, p.bm, 4096) * cb.DEFAULT_SMS


# -- plans -------------------------------------------------------------------------------------------
SHAPES = [(4096, 4096, 1, 16), (4096, 14336, 1, 64), (14336, 4096, 1, 16), (4096, 6144, 3, 64),
          (77, 61, 1, 13), (200, 160, 3, 128), (4096, 4096, 1, 256), (4096, 6144, 3, 16)]


@pytest.mark.parametrize("in_f,out,n,R", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_plan_depends_on_the_bucket_alone(in_f, out, n, R, dtype):
    target = LoraTarget("t", in_f, out, 1, tuple(LoraSlice(f"s{j}", out // n + (j < out % n)) for j in range(n)))
    spec = LoraSpec((target,), num_slots=33, max_rank=R, dtype=dtype)
    floats, ints = cb.plan_workspace(spec)
    prev = None
    for T in range(1, spec.max_tokens + 1, 7):
        b = spec.bucket_for(T)
        p = cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=spec.num_slots)
        if prev is not None and prev.bucket == b:
            assert p == prev  # same bucket, same launch: a graph captured for it replays
        prev = p
        if p.expand == "pair":  # lora_pair: its own workspace, a reader count a chunk in the counters
            assert cb.default_pair(b, dtype, R, n, in_f) and cb.pair_fits(b, dtype, R, n) is None
            assert p.rank_width == cb.pair_width(R) and R <= p.rank_width
            assert (p.bm, p.tiles) == (cb.PAIR_M, cb.pair_chunks(b, spec.num_slots)) and p.counter_ints() == p.tiles <= ints
            assert p.blocks == p.tiles * p.splits and p.col_blocks >= p.tiles and p.splits <= cb.PAIR_MAX_SPLITS
            assert cb.pair_floats(b, n, spec.num_slots, p.rank_width) <= cb.pair_workspace(spec)
            continue
        if p.expand == "one":  # lora_one: clusters, no workspace or counters
            assert cb.default_one(b, True, cb.one_share(in_f, n, R, dtype), dtype)
            assert cb.one_fits(b, R) is None and b == cb.ONE_BUCKET and p.bm == 1
            assert p.blocks % cb.ONE_CLUSTER == 0 and p.blocks * p.bn >= out
            assert p.splits * p.k_split >= in_f and p.k_split % (16 // cb._ITEMSIZE[dtype]) == 0
            continue
        if p.expand == "chunk":  # one launch, whose kernel cuts the step's chunks into parts itself
            assert cb.default_chunk(b, R) and cb.chunk_fits(dtype, R, n, None) is None
            assert p.tiles == cb.fused_units(b, kernels.CHUNK_NARROW_BM, spec.num_slots)
            assert p.workspace_floats(cb.rank_width(R)) <= floats and p.counter_ints() <= ints
            continue
        kc = 128 // cb._ITEMSIZE[dtype]
        assert p.k_split % kc == 0
        assert (p.splits - 1) * p.k_split < in_f <= p.splits * p.k_split  # no empty split
        assert p.tiles * p.bm >= b and p.col_blocks * p.bn >= out and 1 <= p.cpb <= p.col_blocks
        assert p.workspace_floats(cb.rank_width(R)) <= floats and p.counter_ints() <= ints
        for t in kernels.MMA_SHRINK_BM:  # any tile a caller may force fits the counters
            for fused in (False, True):
                assert cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=spec.num_slots, tile=t,
                                      fused=fused).counter_ints() <= ints
        assert p.rank_blocks == -(-R // cb.RANK_BLOCK)
        assert p.fused or p.expand == cb.default_expand(b)
        if not p.fused and p.expand == "expand_ring":  # a forced tile it does not take runs lora_expand
            assert cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=spec.num_slots, tile=16).expand == "expand"
            with pytest.raises(ValueError, match="expand_ring takes tiles of 64"):
                cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=spec.num_slots, tile=16, expand="expand_ring")


def test_few_tokens_split_the_shrink_and_many_columns_share_a_block():
    small = cb.plan_launch(1, 4096, 4096, 1, 16, "bfloat16", num_slots=33, clusters=False)  # below sm_90
    assert small.splits > 16 and small.shrink_blocks >= cb.DEFAULT_SMS // 4
    assert small.cpb == 1  # every column block its own block while blocks are few
    big = cb.plan_launch(4096, 4096, 4096, 1, 16, "bfloat16", num_slots=33)
    assert big.splits < small.splits
    assert big.cpb > 1 and 2 * cb.DEFAULT_SMS <= big.expand_blocks <= 8 * cb.DEFAULT_SMS
    assert small.fused and not big.fused


def test_a_rank16_adapter_runs_the_same_plan_in_a_rank128_pool():
    """The pair: only the rank blocks differ, the extra ones stop at once past a rank-16 adapter.
    lora_chunk: the same chunks (16 up to CHUNK_NARROW_TO positions, 32 above) below CHUNK_WIDE_FROM
    positions and the same grid there (its loops bounded by each adapter's own rank), taller chunks
    (``chunk_bm``) from there at rank 128."""
    for b in DEFAULT_CAPTURE_BUCKETS:
        c16 = cb.plan_launch(b, 4096, 4096, 1, 16, "bfloat16", num_slots=33)
        c128 = cb.plan_launch(b, 4096, 4096, 1, 128, "bfloat16", num_slots=33)
        if c16.expand == c128.expand == "chunk":
            assert (c16.bm, c128.bm) == (16 if b <= 64 else 32, cb.chunk_bm(b, 128)) and c16.tiles == c128.tiles
            if b < cb.CHUNK_WIDE_FROM:
                assert c16.blocks == c128.blocks
        pair = None if c16.fused else cb.default_expand(b)
        p16 = cb.plan_launch(b, 4096, 4096, 1, 16, "bfloat16", num_slots=33, expand=pair)
        p128 = cb.plan_launch(b, 4096, 4096, 1, 128, "bfloat16", num_slots=33, expand=pair)
        assert (p16.bm, p16.bn, p16.fused, p16.col_blocks, p16.cpb, p16.expand, p16.chunks) == (
            p128.bm, p128.bn, p128.fused, p128.col_blocks, p128.cpb, p128.expand, p128.chunks)
        rb = cb.RANK_BLOCK
        assert p128.rank_blocks == 128 // rb and p128.splits * (128 // rb) >= p16.splits


def test_a_member_call_splits_in_for_its_one_slice():
    """One slice of a fused target served alone (its offsets give the other slices no columns)
    splits ``in`` as a one-slice target does, not as the whole target's three slices would; a
    fused launch spreads its grid in the kernel and keeps the whole target's plan."""
    assert cb.live_slices((0, 4096, 5120, 6144)) == 3
    assert cb.live_slices((0, 0, 1024, 1024)) == 1
    for b in (512, 1024, 4096):
        # by default a member runs lora_chunk where a one-slice target does (not the whole target)
        assert (cb.plan_launch(b, 4096, 1024, 3, 64, "bfloat16", num_slots=9, live_slices=1).expand == "chunk") == (
            cb.plan_launch(b, 4096, 1024, 1, 64, "bfloat16", num_slots=9).expand == "chunk") == cb.default_chunk(b, 64)
        assert cb.plan_launch(b, 4096, 1024, 3, 64, "bfloat16", num_slots=9).expand == cb.default_expand(b)
        pair = cb.default_expand(b)
        member = cb.plan_launch(b, 4096, 1024, 3, 64, "bfloat16", num_slots=9, live_slices=1, expand=pair)
        one = cb.plan_launch(b, 4096, 1024, 1, 64, "bfloat16", num_slots=9, expand=pair)
        whole = cb.plan_launch(b, 4096, 1024, 3, 64, "bfloat16", num_slots=9, expand=pair)
        assert not member.fused and member.splits == one.splits > whole.splits
        assert member.shrink_blocks == 3 * one.shrink_blocks  # the other slices' tasks are launched, and stop
        fused = cb.plan_launch(b, 4096, 1024, 3, 64, "bfloat16", num_slots=9, fused=True, live_slices=1)
        assert fused == cb.plan_launch(b, 4096, 1024, 3, 64, "bfloat16", num_slots=9, fused=True)


def test_slices_that_share_a_rank_block_shrink_in_one_task():
    """An unfused shrink of several slices whose rank widths fit one 64-rank block together (q/k/v
    at rank 16, gate/up at 32) runs one task per tile and split for all of them, so it reads x
    once; it splits ``in`` as a one-slice target does, a member call included. Wider slices, one
    slice, and the fused kernel (whose ready counts are per slice) keep a task per slice."""
    assert cb.packed_slices(3, 16, False) and cb.packed_slices(2, 32, False) and cb.packed_slices(4, 13, False)
    assert not cb.packed_slices(3, 32, False) and not cb.packed_slices(1, 16, False)
    assert not cb.packed_slices(3, 16, True)
    for b in (128, 512, 1024, 4096):
        pair = cb.default_expand(b)  # the unfused pair (a one-slice target runs lora_chunk by default)
        one = cb.plan_launch(b, 4096, 1024, 1, 16, "bfloat16", num_slots=9, fused=False, expand=pair)
        for live in (None, 1):
            qkv = cb.plan_launch(b, 4096, 6144, 3, 16, "bfloat16", num_slots=9, fused=False, live_slices=live,
                                 expand=pair)
            assert qkv.packed and qkv.splits == one.splits and qkv.shrink_blocks == one.shrink_blocks
        fused = cb.plan_launch(b, 4096, 6144, 3, 16, "bfloat16", num_slots=9, fused=True)
        assert not fused.packed and fused.shrink_blocks == fused.tiles * fused.splits * 3


def test_workspace_is_v_at_the_largest_bucket():
    qkv = LoraTarget("qkv", 4096, 6144, 32, (LoraSlice("q", 4096), LoraSlice("k", 1024), LoraSlice("v", 1024)))
    down = LoraTarget("down", 14336, 4096, 32)
    spec = LoraSpec((qkv, down), num_slots=65, max_rank=120)
    floats, ints = cb.plan_workspace(spec)
    assert floats == 4096 * 3 * 128  # [bucket, n, rw], rw = 120 rounded up to 16
    # work units: tiles of 16 positions, or a fused launch's chunks of one slot (4096 / 16 + 64)
    assert ints == 2 + 2 * (4096 // 16 + 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_f,out,n,R", SHAPES)
def test_streaming_plans_cover_every_column_and_rank_in_one_wave(in_f, out, n, R, dtype):
    """``expand_stream``: passes of STREAM_BN columns, column groups a multiple of the warps that
    share an m-tile, no more expand blocks than one wave of 4 per multiprocessor once y is large,
    rank blocks of 64, whole chunks per split; a fused launch runs lora_fused whatever is asked."""
    bn, rb, version = kernels.STREAM_BN, cb.RANK_BLOCK, "expand_stream"
    for b in (128, 256, 512, 1024, 4096):
        for tile in kernels.MMA_SHRINK_BM:
            p = cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=33, tile=tile, fused=False, expand=version)
            assert (p.expand, p.bn, p.chunks) == (version, bn, False)
            assert p.col_blocks * p.bn >= out > (p.col_blocks - 1) * p.bn
            share = 64 // tile
            assert p.cpb == p.col_blocks or p.cpb % share == 0
            assert p.expand_blocks <= max(p.tiles, cb.STREAM_BLOCKS_PER_SM * cb.DEFAULT_SMS)
            assert p.rank_blocks == -(-R // rb)
            assert p.packed == (n > 1 and n * cb.rank_width(R) <= rb)
            assert p.shrink_blocks == p.tiles * p.splits * (1 if p.packed else n * p.rank_blocks)
            assert p.k_split % (128 // cb._ITEMSIZE[dtype]) == 0 and p.splits * p.k_split >= in_f
            f = cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=33, tile=tile, fused=True, expand=version)
            assert (f.expand, f.chunks) == ("expand", cb.default_chunks(b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_f,out,n,R", SHAPES)
def test_ring_plans_take_tiles_of_64_and_one_wave(in_f, out, n, R, dtype):
    """``expand_ring``: tiles of RING_BM positions whatever the bucket's own tile, column blocks of
    RING_BN covering ``out``, at most one wave of RING_BLOCKS_PER_SM expand blocks per
    multiprocessor once y is large; a fused launch runs lora_fused whatever is asked."""
    for b in (128, 256, 1024, 4096):
        p = cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=33, fused=False, expand="expand_ring")
        assert (p.expand, p.bm, p.bn, p.chunks) == ("expand_ring", kernels.RING_BM, kernels.RING_BN, False)
        assert p.tiles == -(-b // kernels.RING_BM)
        assert p.col_blocks * p.bn >= out > (p.col_blocks - 1) * p.bn and 1 <= p.cpb <= p.col_blocks
        assert p.expand_blocks <= max(p.tiles, cb.RING_BLOCKS_PER_SM * cb.DEFAULT_SMS)
        if p.tiles * p.col_blocks >= 2 * cb.RING_BLOCKS_PER_SM * cb.DEFAULT_SMS:  # y large: about one wave
            assert p.expand_blocks > cb.RING_BLOCKS_PER_SM * cb.DEFAULT_SMS // 2
        f = cb.plan_launch(b, in_f, out, n, R, dtype, num_slots=33, fused=True, expand="expand_ring")
        assert f.fused and f.expand == "expand"


def test_each_shipped_kernel_is_a_default_somewhere():
    """Every expand kernel is some bucket's default (a bucket listed for expand_stream launches
    unfused: a fused launch would ignore it), the fused kernel is, and lora_chunk is, at each of
    its rank widths. The pair's expand is the bucket's alone; lora_chunk runs where
    ``default_chunk`` says and the target fits it (16-bit; one slice with columns, since these plans
    are given no slice offsets: several slices are test_several_slices_...'s), never in halves or
    with a forced tile."""
    for b in cb.STREAM_EXPAND_BUCKETS:
        assert not cb.default_fused(b)
    chosen, widths = set(), set()
    for b in DEFAULT_CAPTURE_BUCKETS:
        pairs = set()
        for out, n, live in ((4096, 1, None), (14336, 1, None), (6144, 3, None), (6144, 3, 1)):
            for r in (8, 16, 64, 128):
                for dt in DTYPES:
                    p = cb.plan_launch(b, 4096, out, n, r, dt, num_slots=33, live_slices=live)
                    chosen.add("fused" if p.fused else p.expand)
                    fits = cb.chunk_fits(dt, r, n, live) is None
                    one = p.expand in ("one", "pair")  # lora_pair, then lora_one first where they take the call
                    assert (p.expand == "chunk") == (not p.fused and not one and fits and cb.default_chunk(b, r))
                    if one:  # the decode buckets at rank width 16 (test_decode_buckets_...), one position
                        continue
                    if p.expand == "chunk":
                        widths.add(cb.chunk_geometry(r)[0])
                        assert p.blocks <= cb.CHUNK_BLOCKS_PER_SM * cb.DEFAULT_SMS
                        for kw in (dict(whole=False), dict(tile=64)):
                            q = cb.plan_launch(b, 4096, out, n, r, dt, num_slots=33, live_slices=live, **kw)
                            assert q.expand == cb.default_expand(b)
                    else:
                        pairs.add((p.fused, p.expand, p.chunks))
        assert len(pairs) == 1
        fused, expand, _ = pairs.pop()
        assert fused or (expand == "expand_stream") == (b in cb.STREAM_EXPAND_BUCKETS)
        assert fused or (expand == "expand_ring") == (b >= cb.RING_EXPAND_FROM)
    assert chosen == {"fused", *kernels.EXPAND_KERNELS}
    assert widths == set(kernels.CHUNK_RW)
    # lora_one at each of its rank widths where a block's share of A is small (in = 1024)
    assert {cb.built_width(kernels.ONE_RW, r) for r in (16, 64, 128)
            if cb.plan_launch(1, 1024, 4096, 1, r, "bfloat16", num_slots=33).expand == "one"} == set(kernels.ONE_RW)


@pytest.mark.parametrize("R", [16, 64, 128])
def test_a_deep_target_takes_wider_chunks_sooner(R):
    """A target whose `in` is at least CHUNK_DEEP times its `out` (Llama's down) takes chunks of
    CHUNK_WIDE_BM from CHUNK_DEEP_WIDE_FROM positions at rank width 64 (x and A read fewer times);
    its transpose and rank widths 16 and 128 keep the heights by bucket alone."""
    for b in DEFAULT_CAPTURE_BUCKETS:
        deep = cb.plan_launch(b, 14336, 4096, 1, R, "bfloat16", num_slots=33, fused=False, expand="chunk")
        wide = cb.plan_launch(b, 4096, 14336, 1, R, "bfloat16", num_slots=33, fused=False, expand="chunk")
        assert wide.bm == cb.chunk_bm(b, R)
        if cb.rank_width(R) == 64 and cb.CHUNK_DEEP_WIDE_FROM <= b < cb.CHUNK_TALL_FROM:
            assert deep.bm == kernels.CHUNK_WIDE_BM
        else:
            assert deep.bm == cb.chunk_bm(b, R)
        assert (cb.chunk_geometry(R)[0], deep.bm) in kernels.CHUNK_SHAPES
        assert deep.blocks <= cb.chunk_blocks_per_sm("bfloat16", R, deep.bm, 33) * cb.DEFAULT_SMS
    assert cb.chunk_bm(1024, 64, 8192, 4096) == kernels.CHUNK_WIDE_BM
    assert cb.chunk_bm(1024, 64, 8191, 4096) == cb.chunk_bm(1024, 64) == kernels.CHUNK_BM
    assert cb.chunk_bm(1024, 128, 14336, 4096) == cb.chunk_bm(1024, 128) == kernels.CHUNK_BM


@pytest.mark.parametrize("R", [8, 16, 48, 64, 128])
def test_chunk_height_by_bucket(R):
    """lora_chunk's chunks: 16 positions up to CHUNK_NARROW_TO positions; at rank widths above 16,
    128 from CHUNK_TALL_FROM positions and 64 from CHUNK_WIDE_FROM; else 32 (each height an
    instantiation of its own, chunks of 128 in blocks of 256 threads); the counters are sized for
    chunks of 16 either way, and the grid is one wave of what the shared memory of that height
    leaves resident."""
    for b in DEFAULT_CAPTURE_BUCKETS:
        p = cb.plan_launch(b, 4096, 4096, 1, R, "bfloat16", num_slots=33, fused=False, expand="chunk")
        wide = cb.rank_width(R) > 16 and b >= cb.CHUNK_WIDE_FROM
        tall = wide and b >= cb.CHUNK_TALL_FROM
        assert p.bm == (16 if b <= 64 else 128 if tall else 64 if wide else 32) == cb.chunk_bm(b, R)
        assert kernels.chunk_threads(p.bm) == (256 if tall else 128)
        assert (cb.chunk_geometry(R)[0], p.bm) in kernels.CHUNK_SHAPES
        assert p.tiles == cb.fused_units(b, 16, 33)  # counters for chunks of 16: never fewer than taller
        assert p.blocks <= cb.chunk_blocks_per_sm("bfloat16", R, p.bm, 33) * cb.DEFAULT_SMS  # one wave


def test_chunk_plans_refuse_what_the_kernel_does_not_serve():
    for kw, why in ((dict(dtype="float32"), "serves"), (dict(max_rank=256), "ranks up to"),
                    (dict(n_slices=3), "multiples of 128, not of an unknown"),
                    (dict(n_slices=3, slice_align=64), "multiples of 128, not of 64"),
                    (dict(n_slices=2, max_rank=64, slice_align=32), "multiples of 64, not of 32"),
                    (dict(whole=False), "one launch")):
        args = dict(bucket=1024, in_features=4096, out_features=6144, n_slices=1, max_rank=16, dtype="bfloat16")
        args.update({k: v for k, v in kw.items() if k in args})
        with pytest.raises(ValueError, match=why):
            cb.plan_launch(*args.values(), num_slots=33, expand="chunk",
                           **{k: v for k, v in kw.items() if k in ("whole", "slice_align")})
    for kw in (dict(tile=16), dict(chunks=True)):  # what it would ignore is refused
        with pytest.raises(ValueError, match="chunks of 32"):
            cb.plan_launch(1024, 4096, 4096, 1, 16, "bfloat16", num_slots=33, expand="chunk", **kw)
    p = cb.plan_launch(1024, 4096, 6144, 3, 16, "bfloat16", num_slots=33, expand="chunk", live_slices=1)
    assert (p.expand, p.bm, p.tiles) == ("chunk", kernels.CHUNK_BM, cb.fused_units(1024, kernels.CHUNK_NARROW_BM, 33))
    assert not p.sliced  # one member: the instantiation of one slice
    p = cb.plan_launch(1024, 4096, 6144, 3, 16, "bfloat16", num_slots=33, expand="chunk", slice_align=128)
    assert (p.expand, p.n_slices, p.sliced) == ("chunk", 3, True)  # several slices on its column blocks: whole
    p = cb.plan_launch(1024, 4096, 6144, 3, 16, "bfloat16", num_slots=33, expand="chunk", slice_align=128,
                       live_slices=3)
    assert p.sliced
    assert not cb.plan_launch(1024, 4096, 4096, 1, 16, "bfloat16", num_slots=33, expand="chunk").sliced


#: (offsets, max rank, slice_alignment, chunk_fits, the first bucket lora_chunk serves by default)
SLICE_CASES = [((0, 4096, 5120, 6144), 16, 128, True, 64),  # Llama-8B q/k/v
               ((0, 14336, 28672), 16, 128, True, 64),        # its gate/up
               ((0, 4096, 5120, 6144), 64, 128, True, None),  # fits, but rank 64 keeps the fused kernel / pair
               ((0, 192, 384), 64, 64, True, None),
               ((0, 192, 384), 16, 64, False, None),          # 192 is no multiple of 128
               ((0, 96, 136, 160), 64, 8, False, None),
               ((0, 4096), 16, 128, True, 2)]                 # one slice: from CHUNK_FROM


@pytest.mark.parametrize("offsets,R,aligned,fits,first", SLICE_CASES)
def test_several_slices_take_lora_chunk_where_their_columns_fall_on_its_blocks(offsets, R, aligned, fits, first):
    """A fused target (q/k/v, gate/up) runs lora_chunk whole where every slice's columns start on
    one of its column blocks (128 columns at rank width 16, 64 above); by default from 64
    positions at rank width 16 (above it the fused kernel and the pair measured faster)."""
    assert cb.slice_alignment(offsets) == aligned
    n, out = len(offsets) - 1, offsets[-1]
    assert (cb.chunk_fits("bfloat16", R, n, None, aligned) is None) == fits
    chunked = [b for b in DEFAULT_CAPTURE_BUCKETS
               if cb.plan_launch(b, 4096, out, n, R, "bfloat16", num_slots=33, slice_align=aligned).expand == "chunk"]
    share = cb.one_share(4096, n, R, "bfloat16")  # lora_pair and lora_one first where they are the default
    first_taken = {b for b in DEFAULT_CAPTURE_BUCKETS if cb.default_one(b, True, share, "bfloat16")
                   or cb.default_pair(b, "bfloat16", R, n, 4096)}
    assert chunked == ([b for b in DEFAULT_CAPTURE_BUCKETS if b >= first and b not in first_taken] if first else [])
    if fits:  # asked for, it serves every bucket
        for b in DEFAULT_CAPTURE_BUCKETS:
            p = cb.plan_launch(b, 4096, out, n, R, "bfloat16", num_slots=33, slice_align=aligned, fused=False,
                               expand="chunk")
            assert (p.expand, p.n_slices, p.col_blocks) == ("chunk", n, -(-out // cb.chunk_geometry(R)[2]))


def test_decode_buckets_run_lora_pair_at_rank_width_16():
    """From PAIR_FROM up to PAIR_TO positions lora_pair runs by default in the 16-bit types at rank width
    16, every target of the Llama-8B layer, with or without clusters; never in fp32, at rank 128, in
    halves or where something else is forced. Its grids: the shrink a block an item (the most chunks a
    step can have x the splits of `in`), the expand at least a block a chunk, more for wide outputs."""
    layer = {"qkv": (4096, 6144, 3), "o": (4096, 4096, 1), "gate_up": (4096, 28672, 2), "down": (14336, 4096, 1)}
    for dtype in ("bfloat16", "float16"):
        for name, (in_f, out, n) in layer.items():
            pairs = [b for b in DEFAULT_CAPTURE_BUCKETS
                     if cb.plan_launch(b, in_f, out, n, 16, dtype, num_slots=33, slice_align=128).expand == "pair"]
            assert pairs == [b for b in DEFAULT_CAPTURE_BUCKETS if cb.PAIR_FROM <= b <= cb.PAIR_TO], name
            for b in pairs:
                p = cb.plan_launch(b, in_f, out, n, 16, dtype, num_slots=33, slice_align=128)
                per_sm = cb.PAIR_EXPAND_PER_SM_WIDE if out >= cb.PAIR_WIDE else cb.PAIR_EXPAND_PER_SM
                assert (p.bm, p.splits) == (cb.PAIR_M, cb.pair_splits(in_f, n))
                assert p.col_blocks == max(p.tiles, per_sm * cb.DEFAULT_SMS)
                # the splits cover `in` in one round of each block's k-blocks
                assert p.splits * cb.PAIR_SW * cb.PAIR_KB[cb.pair_rt(n)] * 32 >= in_f
                for kw in (dict(clusters=False), dict(max_rank=8)):
                    args = dict(max_rank=16) | kw
                    assert cb.plan_launch(b, in_f, out, n, args.pop("max_rank"), dtype, num_slots=33,
                                          slice_align=128, **args).expand == "pair"
                for kw in (dict(whole=False), dict(fused=True), dict(expand="chunk"), dict(expand="expand")):
                    assert cb.plan_launch(b, in_f, out, n, 16, dtype, num_slots=33, slice_align=128,
                                          **kw).expand != "pair"
    for b in DEFAULT_CAPTURE_BUCKETS[1:]:
        assert cb.plan_launch(b, 4096, 4096, 1, 16, "float32", num_slots=33).expand != "pair"
        assert cb.plan_launch(b, 4096, 4096, 1, 128, "bfloat16", num_slots=33).expand != "pair"
    assert cb.plan_launch(1, 4096, 4096, 1, 16, "bfloat16", num_slots=33).expand == "one"
    assert cb.plan_launch(2 * cb.PAIR_TO, 4096, 4096, 1, 16, "bfloat16", num_slots=33).expand != "pair"


def test_decode_buckets_run_lora_pair_at_rank_width_64_for_one_or_two_slices():
    """At rank width 64 (ranks 17-64, or a pool of a larger max_rank planned for 64) lora_pair runs the
    decode buckets up to PAIR_WIDE_RANK_TO positions of a target of one or two slices (the shrink's A in
    registers: 4 or 8 row tiles of 16 ranks) where one round of its splits covers `in`, at width 64; a
    target of three slices, in = 14336 and larger buckets keep the kernels they ran before. Forced, it
    serves them all."""
    for b in DEFAULT_CAPTURE_BUCKETS:
        for R in (17, 48, 64):
            for in_f, out, n in ((4096, 4096, 1), (4096, 28672, 2), (14336, 4096, 1)):
                p = cb.plan_launch(b, in_f, out, n, R, "bfloat16", num_slots=33, slice_align=128)
                one_round = cb.pair_splits(in_f, n, 64) * cb.PAIR_SW * cb.pair_kb(n, 64) * 32 >= in_f
                assert (p.expand == "pair") == (cb.PAIR_FROM <= b <= cb.PAIR_WIDE_RANK_TO and one_round), (b, R, n)
                assert one_round == (in_f == 4096)
                if cb.PAIR_FROM <= b <= cb.PAIR_TO:
                    p = cb.plan_launch(b, in_f, out, n, R, "bfloat16", num_slots=33, expand="pair")
                    assert p.rank_width == 64 and p.splits == cb.pair_splits(in_f, n, 64)
            assert cb.plan_launch(b, 4096, 6144, 3, R, "bfloat16", num_slots=33).expand != "pair"
    assert cb.pair_kb(1, 64) == cb.PAIR_KB[4] and cb.pair_kb(2, 64) == cb.PAIR_KB[8]


def test_pair_plans_refuse_what_the_kernels_do_not_serve():
    for kw, why in ((dict(dtype="float32"), "float16 and bfloat16"), (dict(max_rank=128), "ranks up to 64"),
                    (dict(max_rank=64, n_slices=3), "up to 2 slices at rank width 64"),
                    (dict(bucket=512), "up to 256 positions"), (dict(n_slices=9), "up to 8 slices"),
                    (dict(whole=False), "not in halves"), (dict(tile=16), "no tile")):
        args = dict(bucket=64, max_rank=16, dtype="bfloat16", n_slices=1) | kw
        with pytest.raises(ValueError, match=why):
            cb.plan_launch(args.pop("bucket"), 4096, 4096, args.pop("n_slices"), args.pop("max_rank"),
                           args.pop("dtype"), num_slots=33, expand="pair", **args)


def test_pair_chunk_bound_holds_every_step():
    """``pair_chunks``: no step of `bucket` positions over the slots has more chunks of PAIR_M (the grids
    and the workspace are sized for it): random steps, and the step of most chunks (every slot but one
    with one position, the rest on the last)."""
    rng = np.random.default_rng(7)
    for bucket in (2, 3, 8, 9, 64, 256):
        for slots in (2, 3, 9, 33, 513):
            bound = cb.pair_chunks(bucket, slots)
            most = 0
            for _ in range(200):
                counts = rng.multinomial(bucket, rng.dirichlet(np.ones(slots - 1) * rng.uniform(0.05, 2)))
                most = max(most, int(sum(-(-c // cb.PAIR_M) for c in counts)))
                assert most <= bound
            k = min(slots - 1, bucket)  # k slots of one position each, the rest on one of them
            worst = (k - 1) + -(-(bucket - (k - 1)) // cb.PAIR_M)
            assert worst <= bound


def test_unknown_kernels_are_refused():
    with pytest.raises(ValueError, match="expand"):
        cb.plan_launch(4096, 4096, 4096, 1, 16, "bfloat16", num_slots=33, expand="v4")


def test_fused_units_hold_every_chunk_of_any_addressing():
    """A fused launch's work units are chunks of one slot (a slot's range cut into pieces of at most
    ``bm`` from its start, clipped to the positions): however a step spreads over the slots, its
    chunks never outnumber the units the launch was sized for, and a step of one slot per position
    needs all of them."""
    rng = np.random.default_rng(0)
    for bucket in (1, 2, 16, 64, 100, 4096):
        for bm in kernels.MMA_SHRINK_BM:
            for S in (2, 3, 9, 33, 513):
                units = cb.fused_units(bucket, bm, S)
                assert units <= bucket
                for _ in range(20):
                    T = int(rng.integers(1, bucket + 1))
                    slots = np.sort(rng.integers(0, S, T))
                    indptr = np.zeros(S + 1, np.int64)
                    np.cumsum(np.bincount(slots, minlength=S), out=indptr[1:])
                    chunks = sum(-(-int(min(indptr[s + 1], T) - indptr[s]) // bm) for s in range(1, S))
                    assert chunks <= units
                if S - 1 >= bucket:
                    assert units == bucket


def test_chunked_plans_fill_about_a_wave_whatever_the_bucket():
    for b in (1, 16, 64):
        for S in (2, 9, 33):
            for out in (4096, 28672):
                p = cb.plan_launch(b, 4096, out, 1, 16, "bfloat16", num_slots=S, chunks=True)
                assert p.fused and p.chunks and p.tiles == cb.fused_units(b, p.bm, S)
                assert p.tiles * p.splits < cb.FUSED_SHRINK_PER_SM * cb.DEFAULT_SMS + p.tiles
                assert p.expand_blocks <= max(p.tiles, cb.FUSED_EXPAND_PER_SM * cb.DEFAULT_SMS)
                assert (p.col_blocks - 1) * p.bn < out <= p.col_blocks * p.bn


def test_decode_chunks_take_more_parts_where_the_rules_say():
    """At the decode buckets and rank width 16 lora_chunk's most parts a chunk are its column blocks
    (up to CHUNK_COL_PARTS) where they outnumber CHUNK_MAX_PARTS; up to CHUNK_FEW_TO positions above
    rank width 16 its stages of `in` or column blocks (up to CHUNK_FEW_PARTS); elsewhere
    CHUNK_MAX_PARTS, or the stages of `in` and column blocks there are if fewer."""
    chunk = dict(num_slots=33, fused=False, expand="chunk", slice_align=128)
    # (bucket, in, out, slices, rank): the most parts
    cases = {(64, 4096, 28672, 2, 16): min(cb.CHUNK_COL_PARTS, 224),  # gate_up: 224 column blocks of 128
             (16, 4096, 6144, 3, 16): 48,                             # q/k/v
             (64, 14336, 4096, 1, 16): cb.CHUNK_MAX_PARTS,            # down: 32 column blocks, 112 stages
             (64, 4096, 4096, 1, 64): cb.CHUNK_MAX_PARTS,             # rank 64: 64 of each, capped
             (256, 4096, 28672, 2, 16): cb.CHUNK_MAX_PARTS,           # chunks of 32
             (64, 2048, 1024, 1, 16): 16,                             # 16 stages, 8 column blocks
             (1, 14336, 4096, 1, 64): cb.CHUNK_FEW_PARTS,             # few positions above rank 16:
             (16, 4096, 4096, 1, 64): 64,                             # the stages of 64 or column blocks
             (1, 4096, 14336, 1, 128): min(cb.CHUNK_FEW_PARTS, 224)}
    for (b, i, o, n, R), most in cases.items():
        p = cb.plan_launch(b, i, o, n, R, "bfloat16", **chunk)
        assert (p.expand, p.splits) == ("chunk", most), (b, i, o, n, R)
        assert p.blocks <= cb.chunk_blocks_per_sm("bfloat16", R, p.bm, 33) * cb.DEFAULT_SMS


def test_one_cuh_constants_match_the_planner():
    """The cluster size and slice count one.cuh is built with are the ones the planner sizes for."""
    text = (kernels.kernel_dir() / "one.cuh").read_text()
    assert re.search(r"constexpr int ONE_CLUSTER = (\d+);", text).group(1) == str(kernels.ONE_CLUSTER)
    assert re.search(r"constexpr int ONE_SLICES = (\d+);", text).group(1) == str(cb.MAX_SLICES)


def test_one_position_runs_lora_one_where_the_device_has_clusters():
    """The bucket of one position: lora_one in clusters of ONE_CLUSTER blocks (at least ONE_COLS columns
    a block, at most ONE_MAX_CLUSTERS clusters), every dtype and target, ranks up to 128; by default
    where a block's share of A is small (rank 16), else lora_chunk by ticket for one 16-bit slice and
    the fused kernel for the rest; the fused kernel below sm_90, above rank 128, wherever something
    else is forced, and at every other bucket."""
    for dtype in ("bfloat16", "float16", "float32"):
        for out, n, clusters in ((4096, 1, 8), (6144, 3, 12), (28672, 2, 16), (100, 1, 1)):
            p = cb.plan_launch(1, 4096, out, n, 16, dtype, num_slots=33, expand="one")
            assert (p.expand, p.fused, p.blocks) == ("one", False, clusters * cb.ONE_CLUSTER)
            assert p.blocks * p.bn >= out and p.shrink_blocks == p.expand_blocks == p.blocks
    # by default where a block's share of A is at most one_max_share(dtype): the Llama-8B layer's four
    # rank-16 targets in 16-bit types (down: 14336 / 8 features x 16 ranks x 2 bytes = 56 KB), and
    # (the shrink on tensor cores) rank 64 of one slice of in = 4096 (64 KB); not the larger
    # rank-64 shares (lora_chunk by ticket for one slice, else the fused kernel), nor fp32 at rank 64
    for in_f, out, n in ((4096, 6144, 3), (4096, 4096, 1), (4096, 28672, 2), (14336, 4096, 1)):
        for dtype in ("bfloat16", "float16"):
            assert cb.one_share(in_f, n, 16, dtype) <= cb.one_max_share(dtype)
            assert cb.plan_launch(1, in_f, out, n, 16, dtype, num_slots=33).expand == "one"
        p64 = cb.plan_launch(1, in_f, out, n, 64, "bfloat16", num_slots=33)
        if n == 1 and in_f == 4096:
            assert cb.one_share(in_f, n, 64, "bfloat16") == cb.ONE_MAX_SHARE_MMA == 64 * 1024
            assert p64.expand == "one"
        elif n == 1:
            assert (p64.expand, p64.fused) == ("chunk", False)
        else:
            assert p64.fused
        assert cb.plan_launch(1, in_f, out, n, 64, "float32", num_slots=33).fused
        assert cb.plan_launch(1, in_f, out, n, 64, "bfloat16", num_slots=33, expand="one").expand == "one"
    assert cb.one_share(14336, 1, 16, "bfloat16") == 14336 // 8 * 16 * 2
    assert cb.one_max_share("float32") == cb.ONE_MAX_SHARE < cb.ONE_MAX_SHARE_MMA == cb.one_max_share("float16")
    for dtype in ("bfloat16", "float16", "float32"):
        assert cb.plan_launch(1, 4096, 4096, 1, 16, dtype, num_slots=33, clusters=False).fused
        assert cb.plan_launch(1, 4096, 4096, 1, 256, dtype, num_slots=33).fused
    for kw in (dict(fused=True), dict(tile=16), dict(expand="expand"), dict(fused=False), dict(whole=False)):
        assert cb.plan_launch(1, 4096, 4096, 1, 16, "bfloat16", num_slots=33, **kw).expand != "one"
    for b in DEFAULT_CAPTURE_BUCKETS[1:]:  # forced above one position: refused (its chunks were deleted)
        with pytest.raises(ValueError, match=f"of 1 position, not {b}"):
            cb.plan_launch(b, 4096, 4096, 1, 16, "bfloat16", num_slots=33, expand="one")
    for kw, why in ((dict(clusters=False), "clusters"), (dict(whole=False), "one launch"),
                    (dict(tile=16), "no tile"), (dict(max_rank=256), "ranks up to 128")):
        args = dict(max_rank=16) | kw
        with pytest.raises(ValueError, match=why):
            cb.plan_launch(1, 4096, 4096, 1, args.pop("max_rank"), "bfloat16", num_slots=33, expand="one", **args)


def test_chunks_where_the_step_is_small_and_only_for_the_fused_kernel():
    assert [b for b in DEFAULT_CAPTURE_BUCKETS if cb.default_chunks(b)] == [2, 4, 8, 16, 32]
    for b in DEFAULT_CAPTURE_BUCKETS:
        p = cb.plan_launch(b, 4096, 4096, 1, 16, "float32", num_slots=33)  # fp32: never lora_chunk
        assert p.chunks == cb.default_chunks(b)
        assert p.tiles == (cb.fused_units(b, p.bm, 33) if p.chunks else -(-b // p.bm))
        assert cb.plan_launch(b, 4096, 4096, 1, 16, "bfloat16", num_slots=33, fused=True, chunks=True).chunks
        tiles = cb.plan_launch(b, 4096, 4096, 1, 16, "bfloat16", num_slots=33, fused=True, chunks=False)
        assert not tiles.chunks and tiles.tiles == -(-b // tiles.bm)
        for expand in set(kernels.EXPAND_KERNELS) - {"chunk", "one", "pair"}:  # the pair's kernels run tiles, whatever is asked
            assert not cb.plan_launch(b, 4096, 4096, 1, 16, "bfloat16", num_slots=33, fused=False,
                                      expand=expand, chunks=True).chunks


def test_tile_and_fused_overrides():
    p = cb.plan_launch(4096, 4096, 4096, 1, 16, "float16", num_slots=33, tile=16, fused=True)
    assert (p.bm, p.bn, p.fused, p.tiles) == (16, 64, True, 256)
    c = cb.plan_launch(4096, 4096, 4096, 1, 16, "float16", num_slots=33, tile=16, fused=True, chunks=True)
    assert (c.fused, c.chunks, c.tiles) == (True, True, 256 + 32)  # chunks: tiles + slots - 1
    with pytest.raises(ValueError, match="tile"):
        cb.plan_launch(64, 4096, 4096, 1, 16, "float16", num_slots=33, tile=48)


# -- argument checks ---------------------------------------------------------------------------------
class FakeDeviceArray:
    """Just a ``__cuda_array_interface__``: what check_call reads of a device array."""

    _next = 1 << 20

    def __init__(self, shape, typestr, strides=None, ptr=None):
        if ptr is None:
            ptr = FakeDeviceArray._next
            FakeDeviceArray._next += 1 << 24
        self.__cuda_array_interface__ = dict(shape=tuple(shape), typestr=typestr, data=(ptr, False),
                                             strides=strides, version=3)


_TS = {"bfloat16": "<u2", "float16": "<f2", "float32": "<f4"}


def _call(T=10, in_f=64, out=96, n=1, R=16, S=5, dtype="bfloat16", **over):
    slices = tuple(LoraSlice(f"s{j}", out // n) for j in range(n))
    spec = LoraSpec((LoraTarget("t", in_f, out, 1, slices),), num_slots=S, max_rank=R, dtype=dtype)
    offs = spec.targets[0].out_offsets()
    floats, ints = cb.plan_workspace(spec)
    limits = cb.CallLimits(spec, 0, cb.DEFAULT_SMS, floats, ints, {offs: 4096} if n > 1 else {})
    ts = _TS[dtype]
    args = dict(y=FakeDeviceArray((T, out), ts), x=FakeDeviceArray((T, in_f), ts),
                a=FakeDeviceArray((S, n, R, in_f), ts), b=FakeDeviceArray((S, out, R), ts),
                scaling=FakeDeviceArray((S, n), "<f4"), ranks=FakeDeviceArray((S, n), "<i4"),
                token_order=FakeDeviceArray((T,), "<i4"), slot_indptr=FakeDeviceArray((S + 1,), "<i4"),
                offsets=offs)
    args.update(over)
    w = LayerWeights(args["a"], args["b"], args["scaling"], args["ranks"], args["offsets"])
    return cb.check_call(limits, args["y"], args["x"], w, args["token_order"], args["slot_indptr"])


def test_a_valid_call_gives_pointers_dims_and_flags():
    call = _call(T=100, in_f=64, out=96, n=3, R=16)
    assert call.dims == (5, 3, 16, 64, 96) and call.positions == 100
    assert call.plan.bucket == 128 and call.rw == 16
    assert call.flags == 7
    assert call.ptrs[6] == 4096  # the slice-offset table of the target
    assert not call.torch
    assert _call(T=100).plan == _call(T=128).plan  # the bucket, not the count


def test_awkward_sizes_and_misaligned_pointers_take_the_element_paths():
    assert _call(in_f=77).flags == 6
    assert _call(R=13).flags == 5
    assert _call(out=90).flags == 3
    assert _call(y=FakeDeviceArray((10, 96), "<u2", ptr=(1 << 30) + 2)).flags == 3
    assert _call(dtype="float32", in_f=66).flags == 6  # 4 floats per 16 bytes


def test_no_positions_is_no_launch():
    assert _call(T=0) is None


@pytest.mark.parametrize("over,err,match", [
    (dict(x=FakeDeviceArray((10, 64), "<f2")), TypeError, "dtype"),
    (dict(x=np.zeros((10, 64), np.float16)), TypeError, "host"),
    (dict(ranks=FakeDeviceArray((5, 1), "<i8")), TypeError, "int32"),
    (dict(scaling=FakeDeviceArray((5, 1), "<f2")), TypeError, "float32"),
    (dict(token_order=FakeDeviceArray((10,), "<i8")), TypeError, "int32"),
    (dict(y=FakeDeviceArray((10, 96), "<u2", strides=(2, 20))), ValueError, "contiguous"),
    (dict(y=FakeDeviceArray((11, 96), "<u2")), ValueError, "share rows"),
    (dict(x=FakeDeviceArray((10, 65), "<u2")), ValueError, "features"),
    (dict(b=FakeDeviceArray((5, 95, 16), "<u2")), ValueError, "w.b"),
    (dict(ranks=FakeDeviceArray((4, 1), "<i4")), ValueError, r"\[S, n\]"),
    (dict(slot_indptr=FakeDeviceArray((5,), "<i4")), ValueError, "slot_indptr"),
    (dict(offsets=(0, 95)), ValueError, "out_offsets"),
    (dict(token_order=FakeDeviceArray((5000,), "<i4")), ValueError, "bucket"),
])
def test_bad_arguments_are_refused(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


def test_one_slice_of_a_fused_b_is_a_slot_strided_view():
    """A call serving one slice of a fused target reads that slice's rows of the fused B in place:
    its slot stride is the fused B's, passed to the kernels (b_slot); a B laid
    out any other way is refused; the member's slice offsets give the other slices no columns."""
    assert member_offsets((0, 64, 80, 96), 0) == (0, 64, 64, 64)
    assert member_offsets((0, 64, 80, 96), 1) == (0, 0, 16, 16)
    assert member_offsets((0, 64, 80, 96), 2) == (0, 0, 0, 16)
    S, out, R = 5, 96, 16
    # slice 1 (columns 64:80) of a [5, 96, 16] bfloat16 B: strides (96 * 16, 16, 1) elements
    view = FakeDeviceArray((S, 16, R), "<u2", strides=(2 * out * R, 2 * R, 2), ptr=(1 << 30) + 2 * 64 * R)
    limits_offs = member_offsets((0, 64, 80, 96), 1)
    spec = LoraSpec((LoraTarget("t", 64, out, 1, tuple(LoraSlice(f"s{j}", w) for j, w in enumerate((64, 16, 16)))),),
                    num_slots=S, max_rank=R, dtype="bfloat16")
    floats, ints = cb.plan_workspace(spec)
    limits = cb.CallLimits(spec, 0, cb.DEFAULT_SMS, floats, ints, {limits_offs: 4096})
    w = LayerWeights(FakeDeviceArray((S, 3, R, 64), "<u2"), view, FakeDeviceArray((S, 3), "<f4"),
                     FakeDeviceArray((S, 3), "<i4"), limits_offs)
    call = cb.check_call(limits, FakeDeviceArray((10, 16), "<u2"), FakeDeviceArray((10, 64), "<u2"), w,
                         FakeDeviceArray((10,), "<i4"), FakeDeviceArray((S + 1,), "<i4"))
    assert call.b_slot == out * R and call.dims == (S, 3, R, 64, 16) and call.flags == 7
    assert cb.check_weights(limits, w).b_slot == out * R
    assert _call(out=96, R=16).b_slot == 96 * 16  # a C-contiguous B: out * R
    # slots apart by no multiple of 16 bytes: B's 16-byte paths (flag 2) are not taken
    odd = FakeDeviceArray((S, 16, R), "<u2", strides=(2 * (out * R + 4), 2 * R, 2), ptr=1 << 30)
    assert cb.check_weights(limits, LayerWeights(w.a, odd, w.scaling, w.ranks, limits_offs)).flags == 5
    for strides in ((2 * out * R, 2, 2 * S), (2 * 8 * R, 2 * R, 2)):  # columns not rows; slots overlapping
        bad = LayerWeights(w.a, FakeDeviceArray((S, 16, R), "<u2", strides=strides), w.scaling, w.ranks, limits_offs)
        with pytest.raises(ValueError, match="w.b must be C-contiguous, or one slice"):
            cb.check_weights(limits, bad)


def test_a_rank_blocked_b_gives_the_kernels_its_strides():
    """B rank-blocked, ``[S, ceil(R / 16), out, 16]`` (a pool above 16 ranks): the kernels read column c,
    rank k at ``c * b_ld + (k // 16) * b_blk + k % 16`` with b_ld 16 and b_blk ``out * 16``; ``[S, out, R]``
    is b_ld R, b_blk 16. One slice's columns of a blocked fused B are read in place; other shapes and
    layouts are refused."""
    S, out, R = 5, 96, 40
    call = _call(R=R, b=FakeDeviceArray((S, 3, out, 16), "<u2"))
    assert (call.b_slot, call.b_ld, call.b_blk) == (3 * out * 16, 16, out * 16) and call.flags == 7
    plain = _call(R=R)
    assert (plain.b_slot, plain.b_ld, plain.b_blk) == (out * R, R, 16) and plain.flags == 7
    assert _call(R=20).flags == 5  # [S, out, 20] bf16: columns 40 bytes apart, no 16-byte pieces of B
    assert _call(R=20, b=FakeDeviceArray((S, 2, out, 16), "<u2")).flags == 7  # blocked: 32 bytes apart
    widths = (64, 16, 16)
    spec = LoraSpec((LoraTarget("t", 64, out, 1, tuple(LoraSlice(f"s{j}", w) for j, w in enumerate(widths))),),
                    num_slots=S, max_rank=R, dtype="bfloat16")
    offs = member_offsets((0, 64, 80, 96), 1)
    floats, ints = cb.plan_workspace(spec)
    limits = cb.CallLimits(spec, 0, cb.DEFAULT_SMS, floats, ints, {offs: 4096})
    a, sc, rk = FakeDeviceArray((S, 3, R, 64), "<u2"), FakeDeviceArray((S, 3), "<f4"), FakeDeviceArray((S, 3), "<i4")
    # slice 1 (columns 64:80) of a [5, 3, 96, 16] bfloat16 B: strides (3 * 96 * 16, 96 * 16, 16, 1) elements
    view = FakeDeviceArray((S, 3, 16, 16), "<u2", strides=(2 * 3 * out * 16, 2 * out * 16, 32, 2),
                           ptr=(1 << 30) + 2 * 64 * 16)
    wa = cb.check_weights(limits, LayerWeights(a, view, sc, rk, offs))
    assert (wa.b_slot, wa.b_ld, wa.b_blk, wa.dims[4], wa.flags) == (3 * out * 16, 16, out * 16, 16, 7)
    for b, match in ((FakeDeviceArray((S, 2, out, 16), "<u2"), "rank-blocked"),  # too few blocks for 40
                     (FakeDeviceArray((S, 3, out, 8), "<u2"), "rank-blocked"),
                     (FakeDeviceArray((S, 3, 16, 16), "<u2", strides=(2 * 3 * out * 16, 32, 2 * out * 16, 2)),
                      "C-contiguous rank-blocked")):  # blocks and columns swapped
        with pytest.raises(ValueError, match=match):
            cb.check_weights(limits, LayerWeights(a, b, sc, rk, offs))
    with pytest.raises(ValueError, match=r"w.b must be \[S, out, R\] = \(5, 'out', 16\), got"):
        _call(R=16, b=FakeDeviceArray((S, 1, out, 16), "<u2"))  # not blocked at 16 ranks


def test_rank_blocked_calls_are_planned():
    """Every call of the GPU suite's rank-blocked B test is one the planner accepts, onto the kernel the
    test names: that test runs each kernel on the layout, none refused on a GPU."""
    from tests.gpu.test_kernels import BLOCKED_CALLS, BLOCKED_SHAPES

    for name, dtype, kw, bound, kernel in BLOCKED_CALLS:
        sh = BLOCKED_SHAPES[name]
        if kw.get("kernel") == "simt":
            continue
        spec = LoraSpec((LoraTarget("t", sh["in_f"], sum(sh["slices"]), 1,
                                    tuple(LoraSlice(f"s{j}", o) for j, o in enumerate(sh["slices"]))),),
                        num_slots=sh.get("num_slots", 9), max_rank=sh["max_rank"], dtype=dtype)
        bucket = spec.bucket_for(sh["T"])
        plan = cb.plan_launch(bucket, sh["in_f"], sum(sh["slices"]), len(sh["slices"]),
                              cb.planned_rank(sh["max_rank"], bound), dtype, num_slots=spec.num_slots,
                              slice_align=cb.slice_alignment(spec.targets[0].out_offsets()),
                              **{k: v for k, v in kw.items() if k in ("fused", "expand", "tile")})
        got = "fused" if plan.fused else plan.expand
        assert kernel is None or got == kernel, (name, dtype, kw, bound, got)


def test_unknown_slices_and_oversized_weights_are_refused():
    with pytest.raises(ValueError, match="no target"):
        _call(n=2, offsets=(0, 40, 96))
    with pytest.raises(ValueError, match="slices"):
        _call(n=9, out=99)


# -- bench arithmetic ----------------------------------------------------------------------------------
def test_bench_compiles_each_dtype_module_once_with_a_name_it_holds():
    """bench kernels loads every dtype's module before its deadline's clock starts: one load per
    dtype, each asked for a kernel its module is built with (a name NVRTC would not know fails
    there, on a GPU host, after the compile)."""
    from lora_cupy import kernels as k

    asked = []

    class Module:
        def __init__(self, family):
            self.family = family

        def get_function(self, name):
            asked.append((self.family, name))

    took = bench.compile_modules(["bfloat16", "float32", "bfloat16", "float16"], load=Module)
    assert took >= 0
    assert [f for f, _ in asked] == ["lora_mma_bfloat16", "lora_mma_float16", "lora_mma_float32"]
    for family, name in asked:
        assert name in k.FAMILIES[family].name_expressions


def test_byte_floor_counts_x_y_and_each_slots_weights_once():
    row = bench.Row("core", 64, 4096, (4096,), (16,) * 8, 16)
    want = 2 * (64 * 4096 + 2 * 64 * 4096 + 8 * (16 * 4096 + 4096 * 16))
    assert bench.byte_floor(row, 64) == want
    qkv = bench.Row("shapes", 1, 4096, (4096, 1024, 1024), (64,), 64, dtype="float32")
    assert bench.byte_floor(qkv, 1) == 4 * (4096 + 2 * 6144 + 64 * 4096 * 3 + 6144 * 64)


def test_targets():
    small = bench.Row("core", 64, 4096, (4096,), (16,) * 8, 16)
    assert bench.targets_met(small, 4.9, 2.0, 10.0)
    assert not bench.targets_met(small, 5.1, 2.0, 10.0)
    assert not bench.targets_met(small, 4.0, 2.0, 3.9)
    big = bench.Row("core", 4096, 4096, (4096,), (16,) * 32, 16)
    assert bench.targets_met(big, 34.0, 24.0, 40.0)
    assert not bench.targets_met(big, 36.0, 24.0, 40.0)


def test_launches_are_timed_side_by_side_by_the_names_of_their_kernels():
    for row in bench.rows():
        names = set(bench.kernel_variants(row, sweep=False))
        fused = (row.bucket or row.T) <= 64
        assert "default" in names
        assert (set(bench.VERSIONS) - set(bench.ONE_LAUNCH) <= names) == (not fused)
        assert ("one" in names) == ((row.bucket or row.T) == cb.ONE_BUCKET)  # lora_one: one position
        assert ("pair" in names) == (cb.pair_fits(row.bucket or row.T, row.dtype, row.pool_rank,
                                                  len(row.slices)) is None)
        assert "one" not in bench.kernel_variants(row, sweep=False, clusters=False)  # below sm_90
        assert (set(bench.DECODE_VERSIONS) <= names) == fused
        # lora_chunk is timed wherever it serves the row: 16-bit, a pool of rank <= 128, one slice or
        # several on its column blocks
        fits = cb.chunk_fits(row.dtype, row.pool_rank, len(row.slices), None,
                             cb.slice_alignment(np.cumsum((0,) + tuple(row.slices)))) is None
        assert ("chunk" in names) == fits
    assert set(bench.VERSIONS) == set(kernels.EXPAND_KERNELS)


def test_versions_table_picks_the_fastest_correct_launch():
    row = bench.Row("core", 4096, 4096, (4096,), (16,) * 32, 16)
    k = lambda us, ok=True: {"us": us, "err": 1e-3, "ok": ok}  # noqa: E731
    res = {"row": bench.asdict(row), "label": row.label, "floor_us": 26.0, "best_baseline_us": 44.0,
           "kernels": {"default": k(73.0), "expand": k(73.0), "expand_stream": k(30.0, ok=False)},
           "parts": {"shrink": 20.0, "expand": 50.0}}
    lines = bench._versions_table([res]).splitlines()
    assert len(lines) == 3 and lines[2].startswith(row.label[:40])
    cells = lines[2][40:].split()
    best = len(bench.VERSIONS) + len(bench.DECODE_VERSIONS) + 1  # after the default and every version
    assert cells[2] == "ERR" and cells[best] == "default"  # over tolerance never wins
    assert cells[cells.index("|") - 1] == "no"  # 73 us: 36% of a 26 us floor
    assert lines[2].endswith("| 20.0 50.0 - -")  # shrink and expand alone; the other expands not timed alone
    res["kernels"]["expand_stream"] = k(36.0)
    cells = bench._versions_table([res]).splitlines()[2][40:].split()
    assert cells[best] == "stream" and cells[cells.index("|") - 1] == "yes"  # 72% of the floor, under 44
    alone = {**res, "kernels": {"default": k(9.0)}}
    assert len(bench._versions_table([alone]).splitlines()) == 2  # a row timed alone is left out


def test_bars_and_the_markdown_report_of_a_saved_run():
    small = bench.Row("core", 1, 4096, (4096,), (16,), 16)
    big = bench.Row("core", 4096, 4096, (4096,), (16,) * 32, 16)
    assert bench.bars(small, 4.9, 0.1, 9.0) == {"latency": True, "baseline": True}
    assert bench.bars(small, 6.0, 4.5, None) == {"latency": True}  # 1.5x a 4.5 us floor
    assert bench.bars(big, 36.0, 26.0, 35.0) == {"70%": True, "baseline": False}
    k = lambda us, ok=True: {"us": us, "err": 2e-3, "ok": ok,  # noqa: E731
                             "plan": {"bm": 64, "bn": 128, "splits": 8, "k_split": 512, "fused": False, "cpb": 2,
                                      "expand": "expand_stream", "chunks": False, "tiles": 64},
                             "occupancy": {"shrink": {"blocks_per_sm": 4}, "expand_stream": {"blocks_per_sm": 3}}}
    res = {"row": bench.asdict(big), "label": big.label, "floor_us": 26.0, "best_baseline_us": 44.0, "us": 60.0,
           "baselines": {"loop": 300.0, "gemm": 44.0}, "kernels": {"default": k(60.0), "expand": k(70.0)},
           "parts": {}, "vs_pool16": 1.1}
    meta = {"device": "GPU", "torch": "2", "copy_bw": 4.2e12, "method": "diff", "flush": "write",
            "calibration_us": {"diff": {"empty_kernel": 0.9}, "dependent_round": 0.3}}
    md = bench.markdown_report({"meta": meta, "rows": [res]})
    assert "4.20 TB/s" in md and "0.30 us" in md
    assert f"| {big.label} | 64/s8 expand_stream | 60.0 | 26.0 | 43 | 300.0 | - | 44.0 | 2.0e-03 | 4/3 | 70% no, baseline no |" in md
    assert "Bars met: 70% 0 of 1, baseline 0 of 1." in md and "T=4096: 1.10x" in md
    assert "```" in md  # the table of launches side by side
    line = bench._table([{**res, "share_of_floor": 26 / 60, "target_ok": False}], 4.2e12).splitlines()[-1]
    assert line.startswith(big.label) and line.endswith("300.0       -    44.0  2.0e-03   4/3 NO")


def test_rows_cover_the_issue():
    rs = bench.rows()
    groups = {r.group for r in rs}
    assert groups == {"core", "skew", "mixed", "shapes", "dtypes", "padding", "poolrank"}
    core = [r for r in rs if r.group == "core"]
    assert {r.T for r in core} == {1, 16, 64, 256, 1024, 4096}
    assert all(r.slots <= r.T for r in rs)
    labels = [r.label for r in rs]
    assert len(labels) == len(set(labels))


def test_timer_refuses_an_unknown_flush_before_touching_a_device():
    with pytest.raises(ValueError, match="flush must be 'write', 'read' or 'none'"):
        bench.Timer(flush="evict")


def test_layer_rows_are_the_issues_and_their_table_and_report_say_which_goals_are_met():
    assert bench.LAYER_GOALS_US == {(1, 1): 15.0, (64, 8): 18.0, (64, 32): 46.0, (256, 32): 46.0}
    assert [(n, i, sum(o)) for n, i, o in bench.LAYER_TARGETS] == [
        ("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
    calls = {"qkv": 3.0, "o": 2.5, "gate_up": 6.0, "down": 3.5}
    row = lambda T, k, warm, ok=True: {"T": T, "adapters": k, "goal_us": bench.LAYER_GOALS_US[(T, k)],  # noqa: E731
                                       "warm_us": warm, "flushed_us": warm + 10, "ok": ok,
                                       "err": {"qkv": 2e-3}, "calls_warm_us": calls, "plans": {"qkv": "16f/s32"}}
    layer = [row(1, 1, 14.0), row(64, 8, 19.0), row(64, 32, 40.0, ok=False)]
    lines = bench.layer_table(layer).splitlines()
    assert len(lines) == 4
    assert lines[1].split()[3:7] == ["14.0", "24.0", "15", "yes"] and lines[2].split()[6] == "NO"
    assert "ERR" in lines[3] and lines[3].split()[6] == "NO"  # over tolerance never meets its goal
    meta = {"device": "GPU", "torch": "2", "copy_bw": 4.2e12, "method": "diff", "flush": "write"}
    md = bench.markdown_report({"meta": meta, "rows": [], "layer": layer})
    assert "| 1 | 1 | 14.0 | 24.0 | 15 | yes | 3.0 | 2.5 | 6.0 | 3.5 | qkv 16f/s32 |" in md
    assert "| 64 | 8 | 19.0 | 29.0 | 18 | no |" in md
