"""LoraAdapterPool: per-request LoRA adapters resident in a fixed set of device slots.

The pool owns the slot weights, decides which adapter sits in which slot (the
:class:`~lora_cupy.slots.SlotTable`), and says per step which slot each token addresses
(``plan`` -> :class:`~lora_cupy.addressing.LoraAddressing`); a backend runs the kernels.

Threads and locks. ``ingest_request``, ``remove_request``, ``load_adapter_async`` and
``unload_adapter`` may come from any thread; ``ask``/``reserve`` from the runner's admission;
``admit``/``plan``/``commit``/``rollback_admit`` from the thread that issues GPU work, one step
at a time. One lock guards the table and the request state and is never held across a wait:
files are read on the store's reader thread, and an admit that must wait for a copy (a
follower whose read is still in flight) waits outside the lock, after the agreement.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from .addressing import LoraAddressing
from .backends.base import LayerWeights
from .buffers import AddressingBuffers, SlotWeights, slot_dtype
from .device import Device, as_device
from .dtypes import normalize_dtype
from .engine.resource import (AdmitOutcome, EngineResourceInfo, LoraStep, ResourceReqConfig, StepContext,
                              StepRows)
from .errors import AdapterNotFoundError, AdapterStateError, CapacityError, LoraError
from .slots import SlotTable
from .spec import LoraSpec
from .store import FAILED, READING, READY, LoraAdapterStore


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter the pool serves: its file, the digest its reads must match, the targets it
    has something for here (empty: it runs with no slot in this pool), its host copy's size."""

    name: str
    path: str
    digest: str
    targets: frozenset[str]
    image_bytes: int


@dataclass
class _Request:
    adapter: str | None
    covers: bool  # its adapter has something for this pool's targets


@dataclass
class _AdmitRecord:
    """What one admit took, for rollback_admit: the rows that took a slot."""

    taken: list = field(default_factory=list)


@dataclass
class LoraStepPlan:
    """One step's plan: its addressing per row grouping, the views a layer launches with (per
    grouping: ``token_order`` over the whole capture bucket, and ``slot_indptr``), whether any
    row has an adapter, and the event after its copies (a CPU layer waits for it; on CUDA
    stream order suffices)."""

    seq: int
    addressing: dict[int, LoraAddressing]
    launch: dict[int, tuple]
    active: bool
    ready: Any

    def wait_host(self) -> None:
        if self.ready is not None and not self.ready.done:
            self.ready.synchronize()


def _single_rank_agree(outcomes: np.ndarray) -> np.ndarray:
    """The agreement of a one-rank instance: its own outcomes."""
    return outcomes


