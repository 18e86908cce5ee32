"""The slot table: which adapter sits in which slot, who holds it, and which slot a miss takes.

Pure bookkeeping: no arrays, no locks, no I/O. The pool calls it under its lock; ``sim/``
restates the same rules independently and hypothesis compares the two through
:meth:`SlotTable.snapshot`. The rules (DESIGN.md invariants 1-9, as far as they are the table's):

- Slot 0 is the zero adapter: never handed out, never held, never resident.
- ``refcount[s]`` is the number of live requests holding ``s``; a request holds at most one
  slot (its adapter's), from the admit that first gives it one until it is released.
- The clock is logical: each :meth:`begin_admit` advances it by one (the pool's steady-state
  admit, where every row holds its slot already, does not call the table at all).
  ``last_use[s]`` is the clock when a row last took ``s`` and when its last holder released it.
- An admit gives rows whose adapter is resident their slot first (hits), so no miss can evict
  an unheld adapter a later row of the same admit names. Each adapter that misses then takes,
  in the order of its first row, the next of the admit's victims: the empty slots (never
  written) by index, then the unheld slots by ``(last_use, index)``. The victims are fixed
  from the table at :meth:`begin_admit`; a miss that fails (its read failed on some rank)
  takes none, so the next surviving miss gets the victim it would have had.
- Reservations count slots and pin none: ``sum(reserved) <= free`` always, where ``free`` is
  the number of unheld slots ``s >= 1``. A row that takes an unheld slot spends its
  reservation; a row without one may take an unheld slot only while another slot stays free
  for every reservation (the admit's backstop).
- :meth:`forget` drops a name -> slot entry (an unload); the slot keeps the weights, unheld,
  and ``resident`` keeps the stale name, until a miss reuses it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SlotSnapshot:
    """The whole table as plain data (for the simulator, tests and reports)."""

    slot_of: dict[str, int]  # adapter name -> slot (served, resident adapters)
    refcount: tuple[int, ...]  # [S] live requests holding each slot
    resident: tuple[str | None, ...]  # [S] the adapter whose weights a slot holds (None: empty)
    last_use: tuple[int, ...]  # [S] clock of the last take or release
    held: dict[Hashable, int]  # rid -> the slot it holds
    reserved: dict[Hashable, int]  # rid -> slots counted for it
    clock: int


@dataclass
class MissGroup:
    """One adapter that missed in an admit, with the rows that name it (in step order)."""

    name: str
    rids: list[Hashable]


@dataclass
class AdmitPicks:
    """What :meth:`SlotTable.begin_admit` decided: hits taken now, misses and their victims.

    ``victims[i]`` is the slot the ``i``-th surviving miss takes at :meth:`SlotTable.finish_miss`.
    ``refused`` maps rids to why they could take no slot (the backstop).
    """

    clock: int
    hits: list[tuple[Hashable, int]] = field(default_factory=list)
    misses: list[MissGroup] = field(default_factory=list)
    victims: list[int] = field(default_factory=list)
    refused: dict[Hashable, str] = field(default_factory=dict)
    next_victim: int = 0


class SlotTable:
    """Slot refcounts, residents, the LRU clock, name -> slot and per-request holds."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the zero adapter), got {num_slots}")
        self.num_slots = num_slots
        self.refcount = [0] * num_slots
        self.resident: list[str | None] = [None] * num_slots
        self.last_use = [0] * num_slots
        self.slot_of: dict[str, int] = {}
        self.held: dict[Hashable, int] = {}
        self.reserved: dict[Hashable, int] = {}
        self.clock = 0
        self._free = num_slots - 1  # unheld slots s >= 1
        self._reserved_total = 0

    # -- queries -------------------------------------------------------------------------
    def lookup(self, name: str) -> int | None:
        """The slot ``name`` is resident in, or None."""
        return self.slot_of.get(name)

    def held_slot(self, rid: Hashable) -> int | None:
        return self.held.get(rid)

    @property
    def free(self) -> int:
        """Unheld slots (slot 0 aside): what reservations may count against."""
        return self._free

    @property
    def reserved_total(self) -> int:
        return self._reserved_total

    def can_reserve(self, n: int = 1) -> bool:
        return self._reserved_total + n <= self._free

    # -- reservations ----------------------------------------------------------------------
    def reserve(self, rid: Hashable, n: int = 1) -> None:
        """Count ``n`` more slots for ``rid``; the caller checked :meth:`can_reserve`."""
        if not self.can_reserve(n):
            raise ValueError(f"reserving {n} for {rid!r} would promise more than {self._free} free slots")
        self.reserved[rid] = self.reserved.get(rid, 0) + n
        self._reserved_total += n

    def unreserve(self, rid: Hashable) -> int:
        """Drop ``rid``'s reservation; returns how many slots it counted."""
        n = self.reserved.pop(rid, 0)
        self._reserved_total -= n
        return n

    def _spend(self, rid: Hashable) -> bool:
        n = self.reserved.get(rid, 0)
        if not n:
            return False
        if n == 1:
            del self.reserved[rid]
        else:
            self.reserved[rid] = n - 1
        self._reserved_total -= 1
        return True

    # -- holds ---------------------------------------------------------------------------
    def _take(self, rids: Sequence[Hashable], slot: int) -> tuple[list[Hashable], list[Hashable]]:
        """Rows of one adapter take ``slot``; returns (taken, refused for want of a free slot).

        The first row to take an unheld slot pays with a reservation from the group if any
        row has one, else only if a slot stays free for every outstanding reservation.
        """
        taken: list[Hashable] = []
        if self.refcount[slot] == 0:
            payer = next((r for r in rids if self.reserved.get(r)), None)
            if payer is None and self._reserved_total >= self._free:
                return [], list(rids)
            if payer is not None:
                self._spend(payer)
            self._free -= 1
        for rid in rids:
            if rid in self.held:
                raise ValueError(f"request {rid!r} holds slot {self.held[rid]} already")
            if self.refcount[slot] and rid in self.reserved:
                self._spend(rid)  # its reservation is no longer needed: the slot is held
            self.refcount[slot] += 1
            self.held[rid] = slot
            taken.append(rid)
        self.last_use[slot] = self.clock
        return taken, []

    def release(self, rid: Hashable) -> int | None:
        """``rid`` lets go of its slot (a remove, or a rollback); returns the slot or None."""
        slot = self.held.pop(rid, None)
        if slot is None:
            return None
        self.refcount[slot] -= 1
        if self.refcount[slot] == 0:
            self._free += 1
            self.last_use[slot] = self.clock
        return slot

    # -- an admit --------------------------------------------------------------------------
    def victim_order(self, exclude: Iterable[int] = ()) -> list[int]:
        """Unheld slots in the order misses take them: empty by index, then by (last_use, index)."""
        skip = set(exclude)
        empty = [s for s in range(1, self.num_slots)
                 if self.refcount[s] == 0 and self.resident[s] is None and s not in skip]
        used = [s for s in range(1, self.num_slots)
                if self.refcount[s] == 0 and self.resident[s] is not None and s not in skip]
        used.sort(key=lambda s: (self.last_use[s], s))
        return empty + used

    def begin_admit(self, rows: Sequence[tuple[Hashable, str]]) -> AdmitPicks:
        """Advance the clock, give hits their slots and fix the misses' victims.

        ``rows`` are ``(rid, adapter name)`` of the step's rows that hold no slot yet, in
        step order. Hits are held on return; misses are grouped by adapter and wait for
        :meth:`finish_miss` or :meth:`drop_miss`.
        """
        self.clock += 1
        picks = AdmitPicks(clock=self.clock)
        by_name: dict[str, list[Hashable]] = {}
        for rid, name in rows:
            if rid in self.held:
                continue
            by_name.setdefault(name, []).append(rid)
        for name, rids in by_name.items():
            slot = self.slot_of.get(name)
            if slot is None:
                picks.misses.append(MissGroup(name, rids))
                continue
            taken, refused = self._take(rids, slot)
            picks.hits += [(rid, slot) for rid in taken]
            for rid in refused:
                picks.refused[rid] = "no free slot outside the reservations"
        picks.victims = self.victim_order()[: len(picks.misses)]
        return picks

    def finish_miss(self, picks: AdmitPicks, miss: MissGroup, rids: Sequence[Hashable] | None = None
                    ) -> int | None:
        """Install ``miss.name`` in the admit's next victim and give it ``rids``; the slot or None.

        ``rids`` (default: the group's) are the rows still to take it. None when no victim is
        left, or when the rows have no reservation and the free slots are all promised: the
        rows are then refused (``picks.refused``) and nothing changes.
        """
        rids = list(miss.rids if rids is None else rids)
        if picks.next_victim >= len(picks.victims):
            for rid in rids:
                picks.refused[rid] = "every slot is held"
            return None
        slot = picks.victims[picks.next_victim]
        if self.refcount[slot]:
            raise ValueError(f"victim slot {slot} was taken between begin_admit and finish_miss")
        has_payer = any(self.reserved.get(r) for r in rids)
        if not has_payer and self._reserved_total >= self._free:
            for rid in rids:
                picks.refused[rid] = "no free slot outside the reservations"
            return None
        picks.next_victim += 1
        old = self.resident[slot]
        if old is not None and self.slot_of.get(old) == slot:
            del self.slot_of[old]
        self.resident[slot] = miss.name
        self.slot_of[miss.name] = slot
        if rids:
            self._take(rids, slot)
        else:
            self.last_use[slot] = self.clock
        return slot

    def rollback(self, rids: Iterable[Hashable], reserved: Iterable[Hashable] = ()) -> list[Hashable]:
        """Undo an admit's takes: ``rids`` release their slots, then ``reserved`` get back the
        reservation their admit spent, while it fits (``sum(reserved) <= free``). Adapters
        the admit loaded stay resident, unheld (a cache). Returns the rids not re-reserved."""
        for rid in rids:
            self.release(rid)
        left = []
        for rid in reserved:
            if self.can_reserve():
                self.reserve(rid)
            else:
                left.append(rid)
        return left

    # -- unload ------------------------------------------------------------------------------
    def forget(self, name: str) -> int | None:
        """Drop ``name``'s name -> slot entry; the slot keeps its weights until reused."""
        slot = self.slot_of.get(name)
        if slot is not None and self.refcount[slot]:
            raise ValueError(f"adapter {name!r}: slot {slot} is still held by {self.refcount[slot]} request(s)")
        return self.slot_of.pop(name, None)

    # -- inspection ----------------------------------------------------------------------------
    def snapshot(self) -> SlotSnapshot:
        return SlotSnapshot(dict(self.slot_of), tuple(self.refcount), tuple(self.resident),
                            tuple(self.last_use), dict(self.held), dict(self.reserved), self.clock)

    def check_valid(self) -> None:
        """Assert every invariant the table can see; raises AssertionError naming the broken one."""
        S = self.num_slots
        assert self.refcount[0] == 0 and self.resident[0] is None, "slot 0 is held or loaded (invariant 1)"
        assert 0 not in self.slot_of.values(), "slot 0 has a name (invariant 1)"
        counts = [0] * S
        for rid, s in self.held.items():
            assert 1 <= s < S, f"request {rid!r} holds slot {s} (invariant 1)"
            counts[s] += 1
        assert counts == self.refcount, f"refcounts {self.refcount} != holders {counts} (invariant 2)"
        for name, s in self.slot_of.items():
            assert 1 <= s < S and self.resident[s] == name, \
                f"name {name!r} -> slot {s} holding {self.resident[s]!r} (invariant 3)"
        for s in range(1, S):
            if self.refcount[s]:
                name = self.resident[s]
                assert name is not None and self.slot_of.get(name) == s, \
                    f"held slot {s} has no served adapter (resident {name!r}) (invariants 3, 9)"
            assert 0 <= self.last_use[s] <= self.clock, f"slot {s} last_use {self.last_use[s]} > clock (invariant 4)"
        free = sum(1 for s in range(1, S) if self.refcount[s] == 0)
        assert free == self._free, f"free count {self._free} != {free}"
        total = sum(self.reserved.values())
        assert total == self._reserved_total, "reservation total out of step"
        assert all(n > 0 for n in self.reserved.values()), "an empty reservation is kept"
        assert total <= free, f"{total} slots reserved but only {free} free (invariant 6)"
        both = set(self.reserved) & set(self.held)
        assert not both, f"requests {sorted(map(repr, both))} both hold a slot and keep a reservation (invariant 6)"
