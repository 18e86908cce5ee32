"""The CUDA backend's per-layer launch, checked without a GPU: parameters packed once at their
natural alignment, y / x / flags patched per call (only when they change), one packed launch per
capture bucket's views, and x / y refused before anything launches."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from lora_cupy.backends import cupy as cb
from lora_cupy.backends.base import LayerWeights
from lora_cupy.planning import LaunchViews
from lora_cupy.spec import LoraSpec, LoraTarget
from tests.test_kernel_backend_cpu import FakeDeviceArray


def _read(params_ptr: int, index: int, ctype):
    """The value parameter ``index`` points at, as the driver would read it."""
    ptr = ctypes.cast(params_ptr, ctypes.POINTER(ctypes.c_uint64))[index]
    return ctypes.cast(ptr, ctypes.POINTER(ctype))[0]


def test_packed_args_lay_values_out_aligned_and_patch_in_place():
    args = (np.uint64(1 << 40), np.int32(-7), np.uint64(9), np.int32(3), np.float32(1.5), np.int32(11))
    p = cb.PackedArgs(args)
    assert p.offsets == (0, 8, 16, 24, 28, 32)
    types = (ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_int32)
    assert [_read(p.ptr, i, t) for i, t in enumerate(types)] == [1 << 40, -7, 9, 3, 1.5, 11]
    p.set_u64(2, 12345678901)
    p.set_i32(5, -2)
    assert _read(p.ptr, 2, ctypes.c_uint64) == 12345678901 and _read(p.ptr, 5, ctypes.c_int32) == -2
    assert _read(p.ptr, 1, ctypes.c_int32) == -7 and _read(p.ptr, 4, ctypes.c_float) == 1.5  # neighbours kept


class _Fn:
    """A stand-in for a CuPy RawKernel: only its function pointer is read."""

    def __init__(self, ptr):
        self.kernel = type("K", (), {"ptr": ptr})()


class _Recorder:
    def __init__(self):
        self.launches = []

    def __call__(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        # the driver copies the values at launch: read them now, as it would
        self.launches.append((fn, (gx, gy, gz), (bx, by, bz), smem, stream,
                              _read(params, 0, ctypes.c_uint64), _read(params, 1, ctypes.c_uint64),
                              _read(params, 2, ctypes.c_int32)))


def _calls():
    args = (np.uint64(0), np.uint64(0), np.int32(0))
    return [cb.KernelCall("a", _Fn(101), (3, 1, 1), (128, 1, 1), 64, args, 0, 1, 2),
            cb.KernelCall("b", _Fn(202), (5, 2, 1), (32, 4, 1), 0, args, 0, 1, 2)]


def test_packed_launch_patches_y_x_and_flags_and_launches_in_order():
    launch = cb.PackedLaunch(_calls())
    rec = launch.launch_kernel = _Recorder()
    launch.run(77, y_ptr=4096, x_ptr=8192, flags=5)
    launch.run(78, y_ptr=4096, x_ptr=8192, flags=5)  # unchanged: nothing to patch
    launch.run(79, y_ptr=1 << 33, x_ptr=8192, flags=3)
    assert [r[0] for r in rec.launches] == [101, 202] * 3
    assert rec.launches[1][1:4] == ((5, 2, 1), (32, 4, 1), 0) and rec.launches[0][3] == 64
    assert [r[4] for r in rec.launches] == [77, 77, 78, 78, 79, 79]
    assert [r[5:] for r in rec.launches[:4]] == [(4096, 8192, 5)] * 4
    assert [r[5:] for r in rec.launches[4:]] == [(1 << 33, 8192, 3)] * 2


def test_packed_launch_runs_the_aligned_instantiation_only_while_the_flags_allow_it():
    """A kernel with an ALIGNED twin: flags 7 launch the twin, any other flags the kernel that reads
    them; a kernel without a twin serves every flags. Packed with flags 7 it starts on the twin."""
    args = (np.uint64(0), np.uint64(0), np.int32(cb.ALIGNED_FLAGS))
    calls = [cb.KernelCall("a", _Fn(101), (3, 1, 1), (128, 1, 1), 64, args, 0, 1, 2, _Fn(111)),
             cb.KernelCall("b", _Fn(202), (5, 2, 1), (32, 4, 1), 0, args, 0, 1, 2)]
    launch = cb.PackedLaunch(calls)
    assert launch.aligned and [r[0] for r in launch.launches] == [111, 202]
    rec = launch.launch_kernel = _Recorder()
    for flags in (7, 3, 3, 6, 7, 5):
        launch.run(77, y_ptr=4096 + 16 * flags, x_ptr=8192, flags=flags)
    assert [r[0] for r in rec.launches] == [111, 202, 101, 202, 101, 202, 101, 202, 111, 202, 101, 202]
    assert [r[7] for r in rec.launches[::2]] == [7, 3, 3, 6, 7, 5]  # the flags still reach the kernel
    assert not launch.aligned
    unaligned = cb.PackedLaunch([cb.KernelCall("a", _Fn(101), (3, 1, 1), (128, 1, 1), 64,
                                               (np.uint64(0), np.uint64(0), np.int32(3)), 0, 1, 2, _Fn(111))])
    assert not unaligned.aligned and unaligned.launches[0][0] == 101
    assert cb.KernelCall("a", _Fn(1), (1, 1, 1), (1, 1, 1), 0, args, 0, 1, 2, _Fn(2)).fn_for(7).kernel.ptr == 2


def test_packed_launch_sends_the_kernels_that_take_pdl_through_the_pdl_launcher():
    """Given a PDL launcher, the kernels marked ``pdl`` launch through it (grid, block, shared memory,
    stream and parameters as the driver's call would take them), the others the usual way, in
    order; without one every kernel launches the usual way. ``EARLY_READS`` or-ed into the flags
    reaches the kernel and still selects the ALIGNED twin."""
    args = (np.uint64(0), np.uint64(0), np.int32(0))
    calls = [cb.KernelCall("a", _Fn(101), (3, 1, 1), (128, 1, 1), 64, args, 0, 1, 2, _Fn(111), pdl=True),
             cb.KernelCall("b", _Fn(202), (5, 2, 1), (32, 4, 1), 0, args, 0, 1, 2)]
    launch = cb.PackedLaunch(calls)
    rec = launch.launch_kernel = _Recorder()
    pdl_seen = []

    def pdl(fn, grid, block, smem, stream, params):
        pdl_seen.append((fn, grid, block, smem, stream, _read(params, 2, ctypes.c_int32)))

    flags = cb.ALIGNED_FLAGS | cb.EARLY_READS
    launch.run(77, y_ptr=4096, x_ptr=8192, flags=flags, pdl=pdl)
    assert pdl_seen == [(111, (3, 1, 1), (128, 1, 1), 64, 77, flags)]
    assert [r[0] for r in rec.launches] == [202] and rec.launches[0][7] == flags
    launch.run(78, y_ptr=4096, x_ptr=8192, flags=3)
    assert [r[0] for r in rec.launches] == [202, 101, 202], "without a launcher every kernel the usual way"
    assert len(pdl_seen) == 1


class _FakeBackend:
    """What LayerLaunch reads of a CupyBackend: limits, kernels per call, a stream, launches."""

    def __init__(self, limits):
        self.limits = limits
        self.device = contextlib.nullcontext()  # the context packing runs in
        self.prepared, self.launched, self.parts = [], [], []

    kernel = "mma"

    def _kernels(self, call, parts=("shrink", "expand")):
        self.prepared.append(call)
        self.parts.append(parts)
        return _calls()

    def stream_ptr(self, torch):
        return 5

    def launch(self, packed, stream, y_ptr=None, x_ptr=None, flags=None):
        self.launched.append((packed, stream, y_ptr, x_ptr, flags))


def _layer(T=64, in_f=64, out=96, S=5, R=16):
    spec = LoraSpec((LoraTarget("t", in_f, out, 1),), num_slots=S, max_rank=R, dtype="bfloat16")
    floats, ints = cb.plan_workspace(spec)
    be = _FakeBackend(cb.CallLimits(spec, 0, cb.DEFAULT_SMS, floats, ints, {}))
    w = LayerWeights(FakeDeviceArray((S, 1, R, in_f), "<u2"), FakeDeviceArray((S, out, R), "<u2"),
                     FakeDeviceArray((S, 1), "<f4"), FakeDeviceArray((S, 1), "<i4"), (0, out))
    return be, cb.LayerLaunch(be, w), spec


def _views(bucket, S=5, parity=0):
    return LaunchViews(bucket, parity, FakeDeviceArray((bucket,), "<i4"), FakeDeviceArray((S + 1,), "<i4"))


def test_layer_launch_packs_once_per_bucket_views_and_checks_x_and_y_every_call():
    be, layer, spec = _layer()
    v16, v64 = _views(16), _views(64)
    x, y = FakeDeviceArray((64, 64), "<u2"), FakeDeviceArray((64, 96), "<u2")
    layer(y, x, v64, 64)
    layer(y, x, v64, 64)
    layer(y, x, v16, 16)
    assert [c.plan.bucket for c in be.prepared] == [64, 16]  # one packed launch per views object
    assert be.launched[0][0] is be.launched[1][0] is not be.launched[2][0]
    ptr_y = y.__cuda_array_interface__["data"][0]
    assert be.launched[0][1:4] == (5, ptr_y, x.__cuda_array_interface__["data"][0]) and be.launched[0][4] == 7
    misaligned = FakeDeviceArray((64, 96), "<u2", ptr=(1 << 31) + 2)
    layer(misaligned, x, v64, 64)
    assert be.launched[-1][2] == (1 << 31) + 2 and be.launched[-1][4] == 3  # y's 16-byte path off
    n = len(be.launched)
    for bad, err in ((FakeDeviceArray((64, 65), "<u2"), ValueError), (FakeDeviceArray((64, 64), "<f2"), TypeError),
                     (np.zeros((64, 64), np.float32), TypeError)):
        with pytest.raises(err):
            layer(y, bad, v64, 64)
    with pytest.raises(ValueError, match="share rows"):
        layer(FakeDeviceArray((32, 96), "<u2"), x, v64, 32)
    with pytest.raises(ValueError, match="addresses 65"):
        layer(y, x, v64, 65)  # the step addresses more rows than x has
    assert len(be.launched) == n  # nothing launched for a refused call


def test_a_half_is_packed_once_per_views_and_part_planned_unfused():
    """LayerLaunch.half packs its launch as __call__ does (once per views, here per part too),
    planned as two launches whatever the bucket, with x or y (the tensor it is given) in both
    pointer slots; x and y are checked on every call."""
    be, layer, spec = _layer()
    v16 = _views(16)
    x, y = FakeDeviceArray((16, 64), "<u2"), FakeDeviceArray((16, 96), "<u2")
    layer.half("shrink", x, v16, 16)
    layer.half("expand", y, v16, 16)
    layer.half("shrink", x, v16, 16)
    assert be.parts == [("shrink",), ("expand",)]  # one packing per (views, part)
    # planned as lora_shrink and an expand: bucket 16 runs lora_pair when whole
    assert all(not c.plan.fused and c.plan.expand not in ("chunk", "one", "pair") for c in be.prepared)
    whole = cb.plan_launch(16, 64, 96, 1, 16, "bfloat16", num_slots=5, num_sms=cb.DEFAULT_SMS)
    assert whole.expand == "pair"
    px, py = x.__cuda_array_interface__["data"][0], y.__cuda_array_interface__["data"][0]
    assert [launch[2:4] for launch in be.launched] == [(px, px), (py, py), (px, px)]
    assert be.launched[0][0] is be.launched[2][0] is not be.launched[1][0]
    with pytest.raises(ValueError, match="must be"):
        layer.half("expand", x, v16, 16)  # x's width is not y's
    with pytest.raises(ValueError, match="part"):
        layer.half("both", x, v16, 16)
    assert len(be.launched) == 3


def test_layer_launch_refuses_torch_tensors_on_the_host():
    torch = pytest.importorskip("torch")
    be, layer, _ = _layer()
    with pytest.raises(TypeError, match="CUDA"):
        layer(torch.zeros(64, 96, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16), _views(64), 64)
    assert not be.launched


def test_weights_are_checked_when_the_layer_is_made():
    be, _, spec = _layer()
    with pytest.raises(TypeError, match="int32"):
        cb.LayerLaunch(be, LayerWeights(FakeDeviceArray((5, 1, 16, 64), "<u2"), FakeDeviceArray((5, 96, 16), "<u2"),
                                        FakeDeviceArray((5, 1), "<f4"), FakeDeviceArray((5, 1), "<i8"), (0, 96)))


def test_a_layer_keeps_the_weights_its_launches_point_at_alive():
    """The packed launches hold the weights' raw pointers: a layer prepared from a temporary (the
    caller keeping no reference) still holds the arrays, and lets them go only with itself. (The
    ALIGNED GPU tests at first prepared from ``dev_weights(...)`` temporaries: CuPy's pool handed
    the freed weights' memory to the views, x and y allocated next, and every route read garbage.)"""
    import gc
    import weakref

    be, layer, _ = _layer()  # _layer passes LayerWeights(...) straight in
    refs = [weakref.ref(a) for a in (layer.held.a, layer.held.b, layer.held.scaling, layer.held.ranks)]
    gc.collect()
    assert all(r() is not None for r in refs)
    assert layer.weights.ptrs[:4] == tuple(r().__cuda_array_interface__["data"][0] for r in refs)
    del layer
    gc.collect()
    assert all(r() is None for r in refs)


class _FakeTensor:
    """Just enough of a CUDA torch tensor for LayerLaunch's fast path."""

    def __init__(self, shape, ptr):
        self.shape, self.dtype, self._ptr = shape, "bf16", ptr

    def is_contiguous(self):
        return True

    def get_device(self):
        return 0

    def data_ptr(self):
        return self._ptr


class _DriverError(Exception):
    pass


@pytest.mark.parametrize("fail_at", [0, 1])
def test_fast_path_relaunches_only_when_no_kernel_ran(fail_at):
    """A driver error on the first kernel (no context current on this thread) relaunches the whole
    call through the backend; one after a kernel already ran is raised: launching every kernel again
    would add that kernel's work twice (a shrink's v, or a fused delta into y)."""
    be, layer, _ = _layer()
    be.driver_error = _DriverError
    views = _views(64)
    x, y = FakeDeviceArray((64, 64), "<u2"), FakeDeviceArray((64, 96), "<u2")
    layer(y, x, views, 64)  # packs the bucket's launch
    packed = layer.packed(views)
    assert len(packed.launches) == 2  # _calls(): two kernels, as an unfused call launches
    ran = []

    def launch(*a):
        if len(ran) == fail_at:
            raise _DriverError("context")
        ran.append(a)

    packed.launch_kernel = launch
    layer._tensor, layer._tdtype, layer._stream = _FakeTensor, "bf16", lambda: 9
    n = len(be.launched)
    tx, ty = _FakeTensor((64, 64), 1 << 32), _FakeTensor((64, 96), 1 << 33)
    if fail_at == 0:
        layer(ty, tx, views, 64)
        assert len(be.launched) == n + 1 and be.launched[-1][1] == 9 and not ran  # the whole call, once
    else:
        with pytest.raises(_DriverError):
            layer(ty, tx, views, 64)
        assert len(be.launched) == n and len(ran) == 1  # the first kernel ran once, nothing relaunched


class _VBackend(_FakeBackend):
    """_FakeBackend plus what LayerLaunch.expand_v reads: its kernel and the driver."""

    def __init__(self, limits):
        super().__init__(limits)
        self.rec = _VRecorder()
        self._driver = type("D", (), {"launchKernel": staticmethod(self.rec)})()
        self.driver_error = _DriverError

    def expand_v_fn(self, dtype, rank_width):
        return _Fn(303 + rank_width)


class _VRecorder:
    def __init__(self):
        self.launches = []

    def __call__(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        u64 = lambda i: _read(params, i, ctypes.c_uint64)  # noqa: E731
        i64 = lambda i: _read(params, i, ctypes.c_int64)  # noqa: E731
        i32 = lambda i: _read(params, i, ctypes.c_int32)  # noqa: E731
        self.launches.append(dict(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), stream=stream,
                                  ys=[u64(i) for i in range(3)], ldy=[i64(i) for i in range(3, 6)],
                                  out=[i32(i) for i in range(6, 9)], boff=[i32(i) for i in range(9, 12)],
                                  v=u64(12), ldv=i64(13), b=u64(14), b_slot=i64(15), b_ld=i32(16), b_blk=i64(17),
                                  S=i32(22), n=i32(23)))


def _v_layer(S=33, R=16, slices=(4096, 1024, 1024)):
    from lora_cupy.spec import LoraSlice

    n = len(slices)
    out = sum(slices)
    t = LoraTarget("qkv", 4096, out, 1, tuple(LoraSlice(f"s{j}", o) for j, o in enumerate(slices)))
    spec = LoraSpec((t,), num_slots=S, max_rank=R, dtype="bfloat16")
    floats, ints = cb.plan_workspace(spec)
    offs = t.out_offsets()
    be = _VBackend(cb.CallLimits(spec, 0, cb.DEFAULT_SMS, floats, ints, {offs: 4096} if n > 1 else {}))
    w = LayerWeights(FakeDeviceArray((S, n, R, 4096), "<u2"), FakeDeviceArray((S, out, R), "<u2"),
                     FakeDeviceArray((S, n), "<f4"), FakeDeviceArray((S, n), "<i4"), offs)
    return be, cb.LayerLaunch(be, w), offs


def test_expand_v_packs_each_slice_and_v_and_refuses_misaligned_rows():
    """lora_expand_v's arguments: each slice's y, row stride, columns and first row of B; v's
    pointer and row stride; a grid of column blocks x chunks (at most one per position, at most
    the bucket's tiles of 8 plus a run per slot) x slices. What it cannot serve is refused before
    any launch."""
    S, R = 33, 16
    be, layer, offs = _v_layer(S, R)
    N = 4096 + S * 3 * R  # the extended GEMM's row: y of q, then v
    gemm = 1 << 32
    ys = [FakeDeviceArray((64, 4096), "<u2", strides=(2 * N, 2), ptr=gemm),
          FakeDeviceArray((64, 1024), "<u2"), FakeDeviceArray((64, 1024), "<u2")]
    v = FakeDeviceArray((64, S * 3 * R), "<u2", strides=(2 * N, 2), ptr=gemm + 2 * 4096)
    layer.expand_v(ys, v, _views(64, S), 64)
    [got] = be.rec.launches
    assert got["fn"] == 303 + R and got["block"] == (cb.EXPAND_V_BN // 4, 1, 1) and got["stream"] == 5
    assert got["grid"] == (4096 // cb.EXPAND_V_BN, 8 + 32, 3)  # 64 positions: 8 tiles + a run per slot
    assert got["ys"] == [gemm] + [y.__cuda_array_interface__["data"][0] for y in ys[1:]]
    assert got["ldy"] == [N, 1024, 1024] and got["out"] == [4096, 1024, 1024] and got["boff"] == [0, 4096, 5120]
    assert got["v"] == gemm + 2 * 4096 and got["ldv"] == N and got["S"] == S and got["n"] == 3
    assert got["b_slot"] == 6144 * R and got["b_ld"] == R and got["b_blk"] == 16  # B [S, out, R]
    layer.expand_v(ys, v, _views(1, S), 1)
    assert be.rec.launches[-1]["grid"][1] == 1  # one position: one chunk
    n = len(be.rec.launches)
    bad_v = FakeDeviceArray((64, S * 3 * R), "<u2", strides=(2 * N, 2), ptr=gemm + 2 * 4100)
    for args, err, match in (
            ((ys, bad_v), ValueError, "multiples of 8"),
            ((ys[:2], v), ValueError, "outputs for"),
            ((ys, FakeDeviceArray((64, S * 3 * R), "<f2")), TypeError, "dtype"),
            (([FakeDeviceArray((64, 4096), "<u2", strides=(2 * N + 2, 2))] + ys[1:], v), ValueError, "multiples of 4"),
            (([FakeDeviceArray((64, 4096), "<u2", strides=(2 * N, 4))] + ys[1:], v), ValueError, "contiguous"),
            ((ys, FakeDeviceArray((63, S * 3 * R), "<u2")), ValueError, r"\[rows >= 64")):
        with pytest.raises(err, match=match):
            layer.expand_v(*args, _views(64, S), 64)
    assert len(be.rec.launches) == n
    _, odd, _ = _v_layer(S, 12, (4096,))
    with pytest.raises(ValueError, match="rank widths"):
        odd.expand_v(ys[:1], v, _views(64, S), 64)
    _, four, _ = _v_layer(S, R, (1024, 1024, 1024, 1024))
    with pytest.raises(ValueError, match="up\\s+to 3 slices"):
        four.expand_v(ys, v, _views(64, S), 64)


def test_views_with_a_rank_bound_plan_and_build_the_call_for_the_narrower_rank():
    """A pool of maximum rank 128 whose step's slots reach rank 16 at most: the whole delta is planned
    and its kernels picked and sized for rank 16 (lora_pair, v rows of 16), A and B still
    read with rank 128's strides; another bound is another packed launch; the halves keep rank 128."""
    be, layer, spec = _layer(R=128)
    x, y = FakeDeviceArray((64, 64), "<u2"), FakeDeviceArray((64, 96), "<u2")
    plain, bounded = _views(64), LaunchViews(64, 0, *_views(64), rank_bound=16)
    layer(y, x, bounded, 64)
    layer(y, x, plain, 64)
    layer(y, x, bounded, 64)
    narrow, wide = be.prepared  # one packing per views object
    assert (narrow.rank, narrow.rw, narrow.dims[2]) == (16, 16, 128)
    assert (wide.rank, wide.rw, wide.dims[2]) == (128, 128, 128)
    assert narrow.plan == cb.plan_launch(64, 64, 96, 1, 16, "bfloat16", num_slots=5, num_sms=cb.DEFAULT_SMS)
    assert narrow.plan.expand == "pair" and wide.plan.expand == "chunk"
    layer.half("shrink", x, bounded, 64)
    assert be.prepared[-1].rank == 128 and be.prepared[-1].rw == 128

    class Kernels:  # what CupyBackend._kernels reads of its backend
        kernel, early_reads, aligned = "mma", 0, None
        workspace = counters = pair_ws = type("Buf", (), {"data": type("D", (), {"ptr": 1 << 20})(), "size": 1 << 30})()

        def _kernel_fn(self, dtype, key):
            return key

    shrink, expand = cb.CupyBackend._kernels(Kernels(), narrow)
    assert shrink.fn[:3] == ("pair_shrink", 16, 1) and expand.fn[:2] == ("pair_expand", 16)  # rank width 16, one slice
    assert shrink.smem == expand.smem == 8 * (5 + 1) and (shrink.block[0], expand.block[0]) == (128, 256)
    R_at, rw_at = 13, 18  # max_rank and rw among lora_mma's parameters
    for call in (shrink, expand):
        assert call.args[R_at] == 128 and call.args[rw_at] == 16
    [chunk] = cb.CupyBackend._kernels(Kernels(), wide)
    assert chunk.fn[:2] == ("chunk", 128) and chunk.args[R_at] == 128 and chunk.args[rw_at] == 128
