"""The CUDA backend against the float64 oracle: every shipped kernel (shrink, expand, expand_stream,
expand_ring, fused; chunks and tiles; SIMT) in both instantiations (ALIGNED, for calls whose x, y and weights allow
every 16-byte path, and the one reading the access flags),
dtype, awkward size and mix, torch tensors and CuPy arrays alike, and CUDA graphs replayed under new
addressing."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.backends.base import LayerWeights
from lora_cupy.backends.cupy import TOLERANCE
from lora_cupy.dtypes import bfloat16
from lora_cupy.planning import LaunchViews


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]

DTYPES = ("bfloat16", "float16", "float32")
#: the expand kernel of an unfused launch, by its name (lora_expand / lora_expand_stream / lora_expand_ring)
VERSIONS = {"expand": dict(expand="expand"), "expand_stream": dict(expand="expand_stream"),
            "expand_ring": dict(expand="expand_ring")}
#: lora_expand_ring runs tiles of 64 positions only
RING_TILE = 64
VARIANTS = {f"mma{t}-fused": dict(kernel="mma", tile=t, fused=True) for t in (16, 32, 64)}
VARIANTS.update({f"mma{t}-fused-{c}": dict(kernel="mma", tile=t, fused=True, chunks=c == "chunks")
                 for t in (16, 64) for c in ("chunks", "tiles")})
VARIANTS.update({f"mma{t}-{v}": dict(kernel="mma", tile=t, fused=False, **VERSIONS[v])
                 for t in (16, 32, 64) for v in VERSIONS if v != "expand_ring" or t == RING_TILE})
VARIANTS["simt"] = dict(kernel="simt")
CASES = {
    "T1": dict(T=1, in_f=256, slices=(512,), max_rank=16, ranks=(16,), mix="identical"),
    "T3-odd": dict(T=3, in_f=77, slices=(61,), max_rank=13, ranks=(1, 8, 13), mix="distinct"),
    "T7-qkv": dict(T=7, in_f=200, slices=(96, 40, 24), max_rank=64, ranks=(0, 1, 8, 13, 64), mix="uniform"),
    "T133-zipf": dict(T=133, in_f=320, slices=(64, 72), max_rank=128, ranks=(1, 8, 13, 64, 128), mix="zipf",
                      num_slots=17, active=12),
    "T133-skew": dict(T=133, in_f=200, slices=(200,), max_rank=128, ranks=(8, 13, 128), mix="skewed"),
    "T1000": dict(T=1000, in_f=512, slices=(136, 248), max_rank=64, ranks=(16, 64), mix="uniform",
                  num_slots=33, active=8),
    "pad100": dict(T=100, in_f=256, slices=(256,), max_rank=16, ranks=(16,), mix="uniform", pad_to=128),
    # three slices whose rank widths share one rank block: the unfused shrink packs them (x read
    # once for every slice), A's slice rows 13 apart, v's 16 apart
    "T300-qkv13": dict(T=300, in_f=264, slices=(128, 40, 40), max_rank=13, ranks=(0, 1, 8, 13), mix="zipf",
                       num_slots=17, active=9),
}


def cp():
    import cupy

    return cupy


def dev(a: np.ndarray):
    """A host array on the device (bfloat16 as CuPy's bfloat16, else as raw uint16 bits)."""
    if a.dtype == bfloat16:
        try:
            return cp().asarray(a)
        except Exception:
            return cp().asarray(a.view(np.uint16))
    return cp().asarray(a)


def put(buf, h: np.ndarray) -> None:
    """Raw host-to-device bytes into an existing buffer (no dtype-specific CuPy kernels)."""
    h = np.ascontiguousarray(h)
    assert buf.nbytes == h.nbytes
    buf.data.copy_from_host(h.ctypes.data, h.nbytes)


def host(a, dtype) -> np.ndarray:
    h = cp().asnumpy(a)
    return h.view(bfloat16) if h.dtype == np.uint16 else h


def dev_weights(w: LayerWeights) -> LayerWeights:
    return LayerWeights(dev(w.a), dev(w.b), dev(w.scaling), dev(w.ranks), w.out_offsets)


def backend_for(spec, **kw):
    from lora_cupy.backends.cupy import CupyBackend

    be = CupyBackend(spec, **kw)
    if be.kernel == "simt":
        be.workspace.fill(np.nan)  # the SIMT shrink writes v before its expand reads it
    return be


def check_clean(be):
    """Every tensor-core launch leaves v (lora_pair's too) and the counters at zero for the next one."""
    if be.kernel == "mma":
        assert not bool(be.workspace.any()), "v not zeroed after the launch"
        assert not bool(be.pair_ws.any()), "lora_pair's v not zeroed after the launch"
        assert not bool(be.counters.any()), "counters not reset after the launch"


def run_cupy(be, case):
    y = dev(case.y0)
    be.delta(y, dev(case.x), dev_weights(case.w), dev(case.token_order), dev(case.slot_indptr))
    cp().cuda.get_current_stream().synchronize()
    check_clean(be)
    return host(y, case.spec.dtype)


def assert_same(a: np.ndarray, b: np.ndarray, dtype: str) -> None:
    """Two runs of one delta agree (split-K adds its partial sums in whatever order they land)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.linalg.norm(a64 - b64) <= TOLERANCE[dtype] / 5 * np.linalg.norm(b64)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_delta_matches_oracle(make_case, check, name, dtype, variant):
    case = make_case(dtype=dtype, **CASES[name])
    be = backend_for(case.spec, **VARIANTS[variant])
    check(case, run_cupy(be, case), dtype)
    # a second call on the same backend (its counters must have reset) with fresh data
    case2 = make_case(dtype=dtype, **CASES[name])
    check(case2, run_cupy(be, case2), dtype)


@pytest.mark.parametrize("mix", ["distinct", "uniform", "zipf", "identical", "skewed"])
@pytest.mark.parametrize("T,version", [(16, None), (64, None), (300, "expand"), (300, "expand_stream"),
                                       (300, "expand_ring"), (4096, "expand"), (4096, "expand_stream"),
                                       (4096, "expand_ring")])
def test_popularity_mixes(make_case, check, mix, T, version):
    case = make_case(T=T, in_f=1024, slices=(512,), max_rank=64, ranks=(8, 16, 64), dtype="bfloat16",
                     mix=mix, num_slots=33, active=min(32, T))
    check(case, run_cupy(backend_for(case.spec, **VERSIONS.get(version, {})), case), "bfloat16")


@pytest.mark.parametrize("T,version", [(64, None), (300, "expand"), (300, "expand_stream"), (4096, "expand"),
                                       (4096, "expand_ring")])
def test_rank16_adapters_in_rank128_pool(make_case, check, T, version):
    """Rank-16 adapters in a pool of max rank 128, the rest of every slot poisoned with NaN."""
    case = make_case(T=T, in_f=512, slices=(256,), max_rank=128, ranks=(16,), dtype="bfloat16",
                     mix="uniform", poison_beyond_rank=True)
    check(case, run_cupy(backend_for(case.spec, **VERSIONS.get(version, {})), case), "bfloat16")


@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize("T,mix", [(64, "distinct"), (61, "zipf"), (16, "uniform")])
def test_chunks_of_a_step_over_many_slots(make_case, check, T, mix, tile):
    """The fused launch's chunks of one slot each when slots outnumber tiles: a pool of 512
    adapters, up to one per position (every work unit used), each warp lane scanning 16 slots."""
    case = make_case(T=T, in_f=264, slices=(136, 40), max_rank=32, ranks=(0, 1, 8, 16, 32), dtype="bfloat16",
                     mix=mix, num_slots=513, active=T)
    be = backend_for(case.spec, tile=tile, fused=True, chunks=True)
    plan = be.plan(T, dev_weights(case.w), "bfloat16")
    assert plan.chunks and plan.fused and plan.tiles == min(plan.bucket, -(-plan.bucket // tile) + 512)
    check(case, run_cupy(be, case), "bfloat16")


def dev_misaligned(h: np.ndarray):
    """A C-contiguous device copy of h whose address is one element past 16-byte alignment."""
    flat = dev(np.zeros(h.size + 8, h.dtype))
    y = flat[1:1 + h.size].reshape(h.shape)
    assert y.data.ptr % 16 != 0 and y.flags.c_contiguous
    put(y, h)
    return y


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_streams_awkward_slices_and_misaligned_rows(make_case, check, dtype, version, misaligned):
    """One multiprocessor planned for: one split of ``in`` per shrink (a plain store of v where one
    warp writes it) and many column blocks per expand block (expand_stream keeps y of the next
    passes in registers), over slices that end inside a column block, ranks below, at and above
    the 64 expand_stream keeps in registers, several runs per warp. Misaligned: x and y one element
    off 16-byte alignment take the element-wise loads and stores."""
    case = make_case(T=300, in_f=96, slices=(520, 13, 467), max_rank=128, ranks=(0, 5, 16, 48, 64, 80, 128),
                     dtype=dtype, mix="zipf", num_slots=17, active=12)
    be = backend_for(case.spec, num_sms=1, tile=64, **VERSIONS[version])
    plan = be.plan(300, dev_weights(case.w), dtype)
    assert plan.cpb >= 8 and plan.splits == 1
    y = dev_misaligned(case.y0) if misaligned else dev(case.y0)
    x = dev_misaligned(case.x) if misaligned else dev(case.x)
    be.delta(y, x, dev_weights(case.w), dev(case.token_order), dev(case.slot_indptr))
    cp().cuda.get_current_stream().synchronize()
    check_clean(be)
    check(case, host(y, dtype), dtype)


def test_torch_tensors_and_cupy_arrays_agree(make_case, check):
    torch = pytest.importorskip("torch")
    from lora_cupy.dtypes import from_torch, to_torch

    case = make_case(T=133, in_f=256, slices=(96, 40, 24), max_rank=64, ranks=(8, 64), dtype="bfloat16",
                     mix="zipf")
    be = backend_for(case.spec)
    y_cupy = run_cupy(be, case)

    def td(a):
        return to_torch(np.ascontiguousarray(a)).cuda()

    y = td(case.y0)
    w = LayerWeights(td(case.w.a), td(case.w.b), td(case.w.scaling), td(case.w.ranks), case.w.out_offsets)
    be.delta(y, td(case.x), w, td(case.token_order), td(case.slot_indptr))
    torch.cuda.synchronize()
    y_torch = from_torch(y)
    check(case, y_torch, "bfloat16")
    check_clean(be)
    assert_same(y_torch, y_cupy, "bfloat16")


def _new_addressing(make_case, spec_case, T, mix):
    """A fresh case of the same spec and bucket-sized buffers: T real tokens, padding after them."""
    c = spec_case
    bucket = c.x.shape[0]
    return make_case(T=T, in_f=c.x.shape[1], slices=tuple(int(v) for v in np.diff(c.w.out_offsets)),
                     max_rank=c.w.a.shape[2],
                     ranks=(1, 8, 16), dtype=c.spec.dtype, mix=mix, num_slots=c.w.a.shape[0], active=6,
                     pad_to=bucket if T < bucket else None)


LAUNCHES = {**{v: dict(fused=False, **kw) for v, kw in VERSIONS.items()},
            "fused_tiles": dict(fused=True, chunks=False), "fused_chunks": dict(fused=True, chunks=True)}


def _aligned_shape(dtype: str) -> dict:
    """A shape that allows every 16-byte path (access flags 7) and is round nowhere else: ``in`` and
    ``out`` no multiple of a stage or column block, slices ending inside a column block, adapter
    ranks that are no multiple of 4 (B's fragments are masked past them; the weights beyond a rank
    hold NaN), and for fp32 an ``out`` that ends half-way into one of expand_stream's 8-column chunks."""
    slices = (200, 56, 28) if dtype == "float32" else (200, 56, 24)
    return dict(in_f=328, slices=slices, max_rank=48, ranks=(0, 1, 5, 13, 16, 40, 48))


ROUTES = ("aligned", "x_misaligned", "y_misaligned", "aligned_off")


def run_prepared(be, case, route: str, bucket: int):
    """One call of ``case`` through a layer prepared on ``be`` (the engine's path), with x or y one
    element off 16-byte alignment where ``route`` says so: ``(y, the layer's packed launch, the
    layer, the device weights it holds)``."""
    w = dev_weights(case.w)  # held here too: the launch reads these arrays through raw pointers
    layer = be.prepare(w)
    views = LaunchViews(bucket, 0, dev(case.token_order), dev(case.slot_indptr))
    x = dev_misaligned(case.x) if route == "x_misaligned" else dev(case.x)
    y = dev_misaligned(case.y0) if route == "y_misaligned" else dev(case.y0)
    layer(y, x, views, case.x.shape[0])
    cp().cuda.get_current_stream().synchronize()
    return y, layer.packed(views), layer, w


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tile,launch", [(t, v) for t in (16, 64) for v in LAUNCHES
                                         if v != "expand_ring" or t == RING_TILE])
