"""The slot table: which adapter sits in which slot, who holds it, and which slot a miss takes.

Pure bookkeeping: no arrays, no locks, no I/O. The pool calls it under its lock; ``sim/slots.py``
restates the same rules independently, under the same names (``refcounts``, ``adapters``,
``last_used``, ``entries``, ``eviction_order``), and hypothesis compares the two through
:meth:`SlotTable.snapshot`. The rules (the README's invariants 1-6, 8 and 9, as far as they are
the table's):

- Slot 0 is the zero adapter: never handed out, never held, never resident (invariant 1).
- ``refcounts[s]`` is the number of live requests holding ``s``; a request holds at most one
  slot (its adapter's), from the admit that first gives it one until it is released (2).
- The clock is logical: an admit that takes at least one slot advances it by one, and every
  slot that admit takes is stamped with the new value (``last_used[s]``; -1: never taken).
  Releases stamp nothing. The pool's steady-state admit (every row holds its slot
  already) does not call the table at all (4).
- An admit gives rows whose adapter is resident their slot first (hits), so no miss can evict
  an unheld adapter a later row of the same admit names. Each adapter that misses then takes,
  in the order of its first row, the next slot of the :meth:`~SlotTable.eviction_order`: the
  empty slots (never written) by index, then the unheld slots by ``(last_used, index)``. The
  victims are fixed from the table at :meth:`~SlotTable.begin_admit`; a miss that fails (its
  read failed on some rank) takes none, so the next surviving miss gets the victim it would
  have had (4, 5, 7).
- Reservations count adapters against slots and pin none (6). ``reserved`` maps a waiting rid
  to its adapter; :meth:`~SlotTable.demand` is the set of reserved adapters that sit in no held
  slot (each will take a slot at its admit), :meth:`~SlotTable.unheld_count` the number of
  unheld slots ``s >= 1``, and ``len(demand()) <= unheld_count()`` always. A reservation for
  an adapter that is held, or counted already, costs nothing more. A row spends its
  reservation when it takes a slot.
- The admit's backstop reads only what every rank of a lockstep instance shares (the table,
  never the reservations, which only the deciding rank keeps): a row is refused only when no
  victim is left for its miss (every slot held). A row of an adapter nobody counted (admitted
  without asking) takes a slot like any other; where that leaves the reservations promising
  more slots than are unheld, the promises made last are taken back (``AdmitPicks.shed``:
  those rows hold nothing and ask again), so ``len(demand()) <= unheld_count()`` still holds
  and every row still counted finds its slot (5, 6).
- :meth:`~SlotTable.forget` drops a name -> slot entry (an unload); the slot keeps the
  weights, unheld, and ``adapters[s]`` keeps the stale name, until a miss reuses it (9).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

NEVER = -1  # last_used of a slot no admit has taken yet


@dataclass(frozen=True)
class SlotSnapshot:
    """The whole table as plain data (for the simulator, tests and reports)."""

    entries: dict[str, int]  # adapter name -> slot (served, resident adapters)
    refcounts: tuple[int, ...]  # [S] live requests holding each slot
    adapters: tuple[str | None, ...]  # [S] the adapter whose weights a slot holds (None: empty)
    last_used: tuple[int, ...]  # [S] clock of the admit that last took it (-1: never)
    holders: dict[Hashable, int]  # rid -> the slot it holds
    reserved: dict[Hashable, str]  # rid -> the adapter counted for it
    clock: int

    @property
    def current(self) -> tuple[bool, ...]:
        """``[S]`` whether slot s's adapter still has its name -> slot entry (False once forgotten)."""
        return tuple(a is not None and self.entries.get(a) == s for s, a in enumerate(self.adapters))


@dataclass
class MissGroup:
    """One adapter that missed in an admit, with the rows that name it (in step order)."""

    name: str
    rids: list[Hashable]


@dataclass
class AdmitPicks:
    """What :meth:`SlotTable.begin_admit` decided: hits taken now, misses and their victims.

    ``victims[i]`` is the slot the ``i``-th surviving miss takes at :meth:`SlotTable.finish_miss`.
    ``refused`` maps rids to why they could take no slot (the backstop). ``shed``: the
    ``(rid, adapter)`` reservations an uncounted row's take made the table take back.
    """

    hits: list[tuple[Hashable, int]] = field(default_factory=list)
    misses: list[MissGroup] = field(default_factory=list)
    victims: list[int] = field(default_factory=list)
    refused: dict[Hashable, str] = field(default_factory=dict)
    spent: list[tuple[Hashable, str]] = field(default_factory=list)  # (rid, adapter) reservations spent
    shed: list[tuple[Hashable, str]] = field(default_factory=list)  # (rid, adapter) reservations taken back
    next_victim: int = 0
    ticked: bool = False  # the clock advanced for this admit


