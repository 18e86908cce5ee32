"""SimPool: one rank's pool, restated from the spec as a plain model of every slot decision.

The decisions and their order follow the pool's invariants (the README's invariants 1-9):

* a request takes its adapter's slot at its first admit and holds it until removed;
* resident-first admits: rows whose adapter is resident take its slot before any miss picks
  one; a miss takes an empty slot first, else the least recently used unheld slot, by a
  logical clock advanced by admits;
* reservations count slots and pin none; the adapters that reserved rows still need a slot
  for never outnumber the unheld slots; only the deciding rank keeps them;
* the admit's backstop reads only what every rank shares: a row is refused only when its miss
  finds no unheld slot; a row nobody counted takes a slot like any other, and where that
  leaves the reservations promising more than the unheld slots, the promises made last are
  taken back (their rows ask again);
* a miss whose adapter failed to read (on any rank) fails before any slot is handed out;
* ``rollback_admit`` gives back exactly what the admit took, loaded adapters stay resident;
* ``unload_adapter`` stops new requests at once and forgets the adapter (name, host copy,
  name -> slot entry) when its last live request is removed; the slot keeps the weights.

Reads are explicit: ``ingest_request`` starts one (the copy is ``PENDING``) and the caller
lands it with ``complete_read``. The host tier holds a copy while a live request names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from .errors import (AdapterStateError, ReadInFlightError, RequestStateError, SimError,
                     UnknownAdapterError)
from .slots import SimSlots, SlotSnapshot


class Copy(str, Enum):
    """Where a host copy stands on one rank."""

    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"


class Ask(str, Enum):
    """What ``ask`` says of a row: it needs a slot, or its adapter failed to read (fail it)."""

    NEED = "need"
    FAIL = "fail"


class Reserve(str, Enum):
    """What ``reserve`` did: nothing to count, counted, must wait, or let through to fail."""

    NONE = "none"
    GRANTED = "granted"
    WAIT = "wait"
    THROUGH = "through"


@dataclass
class SimRequest:
    rid: object
    adapter: str | None  # None: a base-model request
    touches: bool  # whether its adapter has anything for this pool
    slot: int | None = None  # the slot it holds (None: none yet)
    reserved: bool = False


@dataclass
class SimAdapter:
    name: str
    touches: bool = True
    serving: bool = True  # False: unloaded, retiring until its last request is removed


@dataclass(frozen=True)
class AdmitResult:
    """One admit's decisions.

    ``slots``: each row that took a slot now and the slot, in row order; ``hits``: rows whose
    adapter was resident; ``loads``: ``(adapter, slot, overwritten)`` per miss, in miss order,
    ``overwritten`` the adapter whose weights the slot held (None: it was empty);
    ``failed``: rows failed on a failed read, holding no slot; ``refused``: rows the backstop
    turned away (no unheld slot, or only slots reservations promised), holding no slot.
    """

    slots: tuple[tuple[object, int], ...] = ()
    hits: tuple[object, ...] = ()
    loads: tuple[tuple[str, int, str | None], ...] = ()
    failed: tuple[object, ...] = ()
    refused: tuple[object, ...] = ()

    @property
    def evictions(self) -> int:
        return sum(1 for _, _, old in self.loads if old is not None)


class SimPool:
    """One rank's model pool. ``decides``: whether this rank keeps reservations (the leader)."""

    def __init__(self, num_slots: int, *, decides: bool = True, name: str = "llm"):
        self.slots = SimSlots(num_slots)
        self.decides = decides
        self.name = name
        self.adapters: dict[str, SimAdapter] = {}
        self.requests: dict[object, SimRequest] = {}
        self.tier: dict[str, Copy] = {}  # host copies, one per adapter a live request names
        self._named: dict[str, int] = {}  # adapter -> live requests naming it
        self._reserved: dict[str, int] = {}  # adapter -> reserved rows holding no slot yet
        self._promises: dict[object, str] = {}  # rid -> adapter, in the order they were reserved
        self._taken: list[tuple[object, int]] = []  # (rid, slot) the last admit took, until commit

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    # -- adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, *, touches: bool = True) -> None:
        """Serve ``name``; ``touches``: whether it has anything for this pool's targets."""
        a = self.adapters.get(name)
        if a is not None:
            why = "is served already" if a.serving else "is still retiring from an unload"
            raise AdapterStateError(f"adapter {name!r}: cannot load, it {why} (pool {self.name})")
        self.adapters[name] = SimAdapter(name, touches)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving ``name``; returns whether it was forgotten now (no live request names it)."""
        a = self.adapters.get(name)
        if a is None or not a.serving:
            return False
        a.serving = False
        if not self.named(name):
            self._forget(name)
            return True
        return False

    def serves(self, name: str) -> bool:
        a = self.adapters.get(name)
        return a is not None and a.serving

    def named(self, name: str) -> bool:
        """Whether a live request names ``name``."""
        return self._named.get(name, 0) > 0

    def _set_reserved(self, r: SimRequest, on: bool) -> None:
        if r.reserved == on:
            return
        r.reserved = on
        if on:
            self._promises[r.rid] = r.adapter
        else:
            del self._promises[r.rid]
        n = self._reserved.get(r.adapter, 0) + (1 if on else -1)
        if n:
            self._reserved[r.adapter] = n
        else:
            del self._reserved[r.adapter]

    def _forget(self, name: str) -> None:
        del self.adapters[name]
        self.tier.pop(name, None)
        self.slots.forget(name)

    # -- requests ------------------------------------------------------------------------------
    def ingest_request(self, rid, adapter: str | None = None) -> bool:
        """Open ``rid`` on ``adapter`` (None: base model); returns whether a read started."""
        if rid in self.requests:
            raise RequestStateError(f"request {rid!r} ingested twice (pool {self.name})")
        if adapter is not None and not self.serves(adapter):
            raise UnknownAdapterError(f"adapter {adapter!r}: not served by pool {self.name} "
                                      f"(request {rid!r})")
        touches = adapter is not None and self.adapters[adapter].touches
        self.requests[rid] = SimRequest(rid, adapter, touches)
        if adapter is not None:
            self._named[adapter] = self._named.get(adapter, 0) + 1
        if touches and adapter not in self.tier:
            self.tier[adapter] = Copy.PENDING
            return True
        return False

    def complete_read(self, name: str, ok: bool = True) -> bool:
        """Land the read of ``name``'s copy; False if none is in flight (dropped meanwhile)."""
        if self.tier.get(name) is not Copy.PENDING:
            return False
        self.tier[name] = Copy.OK if ok else Copy.FAILED
        return True

    def pending_reads(self) -> list[str]:
        return [n for n, c in self.tier.items() if c is Copy.PENDING]

    def remove_request(self, rid) -> None:
        """Tear ``rid`` down: give back its slot; drop its adapter's copy (and forget the
        adapter, if unloaded) once no live request names it."""
        r = self.requests.pop(rid, None)
        if r is None:
            raise RequestStateError(f"request {rid!r} removed but never ingested (pool {self.name})")
        if r.slot is not None:
            self.slots.release(r.slot)
        self._set_reserved(r, False)
        if r.adapter is not None:
            self._named[r.adapter] -= 1
            if self._named[r.adapter]:
                return
            del self._named[r.adapter]
            self.tier.pop(r.adapter, None)
            a = self.adapters.get(r.adapter)
            if a is not None and not a.serving:
                self._forget(r.adapter)

    def _request(self, rid) -> SimRequest:
        r = self.requests.get(rid)
        if r is None:
            raise RequestStateError(f"request {rid!r} is not live in pool {self.name}")
        return r

    # -- admission -----------------------------------------------------------------------------
    def _needs(self, r: SimRequest) -> bool:
        return r.touches and r.slot is None

    def _lost_read(self, r: SimRequest) -> bool:
        return self.tier.get(r.adapter) is Copy.FAILED and self.slots.slot_of(r.adapter) is None

    def ask(self, rid) -> Ask | None:
        """What a row will need: None on a follower, for a base row, a row holding its slot or a
        reservation, an adapter with nothing here; FAIL for a failed read in no slot."""
        r = self._request(rid)
        if not self.decides or not self._needs(r) or r.reserved:
            return None
        return Ask.FAIL if self._lost_read(r) else Ask.NEED

    def demand(self) -> set[str]:
        """Adapters that reserved rows still need a slot for: those in no held slot."""
        return {a for a in self._reserved if not self.slots.held(a)}

    def reserve(self, rid) -> Reserve:
        """Count ``rid``'s adapter against the unheld slots once its copy is in."""
        r = self._request(rid)
        if not self.decides or not self._needs(r) or r.reserved:
            return Reserve.NONE
        if self._lost_read(r):
            return Reserve.THROUGH
        if self.tier.get(r.adapter) is Copy.PENDING:
            return Reserve.WAIT  # a failed copy whose adapter is resident counts like any other
        need = self.demand()
        if not self.slots.held(r.adapter):
            need.add(r.adapter)
        if len(need) > self.slots.unheld_count():
            return Reserve.WAIT
        self._set_reserved(r, True)
        return Reserve.GRANTED

    def _take(self, rows: list[SimRequest], slot: int, taken: list) -> None:
        """Rows take ``slot``, spending their reservations. Never refused (the decision reads
        only the table, the same on every rank); an adapter nobody counted that makes an
        unheld slot held takes back the promises made last that no unheld slot backs now."""
        uncounted = self.slots.refcounts[slot] == 0 and rows[0].adapter not in self._reserved
        for r in rows:
            r.slot = slot
            self.slots.take(slot)
            self._set_reserved(r, False)
            taken.append((r.rid, slot))
        while uncounted and len(self.demand()) > self.slots.unheld_count():
            last = next(a for a in reversed(self._promises.values()) if not self.slots.held(a))
            for rid in [rid for rid, a in self._promises.items() if a == last]:
                self._set_reserved(self.requests[rid], False)

    def admit(self, rids, failed: set[str] | None = None) -> AdmitResult:
        """Give each row of the step that holds no slot yet its adapter's slot, loading misses.

        Rows are taken adapter by adapter, in the order of each adapter's first row: hits
        first, then misses, each miss the next of the victims fixed once the hits hold their
        slots (empty slots, then least recently used). ``failed``: adapters the instance agreed
        failed to read on some rank (default: this rank's failed copies); their rows fail and
        take nothing (their reservations go before any miss takes a slot). A miss that finds
        no unheld slot is refused. Nothing changes if the admit raises.
        """
        rows = [self._request(rid) for rid in rids]
        if len({id(r) for r in rows}) != len(rows):
            raise RequestStateError(f"a request appears twice in one step: {list(rids)}")
        groups: dict[str, list[SimRequest]] = {}
        for r in rows:
            if self._needs(r):
                groups.setdefault(r.adapter, []).append(r)
        if not groups:
            return AdmitResult()
        hit_groups = [(a, g) for a, g in groups.items() if self.slots.slot_of(a) is not None]
        miss_groups = [(a, g) for a, g in groups.items() if self.slots.slot_of(a) is None]
        if failed is None:
            failed = {a for a, _ in miss_groups if self.tier.get(a) is Copy.FAILED}
        for a, _ in miss_groups:
            c = self.tier.get(a)
            if a in failed:
                continue
            if c is Copy.PENDING:
                raise ReadInFlightError(f"adapter {a!r}: admit needs its copy, still being read "
                                        f"(pool {self.name})")
            if c is not Copy.OK:
                raise SimError(f"adapter {a!r}: copy is {c} here but the instance agreed it read")
        taken: list[tuple[object, int]] = []
        hits, loads, failed_rows, refused = [], [], [], []
        # Resident first: hits hold their slots before any miss picks a victim.
        for a, g in hit_groups:
            self._take(g, self.slots.slot_of(a), taken)
            hits += [r.rid for r in g]
        victims = [int(s) for s in self.slots.eviction_order()]
        for a, g in miss_groups:
            if a in failed:
                for r in g:
                    self._set_reserved(r, False)
                failed_rows += [r.rid for r in g]
        for a, g in miss_groups:
            if a in failed:
                continue
            if not victims:
                refused += [r.rid for r in g]
            else:
                s = victims.pop(0)
                loads.append((a, s, self.slots.install(s, a)))
                self._take(g, s, taken)
        if taken:  # the clock counts admits that take slots
            self.slots.tick()
        for _, s in taken:
            self.slots.stamp(s)
        order = {rid: i for i, rid in enumerate(rids)}
        taken.sort(key=lambda t: order[t[0]])
        self._taken = taken
        return AdmitResult(tuple(taken), tuple(sorted(hits, key=order.get)), tuple(loads),
                           tuple(sorted(failed_rows, key=order.get)), tuple(sorted(refused, key=order.get)))

    def commit(self) -> None:
        """The step ran: its admit can no longer be rolled back."""
        self._taken = []

    def rollback_admit(self) -> list[tuple[object, int]]:
        """Give back the slots the last admit took; what it loaded stays resident, unheld."""
        taken, self._taken = self._taken, []
        given = []
        for rid, s in taken:
            r = self.requests.get(rid)
            if r is not None and r.slot == s:
                r.slot = None
                self.slots.release(s)
                given.append((rid, s))
        return given

    def plan(self, rids) -> np.ndarray:
        """``[rows]`` int32: the slot each row addresses (0: base, failed or nothing here)."""
        out = np.zeros(len(rids), np.int32)
        for i, rid in enumerate(rids):
            s = self._request(rid).slot
            out[i] = 0 if s is None else s
        return out

    # -- checking ------------------------------------------------------------------------------
    def snapshot(self) -> SlotSnapshot:
        return self.slots.snapshot()

    def holders(self) -> dict[object, int]:
        return {rid: r.slot for rid, r in self.requests.items() if r.slot is not None}

    def check_valid(self) -> None:
        """Every invariant the model keeps (AssertionError naming the broken one)."""
        self.slots.check_valid()
        counts = np.zeros(self.num_slots, np.int64)
        for r in self.requests.values():
            if r.slot is not None:
                assert r.slot > 0, f"request {r.rid!r} holds slot 0"
                assert self.slots.adapters[r.slot] == r.adapter, (
                    f"request {r.rid!r} on {r.adapter!r} holds slot {r.slot} "
                    f"({self.slots.adapters[r.slot]!r})")
                assert not r.reserved, f"request {r.rid!r} holds a slot and a reservation"
                counts[r.slot] += 1
            if r.adapter is not None:
                assert r.adapter in self.adapters, f"live request {r.rid!r} names forgotten {r.adapter!r}"
            assert not (r.reserved and not self.decides), "a follower keeps a reservation"
        assert (counts == self.slots.refcounts).all(), (
            f"refcounts {self.slots.refcounts.tolist()} != holders {counts.tolist()}")
        count: dict[str, int] = {}
        res: dict[str, int] = {}
        for r in self.requests.values():
            if r.adapter is not None:
                count[r.adapter] = count.get(r.adapter, 0) + 1
            if r.reserved:
                res[r.adapter] = res.get(r.adapter, 0) + 1
        assert count == self._named and res == self._reserved, "request indices out of date"
        assert set(self._promises) == {r.rid for r in self.requests.values() if r.reserved}, \
            "reservation order out of date"
        named = {r.adapter for r in self.requests.values() if r.touches}
        assert set(self.tier) == named, f"host tier {sorted(self.tier)} != named {sorted(named)}"
        for a in self.adapters.values():
            if not a.serving:
                assert self.named(a.name), f"retiring {a.name!r} is named by no live request"
        for name in self.slots.entries:
            assert name in self.adapters, f"slot entry for forgotten adapter {name!r}"
        assert len(self.demand()) <= self.slots.unheld_count(), (
            f"reservations promise {len(self.demand())} slots, {self.slots.unheld_count()} unheld")