@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_and_unaligned_instantiations(make_case, check, dtype, tile, launch, route):
    """Through a layer's packed launch (the engine's path): x, y and weights that allow every
    16-byte path run each kernel's ALIGNED instantiation; x or y one element off 16-byte alignment,
    or a backend built with ``aligned=False``, the instantiation that reads the flags. Every route
    matches the float64 oracle on fresh random data, with v and the counters left at zero."""
    case = make_case(T=45, dtype=dtype, mix="zipf", num_slots=17, active=9, pad_to=64, **_aligned_shape(dtype))
    kw = dict(aligned=False) if route == "aligned_off" else {}
    be = backend_for(case.spec, tile=tile, **LAUNCHES[launch], **kw)
    y, packed, layer, w = run_prepared(be, case, route, 64)
    assert layer.held is w
    want = {"aligned": 7, "x_misaligned": 6, "y_misaligned": 3, "aligned_off": 7}[route]
    assert packed.last[2] == want
    assert packed.aligned == (route == "aligned")
    assert [ln[0] for ln in packed.launches] == [int(c.fn_for(want).kernel.ptr) for c in packed.calls]
    check_clean(be)
    check(case, host(y, dtype), dtype)


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_one_layer_switches_instantiations_as_alignment_changes(make_case, check, launch):
    """One packed launch, called with aligned rows, then y off alignment, then aligned again: each
    call runs the instantiation its flags allow and matches the oracle."""
    case = make_case(T=45, dtype="bfloat16", mix="uniform", num_slots=17, active=9, pad_to=64,
                     **_aligned_shape("bfloat16"))
    be = backend_for(case.spec, **LAUNCHES[launch])
    # prepared from a temporary on purpose: the layer alone keeps the weights alive (LayerLaunch.held);
    # were they freed, the views, x and y allocated next would take their memory in CuPy's pool
    layer = be.prepare(dev_weights(case.w))
    views = LaunchViews(64, 0, dev(case.token_order), dev(case.slot_indptr))
    x = dev(case.x)
    for misaligned in (False, True, False):
        y = dev_misaligned(case.y0) if misaligned else dev(case.y0)
        layer(y, x, views, case.x.shape[0])
        cp().cuda.get_current_stream().synchronize()
        assert layer.packed(views).aligned == (not misaligned)
        check_clean(be)
        check(case, host(y, "bfloat16"), "bfloat16")