class SlotTable:
    """Slot refcounts, residents, the LRU clock, name -> slot and per-request holds."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the zero adapter), got {num_slots}")
        self.num_slots = num_slots
        self.refcounts = [0] * num_slots
        self.adapters: list[str | None] = [None] * num_slots
        self.last_used = [NEVER] * num_slots
        self.entries: dict[str, int] = {}
        self.holders: dict[Hashable, int] = {}
        self.reserved: dict[Hashable, str] = {}
        self.clock = 0
        self._free = num_slots - 1  # unheld slots s >= 1
        self._res_count: dict[str, int] = {}  # adapter -> reserved rids naming it

    # -- queries -------------------------------------------------------------------------
    def slot_of(self, name: str) -> int | None:
        """The slot ``name`` is resident in, or None."""
        return self.entries.get(name)

    def unheld_count(self) -> int:
        """Unheld slots (slot 0 aside): what reservations may count against."""
        return self._free

    def held(self, name: str) -> bool:
        """Whether ``name`` sits in a slot some live request holds (so it cannot be evicted)."""
        s = self.entries.get(name)
        return s is not None and self.refcounts[s] > 0

    def demand(self) -> set[str]:
        """Reserved adapters in no held slot: each is a slot the reservations promise."""
        return {name for name in self._res_count if not self.held(name)}

    def _demand_count(self) -> int:
        """``len(demand())`` without building the set (:meth:`held` inlined: an admission asks
        this for every reservation, over every adapter reserved)."""
        entries, refcounts = self.entries, self.refcounts
        n = 0
        for name in self._res_count:
            s = entries.get(name)
            if s is None or refcounts[s] <= 0:
                n += 1
        return n

    def can_reserve(self, name: str) -> bool:
        """Whether a reservation for ``name`` keeps ``len(demand()) <= unheld_count()``."""
        return self.held(name) or name in self._res_count or self._demand_count() < self._free

    # -- reservations ----------------------------------------------------------------------
    def reserve(self, rid: Hashable, name: str) -> None:
        """Count ``name`` for ``rid``; the caller checked :meth:`can_reserve`."""
        if rid in self.reserved:
            raise ValueError(f"request {rid!r} has a reservation already")
        if not self.can_reserve(name):
            raise ValueError(f"reserving {name!r} for {rid!r} would promise more than {self._free} free slots")
        self.reserved[rid] = name
        self._res_count[name] = self._res_count.get(name, 0) + 1

    def unreserve(self, rid: Hashable) -> str | None:
        """Drop ``rid``'s reservation; returns the adapter it counted, or None."""
        name = self.reserved.pop(rid, None)
        if name is not None:
            n = self._res_count[name] - 1
            if n:
                self._res_count[name] = n
            else:
                del self._res_count[name]
        return name

    # -- holds ---------------------------------------------------------------------------
    def _take(self, name: str, rids: Sequence[Hashable], slot: int, picks: AdmitPicks) -> list[Hashable]:
        """Rows of adapter ``name`` take ``slot``; returns them.

        Never refused: what may be taken follows from the table alone, the same on every rank.
        The rows' reservations are spent (``picks.spent``); an adapter nobody counted that makes
        an unheld slot held takes back the promises that slot backed (:meth:`_shed`). The
        admit's first take advances the clock, and the slot is stamped.
        """
        uncounted = False
        if self.refcounts[slot] == 0:
            uncounted = name not in self._res_count
            self._free -= 1
        taken: list[Hashable] = []
        for rid in rids:
            if rid in self.holders:
                raise ValueError(f"request {rid!r} holds slot {self.holders[rid]} already")
            if self.unreserve(rid) is not None:
                picks.spent.append((rid, name))
            self.refcounts[slot] += 1
            self.holders[rid] = slot
            taken.append(rid)
        if not picks.ticked:
            self.clock += 1
            picks.ticked = True
        self.last_used[slot] = self.clock
        if uncounted:
            self._shed(picks)
        return taken

    def _shed(self, picks: AdmitPicks) -> None:
        """While the reservations promise more slots than are unheld, take back the promise
        made last: every reservation of the adapter in ``demand()`` reserved most recently."""
        while self._demand_count() > self._free:
            name = next(n for n in reversed(self.reserved.values()) if not self.held(n))
            for rid in [r for r, n in self.reserved.items() if n == name]:
                self.unreserve(rid)
                picks.shed.append((rid, name))

    def release(self, rid: Hashable) -> int | None:
        """``rid`` lets go of its slot (a remove, or a rollback); returns the slot or None."""
        slot = self.holders.pop(rid, None)
        if slot is None:
            return None
        self.refcounts[slot] -= 1
        if self.refcounts[slot] == 0:
            self._free += 1
        return slot

    # -- an admit --------------------------------------------------------------------------
    def eviction_order(self) -> list[int]:
        """Unheld slots in the order misses take them: empty by index, then by (last_used, index)."""
        empty = [s for s in range(1, self.num_slots) if self.refcounts[s] == 0 and self.adapters[s] is None]
        used = [s for s in range(1, self.num_slots) if self.refcounts[s] == 0 and self.adapters[s] is not None]
        used.sort(key=lambda s: (self.last_used[s], s))
        return empty + used

    def begin_admit(self, rows: Sequence[tuple[Hashable, str]]) -> AdmitPicks:
        """Give hits their slots and fix the misses' victims.

        ``rows`` are ``(rid, adapter name)`` of the step's rows that hold no slot yet, in
        step order. Hits are held on return; misses are grouped by adapter and each waits
        for :meth:`finish_miss` (a miss whose read failed just never calls it).
        """
        picks = AdmitPicks()
        by_name: dict[str, list[Hashable]] = {}
        for rid, name in rows:
            if rid in self.holders:
                continue
            by_name.setdefault(name, []).append(rid)
        for name, rids in by_name.items():
            slot = self.entries.get(name)
            if slot is None:
                picks.misses.append(MissGroup(name, rids))
                continue
            picks.hits += [(rid, slot) for rid in self._take(name, rids, slot, picks)]
        if picks.misses:  # an admit of hits alone (a prefill of resident adapters) orders no slot
            picks.victims = self.eviction_order()[: len(picks.misses)]
        return picks

    def finish_miss(self, picks: AdmitPicks, miss: MissGroup, rids: Sequence[Hashable] | None = None
                    ) -> int | None:
        """Install ``miss.name`` in the admit's next victim and give it ``rids``; the slot or None.

        ``rids`` (default: the group's, at least one) are the rows still to take it. None when
        no victim is left: the rows are then refused (``picks.refused``) and nothing changes.
        """
        rids = list(miss.rids if rids is None else rids)
        if picks.next_victim >= len(picks.victims):
            for rid in rids:
                picks.refused[rid] = "every slot is held"
            return None
        slot = picks.victims[picks.next_victim]
        if self.refcounts[slot]:
            raise ValueError(f"victim slot {slot} was taken between begin_admit and finish_miss")
        picks.next_victim += 1
        old = self.adapters[slot]
        if old is not None and self.entries.get(old) == slot:
            del self.entries[old]
        self.adapters[slot] = miss.name
        self.entries[miss.name] = slot
        self._take(miss.name, rids, slot, picks)
        return slot

    def rollback(self, rids: Iterable[Hashable]) -> list[int]:
        """Undo an admit's takes: ``rids`` release the slots it gave them (returned, in order).
        Adapters the admit loaded stay resident, unheld (a cache). The reservations it spent
        stay spent: a rolled-back row holds nothing and asks again at admission."""
        return [s for s in map(self.release, rids) if s is not None]

    # -- unload ------------------------------------------------------------------------------
    def forget(self, name: str) -> int | None:
        """Drop ``name``'s name -> slot entry; the slot keeps its weights until reused."""
        slot = self.entries.get(name)
        if slot is not None and self.refcounts[slot]:
            raise ValueError(f"adapter {name!r}: slot {slot} is still held by {self.refcounts[slot]} request(s)")
        return self.entries.pop(name, None)

    # -- inspection ----------------------------------------------------------------------------
    def snapshot(self) -> SlotSnapshot:
        return SlotSnapshot(dict(self.entries), tuple(self.refcounts), tuple(self.adapters),
                            tuple(self.last_used), dict(self.holders), dict(self.reserved), self.clock)

    def check_valid(self) -> None:
        """Assert every invariant the table can see; raises AssertionError naming the broken one."""
        S = self.num_slots
        assert self.refcounts[0] == 0 and self.adapters[0] is None, "slot 0 is held or loaded (invariant 1)"
        assert 0 not in self.entries.values(), "slot 0 has a name (invariant 1)"
        counts = [0] * S
        for rid, s in self.holders.items():
            assert 1 <= s < S, f"request {rid!r} holds slot {s} (invariant 1)"
            counts[s] += 1
        assert counts == self.refcounts, f"refcounts {self.refcounts} != holders {counts} (invariant 2)"
        for name, s in self.entries.items():
            assert 1 <= s < S and self.adapters[s] == name, \
                f"name {name!r} -> slot {s} holding {self.adapters[s]!r} (invariant 3)"
        for s in range(1, S):
            if self.refcounts[s]:
                name = self.adapters[s]
                assert name is not None and self.entries.get(name) == s, \
                    f"held slot {s} has no served adapter (resident {name!r}) (invariants 3, 9)"
            assert NEVER <= self.last_used[s] <= self.clock, \
                f"slot {s} last_used {self.last_used[s]} outside [-1, clock {self.clock}] (invariant 4)"
        free = sum(1 for s in range(1, S) if self.refcounts[s] == 0)
        assert free == self._free, f"free count {self._free} != {free}"
        counts: dict[str, int] = {}
        for name in self.reserved.values():
            counts[name] = counts.get(name, 0) + 1
        assert counts == self._res_count, "reservation counts out of step"
        need = sum(1 for name in counts if not self.held(name))
        assert need <= free, f"reservations promise {need} slots but only {free} are free (invariant 6)"
        both = set(self.reserved) & set(self.holders)
        assert not both, f"requests {sorted(map(repr, both))} both hold a slot and keep a reservation (invariant 6)"
