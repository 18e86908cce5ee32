"""Planning a step: each row's slot grouped into the fixed addressing buffers, and their copy.

The pool decides which slot each row holds; the :class:`StepPlanner` turns a step's rows and
their slots into the step's :class:`~lora_cupy.addressing.LoraAddressing` per row grouping,
staged on the host and copied into one fixed device buffer per capture bucket and parity, which
a captured graph reads step after step (the plan / run split: planning runs once per step,
every layer's call reads only device buffers).

Parities and fences. plan(N+1) must not overwrite the host buffer that step N's copy still
reads (seed 000, ``force_double_buffer``): each parity keeps the event after its last copy, and
staging into a parity first waits for it. Alternating parities (double-buffering) makes that
wait free, and lets a pre-planned step N+1 fill buffers step N's graph is not reading.

Rank classes (the README's invariant 12). A pool's layout holds every slot at its maximum rank,
but a step whose slots all have smaller ranks need not pay for it: the planner reads each slot's
largest rank from the host copy the slot weights keep (``SlotBank.slot_ranks``, written with the
weights at install), takes the class holding the step's largest (16 or 64 below the maximum:
:func:`~lora_cupy.backends.cupy.planned_rank`), and hands the layers launch views of that class
(one object per bucket, parity and class, over the same buffers), so each layer packs a launch per
class and the runner's graph key tells the classes apart.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .addressing import LoraAddressing
from .backends.cupy import planned_rank
from .device import Device
from .engine.resource import StepRows
from .spec import LoraSpec


@dataclass(frozen=True, eq=False)
class LaunchViews:
    """What a layer's kernels read for one capture bucket and parity: ``token_order[bucket]`` over
    the whole bucket (positions past ``slot_indptr[-1]`` address nothing) and ``slot_indptr[S+1]``.

    One object per buffer (and rank bound), the same step after step, hashed by identity: a
    backend keys the launch it prepared for a layer by it. Iterates as ``(token_order, slot_indptr)``.

    ``rank_bound``: no slot with positions in the step has a rank above it (None: no promise),
    so a layer's whole delta is planned for that rank, not the pool's maximum
    (:func:`~lora_cupy.backends.cupy.planned_rank`); the planner hands out one object per bound
    it uses, over the same buffers.
    """

    bucket: int
    parity: int
    token_order: Any
    slot_indptr: Any
    rank_bound: int | None = None

    def __iter__(self):
        return iter((self.token_order, self.slot_indptr))


@dataclass
class LoraStepPlan:
    """One step's plan: its addressing per row grouping, the launch views and the rows addressed
    per grouping, whether any row has an adapter, and the event after its copies (a CPU layer
    waits for it; on CUDA stream order suffices)."""

    seq: int
    addressing: dict[int, LoraAddressing]
    launch: dict[int, LaunchViews]
    rows: dict[int, int]
    active: bool
    ready: Any

    def wait_host(self) -> None:
        if self.ready is not None and not self.ready.done:
            self.ready.synchronize()


class RowSlots(dict):
    """rid -> the slot its rows address (0: none in this pool), its keys also kept as a set, so
    an admit tells a step whose rows all hold their slots by one set comparison; ``version``
    counts the changes, so a step's slots are looked up again only after one."""

    def __init__(self):
        super().__init__()
        self.rids: set = set()
        self.version = 0
        self._last: tuple = (-1, None, None)  # (version, rids, slots) of the last lookup

    def __setitem__(self, rid, slot: int) -> None:
        super().__setitem__(rid, slot)
        self.rids.add(rid)
        self.version += 1

    def update(self, pairs) -> None:
        pairs = dict(pairs)
        super().update(pairs)
        self.rids.update(pairs)
        self.version += len(pairs)

    def pop(self, rid, *default):
        self.rids.discard(rid)
        self.version += 1
        return super().pop(rid, *default)

    def slots_of(self, rids: tuple, dtype: np.dtype) -> np.ndarray:
        """``[rows]`` each rid's slot (read-only; the same array while nothing changed since a
        lookup of the same rids: a decode batch step after step); ValueError naming a rid that
        holds none here."""
        version, last_rids, slots = self._last
        if version == self.version and last_rids == rids:
            return slots
        try:
            slots = np.fromiter(map(self.__getitem__, rids), dtype, len(rids))
        except KeyError as e:
            raise ValueError(f"row {e.args[0]!r} was not admitted here") from None
        slots.flags.writeable = False
        self._last = (self.version, rids, slots)
        return slots