def graph_replays_new_addressing(make_case, check, backend_kw: dict, first_kw: dict, steps) -> None:
    """One delta captured in a CuPy graph on the first case's buffers, replayed under each of
    ``steps`` ((T, mix): fresh data, addressing and weights written into the same buffers): every
    replay matches the oracle, leaves v and the counters at zero, and agrees with an eager call."""
    cupy = cp()
    first = make_case(**first_kw)
    be = backend_for(first.spec, **backend_kw)
    x, y = dev(first.x), dev(first.y0)
    w = dev_weights(first.w)
    to, ip = dev(first.token_order), dev(first.slot_indptr)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        be.delta(y, x, w, to, ip)  # eager first: nothing is compiled or loaded under capture
        stream.synchronize()
        stream.begin_capture()
        be.delta(y, x, w, to, ip)
        graph = stream.end_capture()
    for T, mix in steps:
        case = _new_addressing(make_case, first, T, mix)
        for buf, h in ((x, case.x), (y, case.y0), (to, case.token_order), (ip, case.slot_indptr),
                       (w.a, case.w.a), (w.b, case.w.b), (w.scaling, case.w.scaling), (w.ranks, case.w.ranks)):
            put(buf, h)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        y_graph = host(y, "bfloat16")
        check(case, y_graph, "bfloat16")
        check_clean(be)
        assert_same(y_graph, run_cupy(be, case), "bfloat16")


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_cupy_graph_replays_new_addressing(make_case, check, launch):
    graph_replays_new_addressing(
        make_case, check, LAUNCHES[launch],
        dict(T=128, in_f=264, slices=(96, 40, 24), max_rank=16, ranks=(1, 8, 16), dtype="bfloat16", mix="uniform",
             active=6),
        ((128, "zipf"), (57, "skewed"), (1, "identical"), (128, "distinct")))


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_torch_graph_replays_new_addressing(make_case, check, launch):
    torch = pytest.importorskip("torch")
    from lora_cupy.dtypes import from_torch, to_torch

    first = make_case(T=64, in_f=512, slices=(384,), max_rank=64, ranks=(8, 64), dtype="bfloat16",
                      mix="uniform", active=6)
    be = backend_for(first.spec, **LAUNCHES[launch])

    def td(a):
        return to_torch(np.ascontiguousarray(a)).cuda()

    x, y = td(first.x), td(first.y0)
    w = LayerWeights(td(first.w.a), td(first.w.b), td(first.w.scaling), td(first.w.ranks), first.w.out_offsets)
    to, ip = td(first.token_order), td(first.slot_indptr)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        be.delta(y, x, w, to, ip)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.delta(y, x, w, to, ip)
    for T, mix in ((64, "zipf"), (33, "skewed"), (64, "identical")):
        case = _new_addressing(make_case, first, T, mix)
        for buf, h in ((x, case.x), (y, case.y0), (to, case.token_order), (ip, case.slot_indptr),
                       (w.a, case.w.a), (w.b, case.w.b), (w.scaling, case.w.scaling), (w.ranks, case.w.ranks)):
            buf.copy_(td(h))
        graph.replay()
        torch.cuda.synchronize()
        y_graph = from_torch(y)
        check(case, y_graph, "bfloat16")
        check_clean(be)
        assert_same(y_graph, run_cupy(be, case), "bfloat16")


