"""The CUDA backend: the slot-grouped delta in the RawKernels of ``raw_kernels/``.

``CupyBackend(spec)`` runs ``y += delta(x)`` on CuPy arrays or torch CUDA tensors, in place and
with no copy. Everything a call needs on the device is made when the backend is built: the
float32 ``v`` (the shrink's output, sized from the spec; it is zero between launches, since the
kernels zero what they used), the self-resetting counters, and the slice-offset tables of the
spec's targets. A call validates its arguments on
the host, then only launches: no allocation, no host sync, and a launch shape that depends on
the capture bucket ``spec.bucket_for(T)`` alone, so a CUDA graph captured once replays for every
later addressing that fits its bucket.

bfloat16 on the device: CuPy 14 has a ``bfloat16`` dtype (``ml_dtypes.bfloat16``), and torch
tensors of ``torch.bfloat16`` cross as they are. A ``uint16`` CuPy array is also taken as raw
bfloat16 bits, for code that holds bf16 that way. Kernels only ever see pointers.

One backend's workspace serves one stream at a time: steps that run concurrently on two
streams (a side lane beside the main chain) each need a backend of their own.
"""

from __future__ import annotations

import functools
import math

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..dtypes import normalize_dtype
from ..kernels import (ALIGNED_FLAGS, EARLY_READS, CHUNK_BM, CHUNK_DTYPES, CHUNK_NARROW_BM, CHUNK_RW, CHUNK_SHAPES, CHUNK_TALL_BM, CHUNK_WG_RW, CHUNK_WIDE_BM, chunk_threads, CUDA_TYPES, EXPAND_KERNELS, EXPAND_V_BN,
                       EXPAND_V_DTYPES, EXPAND_V_RANKS, EXPAND_V_TG, GATHER_A_NAME, GATHER_A_THREADS, GLU_DTYPES, GLU_KS, MMA_SHRINK_BM, MMA_TILES, RING_BM, RING_BN,
                       ONE_CLUSTER, ONE_RW, PAIR_M, PAIR_RT, STREAM_BN, chunk_name, expand_v_name,
                       glu_name, load_module, mma_family, mma_kernels, mma_name, one_name, pair_name)
from ..spec import B_RANK_BLOCK, LoraSpec
from .base import LayerWeights, check_compact, check_gather_pairs, member_offsets

#: Threads per block of every tensor-core kernel.
THREADS = 128
#: Largest number of output slices one target may have (``MAX_SLICES`` in lora_mma.cu).
MAX_SLICES = 8
#: Largest number of slots (slot 0 included) a launch takes: slot_indptr is staged in shared memory.
MAX_SLOTS = 4096
#: Ranks per shrink block; larger pool ranks add blocks that stop at once past an adapter's rank.
RANK_BLOCK = 64
#: H200 multiprocessors, the default when planning with no device at hand.
DEFAULT_SMS = 132

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

#: ||y - ref|| / ||ref|| the kernels stay under per dtype, ref = y + delta in float64: bf16 / fp16
#: carry the output's own rounding and v rounded to the operand type; fp32 runs its operands as
#: bfloat16 hi + lo pairs (three tensor-core products), about 16 mantissa bits.
TOLERANCE = {"bfloat16": 1e-2, "float16": 1.5e-3, "float32": 5e-5}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def rank_width(max_rank: int) -> int:
    """Floats per (position, slice) row of v: the pool's rank rounded up to 16."""
    return _ceil(max_rank, 16) * 16


#: The ranks a call of a pool of a larger maximum rank may be planned for (:func:`planned_rank`):
#: the rank widths lora_one and lora_chunk are built for below their widest. At most three plans
#: (so three packed launches, and graphs) a layer and bucket.
RANK_CLASSES = (16, 64)


def planned_rank(max_rank: int, rank_bound: int | None = None) -> int:
    """The rank a call is planned and launched for: the layout's ``max_rank``, or where
    ``rank_bound`` (no slot the call addresses has a larger rank) is lower, the smallest of
    :data:`RANK_CLASSES` holding it, if narrower than ``max_rank``'s width. A pool of maximum rank
    128 running rank-16 adapters then takes the plans (and kernels) of a rank-16 pool; A and B are
    still read with ``max_rank``'s strides."""
    if rank_bound is None or rank_bound >= max_rank:
        return max_rank
    if rank_bound < 0:
        raise ValueError(f"rank_bound {rank_bound} is negative")
    c = next((w for w in RANK_CLASSES if rank_bound <= w), None)
    return c if c is not None and c < rank_width(max_rank) else max_rank


# -- shared-memory sizes: these mirror Shrink / Expand in lora_mma.cu (a launch given less traps) --
def shrink_smem(dtype: str, bm: int) -> int:
    size = _ITEMSIZE[dtype]
    ldk = 128 // size + 8
    return 3 * (bm + RANK_BLOCK) * ldk * size


