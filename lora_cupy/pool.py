"""LoraAdapterPool: per-request LoRA adapters resident in a fixed set of device slots (seed 000).

The pool keeps the requests and the slot each one's rows address, and answers the seed's
methods. It delegates slot decisions to :mod:`~lora_cupy.slots`, served adapters to
:mod:`~lora_cupy.catalog`, host copies to :mod:`~lora_cupy.store` (whose reader thread reads
every file), the read agreement to :mod:`~lora_cupy.agreement`, each step's addressing to
:mod:`~lora_cupy.planning`, slot weights to :mod:`~lora_cupy.buffers` and the delta to a
backend. Requests, loads and unloads may come from any thread, ``ask``/``reserve`` from the
runner's admission, a step's calls from the thread that issues GPU work. One lock guards the
state, never held across a wait (invariant 10).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from .addressing import LoraAddressing
from .agreement import ReadAgreement
from .backends.base import LayerWeights
from .buffers import SlotBank
from .catalog import AdapterCatalog, Request, ServedAdapter
from .delta import LoraLayerDelta
from .device import Device, as_device
from .dtypes import normalize_dtype
from .engine.resource import AdmitOutcome, EngineResourceInfo, LoraStep, ResourceReqConfig, StepContext, StepRows
from .errors import CapacityError, LoraError
from .planning import LoraStepPlan, RowSlots, StepPlanner
from .slots import SlotTable
from .spec import LoraSpec
from .store import FAILED, READING, READY, LoraAdapterStore


class LoraAdapterPool:
    """Per-request LoRA adapters in ``spec.num_slots - 1`` device slots, for one rank.

    ``agree(outcomes) -> outcomes``: one all-reduce MAX over the instance of the outcome per
    miss of an admit (READY=0, READING=1, FAILED=2; :mod:`~lora_cupy.agreement`). ``decides``:
    this rank chooses batches and keeps reservations (a lockstep leader).
    ``adapters``: served from startup, name -> path or (path, digest). ``reader`` and
    ``max_host_bytes`` configure the host tier. ``read_timeout``: seconds an admit waits for a
    copy still in flight before failing its rows (on every rank, through the agreement).
    """

    supports_preplan = True

    def __init__(self, spec: LoraSpec, device: Device | str | Any = "cpu", rank: int = 0, world_size: int = 1,
                 backend=None, dtype=None, agree: Callable[[np.ndarray], np.ndarray] | None = None,
                 decides: bool = True, *, adapters: Mapping[str, Any] | None = None, reader=None,
                 max_host_bytes: int | None = None, force_double_buffer: bool = True,
                 read_timeout: float | None = None):
        if dtype is not None and normalize_dtype(dtype) != spec.dtype:
            spec = replace(spec, dtype=normalize_dtype(dtype))
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if agree is None and world_size > 1:
            raise ValueError("a pool on a multi-rank instance needs agree: a collective (all-reduce MAX) "
                             "over per-miss read outcomes")
        self.spec, self.device = spec, as_device(device)
        self.rank, self.world_size, self.decides = rank, world_size, decides
        self._agreement = ReadAgreement(agree, read_timeout)
        self.backend = backend if backend is not None else self.device.backend(spec)
        #: the shrink whose expands have not all run, ``(target, layer, slices still to expand)``
        #: (:meth:`LoraLayerDelta.shrink <lora_cupy.delta.LoraLayerDelta.shrink>`), or None
        self.open_halves = None
        self._store = LoraAdapterStore(spec, self.device, reader=reader, max_bytes=max_host_bytes)
        self._lock, self._step_lock = threading.Lock(), threading.Lock()
        self.slots = SlotTable(spec.num_slots)
        self._catalog = AdapterCatalog(self._store, self._lock, self.slots.forget)
        self._slot_weights = SlotBank(spec, self.device)
        self._planner = StepPlanner(spec, self.device, force_double_buffer)
        self._requests = self._catalog.requests  # rid -> Request, opened at ingest
        self._settled = RowSlots()  # rid -> the slot its rows address (0: none here)
        self._deltas: dict[tuple[str, int, int | None], LoraLayerDelta] = {}  # (target, layer, member)
        self.stats = Counter()
        try:
            for f in [self.load_adapter_async(name, *((w,) if isinstance(w, (str, bytes)) or not isinstance(
                    w, Sequence) else w)) for name, w in (adapters or {}).items()]:
                f.result()
        except BaseException:
            self.close()
            raise

    @classmethod
    def build(cls, spec: LoraSpec, info: EngineResourceInfo) -> "LoraAdapterPool":
        """The pool an engine builds for ``spec`` from what it knows (device, rank, adapters...)."""
        return cls(spec, info.device, info.rank, info.world_size, info.backend, info.dtype, info.agree,
                   info.decides, adapters=info.adapters, reader=info.reader, max_host_bytes=info.max_host_bytes,
                   force_double_buffer=info.force_double_buffer)

    store = property(lambda self: self._store, doc="The host tier (:class:`LoraAdapterStore`).")

    @property
    def force_double_buffer(self) -> bool:
        """Double-buffer off the pre-plan path too: plan copies a reused host buffer into a
        device buffer a captured graph reads (seed 000). On unless built without it."""
        return self._planner.double_buffer

    @property
    def served(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._catalog.served)

    def adapter_info(self, name: str) -> ServedAdapter | None:
        with self._lock:
            return self._catalog.info(name)

    # -- requests ----------------------------------------------------------------------------
    def ingest_request(self, rid: Hashable, overrides: ResourceReqConfig | None = None) -> None:
        """Open the request's state, and start reading its adapter into the host tier."""
        with self._lock:
            if not self._catalog.open_request(rid, overrides.adapter if overrides is not None else None).covers:
                self._settled[rid] = 0

    def remove_request(self, rid: Hashable) -> None:
        """Close the request: its slot is given back (refcount), its host copy released. The
        worker calls this only once no in-flight step references the request (invariant 3)."""
        with self._lock:
            if rid in self._requests:
                self.slots.release(rid)
                self.slots.unreserve(rid)
                self._settled.pop(rid, None)
                self._catalog.close_request(rid)

    def runs_adapters(self, rids: Sequence[Hashable]) -> bool:
        """Whether any of ``rids`` names an adapter with something for this pool."""
        with self._lock:
            reqs = self._requests
            return any(r in reqs and reqs[r].covers for r in rids)

    # -- admission -------------------------------------------------------------------------------
    def ask(self, rid: Hashable, node_name: str, graph_walk: Sequence[str] = ()) -> AdmitOutcome | None:
        """ASKS for a row that will need a slot; the failing outcome for a row whose adapter
        failed to read and is in no slot; None when nothing is needed here (see the seed)."""
        with self._lock:
            req = self._waiting(rid, node_name)
            if req is None or rid in self.slots.reserved:
                return None
            e = self._store.get(req.adapter)
            if e is not None and e.state == FAILED and self.slots.slot_of(req.adapter) is None:
                return AdmitOutcome.fail({rid: e.error})
            return AdmitOutcome.ASKS

    def reserve(self, rid: Hashable, node_name: str, graph_walk: Sequence[str] = (),
                published: bool = False) -> int | None:
        """Count ``rid``'s adapter against the unheld slots once its host copy is in (invariant
        6): 1 when counted (or counted already), 0 to wait, None to let it through uncounted (its
        adapter failed to read and is in no slot, so its admit fails it; or it needs nothing)."""
        with self._lock:
            req = self._waiting(rid, node_name)
            if req is None or rid in self.slots.reserved:
                return None if req is None else 1
            e = self._store.get(req.adapter)
            state = FAILED if e is None else e.state
            if state == FAILED and self.slots.slot_of(req.adapter) is None:
                return None
            if state == READING or not self.slots.can_reserve(req.adapter):
                return 0
            self.slots.reserve(rid, req.adapter)
            return 1

    def unreserve(self, rid: Hashable) -> None:
        """Give back ``rid``'s reservation (it waits again, holding nothing)."""
        with self._lock:
            self.slots.unreserve(rid)

    def _waiting(self, rid: Hashable, node_name: str) -> Request | None:
        """``rid``'s request where this rank decides for ``node_name`` and the request still
        needs a slot here (its adapter covers this pool, no slot yet); else None."""
        if not self.decides or node_name != self.spec.node:
            return None
        req = self._requests.get(rid)
        if req is None:
            raise ValueError(f"request {rid!r} was never ingested by this pool")
        return req if req.covers and rid not in self._settled else None

    # -- a step ------------------------------------------------------------------------------------
    def admit(self, step: LoraStep, ctx: StepContext) -> AdmitOutcome:
        """Give each row whose adapter is not resident yet a slot, loading it there.

        Once every row holds its slot (every step after a request's first) this is one set
        check. Otherwise, under the lock, hits take their slots and the misses' victims are
        fixed from the table as it stands (invariants 4, 5); outside it, the instance agrees on
        where each miss's read stands before any rank waits (7); under the lock again, rows
        whose read failed on any rank fail before any slot is handed out, and the rest take
        their victims, whose weights are queued on the device's stream ahead of the step.
        """
        rows = step.rows_for(self.spec.node)
        if rows.rid_set <= self._settled.rids:
            return AdmitOutcome.OK
        with self._step_lock:
            return self._admit(rows, ctx)

    def _admit(self, rows: StepRows, ctx: StepContext) -> AdmitOutcome:
        failed: dict[Hashable, BaseException] = {}
        taken: list[Hashable] = []
        with self._lock:
            need = []
            for rid in rows.rids:
                if rid not in self._settled:
                    req = self._requests.get(rid)
                    if req is None:
                        failed[rid] = LoraError(f"request {rid!r} was never ingested or was removed")
                    else:
                        need.append((rid, req.adapter))
            picks = self.slots.begin_admit(need)
            self._settled.update(picks.hits)
            taken += [rid for rid, _ in picks.hits]
            copies = [self._store.get(m.name) for m in picks.misses]
        if picks.misses:  # none (every row's adapter resident): nothing to agree on, install or refuse
            errors, agreed = self._agreement.outcomes(copies)
            with self._lock:
                for i, m in enumerate(picks.misses):  # failures first: they hold nothing, no reservation
                    if agreed[i] != READY:
                        err = errors[i] or LoraError("its read failed on another rank of the instance", adapter=m.name,
                                                     path=getattr(copies[i], "path", None))
                        for rid in m.rids:
                            failed[rid] = err
                            self.slots.unreserve(rid)
                for i, m in enumerate(picks.misses):
                    rids = [r for r in m.rids if r in self._requests]
                    if agreed[i] != READY or not rids:
                        continue
                    slot = self.slots.finish_miss(picks, m, rids)
                    if slot is not None:
                        self._slot_weights.install(slot, copies[i].image)
                        self._settled.update(dict.fromkeys(rids, slot))
                        taken += rids
                        self.stats["loads"] += 1
                for rid, why in picks.refused.items():
                    name = getattr(self._requests.get(rid), "adapter", None)
                    failed[rid] = CapacityError(f"request {rid!r} gets no slot: {why}", adapter=name,
                                                path=getattr(self._catalog.info(name), "path", None))
        ctx.state[self] = taken
        self.stats["admits"] += 1
        return AdmitOutcome.fail(failed) if failed else AdmitOutcome.OK

    def rollback_admit(self, step: LoraStep, ctx: StepContext) -> None:
        """Give back the slots this step's admit took (invariant 8); an adapter it loaded stays
        resident in its now-unheld slot, as a cache. The rows hold nothing afterwards, no
        reservation either: the runner queues them at admission again."""
        taken = ctx.state.pop(self, None)
        if taken is None:
            return
        with self._step_lock, self._lock:
            taken = [r for r in taken if self._settled.pop(r, None) is not None]
            self.slots.rollback(taken)

    def plan(self, step: LoraStep, ctx: StepContext) -> LoraAddressing | None:
        """Build the step's addressing into the fixed buffers and queue its copy; returns the
        grouping-1 addressing (None: no row here). The full plan goes to ``ctx.plan_results``;
        it becomes the current step now, or, when ``ctx.preplanned``, at :meth:`activate`."""
        rows = step.rows_for(self.spec.node)
        plan = None
        if len(rows):
            with self._step_lock:
                with self._lock:
                    slots = self._settled.slots_of(rows.rids, self._planner.slot_dtype)
                plan = self._planner.plan(ctx.seq, rows, slots, ctx.preplanned, self._slot_weights.slot_ranks)
        elif not ctx.preplanned:
            self._planner.current = None
        ctx.plan_results[self] = plan
        return None if plan is None else plan.addressing[1]

    def activate(self, ctx: StepContext) -> None:
        """Make ``ctx``'s plan the current step (a pre-planned step, as it starts running)."""
        self._planner.current = ctx.plan_results.get(self)

    def commit(self, step: LoraStep, ctx: StepContext) -> None:
        """Record the step's consumption: what its admit took is kept for good."""
        ctx.state.pop(self, None)
        rows = step.rows_for(self.spec.node)
        self.stats.update(steps=1, rows=len(rows), tokens=rows.total_tokens)

    # -- what layers read ---------------------------------------------------------------------------
    def current_plan(self) -> LoraStepPlan | None:
        """The running step's plan, or None where deltas add nothing (no adapter row, no step,
        or a base-only forward on this thread)."""
        return self._planner.running()

    active = property(lambda self: self._planner.running() is not None, doc="Whether deltas add anything now.")

    def addressing(self, grouping: int = 1) -> LoraAddressing:
        """This step's addressing for rows of ``grouping`` (LoraTarget.row_grouping)."""
        return self._planner.addressing(grouping)

    def base_only(self) -> contextlib.AbstractContextManager:
        """A forward outside any step (a compile's warm-up) on this thread: deltas add nothing."""
        return self._planner.base_only()

    def layer_weights(self, target: str, layer_idx: int) -> LayerWeights:
        return self._slot_weights.layer(target, layer_idx)

    def layer_delta(self, target: str, layer_idx: int, member: int | None = None) -> LoraLayerDelta:
        """What a layer calls to add ``target``'s delta at stack layer ``layer_idx`` (one per layer);
        ``member``: slice ``member`` of a fused target alone, into that slice's own output."""
        d = self._deltas.get((target, layer_idx, member))
        if d is None:
            d = self._deltas[(target, layer_idx, member)] = LoraLayerDelta(self, target, layer_idx, member)
        return d

    def bind_a(self, target: str, layer_idx: int, a) -> None:
        """Keep ``target``'s A at stack layer ``layer_idx`` in ``a`` from now on: a C-contiguous
        ``[S, n, R, in]`` array of the pool's dtype on its device (NumPy on cpu, CuPy on cuda),
        such as the rows appended to the layer's base weight so one GEMM writes y and every
        slot's ``x @ A.T`` (:meth:`LoraLayerDelta.expand_v
        <lora_cupy.delta.LoraLayerDelta.expand_v>` then adds the rest). What the slots hold is
        copied in; installs write there; every delta of the layer reads it. Call between steps.
        Once every layer of a target is bound, the pool's own array for them is freed. A layer
        bound already (to another attachment's array) is refused with ValueError."""
        with self._lock:
            self._slot_weights.targets[self.spec.target(target).name].bind(layer_idx, a)
            self._resolve(target, layer_idx)

    def unbind_a(self, target: str, layer_idx: int, a=None) -> None:
        """Undo :meth:`bind_a`: the layer's A back in the pool's own array (the bound one is no
        longer written or read). A no-op for a layer not bound; ``a``: the array it was bound to
        (ValueError if it is bound to another). Call between steps."""
        with self._lock:
            self._slot_weights.targets[self.spec.target(target).name].unbind(layer_idx, a)
            self._resolve(target, layer_idx)

    def _resolve(self, target: str, layer_idx: int) -> None:
        for (t, l, _m), d in self._deltas.items():
            if t == target and l == layer_idx:
                d.resolve()

    def close_halves(self) -> None:
        """Zero the v an open shrink left (a forward that raised between a shrink and its slices'
        expands), on the stream the deltas run on, before another delta reads or adds to it. Call
        from the thread that issues the step's GPU work; a no-op when no shrink is open."""
        if self.open_halves is not None:
            self.open_halves = None
            self.backend.clear_v()

    def layer_ranks(self, target: str, layer_idx: int) -> np.ndarray:
        """``[slots]``: each slot's rank at one target and stack layer (the largest over its
        slices), 0 where its adapter adds nothing there."""
        with self._lock:
            return self._slot_weights.layer_ranks(target, layer_idx)

    # -- runtime load / unload -----------------------------------------------------------------------
    def load_adapter_async(self, name: str, path, digest: str | None = None) -> Future:
        """Serve ``name`` from ``path`` once read (on the reader thread) and checked (spec, digest,
        the host tier's bound): the future gives its :class:`ServedAdapter`, or the refusal.
        Refusals visible now (served already, loading, still retiring) raise here."""
        return self._catalog.load_async(name, path, digest)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving ``name`` to new requests (invariant 9). Its host copy and name -> slot
        entry are forgotten now if no live request names it (True), else when the last one is
        removed (False), which runs to its end on its weights; not served: a no-op (False)."""
        return self._catalog.unload(name)

    # -- checks ------------------------------------------------------------------------------------------
    def check_valid(self) -> None:
        """Assert the README's invariants 1-9 and 12 as far as state shows them (AssertionError if not)."""
        with self._lock:
            self.slots.check_valid()
            assert self.decides or not self.slots.reserved, "a rank that does not decide keeps reservations (6)"
            self._catalog.check_valid(self.slots, self._settled)
            bank = self._slot_weights
            for s in range(self.spec.num_slots):
                most = bank.largest_rank(s)
                assert bank.slot_ranks[s] == most, f"slot {s}: the planner reads rank {bank.slot_ranks[s]}, " \
                                                   f"its weights hold {most} (12)"

    def snapshot(self):
        """The slot table as plain data (see :class:`~lora_cupy.slots.SlotSnapshot`)."""
        with self._lock:
            return self.slots.snapshot()

    def slot_state(self) -> tuple[tuple, tuple]:
        """Each slot's refcount and adapter (None: empty), as tuples: the part of
        :meth:`snapshot` a generator records every step, without copying the rest."""
        with self._lock:
            return tuple(self.slots.refcounts), tuple(self.slots.adapters)

    def close(self) -> None:
        """Stop the reader thread and the host stream."""
        self._store.close()
        self.device.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
