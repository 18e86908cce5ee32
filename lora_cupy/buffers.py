"""The device buffers a pool owns: each target's slot weights, and the addressing buffers.

Both are made once, when the pool is built; a step only writes into them. Slot weights take an
adapter's host copy by non-blocking copies on the device's stream. Addressing is staged on the
host and copied into one fixed device buffer per capture bucket (and parity), which a captured
graph can read step after step.
"""

from __future__ import annotations

import bisect

import numpy as np

from .addressing import LoraAddressing
from .backends.base import LayerWeights
from .device import Device
from .engine.resource import StepRows
from .spec import LoraSpec, LoraTarget
from .adapter import TargetWeights


# -- the slot weights -----------------------------------------------------------------------
class SlotWeights:
    """One target's slot arrays on the device: ``a[L, S, n, R, in]``, ``b[L, S, out, R]``,
    ``ranks``/``scaling[L, S, n]``; and a host mirror of the ranks."""

    def __init__(self, spec: LoraSpec, t: LoraTarget, device: Device):
        L, S, n = t.num_layers, spec.num_slots, t.num_slices
        self.device = device
        self.a = device.zeros(spec.a_shape(t), spec.dtype)
        self.b = device.zeros(spec.b_shape(t), spec.dtype)
        self.ranks = device.zeros((L, S, n), np.int32)
        self.scaling = device.zeros((L, S, n), np.float32)
        self.host_ranks = np.zeros((L, S, n), np.int32)
        self._zero_ranks = device.host_zeros((L, n), np.int32)
        self._zero_scaling = device.host_zeros((L, n), np.float32)
        self._clean = np.ones(S, bool)  # the slot's weights are all zero here
        offs = t.out_offsets(spec.tp_size)
        self.layers = [LayerWeights(self.a[l], self.b[l], self.scaling[l], self.ranks[l], offs)
                       for l in range(L)]

    def install(self, slot: int, img: TargetWeights | None) -> None:
        """Queue the copy of ``img`` (None: nothing here) into ``slot`` on the device's stream."""
        d = self.device
        if img is None:
            if not self._clean[slot]:
                d.copy_to_device(self.ranks[:, slot], self._zero_ranks)
                d.copy_to_device(self.scaling[:, slot], self._zero_scaling)
                d.fill_zero(self.a[:, slot])
                d.fill_zero(self.b[:, slot])
                self.host_ranks[:, slot] = 0
                self._clean[slot] = True
            return
        d.copy_to_device(self.a[:, slot], img.a)
        d.copy_to_device(self.b[:, slot], img.b)
        d.copy_to_device(self.ranks[:, slot], img.ranks)
        d.copy_to_device(self.scaling[:, slot], img.scaling)
        self.host_ranks[:, slot] = img.ranks
        self._clean[slot] = False


# -- the addressing buffers -----------------------------------------------------------------
class AddressingBuffers:
    """One row grouping's addressing: a host staging buffer per parity, and one fixed device
    buffer per (capture bucket, parity) holding ``token_order[bucket]`` then ``slot_indptr[S+1]``.

    Before staging into a parity's host buffer, the caller waits for the copy that last read
    it (the pool keeps one event per parity, after all its groupings' copies): so plan(N+1)
    never overwrites what step N's copy still reads. Alternating parities (double-buffering)
    makes that wait, and the device buffer's reuse, free.
    """

    def __init__(self, spec: LoraSpec, device: Device, grouping: int):
        self.grouping = grouping
        self.device = device
        self.S = spec.num_slots
        self.buckets = spec.capture_buckets
        width = self.buckets[-1] + self.S + 1
        self.host = [device.host_zeros(width, np.int32) for _ in range(2)]
        self.dev = {(b, p): device.zeros(b + self.S + 1, np.int32) for b in self.buckets for p in range(2)}
        self._arange = np.arange(self.buckets[-1], dtype=np.int32)
        self._slot_ids = np.arange(self.S + 1, dtype=slot_dtype(self.S))
        self._views: dict[tuple, LoraAddressing] = {}  # (bucket, parity, rows, active) -> views
        self._launch: dict[tuple, tuple] = {}  # (bucket, parity) -> (token_order[bucket], slot_indptr)

    def stage(self, rows: StepRows, slots: np.ndarray, parity: int) -> tuple[LoraAddressing, tuple, tuple]:
        """Group ``rows`` (row i on ``slots[i]``) by slot into host buffer ``parity``.

        Returns the step's addressing (views sized to its rows), the launch views (the same
        buffer with ``token_order`` spanning the whole bucket: what a layer hands the kernels,
        so a graph captured on one step replays for every step of its bucket), and the
        ``(device, host)`` copy the caller queues. Vectorized; only
        small temporaries are allocated, and the views are cached."""
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
        dev = self.dev[(bucket, parity)]
        active = bool(row_ptr[1] != len(per))  # some row is past slot 0
        key = (bucket, parity, total, active)
        addr = self._views.get(key)
        if addr is None:
            addr = self._views[key] = LoraAddressing(dev[:total], dev[bucket:bucket + S + 1], active=active)
        launch = self._launch.get((bucket, parity))
        if launch is None:
            launch = self._launch[(bucket, parity)] = (dev[:bucket], addr.slot_indptr)
        return addr, launch, (dev, h[:bucket + S + 1])


def slot_dtype(num_slots: int) -> np.dtype:
    """The narrowest dtype of a step's row slots: int16 lets a stable argsort take radix sort."""
    return np.dtype(np.int16 if num_slots < 32767 else np.int32)
