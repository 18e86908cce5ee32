"""Several ranks of one tensor-parallel instance (the README's invariant 5), in the simulator.

Up to 4 ranks see the leader's admits in one order, but ingests and load/unload messages,
read completions and teardowns each in an interleaving of their own (a teardown always
between the same two admits). Every admit must make the same slot decisions on every rank
and leave equal slot tables; two planted faults (a rank deciding from its own read alone, a
victim rule that looks at what an unload forgot) show that a divergence is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 multiple, precondition, rule, run_state_machine_as_test)

import sim
from sim.pool import Copy, Reserve
from sim.slots import SimSlots
from sim.testing import hypothesis_settings


class MultiRankMachine(RuleBasedStateMachine):
    """One SimInstance of 1-4 ranks driven through random, per-rank interleaved histories."""

    instance_cls = sim.SimInstance
    adapters = Bundle("adapters")
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.inst = None
        self.rids = 0
        self.bad_reads: set = set()
        self.admits = 0

    @initialize(target=adapters, world=st.integers(1, 4), num_slots=st.integers(2, 4),
                names=st.integers(3, 6), data=st.data())
    def start(self, world, num_slots, names, data):
        pairs = st.tuples(st.integers(0, world - 1), st.integers(0, names - 1))
        self.bad_reads = {(r, f"a{i}") for r, i in data.draw(st.sets(pairs, max_size=2))}
        self.inst = self.instance_cls(num_slots, world,
                                      read_outcome=lambda r, a: (r, a) not in self.bad_reads)
        for i in range(names):
            self.inst.load_adapter(f"a{i}")
        return multiple(*(f"a{i}" for i in range(names)))

    def _ranks(self):
        return st.integers(0, self.inst.world_size - 1)

    @rule(target=requests, name=adapters, base=st.sampled_from([False] * 5 + [True]),
          leader_reads=st.sampled_from([True, True, False]))
    def ingest(self, name, base, leader_reads):
        rid = self.rids
        self.rids += 1
        name = None if base or name not in self.inst.served else name
        self.inst.ingest_request(rid, name)
        if leader_reads and name is not None:  # the leader takes it and its read lands now
            self.inst.deliver(0, len(self.inst.inbox[0]))
            self.inst.complete_read(0, name)
        return rid

    @precondition(lambda self: self.inst is not None)
    @rule(data=st.data(), count=st.integers(1, 4))
    def deliver(self, data, count):
        """One rank takes its next ingests and control messages, in its own time."""
        self.inst.deliver(data.draw(self._ranks()), count)

    @precondition(lambda self: self.inst is not None and any(p.pending_reads() for p in self.inst.ranks))
    @rule(data=st.data())
    def land_read(self, data):
        rank = data.draw(st.sampled_from([r for r, p in enumerate(self.inst.ranks) if p.pending_reads()]))
        name = data.draw(st.sampled_from(sorted(self.inst.ranks[rank].pending_reads())))
        assert self.inst.complete_read(rank, name)

    @precondition(lambda self: self.inst is not None and any(self.inst.teardowns))
    @rule(data=st.data())
    def land_teardown(self, data):
        rank = data.draw(st.sampled_from([r for r, q in enumerate(self.inst.teardowns) if q]))
        assert self.inst.land_teardown(rank) is not None

    @rule(name=adapters, leader_now=st.booleans())
    def unload(self, name, leader_now):
        self.inst.unload_adapter(name)
        if leader_now:  # the leader applies it at once, the followers whenever theirs arrives
            self.inst.deliver(0, len(self.inst.inbox[0]))

    @rule(name=adapters)
    def reload(self, name):
        if name not in self.inst.served and name not in self.inst.live.values():
            self.inst.load_adapter(name)

    @precondition(lambda self: self.inst is not None and self.inst.live)
    @rule(data=st.data(), rollback=st.sampled_from([False, False, False, True]))
    def step(self, data, rollback):
        """The leader reserves for what waits, then every rank admits the rows it let in."""
        ready = []
        for rid in data.draw(st.permutations(sorted(self.inst.live))):
            got = self.inst.reserve(rid)
            req = self.inst.leader.requests[rid]
            if got in (Reserve.GRANTED, Reserve.THROUGH) or req.reserved or req.slot is not None \
                    or not req.touches:
                ready.append(rid)
        if not ready:
            return
        rows = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        res = self.inst.admit(rows)  # raises DivergenceError if any rank decided otherwise
        self.admits += 1
        snaps = [p.snapshot() for p in self.inst.ranks]
        for s in snaps[1:]:
            assert (s.adapters, s.refcounts, s.last_used) == (snaps[0].adapters, snaps[0].refcounts,
                                                             snaps[0].last_used)
        for rid in res.failed:  # failed everywhere, on any rank's failed read
            a = self.inst.leader.requests[rid].adapter
            assert any((r, a) in self.bad_reads for r in range(self.inst.world_size))
        if rollback:
            self.inst.rollback_admit()
        else:
            self.inst.commit()

    @precondition(lambda self: self.inst is not None and self.inst.live)
    @rule(data=st.data(), rollback=st.sampled_from([False, False, True]))
    def admit_any(self, data, rollback):
        """The leader reserves for what waits, then admits rows it let in and rows it never
        asked for (unreserved admits): every rank still decides alike."""
        for rid in data.draw(st.permutations(sorted(self.inst.live))):
            self.inst.reserve(rid)
        rows = data.draw(st.lists(st.sampled_from(sorted(self.inst.live)), min_size=1, unique=True))
        self.inst.admit(rows)  # raises DivergenceError if any rank decided otherwise
        self.admits += 1
        if rollback:
            self.inst.rollback_admit()
        else:
            self.inst.commit()

    @precondition(lambda self: self.inst is not None and self.inst.leader.holders())
    @rule(count=st.integers(1, 3))
    def finish(self, count):
        for rid in sorted(self.inst.leader.holders())[:count]:
            if rid in self.inst.live:
                self.inst.remove_request(rid)

    @rule(rid=consumes(requests))
    def remove(self, rid):
        if rid in self.inst.live:
            self.inst.remove_request(rid)

    @invariant()
    def valid(self):
        if self.inst is not None:
            self.inst.check_valid()
            for p in self.inst.ranks[1:]:
                assert not any(r.reserved for r in p.requests.values())


SETTINGS = hypothesis_settings(max_examples=400, stateful_step_count=60)
TestMultiRank = MultiRankMachine.TestCase
TestMultiRank.settings = SETTINGS


# --------------------------------------------------------------------------------------------
# The machine can fail: two planted faults that make ranks diverge
# --------------------------------------------------------------------------------------------
class LocalReadsInstance(sim.SimInstance):
    """Planted fault: no agreement; each rank fails a miss only on its own failed read."""

    def admit(self, rids):
        rids = list(rids)
        self.land_before_admit(rids)
        results = []
        for r, pool in enumerate(self.ranks):
            for a in pool.pending_reads():
                self.complete_read(r, a)
            results.append(pool.admit(rids))
        self.seq += 1
        self._check_same(results, f"admit {self.seq}")
        return results[0]


_EVICTION_ORDER = SimSlots.eviction_order


def _forgotten_first_order(self):
    """Planted fault: a slot whose adapter an unload forgot counts as empty."""
    order = list(_EVICTION_ORDER(self))
    order.sort(key=lambda s: self.adapters[s] is not None and self.entries.get(self.adapters[s]) == s)
    return np.array(order, np.int64)


def _machine_fails(machine) -> bool:
    """Whether the machine finds a divergence (searching only: no shrinking, no database)."""
    try:
        run_state_machine_as_test(machine, settings=hypothesis_settings(
            max_examples=600, stateful_step_count=60, print_blob=False, database=None,
            phases=[Phase.generate]))
    except BaseException as e:  # noqa: BLE001  (one failure, or a group of distinct ones)
        found = e.exceptions if isinstance(e, BaseExceptionGroup) else (e,)
        return all(isinstance(x, sim.DivergenceError) for x in found)
    return False


def test_machine_catches_a_rank_that_decides_from_its_own_read():
    class Planted(MultiRankMachine):
        instance_cls = LocalReadsInstance

    assert _machine_fails(Planted)


def _unload_lag_history():
    """x then a take the two slots and end; c's request is ingested; a's unload reaches the
    leader (which forgets a) but not yet the follower; then c's request is admitted."""
    inst = sim.SimInstance(3, 2)
    for name in "xac":
        inst.load_adapter(name)
    for rid, name in enumerate("xa"):
        inst.ingest_request(rid, name)
        inst.deliver(0, 10)
        inst.complete_read(0, name)
        assert inst.reserve(rid) is Reserve.GRANTED
        inst.admit([rid])
        inst.commit()
        inst.remove_request(rid)
    inst.ingest_request(2, "c")
    inst.unload_adapter("a")
    inst.deliver(0, 10)
    inst.complete_read(0, "c")
    assert inst.reserve(2) is Reserve.GRANTED
    return inst, inst.admit([2])


