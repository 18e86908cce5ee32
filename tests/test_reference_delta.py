"""The NumPy reference delta against a dense float64 computation, and its edge cases."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_cupy.addressing import group_by_slot
from lora_cupy.backends.base import LayerWeights
from lora_cupy.backends.reference import dense_delta64, reference_delta, reference_expand_v
from lora_cupy.dtypes import numpy_dtype

DTYPES = ("float32", "float16", "bfloat16")
#: Relative error of float32 accumulation over the sizes drawn here.
ACC_TOL = 1e-5


def random_weights(rng, num_slots, max_rank, in_f, slice_out, dtype, ranks=None) -> LayerWeights:
    n = len(slice_out)
    out = sum(slice_out)
    dt = numpy_dtype(dtype)
    if ranks is None:
        ranks = rng.integers(0, max_rank + 1, size=(num_slots, n))
    ranks = np.asarray(ranks, np.int32).copy()
    ranks[0] = 0
    a = (rng.standard_normal((num_slots, n, max_rank, in_f)) / np.sqrt(in_f)).astype(dt)
    b = rng.standard_normal((num_slots, out, max_rank)).astype(dt)
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(slice_out)]))
    for s in range(num_slots):  # weights past a slice's rank are zero, slot 0 is all zero
        for j in range(n):
            a[s, j, ranks[s, j]:] = 0
            b[s, offs[j]:offs[j + 1], ranks[s, j]:] = 0
    scaling = rng.uniform(0.1, 2.0, size=(num_slots, n)).astype(np.float32)
    scaling[0] = 0
    return LayerWeights(a, b, scaling, ranks, offs)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.sampled_from([1, 3, 7, 16, 133]),
    num_slots=st.integers(2, 9),
    max_rank=st.sampled_from([1, 8, 13, 16]),
    in_f=st.sampled_from([5, 16, 40]),
    slice_out=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    padding=st.integers(0, 5),
)
def test_reference_matches_dense_float64(seed, tokens, num_slots, max_rank, in_f, slice_out, dtype, padding):
    rng = np.random.default_rng(seed)
    w = random_weights(rng, num_slots, max_rank, in_f, slice_out, dtype)
    dt = numpy_dtype(dtype)
    row_slots = rng.integers(0, num_slots, size=tokens)
    order, indptr = group_by_slot(row_slots, num_slots)
    # A capture bucket's padding: positions past slot_indptr[-1] hold stale rows and address nothing.
    order = np.concatenate([order, rng.integers(0, tokens, size=padding).astype(np.int32)])
    x = rng.standard_normal((tokens, in_f)).astype(dt)
    y0 = rng.standard_normal((tokens, sum(slice_out))).astype(dt)
    y = y0.copy()
    reference_delta(y, x, w, order, indptr)
    want = y0.astype(np.float64) + dense_delta64(x, w, row_slots)
    touched = (row_slots != 0) & w.ranks[row_slots].any(axis=1)
    assert np.array_equal(y[~touched], y0[~touched]), "a row on slot 0 (or rank 0) was written"
    if touched.any():
        # Inputs are exact in float64; the only errors are float32 accumulation and y's one
        # rounding to its dtype (half an ulp of the result).
        got, ref = y[touched].astype(np.float64), want[touched]
        delta = ref - y0[touched].astype(np.float64)
        bound = float(ml_dtypes.finfo(dt).eps) * np.linalg.norm(ref) + ACC_TOL * np.linalg.norm(delta)
        assert np.linalg.norm(got - ref) <= bound


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.sampled_from([1, 5, 16, 67]),
    num_slots=st.integers(2, 9),
    max_rank=st.sampled_from([1, 8, 16]),
    slice_out=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
)
def test_expand_from_a_gemm_written_v_matches_dense_float64(seed, tokens, num_slots, max_rank, slice_out, dtype):
    """reference_expand_v: v as one GEMM of x with every slot's A rows writes it (rounded to the
    dtype), each slice's own output, rows of slot 0 untouched, the rest on the float64 oracle."""
    rng = np.random.default_rng(seed)
    in_f = 24
    w = random_weights(rng, num_slots, max_rank, in_f, slice_out, dtype)
    dt = numpy_dtype(dtype)
    n = len(slice_out)
    row_slots = rng.integers(0, num_slots, size=tokens)
    order, indptr = group_by_slot(row_slots, num_slots)
    x = rng.standard_normal((tokens, in_f)).astype(dt)
    v = (x.astype(np.float64) @ w.a.reshape(num_slots * n * max_rank, in_f).astype(np.float64).T).astype(dt)
    ys0 = [rng.standard_normal((tokens, o)).astype(dt) for o in slice_out]
    ys = [y.copy() for y in ys0]
    reference_expand_v(ys, v, w, order, indptr)
    d = dense_delta64(x, w, row_slots)
    touched = (row_slots != 0) & w.ranks[row_slots].any(axis=1)
    for j, (y, y0) in enumerate(zip(ys, ys0)):
        assert np.array_equal(y[~touched], y0[~touched]), "a row on slot 0 (or rank 0) was written"
        c0, c1 = w.out_offsets[j], w.out_offsets[j + 1]
        ref = y0.astype(np.float64) + d[:, c0:c1]
        got = y.astype(np.float64)
        # errors: v's rounding to the dtype (one ulp of each v), float32 sums, y's one rounding
        eps = float(ml_dtypes.finfo(dt).eps)
        vb = np.abs(v.astype(np.float64)).max() if v.size else 0.0
        bmax = float(np.abs(w.b.astype(np.float64)).max()) if w.b.size else 0.0
        bound = eps * (np.abs(ref).max() + 2 * max_rank * vb * bmax * 2.0) + 1e-6
        assert np.abs(got - ref)[touched].max(initial=0.0) <= bound


