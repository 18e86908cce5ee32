"""Shared pieces of the GPU tests: device detection, fresh random cases, the float64 oracle check."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from lora_cupy.addressing import group_by_slot
from lora_cupy.backends.base import LayerWeights
from lora_cupy.backends.cupy import TOLERANCE  # ||out - ref|| / ||ref|| per dtype: the one table
from lora_cupy.backends.reference import dense_delta64
from lora_cupy.dtypes import numpy_dtype
from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget




@pytest.fixture
def rng(request):
    """A fresh generator per test; its seed is in the test's report when it fails."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def row_slots_for(rng, mix: str, T: int, num_slots: int, active: int) -> np.ndarray:
    """Each row's slot under a popularity mix; ``active`` slots (of 1..num_slots-1) take adapters."""
    slots = rng.permutation(np.arange(1, num_slots))[:active]
    if mix == "distinct":
        return slots[np.arange(T) % len(slots)]
    if mix == "uniform":  # with a few base-model rows on slot 0
        rows = slots[rng.integers(0, len(slots), T)]
        rows[rng.random(T) < 0.15] = 0
        return rows
    if mix == "zipf":
        k = np.minimum(rng.zipf(1.5, T), len(slots)) - 1
        return slots[k]
    if mix == "identical":
        return np.full(T, slots[0])
    if mix == "skewed":  # a quarter on slot 0, half on one adapter, the rest spread
        rows = slots[rng.integers(0, len(slots), T)]
        u = rng.random(T)
        rows[u < 0.5] = slots[0]
        rows[u < 0.25] = 0
        return rows
    raise ValueError(mix)


@dataclass
class Case:
    """One delta on the host: inputs, weights, addressing, and the float64 reference of y."""

    spec: LoraSpec
    x: np.ndarray  # [rows, in]
    y0: np.ndarray  # [rows, out]
    w: LayerWeights  # host arrays
    token_order: np.ndarray
    slot_indptr: np.ndarray
    row_slots: np.ndarray  # [rows], 0 for base rows and padding
    ref: np.ndarray  # [rows, out] float64: y0 + delta

    @property
    def touched(self) -> np.ndarray:
        return self.row_slots > 0


def build_case(rng, *, T: int, in_f: int, slices, max_rank: int, ranks, dtype: str, mix: str,
              num_slots: int = 9, active: int = 4, pad_to: int | None = None,
              poison_beyond_rank: bool = True) -> Case:
    """A fresh random case. ``ranks`` are drawn per (slot, slice) from the given choices (0 allowed).

    Weights beyond each slot's rank and all of slot 0 hold NaN when ``poison_beyond_rank``: a
    kernel that reads them shows it. ``pad_to`` adds padding positions (a capture bucket's tail).
    """
    dt = numpy_dtype(dtype)
    slices = tuple(slices)
    n, out = len(slices), sum(slices)
    target = LoraTarget("t", in_f, out, 1, tuple(LoraSlice(f"s{j}", o) for j, o in enumerate(slices)))
    spec = LoraSpec((target,), num_slots=num_slots, max_rank=max_rank, dtype=dtype)
    S, R = num_slots, max_rank
    rank = rng.choice(np.asarray(ranks), size=(S, n)).astype(np.int32)
    rank[0] = 0
    rank = np.minimum(rank, R)
    scaling = rng.uniform(0.5, 2.0, (S, n)).astype(np.float32)
    scaling[0] = 0
    a = (rng.standard_normal((S, n, R, in_f)) / np.sqrt(in_f)).astype(np.float32)
    b = (rng.standard_normal((S, out, R)) / np.sqrt(8)).astype(np.float32)
    offs = target.out_offsets()
    if poison_beyond_rank:
        for s in range(S):
            for j in range(n):
                a[s, j, rank[s, j]:] = np.nan
                b[s, offs[j]:offs[j + 1], rank[s, j]:] = np.nan
    a, b = a.astype(dt), b.astype(dt)
    rows = T if pad_to is None else pad_to
    row_slots = np.zeros(rows, np.int64)
    row_slots[:T] = row_slots_for(rng, mix, T, S, min(active, S - 1))
    token_order, indptr = group_by_slot(row_slots[:T], S)
    if pad_to is not None:  # padding positions point at the padding rows and address nothing
        token_order = np.concatenate([token_order, np.arange(T, pad_to, dtype=np.int32)])
    x = rng.standard_normal((rows, in_f)).astype(dt)
    w = LayerWeights(a, b, scaling, rank, offs)
    d = dense_delta64(x, _finite(w), row_slots)
    y0 = (rng.standard_normal((rows, out)) * max(float(np.abs(d).mean()), 1e-3)).astype(dt)
    return Case(spec, x, y0, w, token_order, indptr, row_slots, y0.astype(np.float64) + d)