class LoraAdapterPool:
    """Per-request LoRA adapters in ``spec.num_slots - 1`` device slots, for one rank.

    ``agree(outcomes) -> outcomes``: the instance's agreement on where each miss's read
    stands, ``outcomes[i]`` in (READY=0, READING=1, FAILED=2) for the admit's i-th miss, same
    length on every rank; it returns the elementwise maximum over ranks (one all-reduce MAX).
    An admit with misses calls it once; a second time only when the first answer says some
    rank's copy was still in flight (every rank then calls it, with its final outcomes).
    ``decides``: this rank chooses batches and keeps reservations (a lockstep leader).
    ``adapters``: served from startup, name -> path or (path, digest). ``reader`` and
    ``max_host_bytes`` configure the host tier (:class:`LoraAdapterStore`).
    """

    supports_preplan = True

    def __init__(self, spec: LoraSpec, device: Device | str | Any = "cpu", rank: int = 0, world_size: int = 1,
                 backend=None, dtype=None, agree: Callable[[np.ndarray], np.ndarray] | None = None,
                 decides: bool = True, *, adapters: Mapping[str, Any] | None = None, reader=None,
                 max_host_bytes: int | None = None, force_double_buffer: bool = True):
        if dtype is not None and normalize_dtype(dtype) != spec.dtype:
            spec = replace(spec, dtype=normalize_dtype(dtype))
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if agree is None:
            if world_size > 1:
                raise ValueError("a pool on a multi-rank instance needs agree: a collective (all-reduce MAX) "
                                 "over per-miss read outcomes")
            agree = _single_rank_agree
        self.spec = spec
        self.device = as_device(device)
        self.rank, self.world_size = rank, world_size
        self.decides = decides
        self.agree = agree
        self.backend = backend if backend is not None else self.device.backend(spec)
        self._force_double_buffer = force_double_buffer
        self._store = LoraAdapterStore(spec, self.device, reader=reader, max_bytes=max_host_bytes)
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self.slots = SlotTable(spec.num_slots)
        self._weights = {t.name: SlotWeights(spec, t, self.device) for t in spec.targets}
        groupings = sorted({1, *(t.row_grouping for t in spec.targets)})
        self._buffers = {g: AddressingBuffers(spec, self.device, g) for g in groupings}
        self._parity = 0
        self._fences: list[Any] = [None, None]  # each parity's event after its last copy (cuda: re-recorded)
        self._slot_dtype = slot_dtype(spec.num_slots)
        self._requests: dict[Hashable, _Request] = {}
        self._settled: dict[Hashable, int] = {}  # rid -> its slot (0: needs none here)
        self._settled_set: set[Hashable] = set()
        self._adapters: dict[str, ServedAdapter] = {}  # served and retiring
        self._served: set[str] = set()
        self._retiring: set[str] = set()
        self._loading: dict[str, Future] = {}
        self._live: Counter = Counter()  # adapter -> live requests naming it
        self._current: LoraStepPlan | None = None
        self._base_only = threading.local()
        self._deltas: dict[tuple[str, int], Any] = {}
        self.stats = Counter()
        if adapters:
            try:
                futures = []
                for name, where in adapters.items():
                    path, digest = (where, None) if isinstance(where, (str, bytes)) or not isinstance(
                        where, Sequence) else tuple(where)
                    futures.append(self.load_adapter_async(name, path, digest))
                for f in futures:
                    f.result()
            except BaseException:
                self.close()
                raise

    @classmethod
    def build(cls, spec: LoraSpec, info: EngineResourceInfo) -> "LoraAdapterPool":
        """The pool an engine builds for ``spec`` from what it knows (device, rank, adapters...)."""
        return cls(spec, info.device, rank=info.rank, world_size=info.world_size, backend=info.backend,
                   dtype=info.dtype, agree=info.agree, decides=info.decides, adapters=info.adapters,
                   reader=info.reader, max_host_bytes=info.max_host_bytes,
                   force_double_buffer=info.force_double_buffer)

    # -- properties ------------------------------------------------------------------------
    @property
    def store(self) -> LoraAdapterStore:
        return self._store

    @property
    def force_double_buffer(self) -> bool:
        """Whether the runner must double-buffer this resource even off the pre-plan path.

        The pool stages each step's addressing in a reused host buffer and issues a
        non-blocking copy into a device buffer a captured graph reads, so it has the hazard;
        on by default (the constructor can turn it off for a runner that never runs ahead).
        """
        return self._force_double_buffer

    @property
    def served(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._served)

    def adapter_info(self, name: str) -> ServedAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    # -- requests ----------------------------------------------------------------------------
    def ingest_request(self, rid: Hashable, overrides: ResourceReqConfig | None = None) -> None:
        """Open the request's state, and start reading its adapter into the host tier."""
        name = overrides.adapter if overrides is not None else None
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"request {rid!r} was ingested already")
            if name is None:
                self._requests[rid] = _Request(None, False)
                self._settle(rid, 0)
                return
            info = self._adapters.get(name) if name in self._served else None
            if info is None:
                why = ("is retiring from an unload" if name in self._retiring else
                       "is still loading" if name in self._loading else "is not served by this pool")
                raise AdapterNotFoundError(f"request {rid!r} names it, but it {why}", adapter=name)
            covers = bool(info.targets)
            self._requests[rid] = _Request(name, covers)
            self._live[name] += 1
            if covers:
                self._store.acquire(name, info.path, info.digest, info.image_bytes)
            else:
                self._settle(rid, 0)

    def remove_request(self, rid: Hashable) -> None:
        """Close the request: its slot is given back (refcount), its host copy released.
        The worker calls this only once no in-flight step references the request."""
        with self._lock:
            req = self._requests.pop(rid, None)
            if req is None:
                return
            self.slots.release(rid)
            self.slots.unreserve(rid)
            self._settled.pop(rid, None)
            self._settled_set.discard(rid)
            name = req.adapter
            if name is None:
                return
            if req.covers:
                self._store.release(name)
            self._live[name] -= 1
            if self._live[name] <= 0:
                del self._live[name]
                if name in self._retiring:
                    self._forget(name)

    def runs_adapters(self, rids: Sequence[Hashable]) -> bool:
        """Whether any of ``rids`` names an adapter with something for this pool."""
        with self._lock:
            reqs = self._requests
            return any(r in reqs and reqs[r].covers for r in rids)

    def _settle(self, rid: Hashable, slot: int) -> None:
        self._settled[rid] = slot
        self._settled_set.add(rid)

    # -- admission -------------------------------------------------------------------------------
    def ask(self, rid: Hashable, node_name: str, graph_walk: Sequence[str] = ()) -> AdmitOutcome | None:
        """ASKS for a row that will need a slot; the failing outcome for a row whose adapter
        failed to read and is in no slot; None when nothing is needed here (see the seed)."""
        if not self.decides or node_name != self.spec.node:
            return None
        with self._lock:
            req = self._need(rid)
            if req is None or rid in self._settled or rid in self.slots.reserved:
                return None
            if self.slots.slot_of(req.adapter) is None:
                e = self._store.get(req.adapter)
                if e is not None and e.state == FAILED:
                    return AdmitOutcome.fail({rid: e.error})
            return AdmitOutcome.ASKS

    def reserve(self, rid: Hashable, node_name: str, graph_walk: Sequence[str] = (),
                published: bool = False) -> int | None:
        """Count ``rid``'s adapter against the free slots once its host copy is in: 1 when
        counted (or counted already), 0 to wait, None to let it through uncounted (its adapter
        failed to read and is in no slot, so its admit fails it; or it needs nothing here).
        ``published`` (the request already runs on an earlier node) changes nothing here."""
        if not self.decides or node_name != self.spec.node:
            return None
        with self._lock:
            req = self._need(rid)
            if req is None or rid in self._settled:
                return None
            if rid in self.slots.reserved:
                return 1
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

    def _need(self, rid: Hashable) -> _Request | None:
        req = self._requests.get(rid)
        if req is None:
            raise ValueError(f"request {rid!r} was never ingested by this pool")
        return req if req.covers else None

    # -- a step ------------------------------------------------------------------------------------
    def admit(self, step: LoraStep, ctx: StepContext) -> AdmitOutcome:
        """Give each row whose adapter is not resident yet a slot, loading it there.

        Once every row holds its slot (every step after a request's first) this is one set
        check. Otherwise: hits take their slots and the misses' victims are fixed, under the
        lock, from the table as it stands; the instance agrees on where each miss's read
        stands (one ``agree`` call) before any rank waits. Where some rank's copy is still in
        flight, each rank waits for its own (outside the lock) and the instance agrees once
        more on the final outcomes. A read that failed on any rank fails its rows on every
        rank, before any slot is handed out; the rest take their victims, whose weights are
        queued on the device's stream ahead of the step.
        """
        rows = step.rows_for(self.spec.node)
        if rows.rid_set <= self._settled_set:
            return AdmitOutcome.OK
        with self._step_lock:
            return self._admit(rows, ctx)

    def _admit(self, rows: StepRows, ctx: StepContext) -> AdmitOutcome:
        failed: dict[Hashable, BaseException] = {}
        rec = _AdmitRecord()
        with self._lock:
            need = []
            for rid in rows.rids:
                if rid in self._settled:
                    continue
                req = self._requests.get(rid)
                if req is None:
                    failed[rid] = LoraError(f"request {rid!r} was never ingested or was removed")
                    continue
                need.append((rid, req.adapter))
            picks = self.slots.begin_admit(need)
            for rid, slot in picks.hits:
                self._settle(rid, slot)
                rec.taken.append(rid)
            entries = [self._store.get(m.name) for m in picks.misses]
        local = np.array([FAILED if e is None else e.outcome() for e in entries], np.int8)
        agreed = self._agree(local)
        if (agreed == READING).any():
            # A copy is still in flight on some rank: each rank waits for its own (outside the
            # lock), then the instance agrees once more on the final outcomes, so no rank
            # installs an adapter whose read failed on another. Every rank saw the same first
            # answer, so every rank makes this second call.
            for i, e in enumerate(entries):
                if agreed[i] != FAILED and local[i] == READING:
                    e.wait()
            local = np.array([FAILED if (agreed[i] == FAILED or e is None) else e.outcome()
                              for i, e in enumerate(entries)], np.int8)
            agreed = self._agree(local)
        survivors = []
        for i, m in enumerate(picks.misses):
            e = entries[i]
            err = None
            if agreed[i] != READY:
                mine = e is not None and local[i] == FAILED and e.error is not None
                err = e.error if mine else LoraError("its read failed on another rank of the instance",
                                                     adapter=m.name, path=None if e is None else e.path)
            if err is not None:
                for rid in m.rids:
                    failed[rid] = err
                with self._lock:  # a failed row holds nothing, and no reservation
                    for rid in m.rids:
                        self.slots.unreserve(rid)
            else:
                survivors.append((m, e))
        with self._lock:
            for m, e in survivors:
                rids = [r for r in m.rids if r in self._requests]
                if not rids:
                    continue
                slot = self.slots.finish_miss(picks, m, rids)
                if slot is None:
                    continue
                for t in self.spec.targets:
                    self._weights[t.name].install(slot, e.image.targets.get(t.name))
                self.device.keep_alive(e.image)
                for rid in rids:
                    self._settle(rid, slot)
                    rec.taken.append(rid)
                self.stats["loads"] += 1
            for rid, why in picks.refused.items():
                name = self._requests[rid].adapter if rid in self._requests else None
                info = self._adapters.get(name)
                failed[rid] = CapacityError(f"request {rid!r} gets no slot: {why}", adapter=name,
                                            path=None if info is None else info.path)
        ctx.state[self] = rec
        self.stats["admits"] += 1
        return AdmitOutcome.fail(failed) if failed else AdmitOutcome.OK

    def _agree(self, local: np.ndarray) -> np.ndarray:
        """The instance's answer (elementwise max over ranks) for this rank's miss outcomes."""
        if not len(local):
            return local
        agreed = np.asarray(self.agree(local))
        if agreed.shape != local.shape:
            raise ValueError(f"agree returned shape {agreed.shape} for {local.shape} outcomes")
        return agreed

    def rollback_admit(self, step: LoraStep, ctx: StepContext) -> None:
        """Give back the slots this step's admit took; an adapter it loaded stays resident in
        its now-unheld slot, as a cache. The rows hold nothing afterwards, no reservation
        either: the runner queues them at admission again."""
        rec = ctx.state.pop(self, None)
        if rec is None:
            return
        with self._step_lock, self._lock:
            taken = [r for r in rec.taken if r in self._settled]
            for rid in taken:
                self._settled.pop(rid)
                self._settled_set.discard(rid)
            self.slots.rollback(taken)

    def plan(self, step: LoraStep, ctx: StepContext) -> LoraAddressing | None:
        """Build the step's addressing (token_order / slot_indptr per row grouping) into the
        fixed buffers and queue its copy; returns the grouping-1 addressing (None: no row here).

        The full plan goes to ``ctx.plan_results[pool]``; it becomes the pool's current step
        now, or, when ``ctx.preplanned``, once the runner calls :meth:`activate`.
        """
        rows = step.rows_for(self.spec.node)
        if not len(rows):
            ctx.plan_results[self] = None
            if not ctx.preplanned:
                self._current = None
            return None
        with self._step_lock:
            with self._lock:
                try:
                    slots = np.fromiter(map(self._settled.__getitem__, rows.rids), self._slot_dtype, len(rows))
                except KeyError as e:
                    raise ValueError(f"row {e.args[0]!r} of step {ctx.seq} was not admitted here") from None
            if self._force_double_buffer or ctx.preplanned:
                self._parity ^= 1
            parity = self._parity
            fence = self._fences[parity]
            if fence is not None and not fence.done:
                fence.synchronize()  # the copy that last read this parity's host buffers has run
            addressing, launch, copies = {}, {}, []
            for g, b in self._buffers.items():
                addressing[g], launch[g], copy = b.stage(rows, slots, parity)
                copies.append(copy)
            fence = self._fences[parity] = self.device.copy_batch(copies, reuse=fence)
            plan = LoraStepPlan(ctx.seq, addressing, launch, addressing[1].active,
                                None if self.device.is_cuda else fence)
        ctx.plan_results[self] = plan
        if not ctx.preplanned:
            self._current = plan
        return addressing[1]

    def activate(self, ctx: StepContext) -> None:
        """Make ``ctx``'s plan the current step (a pre-planned step, as it starts running)."""
        self._current = ctx.plan_results.get(self)

    def commit(self, step: LoraStep, ctx: StepContext) -> None:
        """Record the step's consumption: what its admit took is kept for good."""
        ctx.state.pop(self, None)
        rows = step.rows_for(self.spec.node)
        self.stats["steps"] += 1
        self.stats["rows"] += len(rows)
        self.stats["tokens"] += rows.total_tokens

    # -- what layers read ---------------------------------------------------------------------------
    def current_plan(self) -> LoraStepPlan | None:
        """The running step's plan, or None where deltas add nothing (no adapter row, no step,
        or a base-only forward on this thread)."""
        plan = self._current
        if plan is None or not plan.active or getattr(self._base_only, "depth", 0):
            return None
        return plan

    @property
    def active(self) -> bool:
        return self.current_plan() is not None

    def addressing(self, grouping: int = 1) -> LoraAddressing:
        """This step's addressing for rows of ``grouping`` (LoraTarget.row_grouping)."""
        plan = self._current
        if plan is None:
            raise ValueError("no step is planned on this pool")
        try:
            return plan.addressing[grouping]
        except KeyError:
            raise ValueError(f"grouping {grouping} is not one of this pool's targets' "
                             f"({sorted(plan.addressing)})") from None

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """A forward outside any step (a compile's warm-up) on this thread: deltas add nothing."""
        tl = self._base_only
        tl.depth = getattr(tl, "depth", 0) + 1
        try:
            yield
        finally:
            tl.depth -= 1

    def layer_weights(self, target: str, layer_idx: int) -> LayerWeights:
        t = self.spec.target(target)
        if not 0 <= layer_idx < t.num_layers:
            raise IndexError(f"target {target!r} has {t.num_layers} layers, not {layer_idx}")
        return self._weights[target].layers[layer_idx]

    def layer_delta(self, target: str, layer_idx: int):
        """What a layer calls to add ``target``'s delta at stack layer ``layer_idx``."""
        from .delta import LoraLayerDelta

        key = (target, layer_idx)
        d = self._deltas.get(key)
        if d is None:
            d = self._deltas[key] = LoraLayerDelta(self, target, layer_idx)
        return d

    def layer_ranks(self, target: str, layer_idx: int) -> np.ndarray:
        """``[slots]``: each slot's rank at one target and stack layer (the largest over its
        slices), 0 where its adapter adds nothing there."""
        self.layer_weights(target, layer_idx)
        with self._lock:
            return self._weights[target].host_ranks[layer_idx].max(axis=1)

    # -- runtime load / unload -----------------------------------------------------------------------
    def load_adapter_async(self, name: str, path, digest: str | None = None) -> Future:
        """Serve ``name`` from ``path`` once read (on the reader thread) and checked against the
        spec and ``digest``. The future gives its :class:`ServedAdapter`, or fails: served
        already, still retiring, unreadable, digest mismatch. Refusals visible now raise here."""
        with self._lock:
            if name in self._served:
                raise AdapterStateError("it is served already", adapter=name, path=path)
            if name in self._loading:
                raise AdapterStateError("it is being loaded already", adapter=name, path=path)
            if name in self._retiring:
                raise AdapterStateError(f"it is still retiring from an unload: {self._live[name]} live "
                                        "request(s) still run on it", adapter=name, path=path)
            out: Future = Future()
            out.set_running_or_notify_cancel()
            self._loading[name] = out
        read = self._store.read_async(name, path, digest)
        read.add_done_callback(lambda f: self._finish_load(name, str(path), f, out))
        return out

    def _finish_load(self, name: str, path: str, read: Future, out: Future) -> None:
        err = read.exception()
        result = None
        with self._lock:
            if self._loading.get(name) is not out:
                err = AdapterStateError("it was unloaded while it loaded", adapter=name, path=path)
            else:
                del self._loading[name]
                if err is None:
                    w = read.result()
                    targets = frozenset(w.targets)
                    need = self._store.image_bytes(targets)
                    err = self._store.too_big(name, path, need)
                    if err is None:
                        result = self._adapters[name] = ServedAdapter(name, path, w.digest, targets, need)
                        self._served.add(name)
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(result)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving ``name`` to new requests. Its host copy and name -> slot entry are
        forgotten now if no live request names it (returns True), else when the last one is
        removed (False); those requests run to their end on its weights. An adapter this pool
        does not serve is a no-op (False); a load in flight is cancelled (True)."""
        with self._lock:
            if name in self._loading:
                del self._loading[name]
                return True
            if name not in self._served:
                return False
            self._served.discard(name)
            if self._live.get(name, 0) > 0:
                self._retiring.add(name)
                return False
            self._forget(name)
            return True

    def _forget(self, name: str) -> None:
        self._retiring.discard(name)
        self._served.discard(name)
        self._adapters.pop(name, None)
        self.slots.forget(name)

    # -- checks ------------------------------------------------------------------------------------------
    def check_valid(self) -> None:
        """Assert the README's invariants 1-9 as far as state shows them (AssertionError if not)."""
        with self._lock:
            t = self.slots
            t.check_valid()
            for rid, s in t.holders.items():
                req = self._requests.get(rid)
                assert req is not None, f"removed request {rid!r} still holds slot {s} (invariant 2)"
                assert t.adapters[s] == req.adapter, \
                    f"request {rid!r} on {req.adapter!r} holds slot {s} of {t.adapters[s]!r} (invariant 2)"
                assert self._settled.get(rid) == s, f"request {rid!r}: addressing slot != held slot"
            for rid, s in self._settled.items():
                assert rid in self._requests, f"removed request {rid!r} is still settled"
                if s == 0:
                    req = self._requests[rid]
                    assert req.adapter is None or not req.covers, f"request {rid!r} addresses slot 0"
                else:
                    assert t.holders.get(rid) == s, f"request {rid!r} addresses slot {s} it does not hold"
            assert set(self._settled) == self._settled_set, "settled set out of step"
            if not self.decides:
                assert not t.reserved, "a rank that does not decide keeps reservations (invariant 6)"
            for rid in t.reserved:
                req = self._requests.get(rid)
                assert req is not None and req.covers, f"reservation for {rid!r}, which needs no slot"
            users = Counter(r.adapter for r in self._requests.values() if r.covers)
            for name, n in users.items():
                assert self._store.users(name) == n, \
                    f"adapter {name!r}: host tier counts {self._store.users(name)} users, {n} live requests"
            live = Counter(r.adapter for r in self._requests.values() if r.adapter is not None)
            assert live == +self._live, f"live counts {dict(self._live)} != {dict(live)}"
            assert not (self._served & self._retiring), "an adapter both served and retiring (invariant 9)"
            for name in self._retiring:
                assert self._live.get(name, 0) > 0, f"adapter {name!r} retires with no live request (invariant 9)"
            for name in t.entries:
                assert name in self._served or name in self._retiring, \
                    f"forgotten adapter {name!r} keeps its name -> slot entry (invariant 9)"
            assert set(self._adapters) == self._served | self._retiring, "adapter records out of step"

    def snapshot(self):
        """The slot table as plain data (see :class:`~lora_cupy.slots.SlotSnapshot`)."""
        with self._lock:
            return self.slots.snapshot()

    def close(self) -> None:
        """Stop the reader thread and the host stream."""
        self._store.close()
        self.device.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
