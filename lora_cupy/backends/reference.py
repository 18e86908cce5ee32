"""The NumPy reference delta: the CPU backend, and the oracle the kernels are checked against."""

from __future__ import annotations

import numpy as np

from .base import LayerWeights, active_slots, b_columns, check_compact, check_gather_pairs


def reference_delta(y: np.ndarray, x: np.ndarray, w: LayerWeights, token_order, slot_indptr) -> None:
    """``y[t, cols_j] += scaling[s, j] * (x[t] @ a[s, j, :r].T) @ b[s, cols_j, :r].T``.

    For each slot ``s >= 1`` and row ``t`` in its range of ``token_order``, each slice ``j``
    (``r = ranks[s, j]``). x is ``[T, in]`` and y ``[T, out]``, float16, bfloat16 or float32;
    products accumulate in float32 and y is rounded to its dtype once, after adding. Slot 0,
    rank-0 slices and rows past ``slot_indptr[-1]`` are left untouched. Changes y in place.
    """
    scaling = np.asarray(w.scaling, np.float32)
    ranks = np.asarray(w.ranks)
    offs = w.out_offsets
    for s, _lo, _hi, rows in slot_runs(token_order, slot_indptr, ranks):
        xs = x[rows].astype(np.float32)  # [m, in]
        acc = y[rows].astype(np.float32)  # [m, out]
        for j in range(len(offs) - 1):
            r = int(ranks[s, j])
            c0, c1 = offs[j], offs[j + 1]
            if r == 0 or c1 == c0:  # nothing to add: rank 0, or a slice with no columns here
                continue
            v = xs @ w.a[s, j, :r].astype(np.float32).T  # [m, r]
            acc[:, c0:c1] += scaling[s, j] * (v @ b_columns(w.b, s, c0, c1, r).astype(np.float32).T)
        y[rows] = acc.astype(y.dtype)


def reference_expand_v(ys, v: np.ndarray, w: LayerWeights, token_order, slot_indptr, compact: int = 0) -> None:
    """The delta's expand from a v the base GEMM wrote (``LoraLayerDelta.expand_v``):
    ``ys[j][t] += scaling[s, j] * v[t, (s*n + j)*R : +r] @ b[s, cols_j, :r].T`` for each slot
    ``s >= 1``, row ``t`` in its range of ``token_order`` and slice ``j`` (``r = ranks[s, j]``),
    ``v`` ``[T, S*n*R]`` (every slot's ``x @ A.T`` side by side), ``ys[j]`` ``[T, cols_j]``.
    ``compact`` = kb > 0: ``v`` ``[T, kb*n*R]`` holds only the blocks of the step's slots with
    positions (:func:`active_slots`), the k-th at block ``kb - 1 - k`` (as a GEMM over the rows
    :func:`reference_gather_a` placed writes them).
    Products accumulate in float32 and each y is rounded to its dtype once, after adding."""
    scaling = np.asarray(w.scaling, np.float32)
    ranks = np.asarray(w.ranks)
    offs = w.out_offsets
    n, R = w.a.shape[1], w.a.shape[2]
    block = {s: compact - 1 - k for k, s in enumerate(active_slots(slot_indptr))} if compact else None
    for s, _lo, _hi, rows in slot_runs(token_order, slot_indptr, ranks):
        for j in range(n):
            r, c0, c1 = int(ranks[s, j]), offs[j], offs[j + 1]
            if r == 0 or c1 == c0:
                continue
            col = ((s if block is None else block[s]) * n + j) * R
            vs = v[rows, col:col + r].astype(np.float32)
            acc = ys[j][rows].astype(np.float32)
            acc += scaling[s, j] * (vs @ b_columns(w.b, s, c0, c1, r).astype(np.float32).T)
            ys[j][rows] = acc.astype(ys[j].dtype)


def reference_gather_a(pairs, slot_indptr, kb: int) -> None:
    """``lora_gather_a``: for each ``(tail [S, ...], compact [K, ...])`` pair, the k-th slot with
    positions (k < kb, :func:`active_slots`) copies ``tail[s]`` into ``compact[K - 1 - k]``."""
    slots = active_slots(slot_indptr)[:kb]
    for tail, compact in pairs:
        K = compact.shape[0]
        for k, s in enumerate(slots):
            compact[K - 1 - k] = tail[s]