def expand_smem(dtype: str, bm: int, bn: int) -> int:
    size = _ITEMSIZE[dtype]
    stages = 2 if bm >= 64 else 3  # pipeline stages, and y tiles in the ring
    stage = bn * 24 * size + bm * 24 * 4  # B and v rows of 16 ranks, padded by 8
    return stages * (stage + bm * (bn + 16 // size) * size)


def fused_smem(dtype: str, bm: int, bn: int) -> int:
    return max(shrink_smem(dtype, bm), expand_smem(dtype, bm, bn))


def ring_smem(dtype: str) -> int:
    """``Ring<T>::SMEM`` of expand_ring.cuh: 3 stages of a y tile (64 x 64 columns, rows padded by
    8) and a B tile (64 columns x 64 ranks, fp32 32, padded by 16)."""
    size = _ITEMSIZE[dtype]
    rk = 32 if size == 4 else 64
    return 3 * (RING_BM * (RING_BN + 8) + RING_BN * (rk + 16)) * size


def built_width(widths, max_rank: int) -> int | None:
    """The smallest of a kernel's built rank ``widths`` that holds a pool of ``max_rank`` (None: none)."""
    return next((w for w in widths if rank_width(max_rank) <= w), None)


def chunk_geometry(max_rank: int) -> tuple[int, int, int, int]:
    """``(RW, KC, BN, RB)`` of ``Chunk<T, RW>`` (chunk.cuh) for a pool's maximum rank: the rank
    width it is built for, features a shrink stage, columns an expand stage, ranks an A or B tile
    (a rank block: a rank-128 pool's adapters above rank 64 take two)."""
    rw = built_width(CHUNK_RW, max_rank)
    if rw is None:
        raise ValueError(f"lora_chunk is built for ranks up to {CHUNK_RW[-1]}, not {max_rank}")
    return (rw, 128, 128, 16) if rw <= 16 else (rw, 64, 64, 64)


def chunk_smem(dtype: str, max_rank: int, bm: int, stages: int = 3) -> int:
    """``Chunk<T, RW, BM>::SMEM + SUMS`` of chunk.cuh: ``stages`` stages (3; other counts for dev
    sweeps), each the larger of a shrink stage (x rows of a chunk of ``bm`` positions and A rows of a
    rank block, KC features) and an expand stage (y tile of the chunk x BN, B tile of BN columns x a rank
    block), rows padded by 8 elements; then the shrink's sums of the warps that share an m-tile
    (all but the first of each: 4 floats a lane of each 8 ranks of a rank block)."""
    _, kc, bn, rb = chunk_geometry(max_rank)
    size = _ITEMSIZE[dtype]
    mt = bm // 16
    wk = chunk_threads(bm) // 32 // mt
    extra = mt * (wk - 1) * (rb // 8) * 4 * 32 * 4 if wk > 1 else 0
    return stages * max((bm + rb) * (kc + 8) * size, (bm * (bn + 8) + bn * (rb + 8)) * size) + extra


def chunk_bm(bucket: int, max_rank: int, in_features: int = 0, out_features: int = 0) -> int:
    """Positions a chunk of lora_chunk: ``CHUNK_NARROW_BM`` up to ``CHUNK_NARROW_TO`` positions
    (a decode step's chunks hold a few positions: one m-tile); at rank widths above 16
    ``CHUNK_TALL_BM`` from ``CHUNK_TALL_FROM`` positions and ``CHUNK_WIDE_BM`` from
    ``CHUNK_WIDE_FROM`` (a wide A and B read once for 128 or 64 rows), or at ``CHUNK_WG_RW`` (where
    chunks of 64 run on warpgroup MMAs) from ``CHUNK_DEEP_WIDE_FROM`` for a target whose
    ``in_features`` is at least ``CHUNK_DEEP`` times its ``out_features``; else ``CHUNK_BM``."""
    if bucket <= CHUNK_NARROW_TO:
        return CHUNK_NARROW_BM
    rw = rank_width(max_rank)
    if rw > 16:
        if bucket >= CHUNK_TALL_FROM:
            return CHUNK_TALL_BM
        deep = rw == CHUNK_WG_RW and out_features > 0 and in_features >= CHUNK_DEEP * out_features
        if bucket >= (CHUNK_DEEP_WIDE_FROM if deep else CHUNK_WIDE_FROM):
            return CHUNK_WIDE_BM
    return CHUNK_BM


#: Shared memory of one H100 / H200 multiprocessor, and what each resident block costs beside its own.
SM_SMEM = 228 * 1024
BLOCK_RESERVED_SMEM = 1024
#: lora_chunk's static shared memory at most (chunk.cuh, CHUNK_STATIC_SMEM), and in chunks of
#: ``CHUNK_TALL_BM`` (CHUNK_TALL_STATIC_SMEM: 128 token rows).
CHUNK_STATIC_SMEM = 768
CHUNK_TALL_STATIC_SMEM = 1024


def chunk_static_smem(bm: int) -> int:
    """lora_chunk's static shared memory at most, in chunks of ``bm`` positions."""
    return CHUNK_TALL_STATIC_SMEM if bm == CHUNK_TALL_BM else CHUNK_STATIC_SMEM


def chunk_blocks_per_sm(dtype: str, max_rank: int, bm: int, num_slots: int) -> int:
    """Blocks of lora_chunk one multiprocessor holds (at most what its launch bounds give its
    registers: ``CHUNK_BLOCKS_PER_SM``, ``CHUNK_TALL_BLOCKS_PER_SM`` in chunks of ``CHUNK_TALL_BM``):
    its stages, the slot table, its static shared memory and the reserve. Its grid is one wave of
    these: a part waits for the other parts of its chunk, so a block left for a second wave holds
    up the blocks waiting on it."""
    per_block = (chunk_smem(dtype, max_rank, bm) + 4 * (num_slots + 1) + chunk_static_smem(bm)
                 + BLOCK_RESERVED_SMEM)
    most = CHUNK_TALL_BLOCKS_PER_SM if bm == CHUNK_TALL_BM else CHUNK_BLOCKS_PER_SM
    return max(1, min(most, SM_SMEM // per_block))


def glu_smem(dtype: str) -> int:
    """``Glu<T>::SMEM`` of expand_glu.cuh: 3 stages of a g and a u tile (64 x 64 columns, swizzled)."""
    return 3 * 2 * RING_BM * RING_BN * _ITEMSIZE[dtype]


#: Blocks per multiprocessor ``lora_expand_glu`` is built for (``__launch_bounds__(128, 4)``, what its
#: shared memory allows): its grid is one wave of them.
GLU_BLOCKS_PER_SM = 4


#: Blocks per multiprocessor ``lora_expand_ring`` is built for (``__launch_bounds__(128, 3)``, fp32 2:
#: what its shared memory allows): a plan gives it at most one wave of them.
RING_BLOCKS_PER_SM = 3
RING_BLOCKS_PER_SM_FP32 = 2


#: Blocks per multiprocessor ``lora_expand_stream`` is built for (``__launch_bounds__(128, 4)``).
STREAM_BLOCKS_PER_SM = 4


@dataclass(frozen=True)
class LaunchPlan:
    """How one target's delta runs for one capture bucket: a function of shapes, never of counts.

    ``bm`` positions per tile (shared by shrink and expand), ``bn`` output columns per column
    block and ``cpb`` column blocks per expand block, ``splits`` blocks over ``in`` per shrink
    tile (``k_split`` features each). ``tiles`` counts the work units the launch is sized for:
    tiles of ``bm`` positions, or where ``chunks`` (a fused launch only, ``default_chunks``) chunks
    of one slot each (a slot's range cut into pieces of at most ``bm`` from its start: fewer than
    ``ceil(bucket / bm) + num_slots - 1``, at most one per position), so a step's slots run side
    by side rather than one after another in a tile; a chunked launch's kernels spread its grid
    over the chunks the step has (finer split-K and column groups when they are few). ``expand``
    names the expand kernel of an unfused launch (``EXPAND_KERNELS``): ``"expand"`` (tiles of y
    through shared memory) or ``"expand_stream"`` (each warp streams y through its registers, in
    passes of ``STREAM_BN`` columns); a fused launch runs ``lora_fused``.
    """

    bucket: int
    bm: int
    bn: int
    splits: int
    k_split: int
    fused: bool
    tiles: int
    rank_blocks: int
    col_blocks: int
    cpb: int
    n_slices: int
    expand: str = "expand"
    chunks: bool = False
    #: an unfused shrink whose slices share one rank block (``packed_slices``): one task per
    #: tile and split reads x once for every slice
    packed: bool = False
    #: the grid of a launch whose blocks take their work by ticket (``lora_chunk``: one wave), of
    #: ``lora_one`` (clusters of ``ONE_CLUSTER`` blocks), or of ``lora_pair_shrink`` (``tiles`` chunks x
    #: ``splits``; its expand's grid is ``col_blocks``)
    blocks: int = 0
    #: ``lora_chunk`` over several slices with columns (its ``SLICED`` instantiation); else one
    sliced: bool = False
    #: ``lora_pair``: the rank width its kernels are built for (``pair_width``: 16 or 64); else 0
    rank_width: int = 0

    @property
    def shrink_blocks(self) -> int:
        if self.expand in ("chunk", "one", "pair"):  # every block shrinks, then expands; or the pair's shrink
            return self.blocks
        return self.tiles * self.splits * (1 if self.packed else self.n_slices * self.rank_blocks)

    @property
    def expand_blocks(self) -> int:
        if self.expand in ("chunk", "one"):
            return self.blocks
        if self.expand == "pair":  # lora_pair_expand's grid: at least one block a chunk (tiles)
            return self.col_blocks
        return self.tiles * _ceil(self.col_blocks, self.cpb)

    def workspace_floats(self, rw: int) -> int:
        return self.bucket * self.n_slices * rw

    def counter_ints(self) -> int:
        return self.tiles if self.expand == "pair" else 2 + 2 * self.tiles  # the pair: a reader count a chunk


def default_tile(bucket: int) -> int:
    """Positions per tile for a bucket: small tiles while tokens are few, so blocks are many."""
    if bucket <= 256:
        return 16
    if bucket <= 512:
        return 32
    return 64


#: Blocks per multiprocessor a fused launch (on chunks or tiles) gives its shrink tasks, and its
#: expand tasks: about, and for a chunked launch when every chunk it is sized for has work (4
#: fit: 128 registers and 36 KB of shared memory a block).
FUSED_SHRINK_PER_SM = 4
FUSED_EXPAND_PER_SM = 4


def fused_units(bucket: int, bm: int, num_slots: int) -> int:
    """Work units of a fused launch: the most chunks of one slot (at most ``bm`` positions each) a
    step of ``bucket`` positions over ``num_slots`` slots (slot 0 included) can have."""
    return min(bucket, _ceil(bucket, bm) + num_slots - 1)


def default_chunks(bucket: int) -> bool:
    """Whether a fused launch's work units are chunks of one slot rather than tiles: from 2 to 32
    positions. Measured on an H200 (raw_kernels/NOTES.md, "Decode without runs in series"): at 16
    positions chunks take 8 adapters from 19.3 to 14.1 us (rank 64: 34.5 to 20.7); one position is
    one run either way and tiles were 1-2 us faster (the chunk count is a round of loads more), and
    at 64 positions tiles were as fast or faster on all but one row."""
    return 1 < bucket <= 32


def default_fused(bucket: int) -> bool:
    """Whether one fused launch beats two: it saves a launch, which pays while the work is small."""
    return bucket <= 64


#: Capture buckets whose unfused launch runs ``lora_expand_stream``: only where an H200 run measured
#: it correct and faster on every row of the bucket (lora_cupy/bench/results/kernels-h200.md): 256,
#: 7-23% faster. Elsewhere ``lora_expand`` was as fast or faster (up to 2x at 4096 tokens, rank 64):
#: raw_kernels/NOTES.md says why.
STREAM_EXPAND_BUCKETS = frozenset({256})
#: From this many positions an unfused launch runs ``lora_expand_ring``. On an H200 (NOTES.md,
#: "lora_expand_ring") it beat ``lora_expand`` on every core, shapes, mixed-rank, fp16 / fp32 and
#: pool-rank row of 1024 and 4096 tokens (rank 64 at 4096 tokens: 67-71 against 88-93 us the call)
#: and lost one: a zipf-skewed step of 4096 tokens over 32 adapters, 123 against 99 us.
RING_EXPAND_FROM = 1024


#: Blocks per multiprocessor ``lora_chunk`` is built for (``__launch_bounds__(128, 4)``; in chunks
#: of ``CHUNK_TALL_BM`` ``(256, 2)``: ``Chunk::BLOCKS_PER_SM``), and the most parts one chunk is cut into.
CHUNK_BLOCKS_PER_SM = 4
CHUNK_TALL_BLOCKS_PER_SM = 2
CHUNK_MAX_PARTS = 32
#: At the decode buckets (chunks of ``CHUNK_NARROW_BM``) and rank width 16 a chunk is cut into as many
#: parts as it has column blocks, at most this many (and at most what fills the grid), where that is
#: more than ``CHUNK_MAX_PARTS``: a wide output's column blocks then run side by side rather than in
#: series in 32 parts. On an H200 (raw_kernels/NOTES.md, "lora_chunk at the decode buckets"), gate_up
#: (4096 -> 2 x 14336, 224 column blocks) at 64 positions with 8 adapters took 17.9 us in 66 parts
#: against 21.9 in 32, q/k/v (48) 14.3 against 15.6; at rank 64 more parts lost (T=64 r64 s8 15.4
#: against 14.2, T=256 r64 17.2 against 14.8), and down (14336 -> 4096, 32 column blocks) cut into
#: 64 or 112 parts by its stages of `in` lost 0.7-0.8 us.
CHUNK_COL_PARTS = 128
#: Up to this many positions at rank widths above 16 a chunk is cut into as many parts as it has
#: stages of `in` or column blocks, at most ``CHUNK_FEW_PARTS``; and at one position such a call of
#: one slice runs lora_chunk by ticket (``default_chunk``), where lora_one's clusters would each
#: read too much of A (``one_max_share``). On an H200 (raw_kernels/NOTES.md, "lora_chunk at the
#: decode buckets"; `dev/chunk_sweep.py --decode`) at one position and rank 64: 4096 -> 4096 10.4-10.9
#: us in 64 parts against the fused kernel's 11.8, 14336 -> 4096 12.0 in 128 (13.5; 12.5 in 224),
#: 4096 -> 14336 11.7 in 128 (12.5; 10.3 in 224); at 16 positions with one adapter 11.1 against 11.7
#: in 32 parts; at 64 positions within 0.2 us.
CHUNK_FEW_TO = 16
CHUNK_FEW_PARTS = 128
#: From this many positions a call of one slice with columns that ``chunk_fits`` runs ``lora_chunk``
#: by default (NOTES.md, "lora_chunk"; results/kernels-h200.md, the runs of f557283 and b34b9e4). At
#: f557283 on an H200 it beat the fused launch on the one-slice rows of 16 and 64 positions (T=16 r64
#: with 8 adapters 14.8 against 20.5 us; T=64 r16 with 32: 15.0 against 22.5), one row within 0.1 us,
#: and lost at one position (9.9 against 9.5); it beat the unfused pair on every one-slice row of 256
#: to 4096 positions at rank width 16 (T=4096 r16: 43.7-45.5 against 51.0-52.0 us the call) and of 256
#: to 1024 at rank widths 64 and 128. At b34b9e4 it lost four rows of 256 positions to the pair with
#: expand_stream by 0.1-1.8 us (r64 one adapter 19.0 against 17.9) and won those with 32 adapters
#: (16.9 against 19.4-22.3; r64 27.1 against 34.1-36.0); at 4096 positions of rank 64 chunks of 64
#: beat the pair (59.7-63.7 against 61.3-64.9).
CHUNK_FROM = 2
#: From this many positions a target of several slices with columns runs ``lora_chunk`` by default,
#: at rank width 16 only. On an H200 (results/kernels-h200.md, the run of b34b9e4) the q/k/v row of 64
#: positions with 8 adapters took 17.4 us (fused kernel 17.5 on tiles, 19.8 on chunks; the pair
#: 17.4), and at 1024 positions 31.6 (the pair 33.0-43.7); at rank 64 it lost (26.2 against the
#: pair's 25.1 and the fused kernel's 25.9 at 64 positions, 47.4 against the ring pair's 45.2 at
#: 1024). In the layer (rank 16) with 32 adapters at 64 positions q/k/v and gate/up took 24.2 and 44.8
#: us alone (31.0 and 46.1 with the fused kernel in the run of f557283), with 8 adapters 16.9 and
#: 25.5 (16.6 and 23.1). Fewer positions keep the fused kernel.
CHUNK_SLICES_FROM = 64
#: The most ``slice_alignment`` counts: BN of every rank width of lora_chunk divides it.
CHUNK_SLICE_ALIGN = 128
#: From this many positions lora_chunk cuts a step into chunks of ``CHUNK_WIDE_BM`` at rank widths
#: above 16 (``chunk_bm``), and from ``CHUNK_TALL_FROM`` into chunks of ``CHUNK_TALL_BM`` (blocks of 8
#: warps, 2 a multiprocessor, each reading its slot's A and B once for 128 rows: at 4096 positions of
#: rank 64 the rereads of chunks of 64 cost about 8 us, raw_kernels/NOTES.md "what A's and B's reads
#: cost"). On an H200 (2026-12-06, `dev/chunk_sweep.py --heights`, the kernels of 0f3b0de) with 1 / 8 /
#: 32 adapters at rank 64, chunks of 32 / 64 / 128 took: at 1024 positions 25.4 / 27.3 / 25.6, 26.4 /
#: 28.8 / 27.4 and 30.9 / 34.8 / 44.7 us (a chunk of 64's part there runs 2 stages of `in`, one of 32
#: 4); at 2048 38.1 / 36.6 / 34.9, 38.0 / 38.0 / 36.9 and 41.6 / 41.8 / 47.4 (64 positions a slot:
#: chunks of 128 half empty); at 4096 64.0 / 56.5 / 53.1, 61.8 / 57.1 / 54.7 and 65.2 / 60.6 / 57.9,
#: and on the wide shapes with 8 (4096 -> 14336, 14336 -> 4096) 137.0 / 119.0 / 114.8 and
#: 111.7 / 94.3 / 87.2. (At b34b9e4 chunks of 64 had won at 1024: 27.3 against 29.0 with one adapter.)
#: Since chunks of 64 and 128 run on warpgroup MMAs (sm_90a; on an H200, 2026-12-06, the same sweep):
#: at 1024 24.9 / 25.9 / 24.1, 26.2 / 27.7 / 25.5 and 30.5 / 33.0 / 38.8; at 2048 39.8 / 34.9 / 31.8,
#: 40.5 / 37.0 / 33.4 and 45.3 / 41.4 / 43.6; at 4096 68.6 / 63.5 / 49.8, 70.4 / 60.3 / 50.1 and
#: 72.9 / 62.6 / 54.8. Chunks of 128 from 2048 would gain 3.1-3.6 us with 1 and 8 adapters and lose 2.2
#: with 32 (64 positions a slot); the plan sees neither, so 2048 keeps chunks of 64.
CHUNK_WIDE_FROM = 2048
CHUNK_TALL_FROM = 4096
#: A deep target (``in_features`` at least ``CHUNK_DEEP`` times ``out_features``: Llama's down, 14336 ->
#: 4096) takes chunks of ``CHUNK_WIDE_BM`` from ``CHUNK_DEEP_WIDE_FROM`` positions at rank width
#: ``CHUNK_WG_RW`` (on warpgroup MMAs there; at 128 on mma.sync, not timed on a deep target): its shrink's
#: bytes are x's and A's, and chunks of 32 read A again for every 32 rows and x twice (the rank split),
#: where chunks of 64 read A half as often and x once. On an H100 (2026-12-07,
#: `dev/chunk_sweep.py --heights`, the kernels of 72c046b, flushed us) 14336 -> 4096 at 1024 positions,
#: rank 64, 8 adapters: chunks of 32 / 64 / 128 46.4 / 40.8 / 38.1 (bmm 38.6 in that day's bench run),
#: while 4096 -> 14336 takes 42.5 / 49.8 / 45.6 (chunks of 32 stay).
CHUNK_DEEP = 2
CHUNK_DEEP_WIDE_FROM = 1024
#: Up to this many positions lora_chunk cuts a step into chunks of ``CHUNK_NARROW_BM`` (``chunk_bm``):
#: a decode step's chunk of one slot holds a few positions (2 each with 32 adapters at 64), and a
#: chunk of 32 computed and staged a second m-tile of nothing.
CHUNK_NARROW_TO = 64


#: The capture bucket ``lora_one`` serves: one position (a decode step of one sequence).
ONE_BUCKET = 1
#: Columns a ``lora_one`` block writes, about (a thread a column), and the most clusters of
#: ``ONE_CLUSTER`` blocks a launch takes: each cluster sums all of v again, so more clusters read A
#: more often (from L2) for fewer columns a block.
ONE_COLS = 64
ONE_MAX_CLUSTERS = 16
#: The most bytes of A a ``lora_one`` block sums by default (its eighth of ``in`` for every slice at
#: the pool's rank width), fp32 (``ONE_MAX_SHARE``, the shrink on CUDA cores) and 16-bit types
#: (``ONE_MAX_SHARE_MMA``, on tensor cores): a cluster's 8 blocks read all of the slot's A, where the
#: fused kernel and lora_chunk spread it over every multiprocessor. On an H200 (raw_kernels/NOTES.md,
#: "lora_one" and "lora_one on tensor cores"), on CUDA cores 16-56 KB a block ran 6.1-10.3 us flushed
#: against the fused kernel's 9.5-10.3 (the Llama-8B layer's four rank-16 targets), 64 KB and more
#: 15.1-35.7 against 11.6-13.6 (rank 64); on tensor cores 64 KB (rank 64, `in` = 4096, one slice)
#: 9.7 / 10.3 us flushed against lora_chunk's 10.7 / 11.7, 192-224 KB 15.8-16.4 against 12.1-13.7.
ONE_MAX_SHARE = 56 * 1024
ONE_MAX_SHARE_MMA = 64 * 1024


def one_max_share(dtype: str) -> int:
    """``ONE_MAX_SHARE_MMA`` for the 16-bit types (lora_one's shrink on tensor cores), else
    ``ONE_MAX_SHARE``."""
    return ONE_MAX_SHARE if _ITEMSIZE[normalize_dtype(dtype)] == 4 else ONE_MAX_SHARE_MMA


def one_pieces(in_features: int, dtype: str) -> int:
    """16-byte pieces of ``in`` one ``lora_one`` block of a cluster sums (one.cuh, one_shrink)."""
    return _ceil(_ceil(in_features, 16 // _ITEMSIZE[normalize_dtype(dtype)]), ONE_CLUSTER)


#: The most bytes of dynamic shared memory a ``lora_one`` launch takes for A's share staged before the
#: wait for the grid before (one.cuh, one_stage_a; 16-bit types); a larger share is read from L2 as
#: before (the launch gets none, and the kernel sees it has none).
ONE_STAGE_MAX = 96 * 1024


def one_stage_smem(in_features: int, n_slices: int, rank_width: int, dtype: str) -> int:
    """Dynamic shared memory of a ``lora_one`` launch: its block's share of A, every slice at
    ``rank_width`` rows, each row its pieces rounded up to 128 bytes and 64 more (one.cuh,
    one_stage_ld); 0 for fp32 (the shrink on CUDA cores) or past ``ONE_STAGE_MAX``."""
    if _ITEMSIZE[normalize_dtype(dtype)] == 4:
        return 0
    ld = _ceil(one_pieces(in_features, dtype) * 16, 128) * 128 + 64
    size = n_slices * rank_width * ld
    return size if size <= ONE_STAGE_MAX else 0


def one_share(in_features: int, n_slices: int, max_rank: int, dtype: str) -> int:
    """Bytes of A one ``lora_one`` block sums at most: its pieces of ``in``, every slice at the
    pool's rank width."""
    return n_slices * rank_width(max_rank) * one_pieces(in_features, dtype) * 16


def default_one(bucket: int, clusters: bool, share: int, dtype: str) -> bool:
    """Whether a call of ``bucket`` positions runs ``lora_one`` by default: the bucket of one position,
    on a device with thread-block clusters (compute capability 9.0 or above), where a block's share of
    A (``one_share``) is at most ``one_max_share(dtype)``. Its chunks of 8 positions for the buckets
    above one (the default of the 16-bit types at rank width 16 until ``lora_pair`` took their place:
    raw_kernels/NOTES.md, "lora_one in chunks on tensor cores", "lora_pair") were deleted."""
    return clusters and bucket == ONE_BUCKET and share <= one_max_share(dtype)


#: The capture buckets ``lora_pair`` (pair.cuh: a shrink and an expand launch that overlap the call
#: before under programmatic dependent launch) serves by default, in the 16-bit types at rank width
#: 16, and at 64 for one or two slices: on an H200 (raw_kernels/NOTES.md, "lora_pair") the Llama-8B
#: layer's four calls back to back ran 16 x 8 / 64 x 8 / 64 x 32 / 256 x 32 (positions x adapters) in
#: 24.8 / 25.7 / 55.6 / 65.8 us warm where lora_one in chunks, the default before, took 31.3 / 35.5 /
#: 56.9 / 69.6; at rank width 64 it took the decode rows from lora_chunk ("lora_pair at rank width 64").
#: The 256 bucket on lora_chunk instead (``PAIR_TO = 128``) ran 256 x 32 in 97.2 against 67.1 us warm on an
#: H100 (NOTES.md, "The prefetches of B on an H100").
PAIR_FROM = 2
PAIR_TO = 256
#: At rank width 64 the pair is the default up to ``PAIR_WIDE_RANK_TO`` positions where one round of its
#: shrink's k-blocks covers ``in`` (its splits not capped): on an H200 (NOTES.md, "lora_pair at rank
#: width 64") T=16 / 64 at 4096->4096 ran 9.3 / 10.7 us against lora_chunk's 11.3 / 12.2, while T=256
#: (17.8 against 15.5) and in = 14336 at T=64 (24.9 against 18.1) kept lora_chunk ahead.
PAIR_WIDE_RANK_TO = 64
#: Warps of a ``lora_pair_shrink`` block, the 32-wide k-blocks each holds by its row tiles of 16 ranks
#: (``PairKB``, pair.cuh: slices x rank width / 16), and the most splits of ``in`` a chunk (each adds its
#: sums into the chunk's v).
PAIR_SW = 4
PAIR_KB = {1: 4, 2: 3, 3: 2, 4: 2, 8: 1}
PAIR_MAX_SPLITS = 32
#: Warps of a ``lora_pair_expand`` block, and its blocks a multiprocessor: ``PAIR_EXPAND_PER_SM``,
#: ``PAIR_EXPAND_PER_SM_WIDE`` for outputs of ``PAIR_WIDE`` columns or more (on an H200 within 0.4 us of
#: the best of six settings on every layer row; 2 / 2 ran 64 x 32 6 us slower, 3 / 3 64 x 8 4 us slower:
#: NOTES.md, "lora_pair").
PAIR_EW = 8
PAIR_EXPAND_PER_SM = 2
PAIR_EXPAND_PER_SM_WIDE = 3
PAIR_WIDE = 8192


def pair_width(max_rank: int) -> int | None:
    """The rank width of the ``lora_pair`` kernels a call planned for ``max_rank`` runs (a key of
    ``PAIR_RT``; None: wider than the pair is built for)."""
    return built_width(tuple(PAIR_RT), max_rank)


def pair_rt(n_slices: int, rw: int = 16) -> int:
    """The slices of the ``lora_pair_shrink`` instantiation a target of ``n_slices`` runs at rank width
    ``rw``."""
    return next(rt for rt in PAIR_RT[rw] if rt >= n_slices)


def pair_kb(n_slices: int, rw: int = 16) -> int:
    """32-wide k-blocks a warp of the shrink holds (``PairKB`` of its row tiles of 16 ranks)."""
    return PAIR_KB[pair_rt(n_slices, rw) * rw // 16]


def pair_one_round(in_features: int, n_slices: int, rw: int = 16) -> bool:
    """Whether one round of each shrink warp's k-blocks covers ``in`` (the splits not capped: the
    kernel's own test, ``splits * PAIR_SW * KB >= k-blocks``), so every split holds its A from before
    the wait."""
    return pair_splits(in_features, n_slices, rw) * PAIR_SW * pair_kb(n_slices, rw) >= _ceil(in_features, 32)


def pair_chunks(bucket: int, num_slots: int) -> int:
    """The most chunks of at most ``PAIR_M`` positions of one slot a step of ``bucket`` positions over
    slots 1..num_slots-1 can have: sum of ceil(count / PAIR_M) <= (bucket + (PAIR_M - 1) * slots) / PAIR_M."""
    return max(1, min(bucket, (bucket + (PAIR_M - 1) * min(num_slots - 1, bucket)) // PAIR_M))


def pair_splits(in_features: int, n_slices: int, rw: int = 16) -> int:
    """Splits of ``in`` a chunk's shrink takes: one round of the block's k-blocks each (A held in
    registers from before the wait), at most ``PAIR_MAX_SPLITS`` (past that a split's warps walk its
    k-blocks in turn)."""
    per = PAIR_SW * pair_kb(n_slices, rw)
    return max(1, min(PAIR_MAX_SPLITS, _ceil(_ceil(in_features, 32), per)))


def pair_floats(bucket: int, n_slices: int, num_slots: int, rw: int = 16) -> int:
    """Floats of the v a ``lora_pair`` call of rank width ``rw`` adds into (its workspace, zero before and
    after): chunks x ``PAIR_M`` x n x rw."""
    return pair_chunks(bucket, num_slots) * PAIR_M * n_slices * rw


def pair_fits(bucket: int, dtype: str, max_rank: int, n_slices: int) -> str | None:
    """Why ``lora_pair`` cannot serve a call (None: it can): the 16-bit types, rank width 16 (up to
    ``PAIR_RT[16][-1]`` slices) or 64 (up to ``PAIR_RT[64][-1]``), up to ``PAIR_TO`` positions."""
    if _ITEMSIZE[normalize_dtype(dtype)] != 2:
        return f"lora_pair runs on tensor cores in float16 and bfloat16, not {normalize_dtype(dtype)}"
    rw = pair_width(max_rank)
    if rw is None:
        return f"lora_pair is built for ranks up to {max(PAIR_RT)}, not {max_rank}"
    if bucket > PAIR_TO:
        return f"lora_pair serves capture buckets of up to {PAIR_TO} positions, not {bucket}"
    if n_slices > PAIR_RT[rw][-1]:
        return f"lora_pair is built for up to {PAIR_RT[rw][-1]} slices at rank width {rw}, not {n_slices}"
    return None


def default_pair(bucket: int, dtype: str, max_rank: int, n_slices: int, in_features: int) -> bool:
    """Whether a call of ``bucket`` positions runs ``lora_pair`` by default: ``PAIR_FROM`` to
    ``PAIR_TO`` positions, 16-bit types, rank width 16; or rank width 64 for up to ``PAIR_RT[64][-1]``
    slices, up to ``PAIR_WIDE_RANK_TO`` positions, ``in`` covered by one round of uncapped splits."""
    if not (PAIR_FROM <= bucket <= PAIR_TO and pair_fits(bucket, dtype, max_rank, n_slices) is None):
        return False
    if pair_width(max_rank) == 16:
        return True
    return bucket <= PAIR_WIDE_RANK_TO and pair_one_round(in_features, n_slices, 64)


def pair_workspace(spec: LoraSpec) -> int:
    """Floats the v of ``lora_pair`` takes for every target of a spec, at its largest bucket
    the pair serves and the widest rank it may be planned for (0: a dtype it does not serve)."""
    if normalize_dtype(spec.dtype) not in CHUNK_DTYPES or spec.max_tokens < 1:
        return 0
    bucket = min(spec.max_tokens, PAIR_TO)
    widths = [rw for rw in PAIR_RT if rw <= (pair_width(spec.max_rank) or max(PAIR_RT))]
    return max([pair_floats(bucket, t.num_slices, spec.num_slots, rw) for t in spec.targets
                for rw in widths if t.num_slices <= PAIR_RT[rw][-1]] or [0])


def one_fits(bucket: int, max_rank: int) -> str | None:
    """Why ``lora_one`` cannot serve a call (None: it can): the bucket of one position, ranks up to 128."""
    if bucket != ONE_BUCKET:
        return f"lora_one serves the capture bucket of {ONE_BUCKET} position, not {bucket}"
    if built_width(ONE_RW, max_rank) is None:
        return f"lora_one is built for ranks up to {ONE_RW[-1]}, not {max_rank}"
    return None


def one_clusters(out_features: int) -> int:
    """Clusters of a ``lora_one`` launch: about ``ONE_COLS`` columns a block (the clusters rounded up),
    at most ``ONE_MAX_CLUSTERS``."""
    return max(1, min(ONE_MAX_CLUSTERS, _ceil(out_features, ONE_CLUSTER * ONE_COLS)))


def several_slices(n_slices: int, live_slices: int | None) -> bool:
    """Whether a call serves several slices with columns (``live_slices`` unknown counts as several):
    lora_chunk's ``SLICED`` instantiation, its own default and its own condition in ``chunk_fits``."""
    return n_slices > 1 and live_slices != 1


def default_chunk(bucket: int, max_rank: int, n_slices: int = 1, live_slices: int | None = None) -> bool:
    """Whether a call of ``bucket`` positions whose target ``chunk_fits`` runs ``lora_chunk`` by
    default: from ``CHUNK_FROM`` positions with one slice with columns (from one at rank widths
    above 16, where lora_one is not the default: ``CHUNK_FEW_PARTS``), from ``CHUNK_SLICES_FROM``
    with several at rank width 16 (above it the fused kernel and the pair measured faster)."""
    if several_slices(n_slices, live_slices):
        return bucket >= CHUNK_SLICES_FROM and rank_width(max_rank) <= 16
    return bucket >= CHUNK_FROM or rank_width(max_rank) > 16  # one position: above rank width 16 only


def chunk_fits(dtype: str, max_rank: int, n_slices: int, live_slices: int | None, slice_align: int = 0) -> str | None:
    """Why ``lora_chunk`` cannot serve a target (None: it can): 16-bit types, a pool of rank 128 or
    less, and one slice with columns (a one-slice target, or one member of a fused target served
    into its own output) or several whose column boundaries fall on its column blocks
    (``slice_align``, :func:`slice_alignment`, a multiple of ``chunk_geometry``'s BN)."""
    if normalize_dtype(dtype) not in CHUNK_DTYPES:
        return f"lora_chunk serves {' and '.join(CHUNK_DTYPES)}, not {dtype}"
    if rank_width(max_rank) > CHUNK_RW[-1]:
        return f"lora_chunk is built for ranks up to {CHUNK_RW[-1]}, not {max_rank}"
    bn = chunk_geometry(max_rank)[2]
    if several_slices(n_slices, live_slices) and (slice_align <= 0 or slice_align % bn):
        return (f"lora_chunk serves several slices whose columns start at multiples of {bn}, not of "
                f"{slice_align or 'an unknown step'}")
    return None


def slice_alignment(out_offsets) -> int:
    """The largest power of two up to ``CHUNK_SLICE_ALIGN`` that every column offset of a target's
    slices is a multiple of (what ``chunk_fits`` asks of several slices)."""
    return math.gcd(CHUNK_SLICE_ALIGN, *(int(o) for o in out_offsets))


def default_expand(bucket: int) -> str:
    """The expand kernel of an unfused launch: ``expand_stream`` in ``STREAM_EXPAND_BUCKETS``,
    ``expand_ring`` from ``RING_EXPAND_FROM`` positions, else ``expand``."""
    if bucket in STREAM_EXPAND_BUCKETS:
        return "expand_stream"
    return "expand_ring" if bucket >= RING_EXPAND_FROM else "expand"


@functools.lru_cache(maxsize=4096)
def plan_launch(bucket: int, in_features: int, out_features: int, n_slices: int, max_rank: int,
                dtype: str, *, num_slots: int, num_sms: int = DEFAULT_SMS, tile: int | None = None,
                fused: bool | None = None, expand: str | None = None,
                chunks: bool | None = None, live_slices: int | None = None, whole: bool = True,
                slice_align: int = 0, clusters: bool = True) -> LaunchPlan:
    """The launch plan of one target shape at one capture bucket, for weights of ``num_slots``
    slots (slot 0 included; a fused launch's chunks depend on it). ``slice_align``: what every
    column offset of the target's slices is a multiple of (:func:`slice_alignment`; 0: unknown).
    ``clusters``: the device has thread-block clusters (compute capability 9.0 or above), which
    ``lora_one`` needs.

    ``live_slices``: how many of the ``n_slices`` have columns (one slice of a fused target served
    into its own output: the others have none, and their shrink tasks stop at once); an unfused
    launch splits ``in`` for those alone, so the member's shrink fills the device as a one-slice
    target's does. None: every slice.

    From ``PAIR_FROM`` to ``PAIR_TO`` positions in the 16-bit types a call runs ``lora_pair`` (a shrink
    launch and an expand launch, see pair.cuh) where ``default_pair`` says so (rank width 16; 64 for one
    or two slices up to ``PAIR_WIDE_RANK_TO`` positions), unless a tile, fusing, chunks or another
    expand are forced, or ``whole`` is False; ``expand="pair"`` forces it wherever ``pair_fits``.
    The bucket of one position runs ``lora_one`` (``default_one``: one launch of clusters, see
    one.cuh) where a block's share of A is small enough, unless a tile, fusing, chunks or another
    expand are forced, or ``whole`` is False; ``expand="one"`` forces it at any share.
    A call whose target ``chunk_fits`` runs ``lora_chunk`` (shrink and expand in one launch,
    ``expand="chunk"``) where ``default_chunk`` says so, unless a tile, fusing or chunks are
    forced or ``whole`` is False (a plan for the delta in two launches of its own). Any other call
    runs the fused kernel (``default_fused``) or ``lora_shrink`` and the bucket's expand
    (``default_expand``).

    A chunked launch (fused only: ``chunks``, by default ``default_chunks``) sizes its grid at
    about ``FUSED_SHRINK_PER_SM`` shrink and ``FUSED_EXPAND_PER_SM`` expand blocks per
    multiprocessor, which its kernel spreads over the chunks a step has.

    Split-K aims at about four shrink blocks per multiprocessor (each split adds its partial v
    with 16-byte reductions at L2), never below one stage of ``in`` per block, counting one rank
    block per tile (so a rank-128 pool splits ``in`` as a rank-16 pool does); expand blocks take
    several column blocks each once there are more than about four per multiprocessor, so each
    block's fixed start is spread over more of y. ``expand_stream`` takes as many column blocks
    per block (a multiple of the warps sharing an
    m-tile, ``64 // bm``) as fit every block in one wave of ``STREAM_BLOCKS_PER_SM`` blocks per
    multiprocessor, so each warp streams a long run of y. ``expand_ring`` runs tiles of
    ``RING_BM`` positions (its default tile; a forced other tile runs ``expand`` where the ring
    is only the bucket's default) and one wave of ``RING_BLOCKS_PER_SM`` blocks per
    multiprocessor: each block's start (tile, ranks, first stages) is a few microseconds, and four
    waves measured 11-21% slower on uniform steps of 1024-4096 tokens.
    """
    dtype = normalize_dtype(dtype)
    unforced = fused is None and expand is None and chunks is None and whole and tile is None
    if expand == "pair" or (unforced and default_pair(bucket, dtype, max_rank, n_slices, in_features)):
        why = (pair_fits(bucket, dtype, max_rank, n_slices)
               or (None if whole else "lora_pair runs the whole delta, not in halves")
               or (None if not (fused or chunks or tile) else "lora_pair takes no tile, fusing or chunks"))
        if why:
            raise ValueError(why)
        rw = pair_width(max_rank)
        bound, splits = pair_chunks(bucket, num_slots), pair_splits(in_features, n_slices, rw)
        per_sm = PAIR_EXPAND_PER_SM_WIDE if out_features >= PAIR_WIDE else PAIR_EXPAND_PER_SM
        return LaunchPlan(bucket=bucket, bm=PAIR_M, bn=16, splits=splits,
                          k_split=32 * PAIR_SW * pair_kb(n_slices, rw), fused=False, tiles=bound,
                          rank_blocks=1, col_blocks=max(bound, per_sm * num_sms), cpb=1, n_slices=n_slices,
                          expand="pair", blocks=bound * splits, rank_width=rw)
    share = one_share(in_features, n_slices, max_rank, dtype)
    if expand == "one" or (unforced and default_one(bucket, clusters, share, dtype)
                           and one_fits(bucket, max_rank) is None):
        why = (one_fits(bucket, max_rank) or (None if clusters else "lora_one needs thread-block clusters (sm_90)")
               or (None if whole else "lora_one runs the whole delta in one launch, not in halves")
               or (None if not (fused or chunks or tile) else "lora_one takes no tile, fusing or chunks"))
        if why:
            raise ValueError(why)
        clus = one_clusters(out_features)
        return LaunchPlan(bucket=bucket, bm=1, bn=_ceil(out_features, clus * ONE_CLUSTER), splits=ONE_CLUSTER,
                          k_split=one_pieces(in_features, dtype) * (16 // _ITEMSIZE[dtype]), fused=False, tiles=1,
                          rank_blocks=1, col_blocks=clus * ONE_CLUSTER, cpb=1, n_slices=n_slices, expand="one",
                          blocks=clus * ONE_CLUSTER)
    if (unforced and default_chunk(bucket, max_rank, n_slices, live_slices)
            and chunk_fits(dtype, max_rank, n_slices, live_slices, slice_align) is None):
        fused, expand = False, "chunk"
    fused = default_fused(bucket) if fused is None else bool(fused)
    if fused:
        expand = "expand"
    elif expand is None:  # the bucket's default, unless a tile is forced that it does not take
        expand = default_expand(bucket)
        if expand == "expand_ring" and tile is not None and int(tile) != RING_BM:
            expand = "expand"
    expand = str(expand)
    if expand not in EXPAND_KERNELS:
        raise ValueError(f"expand {expand!r} is not one of {EXPAND_KERNELS}")
    if expand == "chunk":
        bm = chunk_bm(bucket, max_rank, in_features, out_features)
        if (tile is not None and int(tile) != bm) or chunks:
            raise ValueError(f"lora_chunk takes chunks of {bm} positions of one slot here: no tile {tile} or "
                             f"fused chunks")
        return _plan_chunk(bucket, in_features, out_features, n_slices, max_rank, dtype, num_slots=num_slots,
                           num_sms=num_sms, live_slices=live_slices, whole=whole, slice_align=slice_align)
    bm = (RING_BM if expand == "expand_ring" else default_tile(bucket)) if tile is None else int(tile)
    bn = dict(MMA_TILES).get(bm)
    if bn is None:
        raise ValueError(f"tile {bm} is not one of {[t for t, _ in MMA_TILES]}")
    if expand == "expand_ring" and bm != RING_BM:
        raise ValueError(f"expand_ring takes tiles of {RING_BM} positions, not {bm}")
    if not fused:
        chunks = False  # lora_shrink and lora_expand run tiles only
    elif chunks is None:
        chunks = default_chunks(bucket)
    tiles = fused_units(bucket, bm, num_slots) if chunks else _ceil(bucket, bm)
    rank_blocks = _ceil(max_rank, RANK_BLOCK)
    kc = 128 // _ITEMSIZE[dtype]
    nchunks = max(1, _ceil(in_features, kc))
    live = n_slices if fused or live_slices is None else max(1, min(int(live_slices), n_slices))
    packed = packed_slices(n_slices, max_rank, fused)
    # rank blocks past an adapter's rank stop at once: they do not count; packed slices are one task
    base = tiles * (1 if packed else live)
    want = max(1, min(nchunks, _ceil((FUSED_SHRINK_PER_SM if fused else 4) * num_sms, base)))
    per = _ceil(nchunks, want)
    splits = _ceil(nchunks, per)
    if chunks:
        col_blocks = _ceil(out_features, bn)
        cpb = _ceil(col_blocks, max(1, (FUSED_EXPAND_PER_SM * num_sms) // tiles))
    elif expand == "expand_ring":
        bn = RING_BN
        col_blocks = _ceil(out_features, bn)
        per_sm = RING_BLOCKS_PER_SM if _ITEMSIZE[dtype] < 4 else RING_BLOCKS_PER_SM_FP32
        groups = max(1, (per_sm * num_sms) // tiles)  # column groups per tile, at most
        cpb = _ceil(col_blocks, groups)
    elif expand == "expand_stream":
        bn = STREAM_BN
        col_blocks = _ceil(out_features, bn)
        share = 64 // bm  # warps that take turns on one m-tile's column blocks
        groups = max(1, (STREAM_BLOCKS_PER_SM * num_sms) // tiles)  # column groups per tile, at most
        cpb = min(col_blocks, _ceil(_ceil(col_blocks, groups), share) * share)
    else:
        col_blocks = _ceil(out_features, bn)
        per_sm = FUSED_EXPAND_PER_SM if fused else 4
        cpb = max(1, min(col_blocks, (tiles * col_blocks) // (per_sm * num_sms)))
    return LaunchPlan(bucket=bucket, bm=bm, bn=bn, splits=splits, k_split=per * kc, fused=fused,
                      tiles=tiles, rank_blocks=rank_blocks, col_blocks=col_blocks, cpb=cpb,
                      n_slices=n_slices, expand=expand, chunks=chunks, packed=packed)


def _plan_chunk(bucket: int, in_features: int, out_features: int, n_slices: int, max_rank: int, dtype: str, *,
                num_slots: int, num_sms: int, live_slices: int | None, whole: bool, slice_align: int) -> LaunchPlan:
    """``lora_chunk``'s plan: ``bm`` is the height its kernel cuts a step's slots into
    (``chunk_bm``); ``tiles`` the most chunks of ``CHUNK_NARROW_BM`` positions of one slot a step
    can have, which its counters are sized for (never fewer than chunks of ``bm``); the grid
    (``blocks``) one wave of ``chunk_blocks_per_sm`` blocks a multiprocessor (fewer where the
    bucket's chunks and parts cannot fill it), whose blocks take (chunk, part) items by block
    (by ticket past one wave).
    The kernel cuts each of the step's chunks into as many parts (a share of ``in`` and of the
    column blocks) as fill the grid, at most ``splits``: ``CHUNK_MAX_PARTS``, or the stages of
    ``in`` or column blocks there are if fewer; at the decode buckets and rank width 16 the column
    blocks up to ``CHUNK_COL_PARTS`` where they are more, up to ``CHUNK_FEW_TO`` positions above rank
    width 16 the stages or column blocks up to ``CHUNK_FEW_PARTS``. ``k_split`` and ``cpb`` are what a
    step filling its bucket gets. ``sliced``: the instantiation for several slices with columns
    (``live_slices`` unknown counts as several), else the one with the slice loops compiled out."""
    why = chunk_fits(dtype, max_rank, n_slices, live_slices, slice_align) or (
        None if whole else "lora_chunk runs the whole delta in one launch, not in halves")
    if why:
        raise ValueError(why)
    rw, kc, bn, _ = chunk_geometry(max_rank)
    bm, tiles = chunk_bm(bucket, max_rank, in_features, out_features), fused_units(bucket, CHUNK_NARROW_BM, num_slots)
    nk, col_blocks = max(1, _ceil(in_features, kc)), _ceil(out_features, bn)
    sliced = several_slices(n_slices, live_slices)
    most = max(1, min(CHUNK_MAX_PARTS, max(nk, col_blocks)))
    if bm == CHUNK_NARROW_BM and rw <= 16:  # a part a column block, up to CHUNK_COL_PARTS
        most = max(most, min(CHUNK_COL_PARTS, col_blocks))
    if bucket <= CHUNK_FEW_TO and rw > 16:  # a part a stage or column block, up to CHUNK_FEW_PARTS
        most = max(most, min(CHUNK_FEW_PARTS, max(nk, col_blocks)))
    blocks = min(chunk_blocks_per_sm(dtype, max_rank, bm, num_slots) * num_sms,
                 fused_units(bucket, bm, num_slots) * most)
    parts = max(1, min(most, blocks // _ceil(bucket, bm)))  # what the kernel picks for a full bucket
    return LaunchPlan(bucket=bucket, bm=bm, bn=bn, splits=most, k_split=_ceil(nk, parts) * kc, fused=False,
                      tiles=tiles, rank_blocks=1, col_blocks=col_blocks, cpb=_ceil(col_blocks, parts),
                      n_slices=n_slices, expand="chunk", blocks=blocks, sliced=sliced)


def packed_slices(n_slices: int, max_rank: int, fused: bool) -> bool:
    """Whether an unfused shrink runs every slice in one task (the kernel's ``packed_slices``):
    several slices whose rank widths (``max_rank`` rounded up to 16) fit one 64-rank block
    together, so x is read once rather than once per slice (q/k/v, gate/up at rank 16)."""
    return not fused and n_slices > 1 and n_slices * rank_width(max_rank) <= RANK_BLOCK


def plan_workspace(spec: LoraSpec) -> tuple[int, int]:
    """``(floats, ints)`` that v and the counters take for every target and bucket of a spec."""
    n_max = max(t.num_slices for t in spec.targets)
    floats = spec.max_tokens * n_max * rank_width(spec.max_rank)
    units = max(_ceil(spec.max_tokens, min(MMA_SHRINK_BM)), fused_units(spec.max_tokens, min(MMA_SHRINK_BM), spec.num_slots))
    # (lora_pair counts each chunk's readers of v: at most its chunks, fewer than 2 + 2 units, kept explicit)
    return floats, max(2 + 2 * units, pair_chunks(min(spec.max_tokens, PAIR_TO), spec.num_slots))


# -- argument inspection (CuPy arrays, torch tensors, any __cuda_array_interface__) --------------
class DeviceArg(NamedTuple):
    """One device argument as the kernels see it: a pointer, a shape and an element type."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str  # "float32", "float16", "bfloat16", "int32", ...
    device: int | None  # None where the object does not say
    contiguous: bool
    is_torch: bool


_TYPESTR = {"<f4": "float32", "<f2": "float16", "<u2": "bfloat16", "<V2": "bfloat16", "<i4": "int32",
            "<i8": "int64", "<f8": "float64"}
_TORCH_DTYPES: dict[Any, str] = {}  # torch.dtype -> its name, filled as tensors arrive


def inspect_arg(name: str, a) -> DeviceArg:
    """Pointer, shape, dtype, device and contiguity of a CuPy array or torch CUDA tensor.

    A ``uint16`` array is taken as raw bfloat16 bits. Other objects are read through
    ``__cuda_array_interface__``; host arrays are refused with a TypeError.
    """
    mod = type(a).__module__
    if mod.startswith("torch"):
        dev = a.get_device()
        if dev < 0:
            raise TypeError(f"{name}: a torch tensor on {a.device}; the cupy backend needs CUDA tensors")
        dt = _TORCH_DTYPES.get(a.dtype)
        if dt is None:
            dt = _TORCH_DTYPES[a.dtype] = str(a.dtype).removeprefix("torch.")
        return DeviceArg(a.data_ptr(), tuple(a.shape), dt, dev, a.is_contiguous(), True)
    if mod.startswith("cupy"):
        dt = a.dtype.name
        return DeviceArg(a.data.ptr, a.shape, "bfloat16" if dt == "uint16" else dt, a.device.id,
                         a.flags.c_contiguous, False)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{name}: {type(a).__name__} is not a CuPy array or torch CUDA tensor "
                        f"(host arrays go to the reference backend)")
    shape = tuple(int(d) for d in cai["shape"])
    dt = _TYPESTR.get(cai["typestr"], cai["typestr"])
    strides = cai.get("strides")
    if strides is None:
        contiguous = True
    else:
        size = int(cai["typestr"][2:])
        want, acc = [], size
        for d in reversed(shape):
            want.append(acc)
            acc *= d
        contiguous = tuple(strides) == tuple(reversed(want))
    return DeviceArg(int(cai["data"][0]), shape, dt, None, contiguous, False)


def element_strides(a, d: DeviceArg) -> tuple[int, ...]:
    """``a``'s strides in elements (``d``: what :func:`inspect_arg` read of it); those of a
    C-contiguous array where it states none."""
    if d.is_torch:
        return tuple(a.stride())
    if type(a).__module__.startswith("cupy"):
        return tuple(st // a.itemsize for st in a.strides)
    cai = a.__cuda_array_interface__
    size = int(cai["typestr"][2:])
    if cai.get("strides") is None:
        acc, out = 1, []
        for dim in reversed(d.shape):
            out.append(acc)
            acc *= dim
        return tuple(reversed(out))
    return tuple(st // size for st in cai["strides"])


def b_strides(name: str, b, d: DeviceArg) -> tuple[int, int, int]:
    """The kernels' strides of ``b`` (lora_mma.cu's ``Args::b_at``), in elements: from one slot to
    the next, from one column to the next, and from one block of 16 ranks to the next. ``[S, out,
    R]``: ``(out * R, R, 16)`` where C-contiguous, the slot stride more for one slice's columns of a
    fused target's ``[S, out_total, R]`` (each slot's rows contiguous, slots further apart).
    Rank-blocked ``[S, RB, out, 16]``: ``(RB * out * 16, 16, out * 16)`` where C-contiguous, or one
    slice's columns of such an array. ValueError for any other layout."""
    if len(d.shape) == 3:
        S, out, R = d.shape
        if d.contiguous:
            return out * R, R, 16
        strides = element_strides(b, d)
        if strides[2] == 1 and strides[1] == R and (S == 1 or strides[0] >= out * R):
            return (int(strides[0]) if S > 1 else out * R), R, 16
        raise ValueError(f"{name} must be C-contiguous, or one slice's columns of a C-contiguous [S, out, R] "
                         f"array (strides {strides})")
    S, RB, out, W = d.shape
    if d.contiguous:
        return RB * out * W, W, out * W
    strides = element_strides(b, d)
    blk = int(strides[1])  # (rank-blocked only above 16 ranks: RB >= 2)
    if strides[3] == 1 and strides[2] == W and blk >= out * W and (S == 1 or strides[0] >= RB * blk):
        return (int(strides[0]) if S > 1 else RB * blk), W, blk
    raise ValueError(f"{name} must be C-contiguous, or one slice's columns of a C-contiguous rank-blocked "
                     f"[S, RB, out, 16] array (strides {strides})")


def expand_v_grid(bucket: int, num_slots: int, widest: int, n_slices: int) -> tuple[int, int, int]:
    """``lora_expand_v``'s grid: column blocks of the widest slice, a block per chunk a step of
    ``bucket`` positions can have (runs of one slot cut every ``EXPAND_V_TG``: at most the bucket's
    tiles plus one per slot with positions, and never more than the positions), slices."""
    chunks = min(bucket, _ceil(bucket, EXPAND_V_TG) + min(num_slots - 1, bucket))
    return max(1, _ceil(widest, EXPAND_V_BN)), max(1, chunks), n_slices


def rows_arg(name: str, t, cols: int, rows: int, dtype: str, device: int, align: int) -> tuple[int, int]:
    """``(pointer, row stride in elements)`` of a 2-D device array ``[>= rows, cols]`` (torch, CuPy,
    any ``__cuda_array_interface__``) whose rows are contiguous (a column range of a wider array
    is fine), of ``dtype``, on ``device``, its pointer and row stride multiples of ``align``
    elements (TypeError / ValueError naming what is wrong)."""
    d = inspect_arg(name, t)
    if d.device is not None and d.device != device:
        raise ValueError(f"{name} is on device {d.device}, the backend on {device}")
    if d.dtype != dtype:
        raise TypeError(f"{name} has dtype {d.dtype}, the weights {dtype}")
    if len(d.shape) != 2 or d.shape[1] != cols or d.shape[0] < rows:
        raise ValueError(f"{name} must be [rows >= {rows}, {cols}], got {d.shape}")
    size = _ITEMSIZE[dtype]
    strides = element_strides(t, d)
    ld = strides[0] if d.shape[0] > 1 else max(strides[0], cols)
    if (cols > 1 and strides[1] != 1) or ld < cols:
        raise ValueError(f"{name}'s rows must be contiguous (strides {strides})")
    if d.ptr % (align * size) or ld % align:
        raise ValueError(f"{name} must start and step its rows at multiples of {align} elements "
                         f"(pointer {d.ptr:#x}, row stride {ld})")
    return d.ptr, ld


def views_args(limits: "CallLimits", views, num_slots: int) -> tuple[DeviceArg, DeviceArg]:
    """``views``' token_order ``[T]`` and slot_indptr ``[S + 1]``, checked: int32, on the backend's
    device, C-contiguous, T within the largest capture bucket (TypeError / ValueError)."""
    TO, IP = inspect_arg("token_order", views.token_order), inspect_arg("slot_indptr", views.slot_indptr)
    _check_placed(limits, (("token_order", TO), ("slot_indptr", IP)))
    for nm, d in (("token_order", TO), ("slot_indptr", IP)):
        if d.dtype != "int32":
            raise TypeError(f"{nm} must be int32, got {d.dtype}")
    if len(TO.shape) != 1 or IP.shape != (num_slots + 1,):
        raise ValueError(f"token_order must be [T] and slot_indptr [S + 1] = [{num_slots + 1}], "
                         f"got {TO.shape} and {IP.shape}")
    if TO.shape[0] > limits.spec.max_tokens:
        raise ValueError(f"{TO.shape[0]} positions exceed the largest capture bucket {limits.spec.max_tokens}")
    return TO, IP


def _check_placed(limits: "CallLimits", named) -> None:
    for nm, d in named:
        if d.device is not None and d.device != limits.device_id:
            raise ValueError(f"{nm} is on device {d.device}, the backend on {limits.device_id}")
        if not d.contiguous:
            raise ValueError(f"{nm} must be C-contiguous")


@dataclass(frozen=True)
class CallLimits:
    """What a backend was built for; checking and planning a call reads only this."""

    spec: LoraSpec
    device_id: int
    num_sms: int
    workspace_floats: int
    counter_ints: int
    offset_ptrs: Mapping[tuple[int, ...], int]
    tile: int | None = None
    fused: bool | None = None
    expand: str | None = None
    chunks: bool | None = None
    clusters: bool = True  # thread-block clusters (compute capability 9.0 or above): lora_one

    def plan(self, num_tokens: int, in_features: int, out_features: int, n_slices: int, max_rank: int,
             dtype: str, num_slots: int, live_slices: int | None = None, halves: bool = False,
             slice_align: int = 0) -> LaunchPlan:
        """``halves``: a plan for the delta in two launches of its own (shrink, then expand), never fused."""
        return plan_launch(self.spec.bucket_for(num_tokens), in_features, out_features, n_slices,
                           max_rank, dtype, num_slots=num_slots, num_sms=self.num_sms, tile=self.tile,
                           fused=False if halves else self.fused, expand=self.expand, chunks=self.chunks,
                           live_slices=live_slices, whole=not halves, slice_align=slice_align,
                           clusters=self.clusters)


@dataclass(frozen=True)
class WeightArgs:
    """One layer's slot weights as the kernels see them, checked once: their dtype, pointers
    ``(a, b, scaling, ranks, out_offsets)``, dims ``(S, n, R, in, out)``, the 16-byte access
    flags they allow (``flags`` before x's and y's own alignment is known), ``b``'s slot stride
    and how many slices have columns."""

    dtype: str
    ptrs: tuple[int, int, int, int, int]
    dims: tuple[int, int, int, int, int]
    flags: int
    b_slot: int  # w.b's elements from one slot to the next (b_strides)
    b_ld: int  # ... from one column to the next inside a block of 16 ranks
    b_blk: int  # ... from one block of 16 ranks to the next
    live: int  # slices with columns (n, or 1 for one slice of a fused target served alone)
    align: int  # what every column offset of its slices is a multiple of (slice_alignment)


def check_weights(limits: CallLimits, w: LayerWeights) -> WeightArgs:
    """Validate one layer's weights (TypeError / ValueError): what every call of it reuses."""
    A, B = inspect_arg("w.a", w.a), inspect_arg("w.b", w.b)
    SC, RK = inspect_arg("w.scaling", w.scaling), inspect_arg("w.ranks", w.ranks)
    _check_placed(limits, (("w.a", A), ("w.b", B._replace(contiguous=True)), ("w.scaling", SC), ("w.ranks", RK)))
    if A.dtype not in CUDA_TYPES:
        raise TypeError(f"w.a has dtype {A.dtype}; use float16, bfloat16 or float32")
    if B.dtype != A.dtype:
        raise TypeError(f"w.b has dtype {B.dtype}, w.a has {A.dtype}")
    for nm, d, want in (("w.scaling", SC, "float32"), ("w.ranks", RK, "int32")):
        if d.dtype != want:
            raise TypeError(f"{nm} must be {want}, got {d.dtype}")
    if len(A.shape) != 4:
        raise ValueError(f"w.a must be [S, n, R, in], got {A.shape}")
    S, n, R, in_f = A.shape
    blocked = (S, -(-R // B_RANK_BLOCK), "out", B_RANK_BLOCK)
    if not ((len(B.shape) == 3 and B.shape[0] == S and B.shape[2] == R)
            or (R > B_RANK_BLOCK and len(B.shape) == 4 and B.shape[:2] == blocked[:2] and B.shape[3] == blocked[3])):
        raise ValueError(f"w.b must be [S, out, R] = {(S, 'out', R)}"
                         + (f" or rank-blocked [S, ceil(R / 16), out, 16] = {blocked}" if R > B_RANK_BLOCK else "")
                         + f", got {B.shape}")
    out = B.shape[-2]  # y's columns; the slices' offsets must end there
    b_slot, b_ld, b_blk = b_strides("w.b", w.b, B)
    if SC.shape != (S, n) or RK.shape != (S, n):
        raise ValueError(f"w.scaling and w.ranks must be [S, n] = {(S, n)}, got {SC.shape} and {RK.shape}")
    if not 1 <= S <= MAX_SLOTS:
        raise ValueError(f"{S} slots; a launch takes 1..{MAX_SLOTS}")
    if not 1 <= n <= MAX_SLICES:
        raise ValueError(f"{n} slices; a target has 1..{MAX_SLICES}")
    if in_f < 1 or out < 1 or R < 1:
        raise ValueError(f"empty weights: in={in_f}, out={out}, R={R}")
    offs = tuple(int(o) for o in w.out_offsets)
    if len(offs) != n + 1 or offs[0] != 0 or offs[-1] != out or any(b < a for a, b in zip(offs, offs[1:])):
        raise ValueError(f"out_offsets {offs} must rise from 0 to out={out} (w.b's rows) in {n + 1} steps")
    off_ptr = 0
    if n > 1:
        off_ptr = limits.offset_ptrs.get(offs)
        if off_ptr is None:
            raise ValueError(f"out_offsets {offs} belong to no target of the backend's spec")
    rw = rank_width(R)
    floats = limits.spec.max_tokens * n * rw
    if floats > limits.workspace_floats:
        raise ValueError(f"a target of {n} slices at rank {R} exceeds the v built for the spec "
                         f"(max_rank {limits.spec.max_rank}, "
                         f"{max(t.num_slices for t in limits.spec.targets)} slices)")
    ch = 16 // _ITEMSIZE[A.dtype]
    flags = ((1 if in_f % ch == 0 and A.ptr % 16 == 0 else 0)
             | (2 if b_ld % ch == 0 and b_blk % ch == 0 and b_slot % ch == 0 and B.ptr % 16 == 0 else 0)
             | (4 if out % ch == 0 else 0))
    return WeightArgs(A.dtype, (A.ptr, B.ptr, SC.ptr, RK.ptr, off_ptr), (S, n, R, in_f, out), flags, b_slot,
                      b_ld, b_blk,
                      live_slices(offs), slice_alignment(offs))


def live_slices(out_offsets) -> int:
    """How many slices of ``out_offsets`` (``n + 1`` rising offsets) have columns."""
    offs = [int(o) for o in out_offsets]
    return sum(b > a for a, b in zip(offs, offs[1:]))


def _xy_flags(flags: int, x_ptr: int, y_ptr: int) -> int:
    """The weights' access flags less what x's and y's own alignment rules out."""
    if x_ptr & 15:
        flags &= ~1
    if y_ptr & 15:
        flags &= ~4
    return flags


@dataclass(frozen=True)
class LaunchArgs:
    """One checked call: its plan, pointers (y, x, a, b, scaling, ranks, out_offsets, token_order,
    slot_indptr), dims ``(S, n, R, in, out)``, the 16-byte access flags and w.b's slot stride."""

    dtype: str
    plan: LaunchPlan
    rw: int  # floats a (position, slice) row of v: rank_width(rank)
    flags: int
    ptrs: tuple[int, ...]
    dims: tuple[int, int, int, int, int]
    positions: int
    torch: bool
    b_slot: int  # w.b's elements from one slot to the next (WeightArgs.b_slot)
    b_ld: int  # ... from one column to the next (WeightArgs.b_ld)
    b_blk: int  # ... from one block of 16 ranks to the next (WeightArgs.b_blk)
    rank: int  # the rank the kernels are planned, picked and sized for (planned_rank; R: dims[2])


def _check_xy(limits: CallLimits, wa: WeightArgs, Y: DeviceArg, X: DeviceArg) -> None:
    """x ``[rows, in]`` and y ``[rows, out]`` against a layer's checked weights."""
    _check_placed(limits, (("y", Y), ("x", X)))
    if X.dtype != wa.dtype:
        raise TypeError(f"x has dtype {X.dtype}, the weights {wa.dtype}")
    if Y.dtype != wa.dtype:
        raise TypeError(f"y has dtype {Y.dtype}, x has {X.dtype}")
    if len(X.shape) != 2 or len(Y.shape) != 2 or X.shape[0] != Y.shape[0]:
        raise ValueError(f"x [rows, in] and y [rows, out] must share rows, got {X.shape} and {Y.shape}")
    if X.shape[1] != wa.dims[3]:
        raise ValueError(f"x has {X.shape[1]} features, w.a has {wa.dims[3]}")
    if Y.shape[1] != wa.dims[4]:
        raise ValueError(f"y has {Y.shape[1]} features, w.b has {wa.dims[4]}")


def _launch_args(limits: CallLimits, wa: WeightArgs, y_ptr: int, x_ptr: int, TO: DeviceArg, IP: DeviceArg,
                 torch: bool, halves: bool = False, rank_bound: int | None = None) -> LaunchArgs | None:
    """The launch of a call whose x and y were checked against ``wa``: None with no positions.
    ``halves``: planned as two launches (see :meth:`LayerLaunch.half`), always for the layout's
    rank (their v is shared between launches). ``rank_bound``: see :meth:`CupyBackend.delta`."""
    for nm, d in (("token_order", TO), ("slot_indptr", IP)):
        if d.dtype != "int32":
            raise TypeError(f"{nm} must be int32, got {d.dtype}")
    S, n, R, in_f, out = wa.dims
    if len(TO.shape) != 1 or len(IP.shape) != 1 or IP.shape[0] != S + 1:
        raise ValueError(f"token_order must be [T] and slot_indptr [S + 1] = [{S + 1}], "
                         f"got {TO.shape} and {IP.shape}")
    T = TO.shape[0]
    if T == 0:
        return None
    if T > limits.spec.max_tokens:
        raise ValueError(f"{T} positions exceed the largest capture bucket {limits.spec.max_tokens}")
    rank = R if halves else planned_rank(R, rank_bound)
    plan = limits.plan(T, in_f, out, n, rank, wa.dtype, S, wa.live, halves, wa.align)
    if plan.counter_ints() > limits.counter_ints:
        raise ValueError(f"{plan.tiles} work units exceed the counters built for the spec")
    a, b, sc, rk, offs = wa.ptrs
    return LaunchArgs(dtype=wa.dtype, plan=plan, rw=rank_width(rank), flags=_xy_flags(wa.flags, x_ptr, y_ptr),
                      ptrs=(y_ptr, x_ptr, a, b, sc, rk, offs, TO.ptr, IP.ptr), dims=wa.dims, positions=T,
                      torch=torch, b_slot=wa.b_slot, b_ld=wa.b_ld, b_blk=wa.b_blk, rank=rank)


def check_call(limits: CallLimits, y, x, w: LayerWeights, token_order, slot_indptr,
               rank_bound: int | None = None) -> LaunchArgs | None:
    """Validate every argument of a delta call (TypeError / ValueError) before any launch.

    Returns what the launch needs, or None when there are no positions at all.
    """
    Y, X = inspect_arg("y", y), inspect_arg("x", x)
    TO, IP = inspect_arg("token_order", token_order), inspect_arg("slot_indptr", slot_indptr)
    _check_placed(limits, (("y", Y), ("x", X), ("token_order", TO), ("slot_indptr", IP)))
    if X.dtype not in CUDA_TYPES:
        raise TypeError(f"x has dtype {X.dtype}; use float16, bfloat16 or float32")
    wa = check_weights(limits, w)
    _check_xy(limits, wa, Y, X)
    return _launch_args(limits, wa, Y.ptr, X.ptr, TO, IP, Y.is_torch or X.is_torch, rank_bound=rank_bound)


# -- launching: kernel parameters packed once, launched through the driver ------------------------
@dataclass(frozen=True)
class KernelCall:
    """One kernel of a call: its name (as the bench names it), function, grid, block, dynamic shared
    memory, arguments (NumPy scalars, as CuPy would pass them) and where y, x and the flags sit
    among them (None: not an argument of this kernel). ``fn_aligned``: the kernel's ``ALIGNED``
    instantiation, launched instead of ``fn`` while the flags are ``ALIGNED_FLAGS`` (None: ``fn``
    serves every call)."""

    name: str
    fn: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: tuple
    y_at: int | None
    x_at: int | None
    flags_at: int | None
    fn_aligned: Any = None
    #: The kernel starts with ``lora::enter_grid`` (common.cuh): it may launch with programmatic
    #: dependent launch.
    pdl: bool = False

    def fn_for(self, flags: int | None) -> Any:
        """The function a launch with these access flags runs."""
        aligned = flags is not None and flags & ALIGNED_FLAGS == ALIGNED_FLAGS
        return self.fn_aligned if self.fn_aligned is not None and aligned else self.fn


class PackedArgs:
    """A kernel's parameters laid out once for ``cuLaunchKernel``: one buffer holding every value at
    its natural alignment, and the array of pointers to them. ``set_*`` patches a value in place;
    the driver copies the values at launch (and a stream capture at capture), so the buffer is
    reused from call to call."""

    def __init__(self, args: tuple):
        offsets, at = [], 0
        for v in args:
            size = v.dtype.itemsize
            at = _ceil(at, size) * size
            offsets.append(at)
            at += size
        self.buf = np.zeros(_ceil(max(at, 8), 8) * 8, np.uint8)
        for v, o in zip(args, offsets):
            self.buf[o:o + v.dtype.itemsize] = np.frombuffer(v.tobytes(), np.uint8)
        self.offsets = tuple(offsets)
        self.params = np.array([self.buf.ctypes.data + o for o in offsets], np.uint64)
        self.ptr = int(self.params.ctypes.data)
        self._u64 = self.buf.view(np.uint64)
        self._i32 = self.buf.view(np.int32)

    def set_u64(self, index: int, value: int) -> None:
        self._u64[self.offsets[index] >> 3] = value

    def set_i32(self, index: int, value: int) -> None:
        self._i32[self.offsets[index] >> 2] = value


class PackedLaunch:
    """A call's kernels with their parameters packed: :meth:`patch` writes y, x and the flags in,
    :meth:`run` launches each kernel in order on one stream. What a layer keeps per capture
    bucket and parity. ``launches``: per kernel, the driver's arguments but the stream, for the
    flags last written: the kernels' ``ALIGNED`` instantiations while they are ``ALIGNED_FLAGS``
    (``aligned`` says which), the others otherwise."""

    def __init__(self, calls: list[KernelCall]):
        from cupy_backends.cuda.api import driver

        self.launch_kernel = driver.launchKernel
        self.calls = calls
        self.last: tuple = (None, None, None)  # y, x and flags as last patched in
        self._args = [PackedArgs(c.args) for c in calls]

        def launches(flags):  # fn.kernel: loads the module
            return [(int(c.fn_for(flags).kernel.ptr), *c.grid, *c.block, c.smem, p.ptr)
                    for c, p in zip(calls, self._args)]

        self._plain = launches(0)
        self._fast = launches(ALIGNED_FLAGS) if any(c.fn_aligned is not None for c in calls) else self._plain
        self._pdl = tuple(c.pdl for c in calls)
        self._select(next((int(c.args[c.flags_at]) for c in calls if c.flags_at is not None), 0))

    @property
    def aligned(self) -> bool:
        """Whether the launches run the ``ALIGNED`` instantiations."""
        return self.launches is not self._plain

    def _select(self, flags: int) -> None:
        self.launches = self._fast if flags & ALIGNED_FLAGS == ALIGNED_FLAGS else self._plain

    def patch(self, y_ptr: int, x_ptr: int, flags: int) -> None:
        """Write y's and x's pointers and the access flags into every kernel's parameters (and pick
        the instantiations the flags allow)."""
        for c, p in zip(self.calls, self._args):
            if c.y_at is not None:
                p.set_u64(c.y_at, y_ptr)
            if c.x_at is not None:
                p.set_u64(c.x_at, x_ptr)
            if c.flags_at is not None:
                p.set_i32(c.flags_at, flags)
        self._select(flags)
        self.last = (y_ptr, x_ptr, flags)

    def run(self, stream: int, y_ptr: int | None = None, x_ptr: int | None = None,
            flags: int | None = None, pdl: Any = None) -> None:
        """Launch every kernel on ``stream``, with y, x and the flags patched in first where given
        and changed since the last run. ``pdl``: a :class:`~lora_cupy.backends.launch_ex.PdlLauncher`
        that launches the kernels which take it (``KernelCall.pdl``) with programmatic dependent
        launch (None: every kernel the usual way)."""
        if y_ptr is not None and (y_ptr, x_ptr, flags) != self.last:
            self.patch(y_ptr, x_ptr, flags)
        launch = self.launch_kernel
        if pdl is None:
            for fn, gx, gy, gz, bx, by, bz, smem, params in self.launches:
                launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, 0)
            return
        for (fn, gx, gy, gz, bx, by, bz, smem, params), on in zip(self.launches, self._pdl):
            if on:
                pdl(fn, (gx, gy, gz), (bx, by, bz), smem, stream, params)
            else:
                launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, 0)


class CupyBackend:
    """Runs the slot-grouped delta on one CUDA device with the tensor-core kernels.

    ``kernel="mma"`` (tensor cores, the default) or ``"simt"`` (the plain fallback). ``tile``,
    ``fused``, ``chunks`` and ``expand`` (one of ``EXPAND_KERNELS``) override the per-bucket choices of
    :func:`plan_launch` (for benchmarks and tests); ``num_sms`` defaults to the device's
    multiprocessor count. Each tensor-core kernel has two instantiations: a call whose x, y and
    weights allow every 16-byte path (access flags ``ALIGNED_FLAGS``) runs the ``ALIGNED`` one,
    which has no element-wise code; any other call the one that reads the flags at run time.
    ``aligned=False`` runs the latter for every call (tests and A/B timing). ``pdl``: whether the
    tensor-core kernels launch with programmatic dependent launch
    (:mod:`~lora_cupy.backends.launch_ex`; each waits for the grid queued before it, so calls
    back to back overlap their launches and tails), and ``lora_expand_v`` where its caller allows:
    None (the default) where the device (compute capability 9.0 or above) and the driver support
    it, False never (A/B timing). ``early_reads=True`` is the owner's word that the kernel queued
    just before any call on its stream writes neither the step's addressing (``token_order``,
    ``slot_indptr``) nor the weights, scalings, ranks and offsets the call reads (as in the pool,
    which writes them with copies): ``lora_one`` then reads them before it waits (x and y, always
    after). Off by default: a caller that builds its addressing with a kernel just before a call
    keeps every read after the wait.

    Two ways in: :meth:`delta` checks every argument on every call (tests, benchmarks, one-off
    calls); :meth:`prepare` checks one layer's weights once and returns a :class:`LayerLaunch`
    whose calls check only x and y (what :class:`~lora_cupy.delta.LoraLayerDelta` runs).
    """

    name = "cupy"

    def __init__(self, spec: LoraSpec, device=None, *, kernel: str = "mma", tile: int | None = None,
                 fused: bool | None = None, expand: str | None = None, chunks: bool | None = None,
                 num_sms: int | None = None, aligned: bool | None = None, pdl: bool | None = None,
                 early_reads: bool = False):
        import cupy
        from cupy_backends.cuda.api import driver

        if kernel not in ("mma", "simt"):
            raise ValueError(f"kernel must be 'mma' or 'simt', got {kernel!r}")
        if expand is not None and expand not in EXPAND_KERNELS:
            raise ValueError(f"expand must be one of {EXPAND_KERNELS}, got {expand!r}")
        if spec.num_slots > MAX_SLOTS:
            raise ValueError(f"num_slots={spec.num_slots} above the {MAX_SLOTS} a launch takes")
        if aligned not in (None, False):
            raise ValueError(f"aligned must be None (per call) or False (never), got {aligned!r}")
        if pdl not in (None, False):
            raise ValueError(f"pdl must be None (where supported) or False (never), got {pdl!r}")
        self.aligned = aligned
        if early_reads not in (False, True):
            raise ValueError(f"early_reads must be True or False, got {early_reads!r}")
        #: ``EARLY_READS`` or 0, or-ed into every call's flags (``early_reads``).
        self.early_reads = EARLY_READS if early_reads else 0
        if device is None:
            dev_id = cupy.cuda.runtime.getDevice()
        elif isinstance(device, int):
            dev_id = device
        else:
            text = str(device)
            dev_id = int(text.split(":")[1]) if ":" in text else 0
        self.spec = spec
        self.kernel = kernel
        self._cupy = cupy
        self._driver = driver
        self.driver_error = driver.CUDADriverError
        self._device = self.device = cupy.cuda.Device(dev_id)
        self._fns: dict[tuple, Any] = {}
        self._torch_stream = None
        with self._device:
            sms = int(num_sms or self._device.attributes["MultiProcessorCount"])
            floats, ints = plan_workspace(spec)
            self.workspace = cupy.zeros(floats, np.float32)  # v [bucket, n, rw]: zero between launches
            #: lora_pair's v (its shrink adds into it, its expand's last reader of a chunk zeroes it)
            self.pair_ws = cupy.zeros(max(1, pair_workspace(spec) if kernel == "mma" else 0), np.float32)
            self.counters = cupy.zeros(ints, np.int32)  # every launch leaves them at zero
            self._offsets, offset_ptrs = self._offset_table(cupy)
            clusters = int(self._device.compute_capability) >= 90
            self.limits = CallLimits(spec, dev_id, sms, floats, ints, offset_ptrs, tile, fused, expand, chunks,
                                     clusters)
            self._context = driver.ctxGetCurrent()  # the device's primary context, which launches need
            self._load(spec.dtype)
        from .launch_ex import PdlLauncher, pdl_supported

        #: Whether the tensor-core kernels launch with programmatic dependent launch (each waits
        #: for the grid before it, then lets the next one start: launches overlap), and
        #: ``lora_expand_v`` where its caller allows (``pdl``); set False to compare.
        self.pdl = pdl is None and pdl_supported(divmod(int(self._device.compute_capability), 10))
        self._pdl_launch = PdlLauncher() if self.pdl else None

    def clear_v(self) -> None:
        """Zero v (the workspace) on the stream the deltas run on (torch's current one once a layer
        has seen torch tensors, else CuPy's): after a shrink whose expands did not all run (see
        :meth:`LoraLayerDelta.shrink <lora_cupy.delta.LoraLayerDelta.shrink>`), whatever rows and
        slices it wrote."""
        stream = self.stream_ptr(self._torch_stream is not None)
        with self._device:
            self._cupy.cuda.runtime.memsetAsync(self.workspace.data.ptr, 0, self.workspace.nbytes, stream)

    def _offset_table(self, cupy):
        """One device array holding the slice offsets of every multi-slice target of the spec, and
        of each of its slices served alone (:func:`member_offsets`)."""
        tuples = set()
        for t in self.spec.targets:
            if t.num_slices > 1:
                offs = t.out_offsets(self.spec.tp_size)
                tuples.add(offs)
                tuples.update(member_offsets(offs, j) for j in range(t.num_slices))
        tuples = sorted(tuples)
        table = cupy.asarray(np.asarray([v for tup in tuples for v in tup] or [0], np.int32))
        ptrs, at = {}, 0
        for tup in tuples:
            ptrs[tup] = table.data.ptr + 4 * at
            at += len(tup)
        return table, ptrs

    def _load(self, dtype: str) -> None:
        """Compile (or fetch from CuPy's cache) and load every kernel of one dtype."""
        ct = CUDA_TYPES[dtype]
        extra = 4 * (MAX_SLOTS + 1)
        if self.kernel == "simt":
            mod = load_module("lora_delta")
            for kind in ("shrink", "expand"):
                self._fns[(dtype, kind)] = mod.get_function(f"lora_{kind}_simt<{ct}>")
            return
        mod = load_module(mma_family(dtype))

        smem = {"shrink": lambda bm, bn: shrink_smem(dtype, bm), "expand": lambda bm, bn: expand_smem(dtype, bm, bn),
                "fused": lambda bm, bn: fused_smem(dtype, bm, bn),
                "expand_stream": lambda bm, bn: 0,  # expand_stream: slot_indptr alone
                "expand_ring": lambda bm, bn: ring_smem(dtype)}
        if dtype in CHUNK_DTYPES:
            for rw, bm in CHUNK_SHAPES:
                for sliced in (False, True):
                    for aligned in (False, True):
                        fn = mod.get_function(chunk_name(ct, rw, bm, aligned=aligned, sliced=sliced))
                        fn.max_dynamic_shared_size_bytes = chunk_smem(dtype, rw, bm) + extra
                        self._fns[(dtype, "chunk", rw, bm, sliced, aligned)] = fn
        if dtype in CHUNK_DTYPES:  # lora_pair: slot_indptr and the chunks before each slot
            for aligned in (False, True):
                for rw, rts in PAIR_RT.items():
                    for rt in rts:
                        fn = mod.get_function(pair_name(ct, "shrink", aligned=aligned, rw=rw, rt=rt))
                        fn.max_dynamic_shared_size_bytes = 8 * (MAX_SLOTS + 1)
                        self._fns[(dtype, "pair_shrink", rw, rt, aligned)] = fn
                    fn = mod.get_function(pair_name(ct, "expand", aligned=aligned, rw=rw))
                    fn.max_dynamic_shared_size_bytes = 8 * (MAX_SLOTS + 1)
                    self._fns[(dtype, "pair_expand", rw, aligned)] = fn
        for rw in ONE_RW:  # dynamic shared memory: A's share staged (one_stage_smem)
            for aligned in (False, True):
                fn = mod.get_function(one_name(ct, rw, aligned=aligned))
                fn.max_dynamic_shared_size_bytes = ONE_STAGE_MAX
                self._fns[(dtype, "one", rw, aligned)] = fn
        if dtype in GLU_DTYPES:
            for ks in GLU_KS:
                fn = mod.get_function(glu_name(ct, ks))
                fn.max_dynamic_shared_size_bytes = glu_smem(dtype) + extra
                self._fns[(dtype, "glu", ks)] = fn
        for kind, bm, bn, chunks in mma_kernels():  # both instantiations; the key ends in `aligned`
            key = (kind, bm, chunks) if kind == "fused" else (kind, bm)
            for aligned in (False, True):
                fn = mod.get_function(mma_name(ct, kind, bm, bn=bn, chunks=chunks, aligned=aligned))
                fn.max_dynamic_shared_size_bytes = smem[kind](bm, bn) + extra
                self._fns[(dtype, *key, aligned)] = fn

    def expand_v_fn(self, dtype: str, rank_width: int):
        """``lora_expand_v`` (expand_v.cu) for one dtype and rank width, loaded on first use."""
        key = ("expand_v", dtype, rank_width)
        fn = self._fns.get(key)
        if fn is None:
            with self._device:
                fn = load_module("lora_expand_v").get_function(expand_v_name(CUDA_TYPES[dtype], rank_width))
                fn.kernel  # noqa: B018 - loads the module on this device now, not inside a capture
            self._fns[key] = fn
        return fn

    def gather_a(self, pairs) -> "GatherLaunch":
        """``lora_gather_a`` (expand_v.cu) over fixed ``(tail, compact)`` pairs: each a layer's A
        ``[S, n, R, in]`` and the ``[K, n, R, in]`` rows before a base weight that a small step's
        GEMM reads (:class:`GatherLaunch`)."""
        return GatherLaunch(self, pairs)

    def plan(self, num_tokens: int, w: LayerWeights, dtype: str | None = None,
             rank_bound: int | None = None) -> LaunchPlan:
        """The launch plan a call with ``num_tokens`` positions of addressing takes for ``w``
        (``rank_bound``: as :meth:`delta`'s)."""
        S, n, R, in_f = w.a.shape
        return self.limits.plan(num_tokens, in_f, w.b.shape[-2], n, planned_rank(R, rank_bound),
                                normalize_dtype(dtype or self.spec.dtype), S,
                                live_slices(w.out_offsets), slice_align=slice_alignment(w.out_offsets))

    def delta(self, y, x, w: LayerWeights, token_order, slot_indptr, rank_bound: int | None = None) -> None:
        """``y[t, cols_j] += scaling[s, j] * (x[t] @ a[s, j, :r].T) @ b[s, cols_j, :r].T`` for each
        position p of slot s's range of ``token_order`` (s >= 1), t = token_order[p], r = ranks[s, j].

        x ``[rows, in]`` and y ``[rows, out]`` (float16, bfloat16 or float32), weights as
        :class:`LayerWeights` (``a[S, n, R, in]``, ``b[S, out, R]`` or rank-blocked ``b[S, ceil(R / 16), out,
        16]`` for R above 16, of x's dtype, ``scaling[S, n]``
        float32, ``ranks[S, n]`` int32), ``token_order[T]`` and ``slot_indptr[S + 1]`` int32. y is
        changed in place; rows of slot 0 and positions past ``slot_indptr[S]`` are left untouched.
        Launches on torch's current stream when x or y is a torch tensor, else on CuPy's.

        The launch depends on ``len(token_order)`` (its bucket and the position count), so a
        captured graph serves later steps only if ``token_order`` spans the whole capture bucket
        (as :class:`~lora_cupy.delta.LoraLayerDelta` passes it), with ``slot_indptr[S] <= T``.

        ``rank_bound``: a promise that no slot with positions in this call has a rank above it
        (the pool's planner knows each slot's ranks on the host: ``LaunchViews.rank_bound``). The
        call is then planned for :func:`planned_rank` (a pool of maximum rank 128 running rank-16
        adapters takes a rank-16 pool's kernels). A slot above the bound has its delta cut to the
        planned width (the kernels clamp every rank to it, so nothing is read or written outside
        the buffers). None: the layout's R.
        """
        call = check_call(self.limits, y, x, w, token_order, slot_indptr, rank_bound)
        if call is not None:
            self._run(call)

    def prepare(self, w: LayerWeights) -> "LayerLaunch":
        """One layer's delta with its weights checked once (see :class:`LayerLaunch`)."""
        return LayerLaunch(self, w)

    # -- streams and launches ---------------------------------------------------------------------
    def torch_stream(self):
        """A function giving torch's current stream on this device, as a raw pointer."""
        if self._torch_stream is None:
            import torch

            raw, dev = getattr(torch._C, "_cuda_getCurrentRawStream", None), self.limits.device_id
            self._torch_stream = (functools.partial(raw, dev) if raw is not None else
                                  (lambda: torch.cuda.current_stream(dev).cuda_stream))
        return self._torch_stream

    def stream_ptr(self, torch: bool) -> int:
        """The caller's stream: torch's current one on this device for torch tensors, else CuPy's."""
        return self.torch_stream()() if torch else self._cupy.cuda.get_current_stream().ptr

    def launch(self, packed: PackedLaunch, stream: int, y_ptr: int | None = None, x_ptr: int | None = None,
               flags: int | None = None) -> None:
        """Run packed kernels on ``stream`` in this device's context (made current only if it is not)."""
        if flags is not None:
            flags |= self.early_reads
        pdl = self._pdl_launch if self.pdl else None
        if self._driver.ctxGetCurrent() == self._context:
            packed.run(stream, y_ptr, x_ptr, flags, pdl)
        else:
            with self._device:
                packed.run(stream, y_ptr, x_ptr, flags, pdl)

    def _run(self, call: LaunchArgs, parts: tuple[str, ...] = ("shrink", "expand")) -> None:
        """Launch a checked call on the caller's stream (torch's current one for torch tensors).
        ``parts`` (an unfused plan only, for timing each kernel alone) leaves out the shrink or
        the expand; v is then not zero afterwards until the workspace is cleared."""
        with self._device:  # a RawKernel loads its module on the current device
            packed = PackedLaunch(self._kernels(call, parts))
        self.launch(packed, self.stream_ptr(call.torch))

    def _kernel_fn(self, dtype: str, key: tuple):
        if (dtype, *key) not in self._fns:
            self._load(dtype)  # a dtype other than the spec's: compiled on its first (eager) call
        return self._fns[(dtype, *key)]

    def _kernels(self, call: LaunchArgs, parts: tuple[str, ...] = ("shrink", "expand")) -> list[KernelCall]:
        """The kernels one checked call launches, in order, with their arguments."""
        dtype, plan = call.dtype, call.plan
        S, n, R, in_f, out = call.dims
        y, x, a, b, sc, rk, offs, to, ip = (np.uint64(p) for p in call.ptrs)
        b_slot, b_ld, b_blk = np.int64(call.b_slot), np.int32(call.b_ld), np.int64(call.b_blk)
        ws, ctr = np.uint64(self.workspace.data.ptr), np.uint64(self.counters.data.ptr)
        i32 = np.int32
        if self.kernel == "simt":
            rows, per = 8, 16
            return [
                KernelCall("shrink simt", self._kernel_fn(dtype, ("shrink",)), (_ceil(plan.bucket, rows), n, 1),
                           (32, rows, 1), 0, (ws, x, a, rk, to, ip, i32(S), i32(n), i32(R), i32(in_f),
                                              i32(plan.bucket), i32(call.rw)), None, 1, None),
                KernelCall("expand simt", self._kernel_fn(dtype, ("expand",)), (_ceil(out, 128), _ceil(plan.bucket, per), 1),
                           (128, 1, 1), 0, (y, ws, b, sc, rk, offs, to, ip, i32(S), i32(n), i32(R), i32(out),
                                            i32(plan.bucket), i32(call.rw), i32(per), b_slot, b_ld, b_blk), 0, None,
                           None)]
        args = (y, x, a, b, sc, rk, offs, to, ip, ws, ctr, i32(S), i32(n), i32(R), i32(in_f), i32(out),
                i32(plan.bucket), i32(call.positions), i32(call.rw), i32(plan.splits), i32(plan.k_split),
                i32(plan.col_blocks), i32(plan.cpb), i32(call.flags | self.early_reads), b_slot, b_ld, b_blk)
        flags_at = len(args) - 4  # (then b_slot, b_ld, b_blk)
        extra = 4 * (S + 1)  # slot_indptr, after the stages
        mma = lambda name, key, blocks, smem, extra=extra, threads=THREADS: KernelCall(  # noqa: E731
            name, self._kernel_fn(dtype, (*key, False)), (blocks, 1, 1), (threads, 1, 1), smem + extra, args, 0, 1,
            flags_at, None if self.aligned is False else self._kernel_fn(dtype, (*key, True)), pdl=True)
        if plan.fused:
            return [mma("fused", ("fused", plan.bm, plan.chunks), plan.shrink_blocks + plan.expand_blocks,
                        fused_smem(dtype, plan.bm, plan.bn))]
        if plan.expand == "pair":  # two launches, v in the pair's own workspace, a reader count a chunk
            rw = plan.rank_width
            need = pair_floats(plan.bucket, n, S, rw)
            if need > self.pair_ws.size:
                raise ValueError(f"lora_pair needs {need} floats of workspace for this call; the backend built "
                                 f"{self.pair_ws.size} for its spec")
            pargs = args[:9] + (np.uint64(self.pair_ws.data.ptr),) + args[10:]
            smem = 8 * (S + 1)
            out_calls = []
            for part, key, grid, warps in (("shrink", ("pair_shrink", rw, pair_rt(n, rw)), plan.blocks, PAIR_SW),
                                           ("expand", ("pair_expand", rw), plan.col_blocks, PAIR_EW)):
                if part in parts:
                    out_calls.append(KernelCall(
                        f"pair_{part}", self._kernel_fn(dtype, (*key, False)), (grid, 1, 1), (32 * warps, 1, 1), smem,
                        pargs, 0, 1, flags_at,
                        None if self.aligned is False else self._kernel_fn(dtype, (*key, True)), pdl=True))
            return out_calls
        if plan.expand in ("chunk", "one") and set(parts) != {"shrink", "expand"}:
            raise ValueError(f"lora_{plan.expand} runs the shrink and the expand in one launch: neither runs alone")
        Rw = call.rank  # what the kernels are built and sized for; R stays A's and B's stride
        if plan.expand == "one":  # clusters of ONE_CLUSTER blocks (the kernel's attribute)
            rw = built_width(ONE_RW, Rw)
            return [mma("one", ("one", rw), plan.blocks, one_stage_smem(in_f, n, rw, dtype), extra=0)]
        if plan.expand == "chunk":  # shrink and expand in one launch
            rw = chunk_geometry(Rw)[0]
            return [mma("chunk", ("chunk", rw, plan.bm, plan.sliced), plan.blocks, chunk_smem(dtype, Rw, plan.bm),
                        threads=chunk_threads(plan.bm))]
        out_calls = []
        if "shrink" in parts:
            out_calls.append(mma("shrink", ("shrink", plan.bm), plan.shrink_blocks, shrink_smem(dtype, plan.bm)))
        if "expand" in parts:
            key = (plan.expand, plan.bm)
            smem = {"expand": expand_smem(dtype, plan.bm, plan.bn), "expand_ring": ring_smem(dtype)}.get(plan.expand, 0)
            out_calls.append(mma(plan.expand, key, plan.expand_blocks, smem))
        return out_calls

    def occupancy(self, call: LaunchArgs) -> dict[str, dict[str, int]]:
        """Registers, spilled bytes and resident blocks per multiprocessor of each kernel of a call."""
        res = {}
        with self._device:
            for c in self._kernels(call):
                fn = c.fn_for(call.flags)
                attrs = fn.attributes  # a RawKernel's (CuPy): num_regs, local_size_bytes, ...
                res[c.name] = {"registers": int(attrs["num_regs"]), "local_bytes": int(attrs["local_size_bytes"]),
                               "smem": int(c.smem) + int(attrs["shared_size_bytes"]),
                               "blocks_per_sm": int(self._driver.occupancyMaxActiveBlocksPerMultiprocessor(
                                   fn.kernel.ptr, int(c.block[0]), int(c.smem))),
                               "aligned": fn is c.fn_aligned}
        return res


class LayerLaunch:
    """One layer's delta on the CUDA backend, resolved once: its weights checked
    (:func:`check_weights`), and per addressing buffer (a capture bucket and parity, the same
    object step after step) the kernels and their packed parameters, made on first use. A call
    checks only what can change: x's and y's shape, dtype, device and layout, and the stream;
    then it patches their pointers (and the alignment flags) and launches. Called from one
    thread at a time (the thread that issues the step's GPU work).

    The packed launches hold the weights' raw device pointers, so the layer keeps ``w`` itself
    (``held``) for as long as it lives: prepared from a temporary (``prepare(LayerWeights(...))``
    with nothing else referring to the arrays), the arrays would otherwise go back to the memory
    pool at once and the next allocations (x, y, the addressing) reuse their memory.
    """

    def __init__(self, backend: CupyBackend, w: LayerWeights):
        self.backend = backend
        self.weights = check_weights(backend.limits, w)
        self.held = w  # the arrays behind self.weights.ptrs: alive while any launch may read them
        self._launches: dict[Any, PackedLaunch | None] = {}
        self._v_layer = None  # lora_expand_v's function and slice columns (_expand_v_layer)
        self._glu = None  # (why lora_expand_glu cannot serve the weights or None, its function): _glu_layer
        self._device = backend.limits.device_id
        self._tensor = self._tdtype = self._stream = None  # torch.Tensor, the weights' dtype in torch, its stream

    def __call__(self, y, x, views, rows: int) -> None:
        """``y += delta(x)`` over ``views.token_order`` / ``views.slot_indptr`` (a capture bucket's
        fixed addressing buffers, the same hashable object step after step, which keys the packed
        launch); ``rows``: how many rows of x the step addresses."""
        if type(x) is self._tensor and type(y) is self._tensor:  # the hot path: torch tensors that fit
            dims, dt, dev = self.weights.dims, self._tdtype, self._device
            xs, ys = x.shape, y.shape
            packed = self._launches.get(views, False)
            if (len(xs) == 2 and len(ys) == 2 and xs[1] == dims[3] and ys[1] == dims[4] and xs[0] == ys[0]
                    and xs[0] >= rows and x.dtype is dt and y.dtype is dt and x.is_contiguous()
                    and y.is_contiguous() and x.get_device() == dev and y.get_device() == dev and packed is not False):
                if packed is not None:
                    yp, xp = y.data_ptr(), x.data_ptr()
                    flags = self.weights.flags if not (xp | yp) & 15 else _xy_flags(self.weights.flags, xp, yp)
                    if (yp, xp, flags) != packed.last:
                        packed.patch(yp, xp, flags)
                    stream, launch, done = self._stream(), packed.launch_kernel, 0
                    try:
                        for fn, gx, gy, gz, bx, by, bz, smem, params in packed.launches:
                            launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, 0)
                            done += 1
                    except self.backend.driver_error:
                        if done:  # a kernel already ran: launching them all again would add its work twice
                            raise
                        self.backend.launch(packed, stream)  # none or another device's context current here
                return
        self._checked_call(y, x, views, rows)

    def _checked_call(self, y, x, views, rows: int) -> None:
        """Every check, each refusal naming what is wrong; the bucket's launch packed on first use."""
        be = self.backend
        Y, X = inspect_arg("y", y), inspect_arg("x", x)
        _check_xy(be.limits, self.weights, Y, X)
        if X.shape[0] < rows:
            raise ValueError(f"x has {X.shape[0]} rows, but the step addresses {rows}")
        torch = Y.is_torch or X.is_torch
        if torch and self._tensor is None and Y.is_torch and X.is_torch:
            self._tensor, self._tdtype, self._stream = type(x), x.dtype, be.torch_stream()
        packed = self._launches.get(views, False)
        if packed is False:
            packed = self._prepare(views, views, Y.ptr, X.ptr, torch)
        if packed is not None:
            be.launch(packed, be.stream_ptr(torch), Y.ptr, X.ptr, _xy_flags(self.weights.flags, X.ptr, Y.ptr))

    def half(self, part: str, t, views, rows: int) -> None:
        """One half of the delta as a launch of its own, on the caller's stream: ``part`` "shrink"
        reads x = ``t`` into v (the backend's workspace, zero before it); "expand" adds
        ``v * scaling @ B.T`` into y = ``t`` and zeroes the v it read (its slices with columns
        only: a fused target's one slice served alone leaves the other slices' v to theirs). Both
        are planned unfused (``lora_shrink``, then the bucket's expand kernel) whatever the bucket;
        v is shared by every layer of the backend, so between a shrink and the expands of its
        slices no other delta of the backend may run on the device (one stream, or streams that
        wait on each other in that order)."""
        key = (views, part)
        packed = self._launches.get(key)
        if packed is not None and type(t) is self._tensor:  # the hot path, as __call__'s
            ts = t.shape
            if (len(ts) == 2 and ts[1] == self.weights.dims[3 if part == "shrink" else 4] and ts[0] >= rows
                    and t.dtype is self._tdtype and t.is_contiguous() and t.get_device() == self._device):
                p = t.data_ptr()
                flags = self.weights.flags if not p & 15 else _xy_flags(self.weights.flags, p, p)
                self.backend.launch(packed, self._stream(), p, p, flags)
                return
        if part not in ("shrink", "expand"):
            raise ValueError(f"part {part!r}: 'shrink' or 'expand'")
        be, wa = self.backend, self.weights
        if be.kernel != "mma":
            raise NotImplementedError(f"the {be.kernel} kernels run the delta whole, not in halves")
        name = "x" if part == "shrink" else "y"
        A = inspect_arg(name, t)
        _check_placed(be.limits, ((name, A),))
        want = wa.dims[3] if part == "shrink" else wa.dims[4]
        if A.dtype != wa.dtype:
            raise TypeError(f"{name} has dtype {A.dtype}, the weights {wa.dtype}")
        if len(A.shape) != 2 or A.shape[1] != want:
            raise ValueError(f"{name} must be [rows, {want}], got {A.shape}")
        if A.shape[0] < rows:
            raise ValueError(f"{name} has {A.shape[0]} rows, but the step addresses {rows}")
        if A.is_torch and self._tensor is None:
            self._tensor, self._tdtype, self._stream = type(t), t.dtype, be.torch_stream()
        packed = self._launches.get(key, False)
        if packed is False:
            packed = self._prepare(key, views, A.ptr, A.ptr, A.is_torch, part)
        if packed is not None:  # the operand a half does not touch is given t's pointer: flags stay true
            be.launch(packed, be.stream_ptr(A.is_torch), A.ptr, A.ptr, _xy_flags(wa.flags, A.ptr, A.ptr))

    def expand_v(self, ys, v, views, rows: int, after_gemm: bool = False, compact: int = 0) -> None:
        """The delta's expand from a v the base GEMM wrote, on the caller's stream
        (``lora_expand_v``, expand_v.cu; :meth:`LoraLayerDelta.expand_v
        <lora_cupy.delta.LoraLayerDelta.expand_v>`): ``ys`` one output per slice (``[T, cols_j]``,
        rows contiguous, a column range of a wider array allowed), ``v`` ``[T, S*n*R]`` (every
        slot's ``x @ A.T`` side by side), T >= rows; bfloat16 or float16, rank width one of
        ``EXPAND_V_RANKS``, at most 3 slices; y's pointers and row strides multiples of 4
        elements, v's of 8. No workspace is touched (the halves' v stays as it is). Every call is
        checked and packed anew (a CUDA graph pays that once, at capture).

        ``after_gemm``: the caller's word that the kernel queued just before this call on the
        stream writes nothing the kernel reads but y and v (the GEMM that wrote them): the kernel
        then launches with programmatic dependent launch where the backend allows it
        (``backend.pdl``), reading the step's addressing and B while that GEMM finishes.

        ``compact`` = kb > 0: ``v`` is ``[T, kb*n*R]``, the blocks of the step's slots with
        positions only, the k-th at block ``kb - 1 - k`` (a GEMM over the rows
        :meth:`CupyBackend.gather_a` placed writes them so); the step must have at most kb such
        slots (the attachment passes kb >= its rows; the kernel adds nothing for any past kb)."""
        be, wa = self.backend, self.weights
        S, n, R, _in, _out = wa.dims
        fn, cols = self._expand_v_layer()
        if len(ys) != n:
            raise ValueError(f"{len(ys)} outputs for {n} slices")
        offs = self.held.out_offsets
        dev = be.limits.device_id
        yargs = [rows_arg(f"ys[{j}]", y, cols[j], rows, wa.dtype, dev, 4) for j, y in enumerate(ys)]
        check_compact(compact, S)
        vp, ldv = rows_arg("v", v, (compact or S) * n * R, rows, wa.dtype, dev, 8)
        if compact:  # the kernel takes the first slot's block, the k-th k blocks to its left
            vp += (compact - 1) * n * R * _ITEMSIZE[wa.dtype]
        TO, IP = views_args(be.limits, views, S)
        bucket = TO.shape[0]
        if bucket == 0 or rows == 0:
            return
        pad = 3 - n
        yargs += [(0, 0)] * pad
        i32, i64, u64 = np.int32, np.int64, np.uint64
        _a, b, sc, rk, _offs = wa.ptrs
        args = (*(u64(p) for p, _ in yargs), *(i64(ld) for _, ld in yargs), *(i32(c) for c in (*cols, *[0] * pad)),
                *(i32(o) for o in (*offs[:n], *[0] * pad)), u64(vp), i64(ldv), u64(b), i64(wa.b_slot),
                i32(wa.b_ld), i64(wa.b_blk),
                u64(sc), u64(rk), u64(TO.ptr), u64(IP.ptr), i32(S), i32(n), i32(compact))
        packed = PackedArgs(args)
        torch = type(v).__module__.startswith("torch")
        stream = be.stream_ptr(torch)
        grid = expand_v_grid(bucket, S, max(cols), n)
        with be.device:
            if after_gemm and be.pdl:
                be._pdl_launch(int(fn.kernel.ptr), grid, (EXPAND_V_BN // 4, 1, 1), 0, stream, packed.ptr)
            else:
                be._driver.launchKernel(int(fn.kernel.ptr), *grid, EXPAND_V_BN // 4, 1, 1, 0, stream, packed.ptr, 0)

    def glu_fits(self) -> str | None:
        """Why :meth:`glu` cannot serve this layer's weights (None: it can): a gate_up target of two
        slices of equal width, 16-bit, rank width at most 64, R a multiple of 4."""
        return self._glu_layer()[0]

    def _glu_layer(self) -> tuple[str | None, Any]:
        """What ``lora_expand_glu`` takes from this layer's weights alone, found once: why it cannot
        serve them (None: it can) and its function for the smallest KS covering the rank width."""
        if self._glu is None:
            why = self._glu_why()
            fn = None
            if why is None:
                ks = next(k for k in GLU_KS if 16 * k >= rank_width(self.weights.dims[2]))
                fn = self.backend._kernel_fn(self.weights.dtype, ("glu", ks))
            self._glu = (why, fn)
        return self._glu

    def _glu_why(self) -> str | None:
        wa = self.weights
        S, n, R, _in, out = wa.dims
        offs = tuple(self.held.out_offsets)
        if self.backend.kernel != "mma":
            return f"lora_expand_glu is a tensor-core kernel; the backend runs {self.backend.kernel!r}"
        if wa.dtype not in GLU_DTYPES:
            return f"lora_expand_glu serves {GLU_DTYPES}; the weights are {wa.dtype}"
        if n != 2 or offs != (0, out // 2, out):
            return f"lora_expand_glu takes a target of two slices of equal width (gate, up); out offsets {offs}"
        if rank_width(R) > 16 * max(GLU_KS) or R % 4:
            return f"lora_expand_glu takes rank widths up to {16 * max(GLU_KS)} in multiples of 4; R = {R}"
        if (out // 2) % 8:
            return f"lora_expand_glu takes slices of a multiple of 8 columns; they have {out // 2}"
        if not wa.flags & 2:
            return "lora_expand_glu reads B in 8-byte pieces: B's pointer and slot stride must allow them"
        return None

    def glu(self, g, u, h, views, rows: int) -> None:
        """A gated MLP's activation with this gate_up target's expand folded in, on the caller's
        stream (``lora_expand_glu``, expand_glu.cuh): ``h[t] = silu(g[t] + dg[t]) * (u[t] + du[t])``
        for every row t < rows, dg / du slice 0's / 1's delta of row t's slot (none for slot 0),
        from the v a shrink of this target (:meth:`half` "shrink") left in the workspace, which it
        zeroes again. ``views`` None: no addressing, the plain fused activation of every row (no v
        read). g, u, h ``[>= rows, inter]`` (inter: one slice's width), rows contiguous, pointers
        and row strides multiples of 8 elements, g and u with one row stride; h may be g. Every
        call is checked and packed anew (ValueError / TypeError naming what is wrong)."""
        be, wa = self.backend, self.weights
        why, fn = self._glu_layer()
        if why is not None:
            raise ValueError(why)
        S, n, R, in_f, out = wa.dims
        inter, dev = out // 2, be.limits.device_id
        gp, ld = rows_arg("g", g, inter, rows, wa.dtype, dev, 8)
        up, ldu = rows_arg("u", u, inter, rows, wa.dtype, dev, 8)
        hp, ldh = rows_arg("h", h, inter, rows, wa.dtype, dev, 8)
        if ldu != ld:
            raise ValueError(f"g and u must share a row stride, got {ld} and {ldu}")
        if rows == 0:
            return
        to = ip = 0
        positions = rows
        if views is not None:
            TO, IP = views_args(be.limits, views, S)
            to, ip, positions = TO.ptr, IP.ptr, TO.shape[0]
        tiles = _ceil(positions, RING_BM)
        if views is not None and 2 + 2 * tiles > be.limits.counter_ints:  # the plain mode counts nothing
            raise ValueError(f"{tiles} tiles exceed the counters built for the spec")
        col_blocks = _ceil(inter, RING_BN)
        groups = max(1, min(col_blocks, (GLU_BLOCKS_PER_SM * be.limits.num_sms) // tiles))  # one wave
        cpb = _ceil(col_blocks, groups)
        groups = _ceil(col_blocks, cpb)
        i32, u64 = np.int32, np.uint64
        a, b, sc, rk, offs = wa.ptrs
        args = (u64(gp), u64(0), u64(a), u64(b), u64(sc), u64(rk), u64(offs), u64(to), u64(ip),
                u64(be.workspace.data.ptr), u64(be.counters.data.ptr), i32(S), i32(n), i32(R), i32(in_f), i32(out),
                i32(positions), i32(positions), i32(rank_width(R)), i32(1), i32(0), i32(col_blocks), i32(cpb),
                i32(0), np.int64(wa.b_slot), i32(wa.b_ld), np.int64(wa.b_blk), u64(up), u64(hp), i32(ld), i32(ldh),
                i32(inter))
        packed = PackedArgs(args)
        torch = type(g).__module__.startswith("torch")
        with be.device:
            be._driver.launchKernel(int(fn.kernel.ptr), tiles * groups, 1, 1, THREADS, 1, 1,
                                    glu_smem(wa.dtype) + 4 * (S + 1), be.stream_ptr(torch), packed.ptr, 0)

    def _expand_v_layer(self) -> tuple[Any, tuple[int, ...]]:
        """What ``lora_expand_v`` takes from this layer's weights alone, checked on the first call
        that passes: its function and each slice's columns (ValueError while it cannot serve them)."""
        if self._v_layer is None:
            wa = self.weights
            S, n, R, _in, _out = wa.dims
            if wa.dtype not in EXPAND_V_DTYPES or R not in EXPAND_V_RANKS or n > 3:
                raise ValueError(f"lora_expand_v serves {EXPAND_V_DTYPES} at rank widths {EXPAND_V_RANKS} and up "
                                 f"to 3 slices; these weights are {wa.dtype}, rank width {R}, {n} slices")
            offs = self.held.out_offsets
            cols = tuple(offs[j + 1] - offs[j] for j in range(n))
            for j, c in enumerate(cols):
                if c % 4:
                    raise ValueError(f"slice {j} has {c} columns; lora_expand_v takes multiples of 4")
            if not wa.flags & 2:
                raise ValueError("lora_expand_v reads B in 16-byte pieces: B's pointer and slot stride must allow them")
            self._v_layer = (self.backend.expand_v_fn(wa.dtype, R), cols)
        return self._v_layer

    def packed(self, views) -> PackedLaunch | None:
        """The launch packed for ``views`` (None: not yet called there, or no positions)."""
        return self._launches.get(views)

    def _prepare(self, key, views, y_ptr: int, x_ptr: int, torch: bool,
                 part: str | None = None) -> PackedLaunch | None:
        """Pack the launch kept under ``key`` over ``views``: the whole delta, or (``part``) one
        half of it, planned unfused."""
        be = self.backend
        TO = inspect_arg("token_order", views.token_order)
        IP = inspect_arg("slot_indptr", views.slot_indptr)
        _check_placed(be.limits, (("token_order", TO), ("slot_indptr", IP)))
        call = _launch_args(be.limits, self.weights, y_ptr, x_ptr, TO, IP, torch, halves=part is not None,
                            rank_bound=getattr(views, "rank_bound", None))
        with be.device:  # a RawKernel loads its module on the current device
            packed = self._launches[key] = (None if call is None else
                                            PackedLaunch(be._kernels(call) if part is None else be._kernels(call, (part,))))
        return packed


class GatherLaunch:
    """One launch of ``lora_gather_a`` a step, over pairs fixed at construction: for each
    ``(tail [S, n, R, in], compact [K, n, R, in])`` (device arrays of one dtype, contiguous,
    16-byte aligned), the k-th slot with positions (k < kb) copies ``tail[s]`` into
    ``compact[K - 1 - k]`` (:func:`~lora_cupy.backends.reference.reference_gather_a`).
    :meth:`__call__` launches on torch's current stream (``torch=True``) or CuPy's."""

    def __init__(self, backend: CupyBackend, pairs, torch: bool = True):
        import cupy

        pairs = check_gather_pairs(pairs)
        rows, most, self.kmax = [], 0, None
        for i, (tail, compact) in enumerate(pairs):
            t, c = inspect_arg(f"pairs[{i}] tail", tail), inspect_arg(f"pairs[{i}] compact", compact)
            _check_placed(backend.limits, ((f"pairs[{i}] tail", t), (f"pairs[{i}] compact", c)))
            block = int(np.prod(t.shape[1:])) * _ITEMSIZE[t.dtype]
            if block % 16 or t.ptr % 16 or c.ptr % 16:
                raise ValueError(f"pairs[{i}]: lora_gather_a copies 16-byte pieces (a slot's block is {block} "
                                 f"bytes; pointers {t.ptr:#x}, {c.ptr:#x})")
            K = c.shape[0]
            rows.append((t.ptr, c.ptr + (K - 1) * block, block))
            most = max(most, block)
            self.kmax = K if self.kmax is None else min(self.kmax, K)
            if t.shape[0] != backend.spec.num_slots:
                raise ValueError(f"pairs[{i}]: tail has {t.shape[0]} slots, the pool {backend.spec.num_slots}")
        self.backend, self.torch = backend, torch
        with backend.device:
            self.table = cupy.asarray(np.asarray(rows, np.int64).ravel())
            self.fn = load_module("lora_expand_v").get_function(GATHER_A_NAME)
            self.fn.kernel  # noqa: B018 - loads the module now, not inside a capture
        self.entries = len(rows)
        self.blocks = max(1, min(64, _ceil(most // 16, GATHER_A_THREADS * 8)))  # ~8 pieces a thread

    def __call__(self, slot_indptr, kb: int) -> None:
        """Place the step's slots' A (``slot_indptr`` ``[S + 1]`` int32 on the device) for a
        step of at most ``kb`` slots with positions (1 <= kb <= K)."""
        be = self.backend
        S = be.spec.num_slots
        if not isinstance(kb, (int, np.integer)) or not 1 <= kb <= self.kmax:
            raise ValueError(f"kb must be 1..{self.kmax} (the rows each compact holds), got {kb!r}")
        IP = inspect_arg("slot_indptr", slot_indptr)
        _check_placed(be.limits, (("slot_indptr", IP),))
        if IP.dtype != "int32" or IP.shape != (S + 1,):
            raise ValueError(f"slot_indptr must be int32 [{S + 1}], got {IP.dtype} {IP.shape}")
        packed = PackedArgs((np.uint64(self.table.data.ptr), np.uint64(IP.ptr), np.int32(S)))
        stream = be.stream_ptr(self.torch)
        with be.device:
            be._driver.launchKernel(int(self.fn.kernel.ptr), self.blocks, int(kb), self.entries,
                                    GATHER_A_THREADS, 1, 1, 0, stream, packed.ptr, 0)