def test_no_positions_and_base_rows_only_leave_y_untouched(make_case):
    case = make_case(T=40, in_f=128, slices=(64,), max_rank=16, ranks=(16,), dtype="float16", mix="uniform")
    be = backend_for(case.spec)
    y = dev(case.y0)
    w = dev_weights(case.w)
    be.delta(y, dev(case.x), w, dev(case.token_order[:0]), dev(case.slot_indptr))
    base = np.zeros_like(case.slot_indptr)
    base[1:] = case.x.shape[0]  # every row on slot 0
    be.delta(y, dev(case.x), w, dev(np.arange(case.x.shape[0], dtype=np.int32)), dev(base))
    np.testing.assert_array_equal(host(y, "float16"), case.y0)


def test_bad_arguments_refused_before_launch(make_case):
    case = make_case(T=8, in_f=64, slices=(32,), max_rank=16, ranks=(16,), dtype="float32", mix="uniform")
    be = backend_for(case.spec)
    y, x, w = dev(case.y0), dev(case.x), dev_weights(case.w)
    to, ip = dev(case.token_order), dev(case.slot_indptr)
    with pytest.raises(ValueError, match="contiguous"):
        be.delta(y, cp().asfortranarray(x), w, to, ip)
    with pytest.raises(TypeError, match="dtype"):
        be.delta(y, x.astype(np.float16), w, to, ip)
    with pytest.raises(TypeError, match="int32"):
        be.delta(y, x, w, to.astype(np.int64), ip)
    with pytest.raises(TypeError, match="host"):
        be.delta(case.y0, x, w, to, ip)
    np.testing.assert_array_equal(host(y, "float32"), case.y0)