def slot_runs(token_order, slot_indptr, ranks):
    """``(s, lo, hi, rows)`` for each slot ``s >= 1`` with positions ``[lo, hi)`` of ``token_order``
    (its token rows ``rows``) and a nonzero rank on some slice: the runs a delta touches."""
    token_order, indptr, ranks = np.asarray(token_order), np.asarray(slot_indptr), np.asarray(ranks)
    for s in range(1, len(indptr) - 1):
        lo, hi = int(indptr[s]), int(indptr[s + 1])
        if hi > lo and ranks[s].any():
            yield s, lo, hi, token_order[lo:hi]


def dense_delta64(x: np.ndarray, w: LayerWeights, row_slots) -> np.ndarray:
    """The float64 oracle: ``x[t] @ (scaling * B @ A).T`` per row from each slot's dense matrix.

    Returns the delta alone, ``[T, out]`` float64; rows on slot 0 get zeros.
    """
    row_slots = np.asarray(row_slots)
    T, out = x.shape[0], w.b.shape[-2]
    d = np.zeros((T, out), np.float64)
    x64 = x.astype(np.float64)
    offs = w.out_offsets
    for s in np.unique(row_slots):
        if s == 0:
            continue
        rows = np.nonzero(row_slots == s)[0]
        for j in range(len(offs) - 1):
            r = int(w.ranks[s, j])
            c0, c1 = offs[j], offs[j + 1]
            dense = float(w.scaling[s, j]) * (b_columns(w.b, s, c0, c1, r).astype(np.float64)
                                               @ w.a[s, j, :r].astype(np.float64))  # [cols, in]
            d[rows, c0:c1] += x64[rows] @ dense.T
    return d


class ReferenceBackend:
    """The NumPy backend of the CPU device."""

    name = "reference"

    def __init__(self):
        #: v between the halves of a delta (``LoraLayerDelta.shrink`` / ``expand``): float32
        #: ``[positions, slices, max rank]``, None while zero (as the CUDA workspace is between calls)
        self.v: np.ndarray | None = None

    def delta(self, y, x, w: LayerWeights, token_order, slot_indptr) -> None:
        reference_delta(y, x, w, token_order, slot_indptr)

    def clear_v(self) -> None:
        """Zero v (after a shrink whose expands did not all run)."""
        self.v = None

    def gather_a(self, pairs):
        """``(slot_indptr, kb)`` -> :func:`reference_gather_a` over these pairs (the CUDA
        backend's :meth:`~lora_cupy.backends.cupy.CupyBackend.gather_a`)."""
        pairs = check_gather_pairs(pairs)
        return lambda slot_indptr, kb: reference_gather_a(pairs, slot_indptr, kb)

    def prepare(self, w: LayerWeights) -> "ReferenceLaunch":
        """One layer's delta: x and y checked per call, the weights taken as they are."""
        return ReferenceLaunch(w, self)


