"""SimSlots: the slot table alone, with the victim rule, in NumPy.

What an admit decides from, and nothing else: which adapter's weights each slot holds,
each slot's refcount, the logical LRU clock with each slot's last-use stamp, and the
name -> slot entries. Slot 0 is the zero adapter and never appears in any of the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEVER = -1  # the stamp of a slot no admit has taken yet


@dataclass(frozen=True)
class SlotSnapshot:
    """Everything a decision can depend on, as plain values: equal snapshots, equal decisions.

    ``adapters[s]`` is the adapter whose weights slot ``s`` holds (None: empty), ``current[s]``
    whether that adapter's name -> slot entry still points at ``s`` (False once an unload
    forgot it), ``refcounts[s]`` and ``last_used[s]`` the slot's holders and stamp.
    """

    adapters: tuple[str | None, ...]
    current: tuple[bool, ...]
    refcounts: tuple[int, ...]
    last_used: tuple[int, ...]
    clock: int

    def eviction_order(self) -> tuple[int, ...]:
        """The unheld slots in the order misses take them: empty first, then least recently used."""
        return tuple(int(s) for s in eviction_order(np.array([a is None for a in self.adapters]),
                                                    np.array(self.refcounts), np.array(self.last_used)))


def eviction_order(empty: np.ndarray, refcounts: np.ndarray, last_used: np.ndarray) -> np.ndarray:
    """Unheld slots past 0 in the order misses take them.

    Empty slots first, lowest index first; then slots holding weights, oldest stamp first,
    ties (slots taken by one admit) broken by the lower index.
    """
    s = np.arange(refcounts.shape[0])  # [S]
    ok = (refcounts == 0) & (s > 0)
    cand = s[ok]
    # lexsort sorts by the last key first: emptiness, then stamp, then index.
    order = np.lexsort((cand, last_used[ok], ~empty[ok]))
    return cand[order]


class SimSlots:
    """The slot table of one pool: ``num_slots`` slots, slot 0 the zero adapter."""

    def __init__(self, num_slots: int):
        if int(num_slots) < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the zero adapter), got {num_slots}")
        self.num_slots = int(num_slots)
        self.adapters: list[str | None] = [None] * self.num_slots  # weights each slot holds
        self.refcounts = np.zeros(self.num_slots, np.int64)  # [S] live requests holding s
        self.last_used = np.full(self.num_slots, NEVER, np.int64)  # [S] clock of s's last take
        self.clock = 0
        self.entries: dict[str, int] = {}  # name -> slot

    # -- reading -------------------------------------------------------------------------------
    def slot_of(self, name: str) -> int | None:
        """The slot holding ``name``'s current weights, or None when it is resident nowhere."""
        return self.entries.get(name)

    def held(self, name: str) -> bool:
        """Whether ``name`` sits in a slot some live request holds (so it cannot be evicted)."""
        s = self.entries.get(name)
        return s is not None and self.refcounts[s] > 0

    def unheld_count(self) -> int:
        """Slots past 0 with refcount 0: what misses can take."""
        return int(np.count_nonzero(self.refcounts[1:] == 0))

    def held_count(self) -> int:
        return int(np.count_nonzero(self.refcounts[1:] > 0))

    def resident_count(self) -> int:
        """Adapters with a current name -> slot entry."""
        return len(self.entries)

    def eviction_order(self) -> np.ndarray:
        empty = np.array([a is None for a in self.adapters])
        return eviction_order(empty, self.refcounts, self.last_used)

    # -- changing ------------------------------------------------------------------------------
    def install(self, slot: int, name: str) -> str | None:
        """Load ``name`` into unheld ``slot``; returns the adapter whose weights it overwrote."""
        if slot <= 0 or self.refcounts[slot] != 0:
            raise ValueError(f"slot {slot} cannot be overwritten (refcount {self.refcounts[slot]})")
        old = self.adapters[slot]
        if old is not None and self.entries.get(old) == slot:
            del self.entries[old]
        self.adapters[slot] = name
        self.entries[name] = slot
        return old

    def take(self, slot: int) -> None:
        self.refcounts[slot] += 1

    def release(self, slot: int) -> None:
        if self.refcounts[slot] <= 0:
            raise ValueError(f"slot {slot} released with refcount {self.refcounts[slot]}")
        self.refcounts[slot] -= 1

    def tick(self) -> int:
        """Advance the logical clock (one admit that takes slots) and return its new value."""
        self.clock += 1
        return self.clock

    def stamp(self, slot: int) -> None:
        self.last_used[slot] = self.clock

    def forget(self, name: str) -> None:
        """Drop ``name``'s entry; its slot keeps the weights, unheld, until a miss reuses it."""
        self.entries.pop(name, None)

    def snapshot(self) -> SlotSnapshot:
        return SlotSnapshot(
            adapters=tuple(self.adapters),
            current=tuple(a is not None and self.entries.get(a) == s for s, a in enumerate(self.adapters)),
            refcounts=tuple(int(r) for r in self.refcounts),
            last_used=tuple(int(t) for t in self.last_used),
            clock=self.clock,
        )

    def check_valid(self) -> None:
        """The table's own invariants (AssertionError naming the broken one)."""
        assert self.adapters[0] is None, "slot 0 holds an adapter"
        assert self.refcounts[0] == 0, f"slot 0 has refcount {self.refcounts[0]}"
        assert (self.refcounts >= 0).all(), f"negative refcount: {self.refcounts.tolist()}"
        assert (self.last_used <= self.clock).all(), "a stamp is ahead of the clock"
        for name, s in self.entries.items():
            assert 0 < s < self.num_slots, f"{name!r} -> slot {s} out of range"
            assert self.adapters[s] == name, f"{name!r} -> slot {s}, which holds {self.adapters[s]!r}"
        for s in range(1, self.num_slots):
            if self.refcounts[s] > 0:
                assert self.adapters[s] is not None, f"held slot {s} is empty"
                assert self.entries.get(self.adapters[s]) == s, f"held slot {s} has no current entry"