@pytest.mark.parametrize("T,version,kernels", [(16, "fused", ["fused"]), (16, "chunk", ["chunk"]),
                                               (16, None, ["pair_shrink", "pair_expand"]),
                                               (300, "expand", ["shrink", "expand"]),
                                               (300, "expand_stream", ["shrink", "expand_stream"]),
                                               (300, "expand_ring", ["shrink", "expand_ring"])])
def test_occupancy_names_each_launched_kernel(make_case, T, version, kernels):
    from lora_cupy.backends.cupy import check_call

    case = make_case(T=T, in_f=256, slices=(512,), max_rank=64, ranks=(16, 64), dtype="bfloat16", mix="uniform")
    kw = dict(fused=True) if version == "fused" else dict(fused=False, expand=version) if version else {}
    be = backend_for(case.spec, **kw)
    call = check_call(be.limits, dev(case.y0), dev(case.x), dev_weights(case.w), dev(case.token_order),
                      dev(case.slot_indptr))
    occ = be.occupancy(call)
    assert list(occ) == kernels
    assert call.flags == 7 and all(o["aligned"] for o in occ.values())  # round shapes: the ALIGNED twins
    for o in occ.values():
        # 128 threads a block: at most 16 blocks, at least one (else the launch would fail)
        assert 1 <= o["blocks_per_sm"] <= 16 and 1 <= o["registers"] <= 255 and o["local_bytes"] >= 0
        assert o["smem"] >= 4 * (case.spec.num_slots + 1)
    if version == "expand_ring":  # what its plan sizes one wave for (bf16: RING_BLOCKS_PER_SM)
        from lora_cupy.backends.cupy import RING_BLOCKS_PER_SM

        assert occ["expand_ring"]["blocks_per_sm"] >= RING_BLOCKS_PER_SM


