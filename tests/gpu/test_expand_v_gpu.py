"""lora_expand_v (expand_v.cu) against a float64 oracle: the expand of a delta from a v the base GEMM
wrote (every slot's ``x @ A.T`` beside y in the GEMM's rows), each slice into its own output, the
first one a column range of the GEMM's output as the attachment runs it."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.backends.cupy import TOLERANCE
from lora_cupy.dtypes import numpy_dtype
from lora_cupy.planning import LaunchViews

from test_kernels import backend_for, dev, dev_weights, host, pytestmark, rank_blocked  # noqa: F401

CASES = {
    "T1": dict(T=1, in_f=256, slices=(512,), max_rank=16, ranks=(16,), mix="identical"),
    "T7-qkv": dict(T=7, in_f=200, slices=(96, 40, 24), max_rank=64, ranks=(0, 1, 8, 13, 64), mix="uniform"),
    "T64-distinct": dict(T=64, in_f=256, slices=(1024, 256, 256), max_rank=16, ranks=(16,), mix="distinct",
                         num_slots=33, active=32),
    "T64-zipf-r128": dict(T=64, in_f=128, slices=(520, 1036), max_rank=128, ranks=(1, 8, 13, 64, 128),
                          mix="zipf", num_slots=17, active=12),
    "T61-skew-r8": dict(T=61, in_f=96, slices=(2056,), max_rank=8, ranks=(3, 8), mix="skewed"),
    "pad100": dict(T=100, in_f=256, slices=(256,), max_rank=32, ranks=(16, 32), mix="uniform", pad_to=128),
}


def _gemm_v(case) -> np.ndarray:
    """v as the extended GEMM writes it: x . A of every slot (NaN past each rank, as the poisoned
    weights hold), rounded to the dtype."""
    S, n, R, in_f = case.w.a.shape
    a = case.w.a.astype(np.float64).reshape(S * n * R, in_f)
    with np.errstate(invalid="ignore"):
        return (case.x.astype(np.float64) @ a.T).astype(case.x.dtype)


def _oracle(case, v: np.ndarray) -> list[np.ndarray]:
    """float64 ``y0_j + scaling * v[rows, slot's ranks] @ B[slot, cols_j, :r].T`` per slice."""
    w = case.w
    S, n, R, _ = w.a.shape
    offs = w.out_offsets
    out = [case.y0[:, offs[j]:offs[j + 1]].astype(np.float64) for j in range(n)]
    for t in np.nonzero(case.touched)[0]:
        s = int(case.row_slots[t])
        for j in range(n):
            r = int(w.ranks[s, j])
            if r:
                vs = v[t, (s * n + j) * R:(s * n + j) * R + r].astype(np.float64)
                out[j][t] += float(w.scaling[s, j]) * (w.b[s, offs[j]:offs[j + 1], :r].astype(np.float64) @ vs)
    return out


#: each case with B [S, out, R], and those above 16 ranks also rank-blocked, as a pool of such a max_rank holds it
LAYOUTS = [(name, "plain") for name in CASES] + [(name, "blocked") for name, c in CASES.items() if c["max_rank"] > 16]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,layout", LAYOUTS)
def test_expand_v_matches_oracle(make_case, name, layout, dtype):
    import cupy

    case = make_case(dtype=dtype, **CASES[name])
    S, n, R, _ = case.w.a.shape
    offs = case.w.out_offsets
    rows = case.x.shape[0]
    v = _gemm_v(case)
    # the first slice's y and v side by side in one array, as the GEMM writes them
    gemm = np.concatenate([case.y0[:, :offs[1]], v], axis=1)
    d_gemm = dev(gemm)
    ys = [d_gemm[:, :offs[1]]] + [dev(np.ascontiguousarray(case.y0[:, offs[j]:offs[j + 1]])) for j in range(1, n)]
    be = backend_for(case.spec)
    launch = be.prepare(dev_weights(rank_blocked(case).w if layout == "blocked" else case.w))
    views = LaunchViews(len(case.token_order), 0, dev(case.token_order), dev(case.slot_indptr))
    launch.expand_v(ys, d_gemm[:, offs[1]:], views, rows)
    cupy.cuda.get_current_stream().synchronize()
    got = [host(y, dtype) for y in ys]
    want = _oracle(case, v)
    t = case.touched
    assert np.array_equal(host(d_gemm, dtype)[:, offs[1]:].view(np.uint16), v.view(np.uint16)), "v was written"
    for j in range(n):
        y0j = case.y0[:, offs[j]:offs[j + 1]]
        np.testing.assert_array_equal(got[j][~t].view(np.uint16), y0j[~t].view(np.uint16),
                                      err_msg=f"slice {j}: rows of slot 0 or padding were written")
        if t.any():
            assert np.isfinite(got[j][t].astype(np.float64)).all(), "v or B past a rank was read"
            ref = want[j][t]
            delta = ref - y0j[t].astype(np.float64)
            if np.linalg.norm(delta) == 0:  # every touched row's slice has rank 0 here
                np.testing.assert_array_equal(got[j][t].view(np.uint16), y0j[t].view(np.uint16))
                continue
            err = np.linalg.norm(got[j][t].astype(np.float64) - ref) / np.linalg.norm(ref)
            assert err < TOLERANCE[dtype], f"slice {j}: relative error {err:.3g}"
            moved = np.linalg.norm(got[j][t].astype(np.float64) - y0j[t].astype(np.float64))
            assert moved >= 0.5 * np.linalg.norm(delta), f"slice {j}: the delta did not land"


def test_expand_v_in_a_cuda_graph_replays_new_addressing(make_case):
    """Captured once on torch tensors, replayed after the addressing buffers change in place."""
    import torch

    dtype = "bfloat16"
    shape = dict(T=64, in_f=128, slices=(512, 128, 128), max_rank=16, ranks=(8, 16), mix="distinct",
                 num_slots=17, active=8, poison_beyond_rank=False)
    first = make_case(dtype=dtype, **shape)
    S, n, R, _ = first.w.a.shape
    offs = first.w.out_offsets
    be = backend_for(first.spec)
    launch = be.prepare(dev_weights(first.w))
    tt = lambda h: torch.as_tensor(h.view(np.int16) if h.dtype.itemsize == 2 else h, device="cuda")  # noqa: E731
    order, indptr = tt(first.token_order), tt(first.slot_indptr)
    views = LaunchViews(64, 0, order, indptr)
    gemm = torch.empty((64, offs[1] + S * n * R), dtype=torch.bfloat16, device="cuda")
    others = [torch.empty((64, offs[j + 1] - offs[j]), dtype=torch.bfloat16, device="cuda") for j in range(1, n)]
    ys = [gemm[:, :offs[1]]] + others

    def load(case):
        v = _gemm_v(case)
        gemm.view(torch.int16).copy_(tt(np.concatenate([case.y0[:, :offs[1]], v], axis=1)))
        for j, o in enumerate(others, start=1):
            o.view(torch.int16).copy_(tt(np.ascontiguousarray(case.y0[:, offs[j]:offs[j + 1]])))
        order.copy_(tt(case.token_order))
        indptr.copy_(tt(case.slot_indptr))
        return v

    load(first)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch.expand_v(ys, gemm[:, offs[1]:], views, 64)  # warm-up: the module loads outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch.expand_v(ys, gemm[:, offs[1]:], views, 64)
    for _ in range(2):
        case = build_like(make_case, first, shape)
        v = load(case)
        graph.replay()
        torch.cuda.synchronize()
        want = _oracle(case, v)
        got = [y.view(torch.int16).cpu().numpy().view(numpy_dtype(dtype)) for y in ys]
        for j in range(n):
            ref = want[j]
            err = np.linalg.norm(got[j].astype(np.float64) - ref) / np.linalg.norm(ref)
            assert err < TOLERANCE[dtype], f"slice {j}: relative error {err:.3g} after a replay"


def build_like(make_case, first, shape):
    """A fresh case of ``first``'s shape with its weights (new rows, x, y and addressing)."""
    case = make_case(dtype=first.spec.dtype, **shape)
    case.w = first.w
    from lora_cupy.backends.reference import dense_delta64

    case.ref = case.y0.astype(np.float64) + dense_delta64(case.x, first.w, case.row_slots)
    return case


def test_expand_v_refuses_what_it_cannot_serve(make_case):
    import cupy

    case = make_case(dtype="bfloat16", T=8, in_f=64, slices=(64,), max_rank=16, ranks=(16,), mix="uniform")
    S, n, R, _ = case.w.a.shape
    be = backend_for(case.spec)
    launch = be.prepare(dev_weights(case.w))
    views = LaunchViews(8, 0, dev(case.token_order), dev(case.slot_indptr))
    g = cupy.zeros((8, 64 + S * n * R + 8), cupy.uint16)
    with pytest.raises(ValueError, match="multiples of 8"):
        launch.expand_v([g[:, :64]], g[:, 65:65 + S * n * R], views, 8)  # v one element off
    with pytest.raises(ValueError, match=r"\[rows >= 8"):
        launch.expand_v([g[:, :64]], g[:, 64:63 + S * n * R], views, 8)
    with pytest.raises(ValueError, match="outputs for"):
        launch.expand_v([g[:, :64], g[:, :64]], g[:, 64:64 + S * n * R], views, 8)
    case32 = make_case(dtype="float32", T=8, in_f=64, slices=(64,), max_rank=16, ranks=(16,), mix="uniform")
    with pytest.raises(ValueError, match="lora_expand_v serves"):
        backend_for(case32.spec).prepare(dev_weights(case32.w)).expand_v([g], g, views, 8)
    assert not bool(g.any()), "a refused call wrote"


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_expand_v_after_its_gemm_with_pdl(make_case, graphed):
    """Launched right after the GEMM that writes y and v (``after_gemm``: programmatic dependent
    launch on an H200), the expand still reads only what that GEMM wrote: the GEMM's output starts
    as NaN, so a y or v read before the GEMM finished shows; eager, and captured in a graph with
    the GEMM and replayed on fresh x."""
    import torch

    dtype = "bfloat16"
    shape = dict(T=64, in_f=4096, slices=(4096, 1024, 1024), max_rank=16, ranks=(8, 16), mix="distinct",
                 num_slots=17, active=12, poison_beyond_rank=False)
    case = make_case(dtype=dtype, **shape)
    S, n, R, in_f = case.w.a.shape
    offs = case.w.out_offsets
    be = backend_for(case.spec)
    major = int(torch.cuda.get_device_capability()[0])
    assert be.pdl == (major >= 9), "the backend takes programmatic dependent launch where the device has it"
    launch = be.prepare(dev_weights(case.w))
    tt = lambda h: torch.as_tensor(h.view(np.int16), device="cuda").view(torch.bfloat16)  # noqa: E731
    rng = np.random.default_rng(7)
    head = tt((rng.standard_normal((offs[1], in_f)) / 64).astype(case.x.dtype))
    ext = torch.cat([head, tt(case.w.a.reshape(S * n * R, in_f))])
    others = [tt((rng.standard_normal((offs[j + 1] - offs[j], in_f)) / 64).astype(case.x.dtype)) for j in range(1, n)]
    x = tt(case.x)
    views = LaunchViews(64, 0, torch.as_tensor(case.token_order, device="cuda"),
                        torch.as_tensor(case.slot_indptr, device="cuda"))
    gemm = torch.empty((64, ext.shape[0]), dtype=torch.bfloat16, device="cuda")
    ys = [gemm[:, :offs[1]]] + [torch.empty((64, w.shape[0]), dtype=torch.bfloat16, device="cuda") for w in others]

    def step():
        gemm.fill_(float("nan"))
        for y in ys[1:]:
            y.fill_(float("nan"))
        torch.mm(x, ext.t(), out=gemm)
        for y, w in zip(ys[1:], others):
            torch.mm(x, w.t(), out=y)
        launch.expand_v(ys, gemm[:, offs[1]:], views, 64, after_gemm=True)

    def check():
        with torch.no_grad():  # the GEMMs again, into fresh arrays: the base outputs and v
            want_gemm = torch.mm(x, ext.t())
            base = [want_gemm[:, :offs[1]]] + [torch.mm(x, w.t()) for w in others]
        torch.cuda.synchronize()
        h = lambda t: t.contiguous().view(torch.int16).cpu().numpy().view(numpy_dtype(dtype))  # noqa: E731
        v = h(gemm[:, offs[1]:])
        assert np.array_equal(v.view(np.uint16), h(want_gemm[:, offs[1]:]).view(np.uint16)), "v is the GEMM's"
        case.y0 = np.concatenate([h(b) for b in base], axis=1)
        want = _oracle(case, v)
        for j in range(n):
            got = h(ys[j]).astype(np.float64)
            assert np.isfinite(got).all(), f"slice {j}: NaN: y or v read before the GEMM wrote them"
            err = np.linalg.norm(got - want[j]) / np.linalg.norm(want[j])
            assert err < TOLERANCE[dtype], f"slice {j}: relative error {err:.3g}"

    step()
    check()
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(3):
            x.copy_(tt(rng.standard_normal(case.x.shape).astype(case.x.dtype)))
            graph.replay()
            check()


COMPACT_CASES = {
    "T1": dict(T=1, in_f=256, slices=(512,), max_rank=16, ranks=(16,), mix="identical"),
    "T7-qkv": dict(T=7, in_f=200, slices=(96, 40, 24), max_rank=64, ranks=(0, 1, 8, 13, 64), mix="uniform"),
    "T8-distinct": dict(T=8, in_f=128, slices=(1024, 256, 256), max_rank=16, ranks=(8, 16), mix="distinct",
                        num_slots=33, active=8),
    "pad8": dict(T=5, in_f=128, slices=(264,), max_rank=32, ranks=(16, 32), mix="uniform", pad_to=8),
}


@pytest.mark.parametrize("name", list(COMPACT_CASES))
def test_gather_then_compact_expand_v_matches_oracle(make_case, name):
    """A small step: ``gather_a`` places the A of its slots with positions before a base weight
    (the k-th at block K-1-k; the rest of the rows untouched, bit for bit), a GEMM over the kb blocks and the
    weight writes v beside y, and ``expand_v(compact=kb)`` adds what the float64 oracle says."""
    import cupy

    from lora_cupy.backends.reference import active_slots, reference_gather_a

    dtype = "bfloat16"
    case = make_case(dtype=dtype, **COMPACT_CASES[name])
    S, n, R, in_f = case.w.a.shape
    offs = case.w.out_offsets
    kb = len(case.token_order)  # the bucket's rows: at least the slots with positions
    K = 8
    be = backend_for(case.spec)
    launch = be.prepare(dev_weights(case.w))
    tail = dev(case.w.a)
    rng = np.random.default_rng(3)
    head = (rng.standard_normal((offs[1], in_f)) / 16).astype(case.x.dtype)
    # rows the gather must not write hold 3.0 (the weights hold NaN past each rank and in slot 0)
    ext_h = np.concatenate([np.full((K * n * R, in_f), 3.0, case.x.dtype), head])
    ext = dev(ext_h)
    compact = ext[:K * n * R].reshape(K, n, R, in_f)
    gather = be.gather_a([(tail, compact)])
    gather(dev(case.slot_indptr), kb)
    cupy.cuda.get_current_stream().synchronize()
    want_ext = ext_h.copy()
    reference_gather_a([(case.w.a, want_ext[:K * n * R].reshape(K, n, R, in_f))], case.slot_indptr, kb)
    got_ext = host(ext, dtype)
    assert np.array_equal(got_ext.view(np.uint16), want_ext.view(np.uint16)), "the gathered rows differ"
    slots = active_slots(case.slot_indptr)
    assert 1 <= len(slots) <= kb
    # the GEMM over the kb blocks and the weight (float64, rounded), then the expand
    rows_w = want_ext[(K - kb) * n * R:].astype(np.float64)
    with np.errstate(invalid="ignore"):
        gemm = (case.x.astype(np.float64) @ rows_w.T).astype(case.x.dtype)
    gemm[:, kb * n * R:] = case.y0[:, :offs[1]]
    d_gemm = dev(gemm)
    ys = [d_gemm[:, kb * n * R:]] + [dev(np.ascontiguousarray(case.y0[:, offs[j]:offs[j + 1]])) for j in range(1, n)]
    views = LaunchViews(len(case.token_order), 0, dev(case.token_order), dev(case.slot_indptr))
    launch.expand_v(ys, d_gemm[:, :kb * n * R], views, case.x.shape[0], compact=kb)
    cupy.cuda.get_current_stream().synchronize()
    full = np.zeros((gemm.shape[0], S * n * R), case.x.dtype)  # the same v, as every slot's blocks
    for k, s in enumerate(slots):
        b = kb - 1 - k
        full[:, s * n * R:(s + 1) * n * R] = gemm[:, b * n * R:(b + 1) * n * R]
    want = _oracle(case, full)
    t = case.touched
    for j in range(n):
        got = host(ys[j], dtype)
        y0j = case.y0[:, offs[j]:offs[j + 1]]
        np.testing.assert_array_equal(got[~t].view(np.uint16), y0j[~t].view(np.uint16))
        ref = want[j][t]
        if np.linalg.norm(ref - y0j[t].astype(np.float64)) == 0:
            continue
        err = np.linalg.norm(got[t].astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < TOLERANCE[dtype], f"slice {j}: relative error {err:.3g}"
    with pytest.raises(ValueError, match="kb must be"):
        gather(dev(case.slot_indptr), K + 1)
    with pytest.raises(ValueError, match="compact"):
        launch.expand_v(ys, d_gemm[:, :kb * n * R], views, case.x.shape[0], compact=S)
