"""LoraAddressing: which slot each token of a step addresses, grouped by slot.

``token_order[p]`` is a row of x / y; the rows addressing slot ``s`` are
``token_order[slot_indptr[s]:slot_indptr[s + 1]]``. Slot 0's range holds base-model rows and
kernels skip it; positions past ``slot_indptr[-1]`` (a capture bucket's padding) address none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LoraAddressing:
    """One step's addressing: views of fixed buffers, sized to the step's rows.

    ``token_order[T]`` and ``slot_indptr[num_slots + 1]`` are int32 arrays on the pool's
    device. ``active`` is whether any row addresses a slot other than 0 (host-side, so a
    layer can return without a launch). ``rank_bound``: the rank class the step's launches are
    planned for (:class:`~lora_cupy.planning.LaunchViews`; None: the pool's maximum rank), part
    of what a captured graph of the step depends on.
    """

    token_order: Any
    slot_indptr: Any
    active: bool = True
    rank_bound: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_order.shape[0])


def group_by_slot(row_slots, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(token_order[T], slot_indptr[num_slots + 1])`` for each row's slot, stable within a slot.

    ``row_slots[T]`` holds a slot in ``[0, num_slots)`` per row.
    """
    row_slots = np.asarray(row_slots)
    if row_slots.ndim != 1:
        raise ValueError(f"row_slots must be 1-D, got shape {row_slots.shape}")
    if row_slots.size and (row_slots.min() < 0 or row_slots.max() >= num_slots):
        raise ValueError(f"row slots must lie in [0, {num_slots}), got {row_slots.min()}..{row_slots.max()}")
    token_order = np.argsort(row_slots, kind="stable").astype(np.int32)
    counts = np.bincount(row_slots, minlength=num_slots)
    slot_indptr = np.zeros(num_slots + 1, np.int32)
    np.cumsum(counts, out=slot_indptr[1:])
    return token_order, slot_indptr