def rank_blocked(case):
    """``case`` with B rank-blocked, ``[S, ceil(R / 16), out, 16]``, as a pool above 16 ranks holds it
    (the NaN past each slot's rank kept; the oracle is the same)."""
    from dataclasses import replace

    from lora_cupy.spec import blocked_b

    w = case.w
    return replace(case, w=LayerWeights(w.a, blocked_b(w.b, w.a.shape[2]), w.scaling, w.ranks, w.out_offsets))


#: Shapes whose B is rank-blocked (pools of max_rank 64 and 128), and the kernels each is run through:
#: (shape, dtype, backend arguments, rank_bound, the kernel the plan must take). Each is a call the
#: planner accepts (tests/test_kernel_backend_cpu.py: test_rank_blocked_calls_are_planned).
BLOCKED_SHAPES = {
    "T1-r64": dict(T=1, in_f=256, slices=(512,), max_rank=64, ranks=(17, 64), mix="identical"),
    "T16-r64": dict(T=16, in_f=264, slices=(200,), max_rank=64, ranks=(1, 17, 33, 64), mix="uniform"),
    "T64-r16-in-128": dict(T=64, in_f=512, slices=(256,), max_rank=128, ranks=(16,), mix="uniform", num_slots=33,
                           active=32),
    "T1024-r64": dict(T=1024, in_f=512, slices=(512,), max_rank=64, ranks=(1, 17, 64), mix="uniform"),
    "T7-qkv": CASES["T7-qkv"], "T133-zipf": CASES["T133-zipf"], "T1000": CASES["T1000"],
}
BLOCKED_CALLS = [
    ("T1-r64", "bfloat16", {}, None, "one"), ("T1-r64", "float16", dict(fused=False, expand="chunk"), None, "chunk"),
    ("T1-r64", "float32", dict(fused=True), None, "fused"), ("T1-r64", "float32", dict(kernel="simt"), None, None),
    ("T16-r64", "bfloat16", dict(expand="pair"), None, "pair"),
    ("T16-r64", "float16", dict(expand="pair"), None, "pair"),
    ("T64-r16-in-128", "bfloat16", {}, 16, "pair"), ("T64-r16-in-128", "bfloat16", {}, None, None),
    ("T64-r16-in-128", "bfloat16", dict(fused=False, expand="chunk"), 16, "chunk"),
    ("T7-qkv", "bfloat16", {}, None, None), ("T7-qkv", "float32", dict(fused=False, expand="expand_stream"), None,
                                              "expand_stream"),
    ("T133-zipf", "bfloat16", {}, None, None), ("T133-zipf", "float16", dict(fused=False, expand="expand"), None,
                                                "expand"),
    ("T1000", "bfloat16", {}, None, None), ("T1024-r64", "bfloat16", {}, None, "chunk"),
    ("T1024-r64", "float16", {}, None, "chunk"),
    ("T1000", "float32", dict(fused=False, expand="expand"), None, "expand"),
    ("T1000", "bfloat16", dict(fused=False, expand="expand_ring", tile=RING_TILE), None, "expand_ring"),
    ("T1000", "float16", dict(fused=True), None, "fused"),
]


@pytest.mark.parametrize("name,dtype,kw,bound,kernel", BLOCKED_CALLS,
                         ids=[f"{c[0]}-{c[1]}-{c[4] or c[2].get('kernel', 'default')}-b{c[3]}" for c in BLOCKED_CALLS])
def test_rank_blocked_b_matches_oracle(make_case, check, name, dtype, kw, bound, kernel):
    """B rank-blocked (a pool above 16 ranks stores it so: lora_cupy/spec.py, b_shape) through every
    kernel, against the float64 oracle on fresh data: ranks 1-128 in pools of 64 and 128, rank-16
    adapters in a pool of 128 planned for their bound (the layout's reason), NaN past every rank; a
    second call with fresh data on the same backend."""
    for _ in range(2):
        case = rank_blocked(make_case(dtype=dtype, **BLOCKED_SHAPES[name]))
        be = backend_for(case.spec, **kw)
        w = dev_weights(case.w)
        T = case.token_order.shape[0]
        if kernel == "fused":
            assert be.plan(T, w, dtype, rank_bound=bound).fused
        elif kernel is not None:
            assert be.plan(T, w, dtype, rank_bound=bound).expand == kernel
        y = dev(case.y0)
        be.delta(y, dev(case.x), w, dev(case.token_order), dev(case.slot_indptr), rank_bound=bound)
        cp().cuda.get_current_stream().synchronize()
        check_clean(be)
        check(case, host(y, dtype), dtype)