def test_unload_timing_changes_no_decision():
    inst, res = _unload_lag_history()
    assert res.loads == (("c", 1, "x"),)  # the LRU slot on both ranks
    assert inst.ranks[0].slots.slot_of("a") is None and inst.ranks[1].slots.slot_of("a") == 2


def test_a_victim_rule_that_depends_on_unload_timing_diverges(monkeypatch):
    monkeypatch.setattr(SimSlots, "eviction_order", _forgotten_first_order)
    with pytest.raises(sim.DivergenceError):
        _unload_lag_history()


def test_follower_waits_for_its_copy_and_a_remote_failure_fails_everywhere():
    inst = sim.SimInstance(3, 2, read_outcome=lambda r, a: not (r == 1 and a == "b"))
    inst.load_adapter("a")
    inst.load_adapter("b")
    inst.ingest_request(0, "a")
    inst.ingest_request(1, "b")
    for rid in (0, 1):
        inst.deliver(0, 3)
    inst.complete_read(0, "a")
    inst.complete_read(0, "b")
    assert inst.reserve(0) is Reserve.GRANTED and inst.reserve(1) is Reserve.GRANTED
    # Rank 1 has not even ingested: it takes its messages, waits for its reads, and its
    # failed read of b fails row 1 on both ranks before any slot is handed out.
    res = inst.admit([0, 1])
    assert res.failed == (1,) and res.slots == ((0, 1),)
    assert [p.tier["b"] for p in inst.ranks] == [Copy.OK, Copy.FAILED]
    assert [p.slots.slot_of("b") for p in inst.ranks] == [None, None]
    assert np.array_equal(inst.ranks[0].slots.refcounts, inst.ranks[1].slots.refcounts)


def test_teardowns_land_between_the_same_two_admits():
    inst = sim.SimInstance(2, 2)
    inst.load_adapter("a")
    inst.load_adapter("b")
    inst.ingest_request(0, "a")
    for r in range(2):
        inst.deliver(r, 3)
        inst.complete_read(r, "a")
    inst.reserve(0)
    inst.admit([0])
    inst.commit()
    t = inst.remove_request(0)
    assert t.after_tp_seq == 1
    inst.land_teardown(0)  # rank 0 lands it now, rank 1 not yet
    assert inst.ranks[0].slots.refcounts[1] == 0 and inst.ranks[1].slots.refcounts[1] == 1
    inst.ingest_request(1, "b")
    inst.deliver(0, 1)
    inst.complete_read(0, "b")
    assert inst.reserve(1) is Reserve.GRANTED
    res = inst.admit([1])  # rank 1's teardown lands before this admit: same victim on both
    assert res.loads == (("b", 1, "a"),)
    with pytest.raises(sim.RequestStateError):
        inst.remove_request(0)