def test_padding_positions_address_nothing():
    rng = np.random.default_rng()
    w = random_weights(rng, 4, 8, 16, [12], "float32", ranks=[[0], [8], [3], [5]])
    row_slots = np.array([1, 2, 3, 0, 1])
    order, indptr = group_by_slot(row_slots, 4)
    x = rng.standard_normal((7, 16)).astype(np.float32)  # rows 5 and 6 are a bucket's padding
    y = rng.standard_normal((7, 12)).astype(np.float32)
    y0 = y.copy()
    padded = np.concatenate([order, np.array([5, 6], np.int32)])
    reference_delta(y, x, w, padded, indptr)
    assert np.array_equal(y[5:], y0[5:])
    assert np.array_equal(y[3], y0[3])
    d = dense_delta64(x[:5], w, row_slots)
    np.testing.assert_allclose(y[:5] - y0[:5], d, rtol=1e-4, atol=1e-4)
    assert np.abs(d[[0, 1, 2, 4]]).min(axis=1).max() > 0  # the delta is not trivially zero


def test_slices_write_only_their_columns():
    rng = np.random.default_rng()
    w = random_weights(rng, 3, 4, 8, [5, 3, 6], "float32", ranks=[[0, 0, 0], [4, 0, 2], [1, 3, 0]])
    x = rng.standard_normal((2, 8)).astype(np.float32)
    y = rng.standard_normal((2, 14)).astype(np.float32)
    y0 = y.copy()
    order, indptr = group_by_slot(np.array([1, 2]), 3)
    reference_delta(y, x, w, order, indptr)
    assert np.array_equal(y[0, 5:8], y0[0, 5:8])  # slot 1's middle slice has rank 0
    assert np.array_equal(y[1, 8:], y0[1, 8:])  # slot 2's last slice has rank 0
    assert not np.array_equal(y[0, :5], y0[0, :5]) and not np.array_equal(y[1, 5:8], y0[1, 5:8])


def test_group_by_slot_is_stable_and_checked():
    order, indptr = group_by_slot(np.array([2, 0, 2, 1, 0]), 3)
    assert order.tolist() == [1, 4, 3, 0, 2]
    assert indptr.tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError):
        group_by_slot(np.array([0, 3]), 3)