class ReferenceLaunch:
    """One layer's NumPy delta over a bucket's launch views (``views.token_order``,
    ``views.slot_indptr``)."""

    def __init__(self, w: LayerWeights, backend: ReferenceBackend | None = None):
        self.weights = w
        self.backend = backend
        self.in_features, self.out_features = w.a.shape[3], w.b.shape[-2]
        self.dtype = w.a.dtype

    def half(self, part: str, t, views, rows: int) -> None:
        """One half of the delta (``LoraLayerDelta.shrink`` / ``expand``), as the CUDA backend's
        :meth:`~lora_cupy.backends.cupy.LayerLaunch.half`: "shrink" adds ``x @ A.T`` into the
        backend's v, "expand" adds ``scaling * v @ B.T`` into y (rounded once) and zeroes the v
        of its slices with columns. Sums and roundings are those of :func:`reference_delta`."""
        if part not in ("shrink", "expand"):
            raise ValueError(f"part {part!r}: 'shrink' or 'expand'")
        name, want = ("x", self.in_features) if part == "shrink" else ("y", self.out_features)
        if not isinstance(t, np.ndarray):
            raise TypeError(f"the reference backend takes NumPy arrays, got {type(t).__name__}")
        if t.dtype != self.dtype:
            raise TypeError(f"{name} ({t.dtype}) must have the weights' dtype {self.dtype}")
        if t.ndim != 2 or t.shape[1] != want:
            raise ValueError(f"{name} must be [rows, {want}], got {t.shape}")
        if t.shape[0] < rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, but the step addresses {rows}")
        w, be = self.weights, self.backend
        ranks, offs = np.asarray(w.ranks), w.out_offsets
        n, R = w.a.shape[1], w.a.shape[2]
        if part == "shrink" and be.v is None:
            be.v = np.zeros((len(views.token_order), n, R), np.float32)
        v = be.v
        for s, lo, hi, rows_t in slot_runs(views.token_order, views.slot_indptr, ranks):
            if part == "shrink":
                xs = t[rows_t].astype(np.float32)
                for j in range(n):
                    r = int(ranks[s, j])
                    if r and offs[j + 1] > offs[j]:
                        v[lo:hi, j, :r] += xs @ w.a[s, j, :r].astype(np.float32).T
            elif v is not None:
                acc = t[rows_t].astype(np.float32)
                for j in range(n):
                    r, c0, c1 = int(ranks[s, j]), offs[j], offs[j + 1]
                    if r and c1 > c0:
                        bj = b_columns(w.b, s, c0, c1, r).astype(np.float32)
                        acc[:, c0:c1] += np.float32(w.scaling[s, j]) * (v[lo:hi, j, :r] @ bj.T)
                t[rows_t] = acc.astype(t.dtype)
        if part == "expand" and v is not None:
            for j in range(n):
                if offs[j + 1] > offs[j]:
                    v[:, j] = 0.0
            if not v.any():
                be.v = None

    def expand_v(self, ys, v, views, rows: int, after_gemm: bool = False, compact: int = 0) -> None:
        """The expand from a v the base GEMM wrote (:func:`reference_expand_v`); ``ys`` one
        array per slice, ``[T, cols_j]``, ``v`` ``[T, S*n*R]`` (``compact`` = kb > 0:
        ``[T, kb*n*R]``), T >= rows, all of the weights' dtype. ``after_gemm`` changes nothing
        here (the CUDA backend's launch takes it)."""
        w = self.weights
        S, n, R = w.a.shape[:3]
        offs = w.out_offsets
        if len(ys) != n:
            raise ValueError(f"{len(ys)} outputs for {n} slices")
        check_compact(compact, S, views.slot_indptr)
        vcols = (compact or S) * n * R
        for name, t, want in [(f"ys[{j}]", y, offs[j + 1] - offs[j]) for j, y in enumerate(ys)] + [("v", v, vcols)]:
            if not isinstance(t, np.ndarray):
                raise TypeError(f"the reference backend takes NumPy arrays, got {type(t).__name__} for {name}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} ({t.dtype}) must have the weights' dtype {self.dtype}")
            if t.ndim != 2 or t.shape[1] != want or t.shape[0] < rows:
                raise ValueError(f"{name} must be [rows >= {rows}, {want}], got {t.shape}")
        reference_expand_v(ys, v, w, views.token_order, views.slot_indptr, compact)

    def __call__(self, y, x, views, rows: int) -> None:
        if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
            raise TypeError(f"the reference backend takes NumPy arrays, got {type(x).__name__} and "
                            f"{type(y).__name__}")
        if x.dtype != self.dtype or y.dtype != self.dtype:
            raise TypeError(f"x ({x.dtype}) and y ({y.dtype}) must have the weights' dtype {self.dtype}")
        if x.ndim != 2 or y.ndim != 2 or x.shape[1] != self.in_features or y.shape != (x.shape[0], self.out_features):
            raise ValueError(f"x {x.shape} and y {y.shape} do not fit [T, {self.in_features}] and "
                             f"[T, {self.out_features}]")
        if x.shape[0] < rows:
            raise ValueError(f"x has {x.shape[0]} rows, but the step addresses {rows}")
        reference_delta(y, x, self.weights, views.token_order, views.slot_indptr)
