"""The side-by-side suite catches bugs: each test plants one in the real pool's slot table and
runs the pool-vs-simulator state machine under it, which must fail.

The plants: a miss that may evict a held slot; a victim rule that picks the most recently
used slot; an admit that lets a miss evict an unheld adapter a later row of the same step
names (misses before hits). Each must be caught by the suite's own checks (its comparisons
with the simulator and the check_valid invariants), not by an exception from deeper down.
Each patch is undone after its test (monkeypatch). The control, the same machine on the
unpatched pool, is ``tests/test_stateful_pool.py::TestPoolVsSim`` itself.
"""

from __future__ import annotations

from hypothesis import Phase
from hypothesis.stateful import run_state_machine_as_test

from lora_cupy.slots import SlotTable
from sim.testing import hypothesis_settings
from tests.test_stateful_pool import PoolVsSimMachine

_BEGIN_ADMIT = SlotTable.begin_admit


def _suite_fails() -> list[BaseException]:
    """Run the machine (searching only: no shrinking, no example database); what it raised."""
    try:
        run_state_machine_as_test(PoolVsSimMachine, settings=hypothesis_settings(
            max_examples=400, stateful_step_count=60, database=None, print_blob=False,
            phases=[Phase.generate]))
    except BaseException as e:  # noqa: BLE001  (one failure, or a group of distinct ones)
        return list(e.exceptions) if isinstance(e, BaseExceptionGroup) else [e]
    return []


def _caught_by_the_suite(errors) -> bool:
    """Failures the suite's own checks raise (comparisons, check_valid): AssertionErrors."""
    return bool(errors) and all(isinstance(e, AssertionError) for e in errors)


def _evict_held(self, picks, miss, rids=None):
    """Planted: a miss takes the least recently used slot past 0, held or not (and nothing
    checks that its victim is unheld)."""
    rids = list(miss.rids if rids is None else rids)
    slot = min(range(1, self.num_slots), key=lambda s: (self.adapters[s] is not None, self.last_used[s], s))
    old = self.adapters[slot]
    if old is not None and self.entries.get(old) == slot:
        del self.entries[old]
    self.adapters[slot] = miss.name
    self.entries[miss.name] = slot
    self._take(miss.name, rids, slot, picks)
    return slot


def _most_recent_victims(self, exclude=()):
    """Planted: unheld slots holding weights are taken most recently used first."""
    skip = set(exclude)
    empty = [s for s in range(1, self.num_slots)
             if self.refcounts[s] == 0 and self.adapters[s] is None and s not in skip]
    used = [s for s in range(1, self.num_slots)
            if self.refcounts[s] == 0 and self.adapters[s] is not None and s not in skip]
    return empty + sorted(used, key=lambda s: (-self.last_used[s], s))


def _misses_before_hits(self, rows):
    """Planted: misses pick their victims from the table before the hits hold their slots, so
    an unheld adapter a later row names can be evicted (its row then misses as well)."""
    names = []
    for rid, name in rows:
        if rid not in self.holders and name not in names:
            names.append(name)
    misses = [n for n in names if n not in self.entries]
    for s in self.eviction_order()[: len(misses)]:
        victim = self.adapters[s]
        if victim is not None and self.entries.get(victim) == s and victim in names:
            del self.entries[victim]  # evicted by the miss: the later row no longer finds it
    return _BEGIN_ADMIT(self, rows)


def test_suite_catches_eviction_of_a_held_slot(monkeypatch):
    monkeypatch.setattr(SlotTable, "finish_miss", _evict_held)
    assert _caught_by_the_suite(_suite_fails())


def test_suite_catches_most_recently_used_victims(monkeypatch):
    monkeypatch.setattr(SlotTable, "eviction_order", _most_recent_victims)
    assert _caught_by_the_suite(_suite_fails())


def test_suite_catches_a_miss_evicting_a_later_rows_adapter(monkeypatch):
    monkeypatch.setattr(SlotTable, "begin_admit", _misses_before_hits)
    assert _caught_by_the_suite(_suite_fails())