@pytest.mark.parametrize("T,launch", [(7, "fused_chunks"), (45, "fused_tiles"), (300, "expand"), (1000, "expand_ring")])
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_one_slice_of_a_rank_blocked_fused_b(make_case, check, dtype, T, launch):
    """Each slice of a fused target at rank 64 served alone from its rows of a rank-blocked fused B."""
    case = rank_blocked(make_case(T=T, in_f=200, slices=(96, 40, 24), max_rank=64, ranks=(0, 1, 8, 13, 64),
                                  dtype=dtype, mix="zipf", num_slots=17, active=9))
    be = backend_for(case.spec, **LAUNCHES[launch])
    check(case, run_members(be, case, dtype, prepared={1}), dtype)


@pytest.mark.parametrize("T,launch", [(7, "fused_chunks"), (45, "fused_tiles"), (300, "expand"),
                                      (300, "expand_stream"), (1000, "expand"), (1000, "expand_ring")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_slice_of_a_fused_target_into_its_own_output(make_case, check, dtype, T, launch):
    """Each slice of a fused target served alone, into an output of that slice's width (a
    separate q/k/v linear's), reading its rows of the fused B in place (a view whose slots are the
    fused B's apart) and computing nothing for the other slices: the slices' outputs side by side
    match the oracle; slices ending inside a column block, odd ranks, rank 0, NaN past each rank."""
    case = make_case(T=T, dtype=dtype, mix="zipf", num_slots=17, active=9, **_aligned_shape(dtype))
    be = backend_for(case.spec, **LAUNCHES[launch])
    check(case, run_members(be, case, dtype, prepared={1}), dtype)  # slice 1: the engine's path


def run_members(be, case, dtype: str, expand: str | None = None, prepared=frozenset()) -> np.ndarray:
    """Each slice of ``case``'s fused target served alone into an output of its width, its rows of
    the fused B read as a view (``member_weights``); slice j through a prepared layer where j is in
    ``prepared``, else ``be.delta``; v and the counters clean after each. ``expand``: the kernel each
    member's plan must take. Returns the slices' outputs side by side."""
    from lora_cupy.backends.base import member_weights

    w = dev_weights(case.w)
    offs = case.w.out_offsets
    T = case.token_order.shape[0]
    x, to, ip = dev(case.x), dev(case.token_order), dev(case.slot_indptr)
    got = np.empty_like(case.y0)
    for j in range(len(offs) - 1):
        mw = member_weights(w, j)
        assert mw.b.shape[-2] == offs[j + 1] - offs[j] and not mw.b.flags.c_contiguous
        assert expand is None or be.plan(T, mw, dtype).expand == expand
        y = dev(np.ascontiguousarray(case.y0[:, offs[j]:offs[j + 1]]))
        if j in prepared:
            be.prepare(mw)(y, x, LaunchViews(T, 0, to, ip), case.x.shape[0])
        else:
            be.delta(y, x, mw, to, ip)
        cp().cuda.get_current_stream().synchronize()
        check_clean(be)
        got[:, offs[j]:offs[j + 1]] = host(y, dtype)
    return got


@pytest.mark.parametrize("max_rank,ranks", [(13, (0, 1, 8, 13)), (16, (0, 5, 16))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_inf_in_x_leaves_no_nan_in_v_after_packed_halves(make_case, check, inf_in_x, dtype, max_rank, ranks):
    """Slices packed into one shrink task (three of rank width 16), an inf in the x row of one
    adapter token whose last slice has a rank: the whole target's shrink, then each slice's expand
    into its own output. 0 * inf is NaN wherever a zero row of A meets that row, so the shrink may
    write only the columns the expands read and zero again: v and the counters end at zero, and
    every other row matches the oracle (at max_rank 16 the ALIGNED instantiation runs)."""
    from lora_cupy.backends.base import member_weights
    from lora_cupy.backends.cupy import packed_slices

    case = make_case(T=300, in_f=264, slices=(128, 40, 40), max_rank=max_rank, ranks=ranks, dtype=dtype,
                     mix="zipf", num_slots=17, active=9)
    assert packed_slices(3, max_rank, False)
    x, t = inf_in_x(case)
    assert case.w.ranks[case.row_slots[t], -1] > 0  # zero rows of A before its last slice
    order, ip = case.token_order, case.slot_indptr
    be = backend_for(case.spec)
    w = dev_weights(case.w)
    offs = case.w.out_offsets
    views = LaunchViews(order.shape[0], 0, dev(order), dev(ip))
    rows = x.shape[0]
    be.prepare(w).half("shrink", dev(x), views, rows)
    got = np.empty_like(case.y0)
    for j in range(len(offs) - 1):
        y = dev(np.ascontiguousarray(case.y0[:, offs[j]:offs[j + 1]]))
        be.prepare(member_weights(w, j)).half("expand", y, views, rows)
        got[:, offs[j]:offs[j + 1]] = host(y, dtype)
    cp().cuda.get_current_stream().synchronize()
    check_clean(be)
    got[t] = case.ref[t].astype(np.float32).astype(got.dtype)  # its row is inf / NaN by design
    check(case, got, dtype)


@pytest.mark.parametrize("T", [1, 7, 45, 64, 300, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_delta_in_halves(make_case, check, dtype, T):
    """The delta as two launches (what a large step's separate q/k/v linears run: one shrink of
    the fused target, then each linear's expand into its own output), against the oracle; the
    expands of the other slices find their v still there, and after the last one v and the
    counters are zero again. Then the whole target's expand after its shrink, on fresh data,
    through torch tensors."""
    from lora_cupy.backends.base import member_weights

    case = make_case(T=T, dtype=dtype, mix="zipf", num_slots=17, active=9, **_aligned_shape(dtype))
    be = backend_for(case.spec)
    w = dev_weights(case.w)
    offs = case.w.out_offsets
    views = LaunchViews(case.token_order.shape[0], 0, dev(case.token_order), dev(case.slot_indptr))
    rows = case.x.shape[0]
    # the slices some addressed row has a rank on: their v is not all zero after the shrink
    live = {j for s in np.unique(case.row_slots[case.touched]) for j in range(len(offs) - 1) if case.w.ranks[s, j] > 0}
    be.prepare(w).half("shrink", dev(case.x), views, rows)
    cp().cuda.get_current_stream().synchronize()
    assert bool(be.workspace.any()) == bool(live), "the shrink's v against the ranks of the rows it addresses"
    got = np.empty_like(case.y0)
    for j in range(len(offs) - 1):
        y = dev(np.ascontiguousarray(case.y0[:, offs[j]:offs[j + 1]]))
        be.prepare(member_weights(w, j)).half("expand", y, views, rows)
        cp().cuda.get_current_stream().synchronize()
        if any(k > j for k in live):
            assert bool(be.workspace.any()), f"slice {j}'s expand zeroed the v of the slices after it"
        got[:, offs[j]:offs[j + 1]] = host(y, dtype)
    check_clean(be)
    check(case, got, dtype)

    torch = pytest.importorskip("torch")
    from lora_cupy.dtypes import from_torch, to_torch

    def td(a):
        return to_torch(np.ascontiguousarray(a)).cuda()

    case = make_case(T=T, in_f=256, slices=(96, 40, 24), max_rank=64, ranks=(8, 64), dtype=dtype, mix="uniform",
                     num_slots=9, active=5)
    be = backend_for(case.spec)
    w = case.w
    layer = be.prepare(LayerWeights(td(w.a), td(w.b), td(w.scaling), td(w.ranks), w.out_offsets))
    x = td(case.x)
    views = LaunchViews(case.token_order.shape[0], 0, td(case.token_order), td(case.slot_indptr))
    for _ in range(2):  # the second time through the launches packed by the first, into a new y
        y = td(case.y0)
        layer.half("shrink", x, views, case.x.shape[0])
        layer.half("expand", y, views, case.x.shape[0])
        torch.cuda.synchronize()
        check_clean(be)
        check(case, from_torch(y), dtype)
    with pytest.raises(ValueError, match="must be"):
        layer.half("expand", y[:, :3].contiguous(), views, case.x.shape[0])
    # a shrink whose expand never runs (a forward that raised): clear_v zeroes what it wrote
    layer.half("shrink", x, views, case.x.shape[0])
    be.clear_v()
    torch.cuda.synchronize()
    check_clean(be)
    with pytest.raises(NotImplementedError, match="simt"):
        backend_for(case.spec, kernel="simt").prepare(dev_weights(case.w)).half("shrink", dev(case.x), views, 1)