def with_row_at(rng, case: Case, rows: int, at: int) -> Case:
    """``case`` (one position) with its row moved to ``at`` among ``rows`` rows of x and y, the others
    random and addressed by nothing: a kernel that reads row 0 rather than token_order's shows."""
    assert case.token_order.shape[0] == 1 and 0 <= at < rows
    src = int(case.token_order[0])
    x = rng.standard_normal((rows, case.x.shape[1])).astype(case.x.dtype)
    y0 = rng.standard_normal((rows, case.y0.shape[1])).astype(case.y0.dtype)
    x[at], y0[at] = case.x[src], case.y0[src]
    ref = y0.astype(np.float64)
    ref[at] = case.ref[src]
    row_slots = np.zeros(rows, case.row_slots.dtype)
    row_slots[at] = case.row_slots[src]
    return replace(case, x=x, y0=y0, token_order=np.asarray([at], np.int32), row_slots=row_slots, ref=ref)


def with_zero_odd_deltas(case: Case) -> Case:
    """``case`` with B's odd columns zero, so every pair (and 16-byte piece) of y's columns gets exact-zero
    deltas beside nonzero ones, and -0 and +0 planted in y0's odd columns; the oracle redone."""
    case.w.b[:, 1::2, :] = 0
    y0 = case.y0.copy()
    y0[:, 1::4] = -0.0
    y0[:, 3::8] = 0.0
    assert (y0[:, 1::4].view(np.uint16) == 0x8000).all()  # -0 where the cases say it is
    return replace(case, y0=y0, ref=y0.astype(np.float64) + dense_delta64(case.x, _finite(case.w), case.row_slots))


def assert_odd_columns_kept(case: Case, y: np.ndarray) -> None:
    """Every row's odd columns (deltas exactly zero: :func:`with_zero_odd_deltas`) hold y0's bits."""
    np.testing.assert_array_equal(np.asarray(y)[:, 1::2].view(np.uint16), case.y0[:, 1::2].view(np.uint16))


def _finite(w: LayerWeights) -> LayerWeights:
    """The weights with NaN poison zeroed, for the oracle (which slices to each rank anyway)."""
    return LayerWeights(np.nan_to_num(w.a.astype(np.float32)), np.nan_to_num(w.b.astype(np.float32)),
                        w.scaling, w.ranks, w.out_offsets)


def adapter_slots(case: Case) -> list[int]:
    """The slots past slot 0 (no adapter) that hold positions of the case's step."""
    ip = case.slot_indptr
    return [s for s in range(1, len(ip) - 1) if ip[s + 1] > ip[s]]


def with_inf(case: Case) -> tuple[np.ndarray, int]:
    """A copy of ``case.x`` with an inf in the row of the first token on a slot whose last slice
    has a rank (else on any slot with positions), and that row. A packed shrink meets it with the
    zero rows of A before that slice: 0 * inf is NaN, which must land nowhere it stays."""
    ip, order = case.slot_indptr, case.token_order
    slots = adapter_slots(case)
    s = next((s for s in slots if case.w.ranks[s, -1] > 0), slots[0])
    t = int(order[ip[s]])
    x = case.x.copy()
    x[t, min(5, x.shape[1] - 1)] = np.inf
    return x, t


def check_result(case: Case, y: np.ndarray, dtype: str) -> None:
    """y matches the oracle on touched rows within the dtype's tolerance; other rows are bit-exact."""
    y = np.asarray(y)
    t = case.touched
    assert np.isfinite(y.astype(np.float64)).all(), "non-finite output: poisoned weights were read"
    np.testing.assert_array_equal(y[~t].view(np.uint8), case.y0[~t].view(np.uint8),
                                  err_msg="rows of slot 0 or padding were written")
    offs = case.w.out_offsets
    for row in np.nonzero(t)[0]:  # slices of rank 0 at a row's slot keep their bits too
        for j in np.nonzero(case.w.ranks[case.row_slots[row]] == 0)[0]:
            cols = slice(offs[j], offs[j + 1])
            np.testing.assert_array_equal(y[row, cols].view(np.uint8), case.y0[row, cols].view(np.uint8))
    if t.any():
        ref = case.ref[t]
        err = np.linalg.norm(y[t].astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < TOLERANCE[dtype], f"relative error {err:.3g} above {TOLERANCE[dtype]}"
        # and the delta really landed: the output moved away from y0 wherever the delta is large
        moved = np.linalg.norm(y[t].astype(np.float64) - case.y0[t].astype(np.float64))
        assert moved >= 0.5 * np.linalg.norm(ref - case.y0[t].astype(np.float64))


@pytest.fixture
def make_case(rng):
    """``make_case(**shape)``: a fresh random :class:`Case` (see :func:`build_case`)."""
    return lambda **kw: build_case(rng, **kw)


@pytest.fixture
def row_at(rng):
    """``row_at(case, rows, at)``: :func:`with_row_at`, the one position moved to row ``at``."""
    return lambda case, rows, at: with_row_at(rng, case, rows, at)


@pytest.fixture
def inf_in_x():
    """``inf_in_x(case)``: :func:`with_inf`, x with an inf in one adapter token's row."""
    return with_inf


@pytest.fixture
def check():
    """``check(case, y, dtype)``: the oracle comparison of :func:`check_result`."""
    return check_result
