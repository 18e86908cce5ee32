"""The interface a backend implements, and the per-layer weight views it is handed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np


@dataclass(frozen=True)
class LayerWeights:
    """One target's slot weights at one stack layer: views resolved once, read every step.

    ``a[S, n, R, in]``, ``b[S, out, R]`` or rank-blocked ``b[S, ceil(R / 16), out, 16]`` (``R`` above
    16; what a pool stores where :attr:`LoraSpec.b_blocked`; :func:`b_columns` reads either),
    ``scaling[S, n]`` (float32), ``ranks[S, n]`` (int32); slice ``j`` writes columns
    ``out_offsets[j]:out_offsets[j+1]`` of y. Slot 0 is all zero.
    """

    a: Any
    b: Any
    scaling: Any
    ranks: Any
    out_offsets: tuple[int, ...]

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]

    @property
    def max_rank(self) -> int:
        return self.a.shape[2]


class LoraBackend(Protocol):
    """Runs ``y += delta(x)`` for rows grouped by slot."""

    name: str

    def delta(self, y, x, w: LayerWeights, token_order, slot_indptr) -> None:
        """``y[t] += scaling[s, j] * (x[t] @ a[s, j, :r].T) @ b[s, cols_j, :r].T`` for every row t
        in slot s's range of ``token_order`` (s >= 1) and every slice j; in place on y."""
        ...

    def prepare(self, w: LayerWeights) -> Callable[[Any, Any, Any, int], None]:
        """One layer's delta with everything but x and y resolved once: a callable
        ``(y, x, views, rows)`` running :meth:`delta` over ``views.token_order`` /
        ``views.slot_indptr`` (a capture bucket's fixed addressing buffers, the same hashable
        object step after step); ``rows``: how many rows of x the step addresses (x may have
        more, never fewer)."""
        ...


def member_offsets(offsets: tuple[int, ...], j: int) -> tuple[int, ...]:
    """The slice offsets of a call that serves slice ``j`` of a fused target alone, into an output
    of that slice's width: every other slice has no columns, slice ``j`` all of them."""
    width = offsets[j + 1] - offsets[j]
    return tuple(0 if i <= j else width for i in range(len(offsets)))


def member_weights(w: LayerWeights, j: int) -> LayerWeights:
    """Slice ``j`` of a fused target's weights, for a call into that slice's own output: ``a``,
    ``scaling`` and ``ranks`` as they are (the other slices have no columns: the tensor-core
    kernels and the NumPy reference compute nothing for them), ``b`` the view of slice ``j``'s
    rows (each slot's rows contiguous, slots ``out * R`` elements apart: no copy; rank-blocked,
    each block's rows)."""
    o0, o1 = w.out_offsets[j], w.out_offsets[j + 1]
    return LayerWeights(w.a, w.b[..., o0:o1, :], w.scaling, w.ranks, member_offsets(w.out_offsets, j))


def b_columns(b, s: int, c0: int, c1: int, r: int):
    """Slot ``s``'s B at columns ``c0:c1`` and ranks ``:r`` as ``[c1 - c0, r]``, from a layer's ``b``
    in either layout (:class:`LayerWeights`; NumPy or torch): a view of ``[S, out, R]``, a copy of
    the rank-blocked ``[S, ceil(R / 16), out, 16]``."""
    if b.ndim == 3:
        return b[s, c0:c1, :r]
    w = b.shape[-1]  # 16 (LoraSpec.b_shape)
    nb = -(-r // w)
    return b[s, :nb, c0:c1].swapaxes(0, 1).reshape(c1 - c0, nb * w)[:, :r]


def unblocked_b(b):
    """A rank-blocked ``b[..., RB, out, 16]`` as ``[..., out, RB * 16]`` (NumPy or torch; a copy)."""
    *lead, nb, out, w = b.shape
    return b.swapaxes(-2, -3).reshape(*lead, out, nb * w)


def active_slots(slot_indptr) -> list[int]:
    """The slots ``s >= 1`` whose range of ``token_order`` is not empty, in slot order (a step's
    k-th such slot is the one ``lora_gather_a`` places k blocks before the base weight)."""
    indptr = np.asarray(slot_indptr)
    return [s for s in range(1, len(indptr) - 1) if indptr[s + 1] > indptr[s]]


def check_compact(compact: int, num_slots: int, slot_indptr=None) -> None:
    """``expand_v``'s ``compact`` (kb, the blocks of a step's slots v holds; 0: every slot's):
    ValueError unless ``0 <= kb < num_slots``, or (given host addressing) the step has more slots
    with positions than kb."""
    if not isinstance(compact, (int, np.integer)) or not 0 <= compact < num_slots:
        raise ValueError(f"compact must be 0 or the blocks v holds (1..{num_slots - 1}), got {compact!r}")
    if compact and isinstance(slot_indptr, np.ndarray):
        active = len(active_slots(slot_indptr))
        if active > compact:
            raise ValueError(f"the step has {active} slots with positions; v holds {compact} blocks")


def check_gather_pairs(pairs) -> list:
    """``gather_a``'s pairs: each ``(tail [S, n, R, in], compact [K, n, R, in])`` of one dtype,
    K >= 1 (ValueError / TypeError naming the pair)."""
    pairs = list(pairs)
    if not pairs:
        raise ValueError("gather_a needs at least one (tail, compact) pair")
    for i, (tail, compact) in enumerate(pairs):
        if len(tail.shape) != 4 or tuple(compact.shape[1:]) != tuple(tail.shape[1:]) or compact.shape[0] < 1:
            raise ValueError(f"pair {i}: tail [S, n, R, in] and compact [K >= 1, n, R, in] wanted, "
                             f"got {tuple(tail.shape)} and {tuple(compact.shape)}")
        if tail.dtype != compact.dtype:
            raise TypeError(f"pair {i}: tail is {tail.dtype}, compact {compact.dtype}")
    return pairs
