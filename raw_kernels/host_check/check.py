"""Run the tensor-core kernels' task functions on the CPU against the float64 oracle of the GPU tests.

No GPU needed: the sources of raw_kernels/ are copied with their inline-PTX helpers cut out
(host_cuda.h supplies host versions), compiled with g++ into a shared library together with
harness.cpp, and every block of every launch runs as 128 fibers. A case passes when y matches
the oracle (tests/gpu/conftest.py: tolerance, untouched rows bit-exact, no poisoned weight read)
and v and the counters are back at zero. This checks indexing, masks, fragment layouts and the
v / counter protocol; it cannot check timing, memory ordering between blocks, or occupancy.

    python raw_kernels/host_check/check.py [--fused | --expand expand|expand_stream|expand_ring|chunk|one|pair]
        [--tiles-only | --chunks] [--sms 1] [--misalign] [--asan] [--cp-async late|early] [--aligned auto|never] [--members | --halves]
        [--b-blocked]
    python raw_kernels/host_check/check.py --expand-v    # lora_expand_v (expand_v.cu)
    python raw_kernels/host_check/check.py --expand-v --compact    # lora_gather_a, then compact
    python raw_kernels/host_check/check.py --glu [--sms 132] [--inf] [--cp-async early] [--asan]
        # lora_shrink, then lora_expand_glu (expand_glu.cuh)

``--sms 1`` plans for one multiprocessor (long column groups, one shrink split); ``--misalign``
puts x and y one element off 16-byte alignment; ``--asan`` builds with AddressSanitizer (then
run python with ``LD_PRELOAD`` of libasan so numpy's arrays get red zones); ``--cp-async`` makes
each emulated cp.async land at the wait that retires it (late, the default: a read before its wait
sees stale data) or when issued (early: a stage overwritten while still read shows);
``--aligned`` picks the kernels' instantiation as the backend does (auto: ``ALIGNED`` where the
access flags are ``ALIGNED_FLAGS``, the one reading the flags elsewhere) or never the ``ALIGNED`` one;
``--members`` serves each slice of a multi-slice case alone, into an output of its own width, with
B's rows of that slice read as a view (the kernels' ``b_slot``); ``--halves`` runs the whole
target's shrink once and then each slice's expand alone so, as a prefill's q/k/v members run.
``--expand chunk`` runs ``lora_chunk`` (chunk.cuh; 16-bit cases of one slice, or each member with
``--members``): where the step's chunks take one part each (``--sms 1``: a grid of 4 blocks) the
kernel's own block body (items by block, tickets past the grid, the done count), else each item as
a block of its own, every shrink part before any expand part (a part waits for its chunk's others).
``--expand one`` runs ``lora_one`` (one.cuh; cases of one position): each cluster's blocks run their
shrinks into partial arrays of their own (NaN before each cluster), then each block its sum over
them and its columns.
``--expand pair`` runs ``lora_pair`` (pair.cuh; 16-bit cases of up to 256 positions, rank width 16 or 64 of one
or two slices): the shrink's grid of 4-warp blocks, then the expand's of 8-warp blocks, each block in
turn, on a workspace of NaN (the expand must read only parts the shrink wrote), with EARLY_READS.
``--glu`` runs a gate_up target's shrink (tiles of 64, unfused) and then ``lora_expand_glu`` on
``GLU_CASES``, bf16 and fp16, each at one and four multiprocessors (long column groups) and at
``--sms``: h against silu(g + dg) * (u + du) in float64, every element it must not write bit-exact
(with ``--inf``, x's inf row of one adapter token is left out).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

from conftest import adapter_slots, build_case, check_result, with_inf, with_row_at  # noqa: E402

from lora_cupy.backends import cupy as cb  # noqa: E402
from lora_cupy.backends.base import member_offsets  # noqa: E402
from lora_cupy.spec import blocked_b  # noqa: E402
from lora_cupy.kernels import ALIGNED_FLAGS, GLU_KS, cuda_include_dirs  # noqa: E402

#: common.cuh functions made of inline PTX, replaced by host_cuda.h (the last one by a macro that
#: defines the m16n8k16 specializations in place).
PTX_FUNCTIONS = ("void cp_async16(", "void cp_async16_cg(", "void cp_async_commit(", "void cp_async_wait(",
                 "unsigned dynamic_smem_size(", "int load_acquire(", "int atomic_add_acq_rel(",
                 "void mma16816<__nv_bfloat16>(", "void mma16816<__half>(")

from test_kernels import CASES as GPU_CASES  # noqa: E402
from test_chunk_gpu import DECODE_CASES  # noqa: E402
from test_pair_gpu import CASES as PAIR_CASES, CASES64 as PAIR_CASES64  # noqa: E402

#: The cases of the GPU kernel tests, plus one with long column groups and many runs per warp,
#: two whose lora_chunk steps take chunks of 64 and two of 128, two of several slices lora_chunk
#: serves whole, and three of decode buckets (chunks of 16) at each rank width, two of them of
#: several slices, and the GPU tests' cases of lora_chunk at the decode buckets.
CASES = {**GPU_CASES,
         "long": dict(T=300, in_f=96, slices=(520, 13, 467), max_rank=128, ranks=(0, 5, 16, 48, 64, 80, 128),
                      mix="zipf", num_slots=17, active=12),
         # lora_chunk at rank widths 64 and 128: steps whose chunks of 64 (CHUNK_WIDE_FROM) are mostly full
         "tall-r64": dict(T=1500, in_f=136, slices=(200,), max_rank=64, ranks=(0, 5, 17, 64), mix="skewed",
                          num_slots=9, active=4),
         "tall-r128": dict(T=1100, in_f=72, slices=(128, 64), max_rank=128, ranks=(0, 16, 80, 128), mix="identical"),
         # ... and a deep target (`in` at least CHUNK_DEEP times `out`) from CHUNK_DEEP_WIDE_FROM positions:
         # chunks of 64 at rank width 64 (mostly full; then many short runs), 32 at rank width 128
         "deep-r64": dict(T=1000, in_f=600, slices=(264,), max_rank=64, ranks=(1, 17, 64), mix="skewed",
                          num_slots=9, active=4),
         "deep-r64-runs": dict(T=900, in_f=536, slices=(200,), max_rank=64, ranks=(0, 5, 40, 64), mix="zipf",
                               num_slots=65, active=40),
         "deep-r128": dict(T=1000, in_f=600, slices=(264,), max_rank=128, ranks=(1, 80, 128), mix="skewed",
                           num_slots=9, active=4),
         # lora_chunk's rank split (one slice at rank width 64, chunks of 32, an even number of parts):
         # ranks past a part's window, inside it and short of a tile; `in` with a short last stage
         "split-r64": dict(T=300, in_f=1000, slices=(200,), max_rank=64, ranks=(0, 17, 40, 64), mix="skewed",
                           num_slots=9, active=5),
         "split-r64-odd": dict(T=130, in_f=1001, slices=(72,), max_rank=50, ranks=(3, 20, 50), mix="zipf",
                               num_slots=9, active=3),
         # ... and chunks of 128 (blocks of 256 threads) from CHUNK_TALL_FROM: full and partial
         "taller-r64": dict(T=3000, in_f=136, slices=(200,), max_rank=64, ranks=(0, 5, 17, 64), mix="skewed",
                            num_slots=9, active=4),
         "taller-r128": dict(T=2100, in_f=72, slices=(128, 64), max_rank=128, ranks=(0, 16, 80, 128),
                             mix="zipf", num_slots=9, active=6),
         # lora_chunk over several slices (boundaries on its column blocks: 128 at rank width 16, 64 above)
         "qkv128": dict(T=150, in_f=136, slices=(256, 128, 128), max_rank=16, ranks=(0, 5, 16), mix="zipf",
                        num_slots=9, active=6),
         "gateup64": dict(T=333, in_f=200, slices=(192, 192), max_rank=64, ranks=(0, 3, 16, 33, 64), mix="skewed",
                          num_slots=17, active=9, pad_to=384),
         # lora_chunk at decode buckets (chunks of 16): many short runs over several slices, a
         # rank-64 gate/up, a rank-128 pool whose adapters above 64 take two rank blocks
         "dec-qkv": dict(T=50, in_f=136, slices=(256, 128, 128), max_rank=16, ranks=(0, 5, 16), mix="distinct",
                         num_slots=65, active=40),
         "dec-gateup64": dict(T=64, in_f=200, slices=(192, 192), max_rank=64, ranks=(0, 3, 33, 64), mix="zipf",
                              num_slots=17, active=9),
         "dec-r128": dict(T=33, in_f=72, slices=(200,), max_rank=128, ranks=(0, 16, 80, 128), mix="skewed",
                          num_slots=9, active=4, pad_to=64),
         # lora_one (one position): odd `in` and ranks, three slices with a rank-0 one, 513 slots (the
         # slot search past one pass of the block), a rank-128 pool, columns over several clusters,
         "one-odd": dict(T=1, in_f=77, slices=(61,), max_rank=13, ranks=(1, 8, 13), mix="distinct"),
         "one-qkv": dict(T=1, in_f=1032, slices=(96, 40, 24), max_rank=64, ranks=(0, 1, 8, 13, 64), mix="uniform"),
         "one-many": dict(T=1, in_f=264, slices=(136, 40), max_rank=32, ranks=(1, 8, 16, 32), mix="distinct",
                          num_slots=513, active=500),
         "one-r128": dict(T=1, in_f=1000, slices=(64, 72), max_rank=128, ranks=(1, 80, 128), mix="identical"),
         "one-wide": dict(T=1, in_f=520, slices=(3000, 1000), max_rank=16, ranks=(5, 16), mix="uniform"),
         # lora_one at `in` of 4104 and 8200: a block's eighth holds 65 and 129 pieces, several a lane
         "one-long2": dict(T=1, in_f=4104, slices=(40, 24, 24), max_rank=16, ranks=(0, 13, 16), mix="distinct"),
         "one-long4": dict(T=1, in_f=8200, slices=(40, 24), max_rank=64, ranks=(3, 13, 64), mix="distinct"),
         "one-row": dict(T=1, in_f=264, slices=(136, 40), max_rank=16, ranks=(5, 16), mix="distinct"),
         # lora_one at `in` = 24: 3 pieces, so five blocks of a cluster hold no share of A (none staged)
         "one-tiny": dict(T=1, in_f=24, slices=(200,), max_rank=16, ranks=(3, 16), mix="distinct"),
         "many-slots": dict(T=61, in_f=264, slices=(136, 40), max_rank=32, ranks=(0, 1, 8, 16, 32), mix="distinct",
                            num_slots=513, active=61),
         # fp32: every 16-byte path allowed, out ending half-way into expand_stream's last 8-column
         # chunk, ranks no multiple of 4 (16-bit types: y's rows take the element-wise path)
         "half-chunk": dict(T=45, in_f=328, slices=(200, 56, 28), max_rank=48, ranks=(0, 1, 5, 13, 16, 40, 48),
                            mix="zipf", num_slots=17, active=9, pad_to=64),
         # lora_chunk's decode-bucket cases in tests/gpu/test_chunk_gpu.py (chunks of 16, long `in`)
         **{f"decode-{k}": v for k, v in DECODE_CASES.items()},
         # lora_pair's cases in tests/gpu/test_pair_gpu.py (rank widths 16 and 64)
         **{f"pair-{k}": v for k, v in {**PAIR_CASES, **PAIR_CASES64}.items()},
         # lora_pair's expand over shares of whole tiles of one slice (slices of multiples of 16 columns)
         "whole-gateup": dict(T=64, in_f=256, slices=(512, 512), max_rank=16, ranks=(3, 16), mix="zipf",
                              num_slots=33, active=20),
         "whole-o": dict(T=16, in_f=520, slices=(1024,), max_rank=16, ranks=(16,), mix="distinct", num_slots=9,
                         active=8),
         "whole-qkv": dict(T=40, in_f=264, slices=(256, 128, 128), max_rank=16, ranks=(0, 7, 16), mix="skewed",
                           num_slots=17, active=9),
         "whole-r13": dict(T=24, in_f=264, slices=(160, 96), max_rank=13, ranks=(1, 6, 13), mix="uniform",
                           num_slots=9, active=5),
         # pools of a larger maximum rank than their adapters': with --bound planned for the class of
         # their largest rank (16 or 64), A and B read with the pool's strides (NaN past each rank)
         "bound-qkv": dict(T=150, in_f=136, slices=(256, 128, 128), max_rank=128, ranks=(0, 5, 16), mix="zipf",
                           num_slots=9, active=6),
         "bound-dec": dict(T=50, in_f=136, slices=(256, 128), max_rank=128, ranks=(0, 3, 16), mix="distinct",
                           num_slots=33, active=20),
         "bound-cl": dict(T=30, in_f=136, slices=(200,), max_rank=64, ranks=(0, 3, 16), mix="zipf", num_slots=17,
                          active=9),
         "bound-one": dict(T=1, in_f=264, slices=(136, 40), max_rank=64, ranks=(5, 16), mix="distinct"),
         "bound-64": dict(T=333, in_f=200, slices=(192, 192), max_rank=128, ranks=(0, 17, 40, 64), mix="skewed",
                          num_slots=17, active=9, pad_to=384),
         "bound-48": dict(T=700, in_f=72, slices=(200,), max_rank=48, ranks=(0, 1, 13, 16), mix="uniform")}
#: Cases of one position whose row is moved among more rows of x and y: (rows, the row).
ROW_AT = {"one-row": (5, 3)}
DTYPE_CODE = {"bfloat16": 0, "float16": 1, "float32": 2}
B_BLOCKED = [False]  # --b-blocked: B of cases above 16 ranks rank-blocked, as a pool holds it


def b_arg(b: np.ndarray, R: int) -> tuple[np.ndarray, int, int, int]:
    """A case's ``b [S, out, R]`` as the kernels get it: (array, b_slot, b_ld, b_blk); rank-blocked,
    ``[S, ceil(R / 16), out, 16]``, where --b-blocked and R is above 16 (lora_mma.cu's Args::b_at)."""
    S, out, _ = b.shape
    if B_BLOCKED[0] and R > 16:
        bb = blocked_b(np.ascontiguousarray(b), R)
        return bb, bb.shape[1] * out * 16, 16, out * 16
    return np.ascontiguousarray(b), out * R, R, 16

#: lora_expand_glu's cases: a gate_up target of two slices of ``inter`` columns each (inter a
#: multiple of 8, R of 4: what the backend's glu_fits allows). ``h``: "g" writes h in place over g,
#: "own" into a buffer of its own with rows 8 elements wider (ld_h != ld); ``fused``: g and u are
#: the two halves of one [rows, 2 inter] array (the gate_up GEMM's output, ld = 2 inter), else two
#: arrays; ``plain``: no addressing (slot_indptr null), h = silu(g) * u for the first T rows;
#: ``reverse``: blocks run last to first.
GLU_CASES = {
    # KS 1, slices ending 8 columns into a column block, zipf runs (no slot 0), a bucket's padding
    "r16-zipf": dict(T=150, in_f=72, inter=200, max_rank=16, ranks=(0, 5, 13, 16), mix="zipf", num_slots=9,
                     active=6, pad_to=192, h="own", fused=True),
    # slot-0 rows among the runs, h over g inside the gate_up array (u's half must stay as it was)
    "r16-inplace": dict(T=200, in_f=136, inter=136, max_rank=16, ranks=(0, 5, 13, 16), mix="uniform",
                        num_slots=17, active=9, pad_to=256, h="g", fused=True, reverse=True),
    # KS 1 at rank 12 (B's rows 12 apart), long runs: most warps meet one run, some with slot 0's rows
    "r12-skewed": dict(T=300, in_f=64, inter=136, max_rank=12, ranks=(0, 4, 9, 12), mix="skewed", num_slots=9,
                       active=4, pad_to=320, h="g", fused=False),
    # KS 2; a quarter of the rows on slot 0 (a first tile with no run), five column blocks
    "r32-skewed": dict(T=260, in_f=64, inter=264, max_rank=32, ranks=(0, 4, 17, 32), mix="skewed", num_slots=9,
                       active=5, pad_to=320, h="g", fused=False),
    # KS 2 with B's rows 20 ranks apart (rank width 32): the second k-step holds one group of 4 ranks,
    # the loads past it are not made (under --asan, one past B's last row would show)
    "r20": dict(T=130, in_f=96, inter=72, max_rank=20, ranks=(0, 3, 8, 17, 20), mix="uniform", num_slots=9,
                active=6, h="own", fused=False),
    # KS 4, inter a multiple of 64, runs of 6 rows (several a warp), rank 1 next to rank 64
    "r64-distinct": dict(T=192, in_f=128, inter=256, max_rank=64, ranks=(0, 1, 8, 24, 48, 64), mix="distinct",
                         num_slots=33, active=32, h="own", fused=True, reverse=True),
    # KS 4 at rank width 48 (the fourth k-step never live), a last tile of 44 positions, no padding
    "r48-zipf": dict(T=300, in_f=64, inter=200, max_rank=48, ranks=(0, 13, 33, 48), mix="zipf", num_slots=17,
                     active=12, h="g", fused=True),
    # one addressed row in a tile of padding
    "one-row": dict(T=1, in_f=64, inter=136, max_rank=32, ranks=(32,), mix="identical", pad_to=64, h="own",
                    fused=True),
    # no addressing: the plain activation, rows past T untouched
    "plain-inplace": dict(T=100, in_f=64, inter=200, max_rank=16, ranks=(16,), mix="uniform", pad_to=128, h="g",
                          fused=True, plain=True),
    "plain-own": dict(T=330, in_f=64, inter=136, max_rank=64, ranks=(64,), mix="uniform", pad_to=384, h="own",
                      fused=False, plain=True, reverse=True),
}
#: multiprocessors each GLU case is planned for besides --sms: one (a column group per tile, cpb =
#: every column block) and four (groups of several blocks, not dividing five column blocks evenly)
GLU_SMS = (1, 4)


def _cut(text: str, name: str, repl: str) -> str:
    """``text`` with the definition of the function whose signature holds ``name`` replaced."""
    i = text.find(name)
    if i < 0:
        raise SystemExit(f"host_check: {name!r} is no longer in common.cuh; update PTX_FUNCTIONS")
    start = text.rfind("\n", 0, i) + 1
    depth = 0
    for k in range(text.index("{", i), len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[:start] + repl + text[k + 1:]
    raise SystemExit(f"host_check: unbalanced braces after {name!r}")


def build(out_dir: Path, asan: bool) -> Path:
    """The kernels with their PTX cut out, compiled with harness.cpp into a shared library."""
    src = out_dir / "src"
    src.mkdir()
    for p in (ROOT / "raw_kernels").iterdir():
        if p.suffix in (".cu", ".cuh"):  # `static alignas(n)` is no C++: the alignment first
            (src / p.name).write_text(re.sub(r"__shared__ __align__\((\d+)\)", r"__align__(\1) __shared__",
                                             p.read_text()))
    common = (src / "common.cuh").read_text()
    for name in PTX_FUNCTIONS:
        common = _cut(common, name, "EMU_MMA_SPECIALIZATIONS\n" if name.startswith("void mma16816<__half>") else "")
    (src / "common.cuh").write_text(common)
    mma = (src / "lora_mma.cu").read_text()
    mma = mma[: mma.index("#define LORA_PARAMS")]  # the task functions only
    (src / "lora_mma.cu").write_text(mma)
    lib = out_dir / "libhost_check.so"
    flags = ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"] if asan else ["-O2"]
    # the kernels read and write 2-byte elements through uint2 / uint4 (as CUDA code does): on the
    # host that is type punning, which strict aliasing at -O2 let g++ drop (lora_expand_v's stores)
    flags.append("-fno-strict-aliasing")
    cmd = ["g++", "-std=c++20", *flags, "-fPIC", "-shared", "-include", str(HERE / "host_cuda.h"),
           f"-I{src}", *(f"-I{d}" for d in cuda_include_dirs()), str(HERE / "harness.cpp"), "-o", str(lib)]
    subprocess.run(cmd, check=True)
    return lib


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` whose data starts one element past 16-byte alignment."""
    buf = np.zeros(a.size + 16, a.dtype)
    off = next(k for k in range(1, 16) if (buf.ctypes.data + k * a.itemsize) % 16)
    out = buf[off:off + a.size].reshape(a.shape)
    out[...] = a
    return out


#: ``--bound``: plan each whole call for its case's largest rank, as a pool's planner does
#: (``planned_rank``; the halves always for the pool's maximum rank).
BOUND = False


def planned(case, whole: bool = True) -> int:
    """The rank ``case``'s call is planned and launched for (its v's rows: rank_width of it)."""
    R = case.w.a.shape[2]
    return cb.planned_rank(R, int(case.w.ranks.max())) if BOUND and whole else R


def plan_for(case, *, expand: str, tile: int, sms: int, fused: bool = False,
             chunks: bool | None = None, out: int | None = None, whole: bool = True) -> cb.LaunchPlan:
    """The launch plan of ``case`` at its capture bucket (unfused unless ``fused``); ``out``: y's
    columns where a call serves one slice alone; ``whole``: not a half (see :func:`planned`)."""
    S, n, _, in_f = case.w.a.shape
    return cb.plan_launch(case.spec.bucket_for(case.token_order.shape[0]), in_f, out or case.y0.shape[1], n,
                          planned(case, whole),
                          case.spec.dtype, num_slots=S, tile=tile or None, fused=fused, expand=None if fused else expand,
                          chunks=chunks, num_sms=sms, live_slices=None if out is None else 1,
                          slice_align=cb.slice_alignment(case.w.out_offsets))


def run(lib, case, plan: cb.LaunchPlan, *, misalign: bool, aligned: str = "auto",
        member: int | None = None, part: str | None = None, ws=None, counters=None) -> tuple[np.ndarray, int, bool]:
    """One delta of ``case`` on the host under ``plan``: (y, flags, whether the ``ALIGNED``
    instantiation ran); v and counters checked at zero. ``member``: slice ``member`` alone, into
    an output of its width, reading its rows of B as a view (slots ``out * R`` elements apart,
    the kernels' ``b_slot``); y is then that slice's columns. ``part``: "shrink" or "expand" alone
    (an unfused plan), on the given ``ws`` and ``counters``, with no check of them."""
    w, dtype = case.w, case.spec.dtype
    S, n, R, in_f = w.a.shape
    T = case.token_order.shape[0]
    offsets, y0 = w.out_offsets, case.y0
    b, b_slot, b_ld, b_blk = b_arg(w.b, R)
    if member is not None:
        o0, o1 = w.out_offsets[member], w.out_offsets[member + 1]
        b, offsets, y0 = b[..., o0:o1, :], member_offsets(w.out_offsets, member), case.y0[:, o0:o1]
    out = y0.shape[1]
    x, y = case.x, np.array(y0, copy=True, order="C")  # never the case's own y0
    if misalign:
        x, y = _misaligned(x), _misaligned(y)
    ch = 16 // x.itemsize
    flags = ((1 if in_f % ch == 0 and x.ctypes.data % 16 == 0 and w.a.ctypes.data % 16 == 0 else 0)
             | (2 if b_ld % ch == 0 and b_blk % ch == 0 and b.ctypes.data % 16 == 0 else 0)
             | (4 if out % ch == 0 and y.ctypes.data % 16 == 0 else 0))
    use_aligned = aligned == "auto" and flags == ALIGNED_FLAGS
    rw = cb.rank_width(planned(case, part is None))
    pair = plan.expand == "pair"
    if ws is None:  # the pair's own workspace (each chunk's v, zero before and after) or v
        ws = (np.zeros(cb.pair_floats(plan.bucket, n, S, plan.rank_width), np.float32) if pair
              else np.zeros(plan.bucket * n * rw, np.float32))
        counters = np.zeros(plan.counter_ints(), np.int32)
    offs = np.asarray(offsets, np.int32) if n > 1 else None
    scaling = np.ascontiguousarray(w.scaling, np.float32)
    ranks = np.ascontiguousarray(w.ranks, np.int32)
    dims = np.asarray([S, n, R, in_f, out, plan.bucket, T, rw, plan.splits, plan.k_split, plan.col_blocks,
                       plan.cpb, int(plan.chunks), flags, int(use_aligned), b_slot, int(plan.sliced), b_ld, b_blk],
                      np.int32)

    def ptr(a):
        return ctypes.c_void_p(None if a is None else a.ctypes.data)

    code = int(plan.chunks) if plan.fused else {"expand": 3, "expand_stream": 4, "expand_ring": 5,
                                                "chunk": 6, "one": 7, "pair": 9}[plan.expand]
    rc = lib.emu_delta(DTYPE_CODE[dtype], plan.bm, code, 0 if part == "expand" else plan.shrink_blocks,
                       0 if part == "shrink" else plan.expand_blocks, ptr(y), ptr(x), ptr(w.a), ptr(b), ptr(scaling),
                       ptr(ranks), ptr(offs), ptr(case.token_order), ptr(case.slot_indptr), ptr(ws), ptr(counters),
                       ptr(dims))
    assert rc == 0, f"no kernel for tile {plan.bm}" if rc == 2 else f"ALIGNED asked with flags {flags}"
    if part is None:
        assert not ws.any(), "v not zeroed after the launch"
        assert not counters.any(), "counters not reset after the launch"
    return y, flags, use_aligned


def run_halves(lib, case, *, expand: str, tile: int, sms: int, misalign: bool,
               aligned: str) -> tuple[np.ndarray, int, bool]:
    """The delta in halves, as a prefill's separate q/k/v linears run it: the whole target's
    shrink, then each slice's expand alone into an output of its width; v and the counters zero
    after the last expand (each expand zeroes only its own slice's v)."""
    S, n, R, in_f = case.w.a.shape
    offs = case.w.out_offsets
    whole = plan_for(case, expand=expand, tile=tile, sms=sms, whole=False)
    ws = np.zeros(whole.bucket * n * cb.rank_width(R), np.float32)
    counters = np.zeros(whole.counter_ints(), np.int32)
    run(lib, case, whole, misalign=misalign, aligned=aligned, part="shrink", ws=ws, counters=counters)
    y = np.empty_like(case.y0)
    for j in range(len(offs) - 1):
        p = plan_for(case, expand=expand, tile=tile, sms=sms, out=offs[j + 1] - offs[j], whole=False)
        yj, flags, al = run(lib, case, p, misalign=misalign, aligned=aligned, member=j, part="expand",
                            ws=ws, counters=counters)
        y[:, offs[j]:offs[j + 1]] = yj
    assert not ws.any(), "v not zeroed after the last slice's expand"
    assert not counters.any(), "counters not reset after the expands"
    return y, flags, al


def run_expand_v(lib, case, compact: bool = False) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """``lora_expand_v`` on the host for ``case``: v as the extended GEMM writes it beside the
    first slice's y (one array), the other slices each in its own; (each slice's y, v, the GEMM's
    array after the call). ``compact``: v holds only the blocks of the step's slots with
    positions (kb = the bucket's positions, the k-th slot's block at kb-1-k),
    placed there by ``lora_gather_a`` run on the host too (checked against the NumPy reference,
    every row it must not write left at 3.0),
    and the kernel runs with compact = kb; the returned v is the every-slot one it stands for."""
    from test_expand_v_gpu import _gemm_v

    w = case.w
    S, n, R, in_f = w.a.shape
    offs = w.out_offsets
    v = _gemm_v(case)
    kb = len(case.token_order) if compact else 0
    if compact:  # the gather, then the GEMM's v over the kb gathered blocks
        from lora_cupy.backends.reference import reference_gather_a

        K = 8
        a = np.ascontiguousarray(w.a)
        rows = np.full((K, n, R, in_f), 3.0, a.dtype)  # finite, unlike the poison past each rank
        want = rows.copy()
        reference_gather_a([(a, want)], case.slot_indptr, kb)
        block = n * R * in_f * a.itemsize
        table = np.asarray([a.ctypes.data, rows.ctypes.data + (K - 1) * block, block], np.int64)
        rc = lib.emu_gather_a(ctypes.c_void_p(table.ctypes.data), ctypes.c_void_p(case.slot_indptr.ctypes.data),
                              ctypes.c_int(S), ctypes.c_int(2), ctypes.c_int(kb), ctypes.c_int(1))
        assert rc == 0 and np.array_equal(rows.view(np.uint16), want.view(np.uint16)), "lora_gather_a's rows differ"
        with np.errstate(invalid="ignore"):
            vk = (case.x.astype(np.float64) @ rows[K - kb:].reshape(kb * n * R, in_f).astype(np.float64).T
                  ).astype(case.x.dtype)
    gemm = np.ascontiguousarray(np.concatenate([case.y0[:, :offs[1]], vk if compact else v], axis=1))
    ys = [gemm[:, :offs[1]]] + [np.ascontiguousarray(case.y0[:, offs[j]:offs[j + 1]]) for j in range(1, n)]
    pad = 3 - n
    ptrs = (ctypes.c_void_p * 3)(*[y.ctypes.data for y in ys], *[None] * pad)
    ldy = (ctypes.c_longlong * 3)(*[y.strides[0] // y.itemsize for y in ys], *[0] * pad)
    out = (ctypes.c_int * 3)(*[offs[j + 1] - offs[j] for j in range(n)], *[0] * pad)
    boff = (ctypes.c_int * 3)(*offs[:n], *[0] * pad)
    b, b_slot, b_ld, b_blk = b_arg(w.b, R)
    scaling = np.ascontiguousarray(w.scaling, np.float32)  # held while the call reads them
    ranks = np.ascontiguousarray(w.ranks, np.int32)
    grid = cb.expand_v_grid(len(case.token_order), S, max(out[:n]), n)
    dims = np.asarray([R, *grid, S, n, kb], np.int32)
    vptr = gemm[:, offs[1] + max(kb - 1, 0) * n * R:].ctypes.data  # compact: the first slot's block
    rc = lib.emu_expand_v(DTYPE_CODE[case.spec.dtype], ptrs, ldy, out, boff,
                          ctypes.c_void_p(vptr), ctypes.c_longlong(gemm.shape[1]),
                          ctypes.c_void_p(b.ctypes.data), ctypes.c_longlong(b_slot), ctypes.c_int(b_ld),
                          ctypes.c_longlong(b_blk),
                          ctypes.c_void_p(scaling.ctypes.data), ctypes.c_void_p(ranks.ctypes.data),
                          ctypes.c_void_p(case.token_order.ctypes.data), ctypes.c_void_p(case.slot_indptr.ctypes.data),
                          ctypes.c_void_p(dims.ctypes.data))
    assert rc == 0, f"no lora_expand_v for rank width {R}"
    if compact:  # the every-slot v and GEMM array the compact ones stand for
        return [y.copy() for y in ys], v, np.concatenate([case.y0[:, :offs[1]], v], axis=1)
    return [y.copy() for y in ys], v, gemm


def check_expand_v(case, got: list[np.ndarray], v: np.ndarray, gemm: np.ndarray) -> None:
    """As tests/gpu/test_expand_v_gpu.py: v untouched, rows of slot 0 and padding bit-exact,
    every slice on the float64 oracle within the dtype's tolerance, and moved by its delta."""
    from test_expand_v_gpu import _oracle

    offs = case.w.out_offsets
    assert np.array_equal(gemm[:, offs[1]:].view(np.uint16), v.view(np.uint16)), "v was written"
    want = _oracle(case, v)
    t = case.touched
    for j in range(len(offs) - 1):
        y0j = case.y0[:, offs[j]:offs[j + 1]]
        assert np.array_equal(got[j][~t].view(np.uint16), y0j[~t].view(np.uint16)), f"slice {j}: untouched rows written"
        if not t.any():
            continue
        assert np.isfinite(got[j][t].astype(np.float64)).all(), f"slice {j}: v or B past a rank was read"
        delta = want[j][t] - y0j[t].astype(np.float64)
        if np.linalg.norm(delta) == 0:
            assert np.array_equal(got[j][t].view(np.uint16), y0j[t].view(np.uint16))
            continue
        err = np.linalg.norm(got[j][t].astype(np.float64) - want[j][t]) / np.linalg.norm(want[j][t])
        assert err < cb.TOLERANCE[case.spec.dtype], f"slice {j}: relative error {err:.3g}"
        moved = np.linalg.norm(got[j][t].astype(np.float64) - y0j[t].astype(np.float64))
        assert moved >= 0.5 * np.linalg.norm(delta), f"slice {j}: the delta did not land"


def silu64(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def run_glu(lib, case, spec: dict, sms: int) -> dict:
    """``lora_expand_glu`` on the host for ``case`` (a two-slice target of ``inter`` columns each)
    as the backend launches it (LayerLaunch.glu), after the whole target's ``lora_shrink`` (tiles of
    64) into a zero v; plain mode runs no shrink and poisons v and the counters (it must read
    neither; token_order and slot_indptr are null, as the backend passes them). Returns what
    check_glu needs: every buffer before and after, h's view, v, counters."""
    w, dt = case.w, case.spec.dtype
    S, n, R, in_f = w.a.shape
    inter, rows = spec["inter"], case.y0.shape[0]
    plain = spec.get("plain", False)
    if spec["fused"]:  # the gate_up GEMM's output: g and u its halves, one row stride
        gu = np.array(case.y0, copy=True, order="C")
        g, u, bufs = gu[:, :inter], gu[:, inter:], {"gu": gu}
    else:
        g, u = np.ascontiguousarray(case.y0[:, :inter]), np.ascontiguousarray(case.y0[:, inter:])
        bufs = {"g": g, "u": u}
    ld = g.strides[0] // g.itemsize
    if spec["h"] == "g":
        h = g
    else:  # rows 8 wider than h's columns, NaN: every element the kernel must not write stays NaN
        hb = np.full((rows, inter + 8), np.nan, np.float32).astype(g.dtype)
        h, bufs["h"] = hb[:, :inter], hb
    ld_h = h.strides[0] // h.itemsize
    rw = cb.rank_width(R)
    plan = plan_for(case, expand="expand", tile=64, sms=sms, whole=False)
    ws = np.zeros(plan.bucket * n * rw, np.float32)
    counters = np.zeros(plan.counter_ints(), np.int32)
    if plain:
        ws[:], counters[:] = np.nan, 7
        positions = int(case.slot_indptr[-1])  # the unpadded rows: those past it stay as they were
    else:
        run(lib, case, plan, misalign=False, part="shrink", ws=ws, counters=counters)
        positions = case.token_order.shape[0]
    before = {k: bf.copy() for k, bf in bufs.items()}
    ws0, counters0 = ws.copy(), counters.copy()
    # LayerLaunch.glu's grid: one wave of GLU_BLOCKS_PER_SM blocks a multiprocessor over tiles x groups
    tiles = -(-positions // cb.RING_BM)
    col_blocks = -(-inter // cb.RING_BN)
    groups = max(1, min(col_blocks, (cb.GLU_BLOCKS_PER_SM * sms) // tiles))
    cpb = -(-col_blocks // groups)
    groups = -(-col_blocks // cpb)
    ks = next(k for k in GLU_KS if 16 * k >= rw)
    offs = np.asarray(w.out_offsets, np.int32)
    assert list(offs) == [0, inter, 2 * inter]
    b, b_slot, b_ld, b_blk = b_arg(w.b, R)
    scaling = np.ascontiguousarray(w.scaling, np.float32)
    ranks = np.ascontiguousarray(w.ranks, np.int32)
    dims = np.asarray([S, n, R, in_f, 2 * inter, positions, positions, rw, 1, 0, col_blocks, cpb, 0, 0, 0,
                       b_slot, ld, ld_h, inter, b_ld, b_blk], np.int32)

    def ptr(a):
        return ctypes.c_void_p(None if a is None else a.ctypes.data)

    rc = lib.emu_glu(DTYPE_CODE[dt], ks, tiles * groups, int(spec.get("reverse", False)), ptr(g), ptr(u), ptr(h),
                     ptr(b), ptr(scaling), ptr(ranks), ptr(offs), ptr(None if plain else case.token_order),
                     ptr(None if plain else case.slot_indptr), ptr(ws), ptr(counters), ptr(dims))
    assert rc != 4, "shared memory past Glu<T>::SMEM written (on the device: s_indptr)"
    assert rc == 0, f"no lora_expand_glu for KS {ks}"
    return dict(bufs=bufs, before=before, h=h, positions=positions, plain=plain, inter=inter, ws=(ws0, ws),
                counters=(counters0, counters), desc=f"KS {ks} tiles {tiles:2d} groups {groups} cpb {cpb}")


def plant_inf(case) -> tuple[np.ndarray, int | None]:
    """``with_inf`` where the case has a position on an adapter slot; x unchanged and no row where its
    draw put every position on slot 0 (a one-position case may: nothing then meets an adapter)."""
    return with_inf(case) if adapter_slots(case) else (case.x, None)


def check_glu(case, r: dict, inf_row: int | None = None) -> None:
    """h on the float64 oracle: silu(g + dg) * (u + du) on the rows of every addressed position (for
    plain mode the first ``positions`` rows, silu(g) * u), within the dtype's tolerance over them
    and, each row, within 4 times it of the rows' mean norm; no NaN (B, A past a rank, v); the
    delta landed on rows of an adapter; every other element of g, u and h bit-exact; v and the
    counters back at zero (plain mode: as they were). ``inf_row``: x's row holding an inf (--inf),
    whose h row is NaN by design: the others are checked."""
    inter, dt = r["inter"], case.spec.dtype
    rows = case.y0.shape[0]
    (ws0, ws), (counters0, counters) = r["ws"], r["counters"]
    if r["plain"]:
        assert np.array_equal(ws.view(np.int32), ws0.view(np.int32)), "plain mode wrote v"
        assert np.array_equal(counters, counters0), "plain mode wrote the counters"
    else:
        assert not ws.any(), "v not zeroed after lora_expand_glu"
        assert not counters.any(), "counters not reset after lora_expand_glu"
    y0 = case.y0.astype(np.float64)
    base = silu64(y0[:, :inter]) * y0[:, inter:]  # slot 0's rows, and no delta
    if r["plain"]:
        hit, want = np.arange(rows) < r["positions"], base
    else:
        hit = np.zeros(rows, bool)
        hit[case.token_order[:case.slot_indptr[-1]]] = True
        want = silu64(case.ref[:, :inter]) * case.ref[:, inter:]
    h, tol = r["h"], cb.TOLERANCE[dt]
    if inf_row is not None:
        h[inf_row] = want[inf_row].astype(np.float32).astype(h.dtype)
    # every element but h's addressed rows as it was (h may be a view of g's or the gate_up array)
    for k, buf in r["bufs"].items():
        written = np.zeros(buf.shape, bool)
        if np.shares_memory(buf, h):
            written[:, :inter][hit] = True  # h starts at the array's first element in every layout
        bad = np.nonzero((buf.view(np.uint16) != r["before"][k].view(np.uint16)) & ~written)
        assert not bad[0].size, f"{k}: {bad[0].size} elements written it must not (row {bad[0][0]}, col {bad[1][0]})"
    if not hit.any():
        return
    got = h[hit].astype(np.float64)
    assert np.isfinite(got).all(), f"non-finite h in {int((~np.isfinite(got)).any(1).sum())} rows"
    err = np.linalg.norm(got - want[hit]) / np.linalg.norm(want[hit])
    assert err < tol, f"relative error {err:.3g} above {tol}"
    row_err = np.linalg.norm(got - want[hit], axis=1) / np.sqrt(np.mean(np.sum(want[hit] ** 2, axis=1)))
    k = int(np.argmax(row_err))
    assert row_err[k] < 4 * tol, f"row {np.nonzero(hit)[0][k]}: error {row_err[k]:.3g} of a mean row's norm"
    ad = hit & case.touched & (case.w.ranks[case.row_slots].max(axis=1) > 0)
    if ad.any():  # the delta really landed: without it the rows would be far off
        moved = np.linalg.norm(h[ad].astype(np.float64) - base[ad])
        assert moved >= 0.5 * np.linalg.norm(want[ad] - base[ad]), "the delta did not land"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--tiles", default="16,32,64")
    ap.add_argument("--expand", default="expand", choices=cb.EXPAND_KERNELS)
    ap.add_argument("--tiles-only", action="store_true", help="tiles even where chunks are the default")
    ap.add_argument("--chunks", action="store_true", help="(fused) chunks of one slot even where tiles are the default")
    ap.add_argument("--cp-async", default="late", choices=("late", "early"),
                    help="when an emulated cp.async lands: at the wait that retires it, or at once")
    ap.add_argument("--fused", action="store_true", help="the fused launch (chunks of one slot each)")
    ap.add_argument("--sms", type=int, default=cb.DEFAULT_SMS)
    ap.add_argument("--misalign", action="store_true")
    ap.add_argument("--asan", action="store_true")
    ap.add_argument("--aligned", default="auto", choices=("auto", "never"),
                    help="the ALIGNED instantiation where the flags allow it (as the backend), or never")
    ap.add_argument("--members", action="store_true",
                    help="each slice of a multi-slice case alone, into its own output, B read as a view")
    ap.add_argument("--halves", action="store_true",
                    help="the whole target's shrink, then each slice's expand alone into its own output")
    ap.add_argument("--inf", action="store_true",
                    help="an inf in x's row of one adapter token: v and counters must still end at zero "
                         "(0 * inf is NaN wherever a zero row of A meets it), the other rows exact")
    ap.add_argument("--expand-v", action="store_true",
                    help="lora_expand_v (expand_v.cu) on the cases of tests/gpu/test_expand_v_gpu.py, bf16 and fp16")
    ap.add_argument("--compact", action="store_true",
                    help="with --expand-v: lora_gather_a, then lora_expand_v with compact = kb, on the "
                         "small-step cases of tests/gpu/test_expand_v_gpu.py")
    ap.add_argument("--glu", action="store_true",
                    help="lora_shrink, then lora_expand_glu (expand_glu.cuh) on GLU_CASES, bf16 and fp16")
    ap.add_argument("--bound", action="store_true",
                    help="plan each whole call for its case's largest rank, as a pool's planner does "
                         "(the bound-* cases: narrower than the pool's maximum rank)")
    ap.add_argument("--b-blocked", action="store_true",
                    help="B of every case above 16 ranks rank-blocked, [S, ceil(R / 16), out, 16], as a pool "
                         "of such a max_rank holds it")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    B_BLOCKED[0] = args.b_blocked
    global BOUND
    BOUND = args.bound
    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.CDLL(str(build(Path(tmp), args.asan)))
        lib.emu_set_cp_early(int(args.cp_async == "early"))
        rng = np.random.default_rng(args.seed)
        fails = 0
        if args.glu:
            for name, spec in GLU_CASES.items():
                for dt in ("bfloat16", "float16"):
                    for sms in sorted({*GLU_SMS, args.sms}):
                        kw = {k: v for k, v in spec.items() if k not in ("inter", "h", "fused", "plain", "reverse")}
                        case = build_case(rng, dtype=dt, slices=(spec["inter"], spec["inter"]), **kw)
                        inf_row = None
                        if args.inf and not spec.get("plain"):  # plain mode reads no x
                            case.x, inf_row = plant_inf(case)
                        t0, r = time.time(), {"desc": ""}
                        try:
                            r = run_glu(lib, case, spec, sms)
                            check_glu(case, r, inf_row)
                            status = "ok"
                        except AssertionError as e:
                            fails += 1
                            status = "FAIL " + re.sub(r"\s+", " ", str(e))[:200]
                        print(f"glu {name:13s} {dt:9s} sms {sms:3d} {r['desc']} {status} ({time.time() - t0:.1f}s)",
                              flush=True)
            print(f"{fails} failed")
            return 1 if fails else 0
        if args.expand_v:
            from test_expand_v_gpu import CASES as V_CASES, COMPACT_CASES

            for name in (COMPACT_CASES if args.compact else V_CASES):
                for dt in ("bfloat16", "float16"):
                    case = build_case(rng, dtype=dt, **(COMPACT_CASES if args.compact else V_CASES)[name])
                    t0 = time.time()
                    try:
                        check_expand_v(case, *run_expand_v(lib, case, args.compact))
                        status = "ok"
                    except AssertionError as e:
                        fails += 1
                        status = "FAIL " + re.sub(r"\s+", " ", str(e))[:200]
                    print(f"expand_v {name:14s} {dt:9s} {status} ({time.time() - t0:.1f}s)", flush=True)
            print(f"{fails} failed")
            return 1 if fails else 0
        for name in args.cases.split(","):
            for dt in args.dtypes.split(","):
                tiles = ([cb.RING_BM] if args.expand == "expand_ring" else [0] if args.expand in ("chunk", "one", "pair")
                         else args.tiles.split(",")) if not args.fused else args.tiles.split(",")
                for tile in (int(t) for t in tiles):
                    case = build_case(rng, dtype=dt, **CASES[name])
                    if name in ROW_AT:
                        case = with_row_at(rng, case, *ROW_AT[name])
                    inf_row = None
                    if args.inf:
                        case.x, inf_row = plant_inf(case)
                    offs = case.w.out_offsets
                    members = range(len(offs) - 1) if args.members else [None]
                    if (args.members or args.halves) and len(offs) < 3:
                        continue  # one slice: nothing to serve apart
                    try:
                        plans = [plan_for(case, expand=args.expand, tile=tile, sms=args.sms, fused=args.fused,
                                          chunks=False if args.tiles_only else True if args.chunks else None,
                                          out=None if j is None else offs[j + 1] - offs[j]) for j in members]
                    except ValueError as e:  # lora_chunk, lora_one, lora_pair: a case it does not serve
                        if args.expand not in ("chunk", "one", "pair"):
                            raise
                        print(f"{name:10s} {dt:9s} {args.expand}: not served ({e})", flush=True)
                        continue
                    plan = plans[0]
                    t0 = time.time()
                    try:
                        y = np.empty_like(case.y0)
                        if args.halves:
                            y, flags, al = run_halves(lib, case, expand=args.expand, tile=tile, sms=args.sms,
                                                      misalign=args.misalign, aligned=args.aligned)
                            members = []
                        for j, p in zip(members, plans):
                            yj, flags, al = run(lib, case, p, misalign=args.misalign, aligned=args.aligned, member=j)
                            if j is None:
                                y = yj
                            else:
                                y[:, offs[j]:offs[j + 1]] = yj
                        if inf_row is not None:  # its row is inf / NaN by design: the others are checked
                            y[inf_row] = case.ref[inf_row].astype(np.float32).astype(y.dtype)
                        check_result(case, y, dt)
                        status = f"flags {flags}{' ALIGNED' if al else ''}: ok"
                    except AssertionError as e:
                        fails += 1
                        status = "FAIL " + re.sub(r"\s+", " ", str(e))[:200]
                    kind = ("fused" if plan.fused else f"shrink/{plan.expand}") + ("/chunks" if plan.chunks else "")
                    print(f"{name:10s} {dt:9s} tile {plan.bm:2d} {kind} units {plan.tiles:3d} splits {plan.splits:3d} "
                          f"cpb {plan.cpb:3d} {status} ({time.time() - t0:.1f}s)", flush=True)
        print(f"{fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