def slot_dtype(num_slots: int) -> np.dtype:
    """The narrowest dtype of a step's row slots: int16 lets a stable argsort take radix sort."""
    return np.dtype(np.int16 if num_slots < 32767 else np.int32)


class AddressingBuffers:
    """One row grouping's addressing: a host staging buffer per parity, and one fixed device
    buffer per (capture bucket, parity) holding ``token_order[bucket]`` then ``slot_indptr[S+1]``."""

    def __init__(self, spec: LoraSpec, device: Device, grouping: int):
        self.grouping = grouping
        self.S = spec.num_slots
        self.buckets = spec.capture_buckets
        width = self.buckets[-1] + self.S + 1
        self.host = [device.host_zeros(width, np.int32) for _ in range(2)]
        self.dev = {(b, p): device.zeros(b + self.S + 1, np.int32) for b in self.buckets for p in range(2)}
        self.launch = {(b, p): LaunchViews(b, p, d[:b], d[b:b + self.S + 1]) for (b, p), d in self.dev.items()}
        self._bounded: dict[tuple[int, int, int], LaunchViews] = {}  # (bucket, parity, rank bound) -> views
        self._arange = np.arange(self.buckets[-1], dtype=np.int32)
        self._slot_ids = np.arange(self.S + 1, dtype=slot_dtype(self.S))
        self._views: dict[tuple, LoraAddressing] = {}  # (bucket, parity, rows, active, rank bound) -> views

    def views(self, bucket: int, parity: int, rank_bound: int | None = None) -> LaunchViews:
        """The launch views of a bucket and parity under ``rank_bound`` (None: the plain ones):
        one object per bound, over the same buffers."""
        if rank_bound is None:
            return self.launch[(bucket, parity)]
        key = (bucket, parity, rank_bound)
        v = self._bounded.get(key)
        if v is None:
            base = self.launch[(bucket, parity)]
            v = self._bounded[key] = LaunchViews(bucket, parity, base.token_order, base.slot_indptr, rank_bound)
        return v

    def stage(self, rows: StepRows, slots: np.ndarray, parity: int,
              rank_bound: int | None = None) -> tuple[LoraAddressing, LaunchViews, tuple]:
        """Group ``rows`` (row i on ``slots[i]``) by slot into host buffer ``parity``.

        Returns the step's addressing (views sized to its rows), the bucket's launch views (those
        of ``rank_bound``: see :class:`LaunchViews`), and the ``(device, host)`` copy the caller
        queues. Vectorized; only small temporaries are allocated, and the views are cached."""
        per, starts, total = rows.grouped(self.grouping)
        k = bisect.bisect_left(self.buckets, max(total, 1))
        if k == len(self.buckets):
            raise ValueError(f"{total} rows at grouping {self.grouping} exceed the largest capture bucket "
                             f"{self.buckets[-1]}")
        bucket, S = self.buckets[k], self.S
        h = self.host[parity]
        order = np.argsort(slots, kind="stable")  # [rows] rows grouped by slot, stable
        row_ptr = np.searchsorted(slots[order], self._slot_ids)  # [S+1] each slot's first row
        indptr = h[bucket:bucket + S + 1]
        if total == len(per):  # one row each: decode steps, the common case
            np.take(starts, order, out=h[:total])
            indptr[...] = row_ptr
        else:
            sp = per[order]
            cum = np.zeros(len(sp) + 1, np.int64)
            np.cumsum(sp, out=cum[1:])  # where each sorted row's range begins in token_order
            np.add(self._arange[:total], np.repeat(starts[order] - cum[:-1], sp), out=h[:total],
                   casting="unsafe")
            indptr[...] = cum[row_ptr]
        launch = self.views(bucket, parity, rank_bound)
        active = bool(row_ptr[1] != len(per))  # some row is past slot 0
        key = (bucket, parity, total, active, rank_bound)
        addr = self._views.get(key)
        if addr is None:
            addr = self._views[key] = LoraAddressing(launch.token_order[:total], launch.slot_indptr, active=active,
                                                     rank_bound=rank_bound)
        return addr, launch, (self.dev[(bucket, parity)], h[:bucket + S + 1])


