"""Finding, compiling and loading the CUDA C sources in ``raw_kernels/``.

One loader: it reads a ``.cu`` file, prepends a variant's ``#define``s and returns a memoized
module. On most devices that is a ``cupy.RawModule`` (CuPy caches the compiled module per device and
on disk); on Hopper the kernels are built for the architecture-specific target ``sm_90a`` (its
warpgroup MMAs), which CuPy's own compile cannot ask for, so NVRTC is called here and the CUBIN is
cached on disk (:func:`cache_dir`) and loaded. The compile check runs the same NVRTC with the same
options and include path, for a chosen architecture, and needs no GPU.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import LoraError

_PKG = Path(__file__).resolve().parent

#: The options every kernel is compiled with, at run time and by the compile check. NVRTC 13.0 (the
#: toolkit of CUDA 13.0 hosts) takes a generic lambda in device code for a host function and refuses
#: lora_mma.cu without ``-default-device`` (unannotated functions are device functions); 13.5 does not.
NVRTC_OPTIONS = ("-std=c++17", "-default-device")
#: The architectures the compile check builds for: Hopper's build (``device_arch``), the same
#: sources without its architecture-specific instructions (what a later architecture compiles), Ampere.
CHECK_ARCHS = ("sm_90a", "sm_90", "sm_80")
#: Where :func:`cache_dir` keeps the CUBINs built here at run time (default: ``$XDG_CACHE_HOME/lora_cupy``,
#: else ``~/.cache/lora_cupy``).
CACHE_ENV = "LORA_CUPY_CACHE_DIR"


class KernelCompileError(LoraError):
    """NVRTC refused a kernel source; the message holds its log."""


@dataclass(frozen=True)
class KernelFamily:
    """One ``.cu`` file and the template instantiations run time asks of it."""

    file: str
    name_expressions: tuple[str, ...] = ()


#: CUDA element type of each dtype the pool serves.
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
_DTYPES = tuple(CUDA_TYPES.values())

#: Tile heights (positions per block) of the tensor-core shrink.
MMA_SHRINK_BM = (16, 32, 64)
#: (tile height, column block) pairs of the tensor-core expand and of the fused kernel.
MMA_TILES = ((16, 64), (32, 128), (64, 128))
#: Columns of one pass of ``lora_expand_stream``, ``Stream<T>::BN`` in expand_stream.cuh.
STREAM_BN = 32
#: The expand kernels an unfused plan may pick, by their CUDA names less ``lora_``: ``expand``
#: (tiles of y through shared memory), ``expand_stream`` (y streamed by each warp through its
#: registers) and ``expand_ring`` (tiles of 64 positions, y and B through a ring of cp.async stages,
#: v in registers), each after ``lora_shrink``; and ``chunk`` (``lora_chunk``, chunk.cuh: the shrink
#: and the expand of each chunk of one slot in the same blocks, one launch). There is one fused
#: kernel for decode sizes (``lora_fused``); ``one`` (``lora_one``, one.cuh: the whole delta of a
#: step of one position in thread-block clusters, sm_90); and ``pair`` (``lora_pair_shrink`` then
#: ``lora_pair_expand``, pair.cuh: the decode buckets' delta in two light launches that overlap the
#: call before under programmatic dependent launch).
EXPAND_KERNELS = ("expand", "expand_stream", "expand_ring", "chunk", "one", "pair")
#: Tile height and column block of ``lora_expand_ring`` (``Ring<T>`` in expand_ring.cuh).
RING_BM = 64
RING_BN = 64


#: Access flags (``flags`` of every tensor-core kernel: 1 = x and A, 2 = B, 4 = y take 16-byte
#: loads and stores) of a call that runs the kernels' ``ALIGNED = true`` instantiations, built with
#: every 16-byte path taken and no element-wise code; any other flags run ``ALIGNED = false``,
#: which reads the flags at run time.
ALIGNED_FLAGS = 7
#: Access flag (common.cuh, ``lora::EARLY_READS``): the kernel before a call writes neither the step's
#: addressing nor the weights, so ``lora_one`` reads them before it waits for that kernel.
EARLY_READS = 8


def _cbool(v: bool) -> str:
    return "true" if v else "false"


def mma_name(ctype: str, kernel: str, bm: int, *, aligned: bool, bn: int | None = None,
             chunks: bool = False) -> str:
    """The name expression of one tensor-core kernel: ``kernel`` is ``shrink``, ``expand``,
    ``expand_stream``, ``expand_ring`` or ``fused``; ``aligned`` picks its ``ALIGNED`` instantiation."""
    a = _cbool(aligned)
    if kernel == "shrink":
        return f"lora_shrink<{ctype}, {bm}, {a}>"
    if kernel == "expand":
        return f"lora_expand<{ctype}, {bm}, {bn}, {a}>"
    if kernel == "fused":
        return f"lora_fused<{ctype}, {bm}, {bn}, {_cbool(chunks)}, {a}>"
    if kernel == "expand_stream":
        return f"lora_expand_stream<{ctype}, {bm}, {a}>"
    if kernel == "expand_ring":
        return f"lora_expand_ring<{ctype}, {a}>"
    raise ValueError(f"no tensor-core kernel {kernel!r}")


#: Rank widths ``lora_chunk`` (chunk.cuh) is built for: a pool of rank 16 or less runs the first, one
#: of rank 17-64 the second, 65-128 the third; its element types (16-bit only) and positions a chunk
#: (above ``backends.cupy.CHUNK_NARROW_TO`` positions: at rank width 16, and below ``CHUNK_WIDE_FROM``
#: positions at the others; ``chunk_bm``).
CHUNK_RW = (16, 64, 128)
CHUNK_DTYPES = ("float16", "bfloat16")
CHUNK_BM = 32
#: Positions a chunk of lora_chunk up to ``backends.cupy.CHUNK_NARROW_TO`` positions (decode: a
#: chunk of a few positions fills one m-tile, not two); every step's counters are sized for these.
CHUNK_NARROW_BM = 16
#: Positions a chunk of lora_chunk at rank widths above 16 from ``backends.cupy.CHUNK_WIDE_FROM``
#: positions, and from ``CHUNK_DEEP_WIDE_FROM`` for a deep target (``chunk_bm``): a wide A and B are read
#: once for 64 rows.
CHUNK_WIDE_BM = 64
#: Positions a chunk of lora_chunk at rank widths above 16 from ``backends.cupy.CHUNK_TALL_FROM``
#: positions (``chunk_bm``): A and B read once for 128 rows, by blocks of 8 warps (``chunk_threads``).
CHUNK_TALL_BM = 128
#: The rank width whose chunks of ``CHUNK_WIDE_BM`` and ``CHUNK_TALL_BM`` run on warpgroup MMAs where built for
#: sm_90a (``Chunk::WG``); the other widths' run on mma.sync.
CHUNK_WG_RW = 64
#: Parts of a chunk that share its shrink's `in` with the ranks split between them (``Chunk::RSPLIT``): one
#: slice at rank width 64 in chunks of ``CHUNK_BM``, where a chunk's parts are a multiple of it.
CHUNK_RSPLIT = 2
#: The largest share of B a lora_chunk part copies through L1 (``CHUNK_B_L1_MAX``, chunk.cuh; bytes: its
#: column blocks x their columns x the rank width x 2); a larger share goes through L2 only.
CHUNK_B_L1_MAX = 48 * 1024
#: ``(rank width, positions a chunk)`` of each lora_chunk instantiation.
CHUNK_SHAPES = tuple((rw, bm) for rw in CHUNK_RW
                     for bm in ((CHUNK_NARROW_BM, CHUNK_BM) + ((CHUNK_WIDE_BM, CHUNK_TALL_BM) if rw > 16 else ())))


def chunk_threads(bm: int) -> int:
    """Threads a block of lora_chunk in chunks of ``bm`` positions (``Chunk::NTHREADS``): 4 warps, 8
    in chunks of ``CHUNK_TALL_BM`` (a warp an m-tile of 16 rows, as in chunks of 64)."""
    return 256 if bm == CHUNK_TALL_BM else 128


def chunk_name(ctype: str, rw: int, bm: int, *, aligned: bool, sliced: bool) -> str:
    """The name expression of ``lora_chunk`` (chunk.cuh, in the tensor-core family) for one element
    type, rank width (``CHUNK_RW``) and instantiation: ``sliced`` serves several slices with
    columns, the other one slice (the slice loops and lookups compiled out)."""
    return f"lora_chunk<{ctype}, {rw}, {bm}, {_cbool(aligned)}, {_cbool(sliced)}>"


def mma_kernels():
    """``(kernel, bm, bn, chunks)`` of every tensor-core kernel a dtype's module holds, each in
    two instantiations (``aligned`` False and True): what the module is built with and the
    backend loads."""
    for bm in MMA_SHRINK_BM:
        yield "shrink", bm, None, False
    for bm, bn in MMA_TILES:
        yield "expand", bm, bn, False
        for chunks in (False, True):
            yield "fused", bm, bn, chunks
        yield "expand_stream", bm, None, False
    yield "expand_ring", RING_BM, RING_BN, False


#: k-steps of 16 ranks ``lora_expand_glu`` is built for (its rank width / 16, chosen as the smallest
#: that covers the pool's), and the element types it serves.
GLU_KS = (1, 2, 4)
GLU_DTYPES = ("float16", "bfloat16")


def glu_name(ctype: str, ks: int) -> str:
    """The name expression of ``lora_expand_glu`` (expand_glu.cuh, in the tensor-core family)."""
    return f"lora_expand_glu<{ctype}, {ks}>"


#: Rank widths ``lora_one`` (one.cuh: the capture bucket of one position, in thread-block clusters of
#: ``ONE_CLUSTER`` blocks) is built for, as lora_chunk's (every element type).
ONE_RW = (16, 64, 128)
ONE_CLUSTER = 8


def one_name(ctype: str, rw: int, *, aligned: bool) -> str:
    """The name expression of ``lora_one`` (one.cuh, in the tensor-core family) for one element type
    and rank width (``ONE_RW``)."""
    return f"lora_one<{ctype}, {rw}, {_cbool(aligned)}>"


#: Slices a ``lora_pair_shrink`` instantiation is built for at each rank width of the pair (pair.cuh:
#: NS slices of RW / 16 row tiles each; a target of n slices takes the smallest at least n), and
#: positions a chunk of the pair.
PAIR_RT = {16: (1, 2, 3, 4, 8), 64: (1, 2)}
PAIR_M = 8


def pair_name(ctype: str, part: str, *, aligned: bool, rw: int = 16, rt: int = 0) -> str:
    """The name expression of ``lora_pair_shrink`` (``part="shrink"``, for ``rt`` slices, one of
    ``PAIR_RT[rw]``) or ``lora_pair_expand`` at rank width ``rw`` (a key of ``PAIR_RT``; pair.cuh, in
    the 16-bit tensor-core families)."""
    if part == "shrink":
        return f"lora_pair_shrink<{ctype}, {rt}, {rw}, {_cbool(aligned)}>"
    return f"lora_pair_expand<{ctype}, {rw}, {_cbool(aligned)}>"


def _mma_names(ctype: str) -> tuple[str, ...]:
    glu = tuple(glu_name(ctype, ks) for ks in GLU_KS) if ctype != "float" else ()
    chunk = tuple(chunk_name(ctype, rw, bm, aligned=a, sliced=sl) for rw, bm in CHUNK_SHAPES
                  for a in (False, True) for sl in (False, True)) if ctype != "float" else ()
    one = tuple(one_name(ctype, rw, aligned=a) for rw in ONE_RW for a in (False, True))
    pair = (tuple(pair_name(ctype, "shrink", aligned=a, rw=rw, rt=rt) for rw in PAIR_RT for rt in PAIR_RT[rw]
                  for a in (False, True))
            + tuple(pair_name(ctype, "expand", aligned=a, rw=rw) for rw in PAIR_RT for a in (False, True))
            ) if ctype != "float" else ()
    return tuple(mma_name(ctype, k, bm, bn=bn, chunks=c, aligned=aligned)
                 for aligned in (False, True) for k, bm, bn, c in mma_kernels()) + glu + chunk + one + pair


#: Rank widths (the pool's maximum rank) ``lora_expand_v`` is built for, and the positions a block.
EXPAND_V_RANKS = (8, 16, 32, 64, 128)
EXPAND_V_TG = 8
#: Columns a block of ``lora_expand_v`` (128 threads of 4 columns).
EXPAND_V_BN = 512
#: Element types ``lora_expand_v`` serves (it moves 8-byte pieces of 2-byte elements).
EXPAND_V_DTYPES = ("float16", "bfloat16")


#: ``lora_gather_a`` (expand_v.cu): a small step's slots' A rows placed beside the base weight.
GATHER_A_NAME = "lora_gather_a"
#: Threads of a ``lora_gather_a`` block.
GATHER_A_THREADS = 256


def expand_v_name(ctype: str, rank_width: int) -> str:
    """The name expression of ``lora_expand_v`` (expand_v.cu) for one element type and rank width."""
    return f"lora_expand_v<{ctype}, {rank_width}, {EXPAND_V_TG}>"


def mma_family(dtype: str) -> str:
    """The tensor-core family of one dtype: each dtype is its own module, compiled on first use."""
    return f"lora_mma_{dtype}"


#: Every kernel family the backends load; the compile check builds each of them.
FAMILIES: dict[str, KernelFamily] = {
    "lora_delta": KernelFamily(
        "lora_delta.cu",
        tuple(f"lora_shrink_simt<{t}>" for t in _DTYPES) + tuple(f"lora_expand_simt<{t}>" for t in _DTYPES),
    ),
    **{mma_family(d): KernelFamily("lora_mma.cu", _mma_names(t)) for d, t in CUDA_TYPES.items()},
    "lora_expand_v": KernelFamily(
        "expand_v.cu", (*(expand_v_name(CUDA_TYPES[d], r) for d in EXPAND_V_DTYPES for r in EXPAND_V_RANKS),
                        GATHER_A_NAME)),
}


def kernel_dir() -> Path:
    """Where the ``.cu`` sources are: inside an installed wheel, else the checkout's ``raw_kernels/``."""
    for d in (_PKG / "_kernels", _PKG.parent / "raw_kernels"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError(f"no raw_kernels directory beside {_PKG}")


def kernel_sources() -> list[Path]:
    return sorted(kernel_dir().glob("*.cu"))


def read_source(file: str, defines: Mapping[str, object] | None = None) -> str:
    """The source of ``file`` with ``#define NAME VALUE`` lines for a variant prepended.

    A first comment line carries the sha256 of every shared header: CuPy keys its compile cache on
    the source text and options alone, so without it an edited ``.cuh`` would reuse a stale module.
    """
    text = (kernel_dir() / file).read_text()
    head = f"// headers {_headers_digest()}\n"
    head += "".join(f"#define {k} {v}\n" for k, v in sorted((defines or {}).items()))
    return head + text


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(kernel_dir().glob("*.cuh")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def run_options(options=NVRTC_OPTIONS) -> tuple[str, ...]:
    """NVRTC options at run time (``options`` and the kernels' directory): CuPy adds the device's
    architecture and its toolkit headers; :func:`compile_options` adds them for the project's own compile."""
    return (*options, f"-I{kernel_dir()}")


def device_arch(compute_capability: str) -> str:
    """The target the kernels are built for on a device of ``compute_capability`` (CuPy's ``"90"``):
    ``sm_90a`` on Hopper, whose warpgroup MMAs (chunk.cuh's chunks of 64 and 128) exist only there, else
    ``sm_<cc>``."""
    cc = str(compute_capability)
    if not cc.isdigit():
        raise ValueError(f"compute capability {compute_capability!r} is not a number such as '90'")
    return "sm_90a" if cc == "90" else f"sm_{cc}"


def cuda_include_dirs() -> list[str]:
    """Where ``cuda_fp16.h`` / ``cuda_bf16.h`` are found: the CUDA wheels, a toolkit, or CuPy's CUDA."""
    dirs = []
    for base in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include"):
            d = Path(base) / sub
            if (d / "cuda_fp16.h").is_file():
                dirs.append(str(d))
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    if "cupy" in sys.modules:  # on a GPU machine: the toolkit CuPy itself compiles with
        try:
            dirs.append(os.path.join(sys.modules["cupy"].cuda.get_cuda_path() or "", "include"))
        except Exception:  # noqa: BLE001 - a CuPy without a CUDA path adds nothing
            pass
    dirs.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(dirs) if os.path.isfile(os.path.join(d, "cuda_fp16.h"))]


def _nvrtc(source: str, name: str, arch: str, name_expressions, cubin: bool):
    """``(PTX or CUBIN, {name expression: lowered name})`` of one NVRTC compile, as at run time."""
    ptx, bin_, lowered = _nvrtc_both(source, name, arch, tuple(name_expressions))
    return (bin_ if cubin else ptx), dict(lowered)


#: NVRTC compiles done in this process, or under way in a worker process (a ``Future``,
#: :func:`compile_ahead`), by ``(source, name, arch, name expressions)``: the compile check, the code
#: sizes and a prebuild of the same family and architecture share one compile (a tensor-core family
#: takes minutes). The ``_COMPILED_KEEP`` most recent results are kept.
_COMPILED: dict[tuple, object] = {}
_COMPILED_KEEP = 16
_AHEAD = None  # the worker processes of compile_ahead (a ProcessPoolExecutor), started on first use


def _nvrtc_both(source: str, name: str, arch: str, name_expressions: tuple[str, ...]):
    """One NVRTC compile's PTX, CUBIN and lowered names (a sorted tuple of pairs), kept for the
    process; a compile that :func:`compile_ahead` started is waited for rather than run again."""
    from concurrent.futures import Future

    key = (source, name, arch, tuple(name_expressions))
    hit = _COMPILED.pop(key, None)
    if isinstance(hit, Future):
        try:
            hit = hit.result()
        except Exception:  # noqa: BLE001 - a refused source (or a lost worker): compiled here for its log
            hit = None
    if hit is None:
        hit = _nvrtc_compile(*key)
    _COMPILED[key] = hit
    done = [k for k, v in _COMPILED.items() if not isinstance(v, Future)]
    for k in done[:max(0, len(done) - _COMPILED_KEEP)]:
        del _COMPILED[k]
    return hit


def compile_options(arch: str, options=NVRTC_OPTIONS) -> list[str]:
    """The whole option list of one NVRTC compile for ``arch``: :func:`run_options` of ``options``, the
    target, and where the CUDA headers are."""
    return [*run_options(options), f"-arch={arch}", *(f"-I{d}" for d in cuda_include_dirs())]


def _nvrtc_compile(source: str, name: str, arch: str, name_expressions: tuple[str, ...], extra: tuple[str, ...] = ()):
    """One NVRTC compile with the run-time options for ``arch`` (and ``extra`` options after them):
    ``(PTX, CUBIN, lowered names)``."""
    from cupy_backends.cuda.libs import nvrtc

    opts = [*compile_options(arch), *extra]
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise KernelCompileError(f"NVRTC failed for {arch}: {e}\n{log}", path=name) from None
        lowered = tuple((expr, nvrtc.getLoweredName(prog, expr)) for expr in name_expressions)
        return nvrtc.getPTX(prog), _whole_elf(nvrtc.getCUBIN(prog)), lowered
    finally:
        nvrtc.destroyProgram(prog)


def compile_ahead(pairs=None, jobs: int | None = None) -> list:
    """Start the NVRTC compiles of ``(family, arch)`` pairs (default: every family for each of
    ``CHECK_ARCHS``) in ``jobs`` worker processes (default: the CPUs, at most the pairs), the
    largest families first, and return their futures. A later :func:`compile_family`,
    :func:`code_sizes` or :func:`prebuild` of the same source and architecture in this process
    waits for its result instead of compiling again; a compile that fails in a worker is run again
    where it is asked for, so its error is raised there. Nothing is started for a pair already
    compiled or under way."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    global _AHEAD
    pairs = list(pairs if pairs is not None else [(f, a) for a in CHECK_ARCHS for f in FAMILIES])
    todo = []
    for family, arch in pairs:
        fam = FAMILIES[family]
        key = (read_source(fam.file), fam.file, arch, tuple(fam.name_expressions))
        if key not in _COMPILED and key not in (k for k, _ in todo):
            newer = int("".join(c for c in arch if c.isdigit()) or 0) >= 90  # sm_90 measured 1.4x sm_80's time
            todo.append((key, len(fam.name_expressions) * (1.5 if newer else 1)))
    if not todo:
        return []
    if _AHEAD is None:
        jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
        _AHEAD = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    futures = []
    for key, _ in sorted(todo, key=lambda t: -t[1]):  # the largest first: they bound the wall time
        _COMPILED[key] = fut = _AHEAD.submit(_nvrtc_compile, *key)
        futures.append(fut)
    return futures


def cancel_ahead() -> None:
    """Stop :func:`compile_ahead`'s workers: compiles not started are dropped, running ones killed
    (an interpreter would otherwise wait for them at exit), and what they would have given is
    compiled where it is asked for."""
    from concurrent.futures import Future

    global _AHEAD
    if _AHEAD is None:
        return
    procs = getattr(_AHEAD, "_processes", None)  # the executor's own: no public handle before 3.14
    procs = list(procs.values()) if isinstance(procs, dict) else []
    _AHEAD.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.terminate()
    for key in [k for k, v in _COMPILED.items() if isinstance(v, Future)]:
        del _COMPILED[key]
    _AHEAD = None


def compile_source(source: str, name: str, arch: str, name_expressions=()) -> str:
    """Compile ``source`` with NVRTC for ``arch`` (``"sm_90"``), as at run time; return the PTX.

    Raises :class:`KernelCompileError` with NVRTC's log when the source does not compile.
    """
    return _nvrtc(source, name, arch, name_expressions, cubin=False)[0]


def compile_family(family: str, arch: str) -> str:
    fam = FAMILIES[family]
    return compile_source(read_source(fam.file), fam.file, arch, fam.name_expressions)


def _elf_heads(blob: bytes) -> list[tuple[int, int, int, int, int, int]]:
    """The section headers (name offset, type, flags, address, offset, size) of a 64-bit
    little-endian ELF image (a CUBIN)."""
    import struct

    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise ValueError("not a 64-bit ELF image")
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", blob, 0x3A)
    return [struct.unpack_from("<IIQQQQ", blob, shoff + i * shentsize) for i in range(shnum)]


def _elf_sections(blob: bytes, data: bool = False) -> dict[str, int] | dict[str, bytes]:
    """Section name -> size (``data``: the bytes) of a 64-bit little-endian ELF image (a CUBIN)."""
    import struct

    heads = _elf_heads(blob)
    strtab = heads[struct.unpack_from("<H", blob, 0x3E)[0]][4]
    names = {}
    for name_off, _, _, _, off, size in heads:
        end = blob.index(b"\0", strtab + name_off)
        names[blob[strtab + name_off:end].decode()] = blob[off:off + size] if data else size
    return names


def _elf_end(blob: bytes) -> int:
    """The bytes a 64-bit little-endian ELF image spans by its own header: its program and section
    header tables and every section's data (SHT_NOBITS sections, .bss and .nv.shared, occupy none)."""
    import struct

    phoff, shoff = struct.unpack_from("<QQ", blob, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", blob, 0x36)
    ends = [off + size for _, kind, _, _, off, size in _elf_heads(blob) if kind != 8]
    return max([phoff + phentsize * phnum, shoff + shentsize * shnum, *ends])


def _whole_elf(cubin: bytes) -> bytes:
    """A CUBIN as NVRTC wrote it. CuPy's ``nvrtc.getCUBIN`` (14.2) returns the image less its last
    byte (a zero: the high byte of its last program header, which ends the file), so tools that read
    the whole image (nvdisasm, cuobjdump) refuse the file; the few bytes its header says it spans
    past the end are given back as the zeros NVRTC wrote."""
    try:
        short = _elf_end(cubin) - len(cubin)
    except ValueError:  # not an ELF image: as it is
        return cubin
    return cubin + b"\0" * short if 0 < short <= 8 else cubin


def code_sizes(family: str, arch: str = "sm_90") -> dict[str, int]:
    """SASS instructions (16 bytes each from sm_70 on) of every kernel of one family, by its name
    expression: what a launch asks of the instruction caches (a kernel's code, too, comes from DRAM
    after an L2 flush). Compiled with NVRTC for ``arch``; no GPU needed."""
    fam = FAMILIES[family]
    cubin, lowered = _nvrtc(read_source(fam.file), fam.file, arch, fam.name_expressions, cubin=True)
    sections = _elf_sections(cubin)
    return {expr: sections[f".text.{low}"] // 16 for expr, low in lowered.items()}


#: A directory of CUBINs built ahead (``lora-cupy check-kernels --prebuild DIR``, no GPU needed): where
#: set, a family whose source (headers included), architecture and kernels match a file there loads
#: it rather than compiling with NVRTC on first use (about 90 s a 16-bit dtype's tensor-core family);
#: a family with no match, or one the driver refuses, compiles as without it.
PREBUILT_ENV = "LORA_CUPY_PREBUILT"


def prebuilt_stem(family: str, arch: str, source: str) -> str:
    """The file name (less ``.cubin`` / ``.json``) of one family's prebuilt CUBIN: its source text
    (``read_source``, whose first line digests the headers), ``arch``, the compile options and its
    name expressions, hashed; a source or kernel list changed since the build matches no file."""
    fam = FAMILIES[family]
    key = "\0".join((source, arch, *NVRTC_OPTIONS, *fam.name_expressions))
    return f"{family}.{arch}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def prebuild(out_dir, arch: str = "sm_90a", families=None) -> list[Path]:
    """Compile ``families`` (default: all) with NVRTC for ``arch`` into ``out_dir``: for each, the
    CUBIN and a JSON of its name expressions' lowered names. Returns the CUBINs written."""
    written = []
    for family in families or FAMILIES:
        fam = FAMILIES[family]
        source = read_source(fam.file)
        blob, lowered = _nvrtc(source, fam.file, arch, fam.name_expressions, cubin=True)
        written.append(_store_cubin(out_dir, family, arch, source, blob, lowered))
    return written


class PrebuiltModule:
    """A CUBIN (built ahead, or here by :func:`cached_cubin`) loaded as a ``cupy.RawModule``, its
    kernels asked for by name expression."""

    def __init__(self, cubin: Path, lowered: Mapping[str, str]):
        import cupy

        self.path = cubin
        self._module = cupy.RawModule(path=str(cubin))
        self._lowered = dict(lowered)

    def get_function(self, name_expression: str):
        return self._module.get_function(self._lowered[name_expression])


def _cubin_files(where, family: str, arch: str, source: str) -> tuple[Path, Path]:
    """The CUBIN and names file of one family, target and source under ``where`` (``prebuilt_stem``)."""
    stem = Path(where) / prebuilt_stem(family, arch, source)
    return Path(f"{stem}.cubin"), Path(f"{stem}.json")


def _store_cubin(where, family: str, arch: str, source: str, blob: bytes, lowered: Mapping[str, str]) -> Path:
    """Write a compile's CUBIN and lowered names under ``where``, each file renamed into place whole
    (a process that stops mid-write leaves no torn file); returns the CUBIN's path."""
    return _write_cubin(*_cubin_files(where, family, arch, source), blob, lowered)


def _write_cubin(cubin: Path, names: Path, blob: bytes, lowered: Mapping[str, str]) -> Path:
    import json

    cubin.parent.mkdir(parents=True, exist_ok=True)
    for path, data in ((cubin, blob), (names, json.dumps(dict(lowered), indent=0).encode())):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return cubin


def _stored_cubin(where, family: str, arch: str, source: str) -> tuple[Path, dict[str, str]] | None:
    """The family's CUBIN for ``arch`` and its lowered names if ``where`` holds them for this very
    source (``prebuilt_stem``), else None; a names file that cannot be read raises (OSError, ValueError)."""
    return _read_stored(*_cubin_files(where, family, arch, source))


def _read_stored(cubin: Path, names: Path) -> tuple[Path, dict[str, str]] | None:
    """``cubin`` and the lowered names in ``names`` where both files are there, else None; a names file
    that cannot be read raises (OSError, ValueError)."""
    import json

    if not (cubin.is_file() and names.is_file()):
        return None
    return cubin, dict(json.loads(names.read_text()))


def _loaded(cubin: Path, lowered: Mapping[str, str], family: str) -> PrebuiltModule:
    """``cubin`` as a module, loaded now (the first kernel asked for): a refusal by the driver raises here."""
    return _loaded_as(cubin, lowered, FAMILIES[family].name_expressions[:1])


def _loaded_as(cubin: Path, lowered: Mapping[str, str], first=()) -> PrebuiltModule:
    mod = PrebuiltModule(cubin, lowered)
    for expr in first:
        mod.get_function(expr)
    return mod


def _portable_build_warning(name: str, arch: str, e: Exception, stacklevel: int) -> None:
    """The warning of a failed build for ``arch`` (sm_90a) that falls back to CuPy's build for ``sm_<cc>``."""
    import warnings

    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    warnings.warn(f"{name}: the {arch} build failed ({first}); compiling it through CuPy for {arch[:-1]} "
                  "instead (no warpgroup MMAs)", RuntimeWarning, stacklevel=stacklevel + 1)


def _prebuilt(family: str, source: str, arch: str):
    """The family's prebuilt module for ``arch`` from ``PREBUILT_ENV``'s directory, or None."""
    import warnings

    where = os.environ.get(PREBUILT_ENV, "").strip()
    if not where:
        return None
    try:
        hit = _stored_cubin(where, family, arch, source)
        return None if hit is None else _loaded(*hit, family)
    except Exception as e:  # noqa: BLE001 - any refusal falls back to compiling, with a warning
        name = prebuilt_stem(family, arch, source) + ".cubin"
        warnings.warn(f"{PREBUILT_ENV}: {name} not loaded ({e}); compiling {family} instead", stacklevel=2)
        return None


def cache_dir() -> Path:
    """Where CUBINs compiled here at run time are kept between processes (``CACHE_ENV``)."""
    where = os.environ.get(CACHE_ENV, "").strip()
    if where:
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lora_cupy"


def cached_cubin(family: str, source: str, arch: str, where: Path | None = None) -> tuple[Path, dict[str, str]]:
    """One family's CUBIN for ``arch`` and its lowered names, from ``where`` (default :func:`cache_dir`)
    if an earlier process built the same source there, else compiled with NVRTC now and written
    there (each file renamed into place whole, so a process that stops mid-write leaves no torn file)."""
    fam = FAMILIES[family]
    out = Path(where) if where is not None else cache_dir()
    try:
        hit = _stored_cubin(out, family, arch, source)
    except (OSError, ValueError):
        hit = None  # unreadable: built again below
    if hit is not None:
        return hit
    logging.getLogger(__name__).info("compiling %s for %s with NVRTC (once; cached in %s)", family, arch, out)
    blob, lowered = _nvrtc(source, fam.file, arch, fam.name_expressions, cubin=True)
    return _store_cubin(out, family, arch, source, blob, lowered), lowered


def _cached_module(family: str, source: str, arch: str) -> PrebuiltModule:
    """The family's module from :func:`cached_cubin`; a cached file the driver refuses (a damaged
    cache) is removed and built once more."""
    cubin, lowered = cached_cubin(family, source, arch)
    try:
        return _loaded(cubin, lowered, family)
    except Exception:  # noqa: BLE001 - the driver refused the cached file: build it again
        for path in _cubin_files(cache_dir(), family, arch, source):
            path.unlink(missing_ok=True)
        return _loaded(*cached_cubin(family, source, arch), family)


@functools.lru_cache(maxsize=None)
def _load(family: str, defines: tuple[tuple[str, object], ...]):
    import cupy

    fam = FAMILIES[family]
    source = read_source(fam.file, dict(defines))
    arch = _device_arch_here()
    if not defines:  # a tuning variant always compiles
        mod = _prebuilt(family, source, arch)
        if mod is not None:
            return mod
    if arch.endswith("a"):  # an architecture-specific target: CuPy's RawModule asks NVRTC for sm_<cc>
        try:
            return _cached_module(family, source, arch)
        except Exception as e:  # noqa: BLE001 - any failure of this path keeps the portable build
            _portable_build_warning(family, arch, e, stacklevel=3)
    return cupy.RawModule(code=source, options=run_options(), name_expressions=fam.name_expressions)


def _device_arch_here() -> str:
    """:func:`device_arch` of the current CUDA device."""
    import cupy

    return device_arch(cupy.cuda.Device().compute_capability)


def _source_files(where, source: str, name: str, arch: str, names: tuple[str, ...], include_dirs=()):
    """The CUBIN and names file of a source that is no family under ``where``: its name, ``arch`` and a
    hash of the source, the headers it may include (the kernels' and those of ``include_dirs``), the
    options and the name expressions, so an edited header builds anew."""
    heads = hashlib.sha256()
    for d in include_dirs:
        for p in sorted(q for q in Path(d).glob("*") if q.suffix in (".cuh", ".h")):
            heads.update(p.name.encode() + b"\0" + p.read_bytes())
    extra = tuple(f"-I{d}" for d in include_dirs)
    key = "\0".join((source, name, arch, _headers_digest(), heads.hexdigest(), *NVRTC_OPTIONS, *extra, *names))
    stem = Path(where) / f"{Path(name).stem}.{arch}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return Path(f"{stem}.cubin"), Path(f"{stem}.json")


def source_cubin(source: str, name: str, name_expressions, arch: str = "sm_90a", where=None, include_dirs=()) -> Path:
    """The CUBIN of ``source`` (kernel code that is none of the families) for ``arch``, from ``where``
    (default :func:`cache_dir`) if built there before from the same source and headers, else compiled
    with the project's NVRTC options plus ``include_dirs`` and written there (each file renamed into
    place whole). On a CPU machine with ``where`` the directory ``LORA_CUPY_PREBUILT`` will name, it
    builds a dev tool's module ahead."""
    return _source_built(source, name, tuple(name_expressions), arch, where, include_dirs)[0]


def _source_built(source: str, name: str, names: tuple[str, ...], arch: str, where,
                  include_dirs) -> tuple[Path, dict[str, str]]:
    """:func:`source_cubin`'s CUBIN and its lowered names, each read or compiled once."""
    cubin, names_file = _source_files(where if where is not None else cache_dir(), source, name, arch, names,
                                      include_dirs)
    hit = _read_stored(cubin, names_file)
    if hit is None:
        logging.getLogger(__name__).info("compiling %s for %s with NVRTC (once; kept in %s)", name, arch, cubin.parent)
        _, blob, lowered = _nvrtc_compile(source, name, arch, names, tuple(f"-I{d}" for d in include_dirs))
        hit = cubin, dict(lowered)
        _write_cubin(cubin, names_file, blob, hit[1])
    return hit


def source_module(source: str, name: str, name_expressions, include_dirs=()):
    """A module of ``source``, kernel code that is none of the families (a dev tool's traced or patched
    copy of lora_mma.cu, a prototype), built for this device as :func:`load_module` builds the families,
    so what a dev tool times is what the families run: on Hopper for ``sm_90a`` (the warpgroup MMAs in)
    by :func:`source_cubin`, found first in ``LORA_CUPY_PREBUILT``'s directory where it was built ahead;
    elsewhere, or where that build fails (with a warning saying so), CuPy's ``RawModule`` for
    ``sm_<cc>``. Either way ``get_function(name expression)``."""
    names = tuple(name_expressions)
    arch = _device_arch_here()
    if arch.endswith("a"):
        try:
            ahead = os.environ.get(PREBUILT_ENV, "").strip()
            hit = _read_stored(*_source_files(ahead, source, name, arch, names, include_dirs)) if ahead else None
            if hit is None:
                hit = _source_built(source, name, names, arch, None, include_dirs)
            return _loaded_as(*hit, names[:1])  # loaded now: a refusal by the driver falls back below
        except Exception as e:  # noqa: BLE001 - any failure of this path keeps the portable build
            _portable_build_warning(name, arch, e, stacklevel=2)
    import cupy

    return cupy.RawModule(code=source, options=(*run_options(), *(f"-I{d}" for d in include_dirs)),
                          name_expressions=names)


def env_defines() -> dict[str, str]:
    """``#define``s for tuning runs from ``LORA_CUPY_KERNEL_DEFINES`` ("NAME=VALUE,NAME=VALUE")."""
    text = os.environ.get("LORA_CUPY_KERNEL_DEFINES", "").strip()
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier() or not value.strip():
            raise ValueError(f"LORA_CUPY_KERNEL_DEFINES: {item!r} is not NAME=VALUE")
        out[name] = value.strip()
    return out


def load_module(family: str, defines: Mapping[str, object] | None = None):
    """The memoized ``cupy.RawModule`` of one kernel family and variant (plus any
    ``LORA_CUPY_KERNEL_DEFINES`` of the environment, for tuning runs)."""
    return _load(family, tuple(sorted({**env_defines(), **(defines or {})}.items())))