class StepPlanner:
    """The addressing of every step of one pool: its buffers per row grouping, the parity, each
    parity's fence, and the plan of the step the layers run now (``current``).

    ``double_buffer``: alternate parities on every step (the pool's ``force_double_buffer``); a
    pre-planned step always takes the other parity, since the running step still reads its own.
    """

    def __init__(self, spec: LoraSpec, device: Device, double_buffer: bool):
        self.device = device
        self.max_rank = spec.max_rank
        self.double_buffer = double_buffer
        groupings = sorted({1, *(t.row_grouping for t in spec.targets)})
        self.buffers = {g: AddressingBuffers(spec, device, g) for g in groupings}
        self.slot_dtype = slot_dtype(spec.num_slots)  # what plan takes a step's row slots in
        self.current: LoraStepPlan | None = None
        self._base_only: dict[int, int] = {}  # thread -> depth of base-only forwards on it (usually empty)
        self._parity = 0
        self._fences: list[Any] = [None, None]  # each parity's event after its last copy (cuda: re-recorded)

    def plan(self, seq: int, rows: StepRows, slots: np.ndarray, preplanned: bool,
             slot_ranks: np.ndarray | None = None) -> LoraStepPlan:
        """Stage ``rows`` (row i on ``slots[i]``) for every grouping and queue the copy; the plan
        becomes ``current`` unless the step is pre-planned (the runner activates it later).
        ``slot_ranks[S]``: each slot's largest rank (host copy); the step's launch views then carry
        the rank class its slots need (:meth:`rank_bound`)."""
        if self.double_buffer or preplanned:
            self._parity ^= 1
        parity = self._parity
        fence = self._fences[parity]
        if fence is not None and not fence.done:
            fence.synchronize()  # the copy that last read this parity's host buffers has run
        addressing, launch, copies = {}, {}, []
        bound = self.rank_bound(slots, slot_ranks)
        for g, b in self.buffers.items():
            addressing[g], launch[g], copy = b.stage(rows, slots, parity, bound)
            copies.append(copy)
        fence = self._fences[parity] = self.device.copy_batch(copies, reuse=fence)
        plan = LoraStepPlan(seq, addressing, launch, {g: a.num_tokens for g, a in addressing.items()},
                            addressing[1].active, None if self.device.is_cuda else fence)
        if not preplanned:
            self.current = plan
        return plan

    def rank_bound(self, slots: np.ndarray, slot_ranks: np.ndarray | None) -> int | None:
        """The rank class a step on ``slots`` is launched for: the smallest of
        :data:`~lora_cupy.backends.cupy.RANK_CLASSES` holding every one of its slots' ranks, where
        narrower than the pool's maximum rank (None: the maximum; also without ``slot_ranks`` or
        with no row on an adapter).
        A class, not the exact rank, so a layer keeps at most a few launches (and graphs) a bucket."""
        if slot_ranks is None or not len(slots):
            return None
        most = int(slot_ranks[slots].max())
        if most == 0:  # no row on an adapter: nothing launches
            return None
        r = planned_rank(self.max_rank, most)
        return None if r == self.max_rank else r

    def running(self) -> LoraStepPlan | None:
        """The current plan where deltas add something: None with no step, no adapter row, or in
        a base-only forward on this thread."""
        plan = self.current
        if plan is None or not plan.active or (self._base_only and threading.get_ident() in self._base_only):
            return None
        return plan

    def addressing(self, grouping: int) -> LoraAddressing:
        plan = self.current
        if plan is None:
            raise ValueError("no step is planned on this pool")
        if grouping not in plan.addressing:
            raise ValueError(f"grouping {grouping} is not one of this pool's targets' ({sorted(plan.addressing)})")
        return plan.addressing[grouping]

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """Deltas add nothing on this thread inside (a forward outside any step)."""
        me = threading.get_ident()
        self._base_only[me] = self._base_only.get(me, 0) + 1
        try:
            yield
        finally:
            if self._base_only[me] == 1:
                del self._base_only[me]
            else:
                self._base_only[me] -= 1
