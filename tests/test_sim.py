"""The simulator on its own: the spec's slot decisions, checked from first principles.

A state machine drives one SimPool through random histories and checks every admit against
what seed 000 and the README's invariants 1-9 say it must do, from the state before it (not by
re-running the simulator's rule); unit tests pin the named cases; the two-pool drain, the
workload player, trace files and the CLI follow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 multiple, precondition, rule)

import sim
from sim.pool import Ask, Copy, Reserve
from sim.testing import hypothesis_settings, node_workloads

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# The spec's rules, checked against the state before each admit
# --------------------------------------------------------------------------------------------
def check_admit(before: sim.SlotSnapshot, holders_before: dict, pool: sim.SimPool, rows, res,
                tiers_before: dict) -> None:
    """What one admit must have done, from the table it started from."""
    after = pool.snapshot()
    entries_before = {a: s for s, a in enumerate(before.adapters) if a is not None and before.current[s]}
    # The adapters of the rows that run this step (a refused or failed row does not).
    step_adapters = {pool.requests[r].adapter for r in rows if pool.requests[r].adapter is not None
                     and r not in res.refused and r not in res.failed}
    new_rows = [r for r in rows if r not in holders_before and pool.requests[r].touches]
    taken = dict(res.slots)
    # Invariant 1: slot 0 is never handed out.
    assert 0 not in taken.values()
    # Invariant 2: a request that held a slot keeps it; rows new to a slot take their adapter's.
    for r in rows:
        if r in holders_before:
            assert r not in taken and pool.requests[r].slot == holders_before[r]
    for r in new_rows:
        a = pool.requests[r].adapter
        if r in res.refused:
            assert pool.requests[r].slot is None  # the backstop: refused rows take nothing
        elif r in res.failed:
            assert pool.requests[r].slot is None
            # Invariant 7: only a miss whose copy failed fails.
            assert a not in entries_before and tiers_before[a] is Copy.FAILED
        else:
            assert taken[r] == pool.slots.slot_of(a) and after.adapters[taken[r]] == a
    for r in res.hits:
        assert taken[r] == entries_before[pool.requests[r].adapter]
    loaded = [s for _, s, _ in res.loads]
    assert len(set(loaded)) == len(loaded)
    for a, s, old in res.loads:
        # Invariant 3: only an unheld slot is overwritten; what it held is reported.
        assert before.refcounts[s] == 0 and s > 0 and old == before.adapters[s]
        # Invariant 4, resident first: no miss evicts an adapter a row of this step names.
        assert old is None or not before.current[s] or old not in step_adapters
    # Invariant 4: empty slots first, then least recently used among the unheld, unnamed ones.
    hit_slots = {entries_before[pool.requests[r].adapter] for r in res.hits}
    spare = [s for s in range(1, len(before.adapters)) if before.refcounts[s] == 0
             and s not in hit_slots and s not in loaded]
    if any(before.adapters[s] is None for s in spare):
        assert all(before.adapters[s] is None for s in loaded), "a miss evicted while a slot was empty"
    for s in loaded:
        if before.adapters[s] is not None:
            older = [t for t in spare if before.adapters[t] is not None
                     and (before.last_used[t], t) < (before.last_used[s], s)]
            assert not older, f"slot {s} evicted while less recently used {older} stayed"
    # The clock moves by admits: every slot taken now carries the newest stamp.
    if taken:
        assert after.clock == before.clock + 1
        for s in taken.values():
            assert after.last_used[s] == after.clock
    else:
        assert after.clock == before.clock and after.last_used == before.last_used
    # Refcounts rise by exactly the rows that took a slot.
    delta = np.array(after.refcounts) - np.array(before.refcounts)
    want = np.bincount(list(taken.values()), minlength=len(delta)) if taken else np.zeros_like(delta)
    assert (delta == want).all()


class SimPoolMachine(RuleBasedStateMachine):
    """Random histories through one SimPool; every admit checked by ``check_admit``."""

    adapters = Bundle("adapters")
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.pool = None
        self.rids = 0

    @initialize(target=adapters, num_slots=st.integers(2, 4), names=st.integers(3, 7))
    def start(self, num_slots, names):
        self.pool = sim.SimPool(num_slots)
        for i in range(names):
            self.pool.load_adapter(f"a{i}", touches=i != 1)  # a1 has nothing for this pool
        return multiple(*(f"a{i}" for i in range(names)))

    @rule(name=adapters)
    def reload(self, name):
        if name in self.pool.adapters:
            with pytest.raises(sim.AdapterStateError):
                self.pool.load_adapter(name)
        else:
            self.pool.load_adapter(name)
            assert self.pool.slots.slot_of(name) is None  # stale weights are never a hit

    @rule(name=adapters)
    def unload(self, name):
        serving = self.pool.serves(name)
        named = self.pool.named(name)
        before = self.pool.snapshot()
        forgotten = self.pool.unload_adapter(name)
        assert forgotten == (serving and not named)
        if serving:
            # Invariant 9: new requests stop at once.
            with pytest.raises(sim.UnknownAdapterError):
                self.pool.ingest_request(("refused", self.rids), name)
        if forgotten:
            assert self.pool.slots.slot_of(name) is None and name not in self.pool.tier
        assert self.pool.snapshot().adapters == before.adapters  # the weights stay
        assert self.pool.snapshot().refcounts == before.refcounts

    @rule(target=requests, name=adapters, base=st.sampled_from([False] * 5 + [True]),
          land=st.sampled_from([True, True, True, False]))
    def ingest(self, name, base, land):
        if not base and not self.pool.serves(name):
            with pytest.raises(sim.UnknownAdapterError):
                self.pool.ingest_request(("refused", self.rids), name)
            base = True
        rid = self.rids
        self.rids += 1
        if self.pool.ingest_request(rid, None if base else name) and land:
            self.pool.complete_read(name, True)
        return rid

    @precondition(lambda self: self.pool is not None and self.pool.pending_reads())
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def land_read(self, data, ok):
        name = data.draw(st.sampled_from(sorted(self.pool.pending_reads())))
        assert self.pool.complete_read(name, ok)
        assert self.pool.tier[name] is (Copy.OK if ok else Copy.FAILED)

    def _reserve(self, rid):
        req = self.pool.requests[rid]
        asked = self.pool.ask(rid)
        got = self.pool.reserve(rid)
        needs = req.touches and req.slot is None
        if not needs:
            assert asked is None and got is Reserve.NONE
        elif got is Reserve.THROUGH:
            assert asked is Ask.FAIL and self.pool.slots.slot_of(req.adapter) is None
        elif got is Reserve.GRANTED:
            assert asked is Ask.NEED and req.reserved and self.pool.tier[req.adapter] is not Copy.PENDING
        elif got is Reserve.WAIT:
            full = len(self.pool.demand() | {req.adapter}) > self.pool.slots.unheld_count()
            assert self.pool.tier[req.adapter] is Copy.PENDING or full
        else:  # NONE for a row that needs a slot: only when it holds a reservation already
            assert req.reserved

    def _ready(self):
        """Live rows whose admit needs no wait: reserved, let through, holding or base."""
        out = []
        for rid, r in self.pool.requests.items():
            if not r.touches or r.slot is not None or r.reserved:
                out.append(rid)
            elif self.pool.tier.get(r.adapter) is Copy.FAILED and self.pool.slots.slot_of(r.adapter) is None:
                out.append(rid)
        return out

    def _finish(self, rows, res, before, rollback):
        if not rollback:
            self.pool.commit()
            return
        given = self.pool.rollback_admit()
        # Invariant 8: exactly the slots it took come back; what it loaded stays resident.
        assert sorted(given) == sorted(res.slots)
        assert self.pool.snapshot().refcounts == before.refcounts
        for a, s, _ in res.loads:
            assert self.pool.slots.slot_of(a) == s

    def _admit(self, rows, rollback):
        before = self.pool.snapshot()
        holders = self.pool.holders()
        tiers = dict(self.pool.tier)
        counted = {r.adapter for r in self.pool.requests.values() if r.reserved}
        res = self.pool.admit(rows)
        check_admit(before, holders, self.pool, rows, res, tiers)
        shed = counted - {r.adapter for r in self.pool.requests.values() if r.reserved} - {
            self.pool.requests[r].adapter for r, _ in res.slots}
        for rid in res.refused:
            # Only an uncounted row is refused (a counted one always finds its slot, unless an
            # uncounted take shed its promise), and only when no unheld slot is left.
            assert self.pool.requests[rid].adapter not in counted or shed
            assert not self.pool.requests[rid].reserved and not self.pool.slots.unheld_count()
        self._finish(rows, res, before, rollback)
        return res

    @precondition(lambda self: self.pool is not None and self.pool.requests)
    @rule(data=st.data(), rollback=st.sampled_from([False, False, False, True]))
    def step(self, data, rollback):
        """The runner's step: reserve what waits (in a random order), admit rows that may run."""
        for rid in data.draw(st.permutations(sorted(self.pool.requests))):
            self._reserve(rid)
        # Invariant 6: every reserved row finds a slot at its admit.
        ready = self._ready()
        if ready:
            res = self._admit(data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True)), rollback)
            assert not res.refused

    @precondition(lambda self: self.pool is not None and self.pool.requests)
    @rule(data=st.data(), rollback=st.booleans())
    def admit_any(self, data, rollback):
        """An admit of any rows, unreserved ones too: the backstop refuses only a miss that finds
        no unheld slot; promises an uncounted row broke are taken back (check_valid then shows
        every promise still made is kept)."""
        rows = data.draw(st.lists(st.sampled_from(sorted(self.pool.requests)), min_size=1, unique=True))
        before = self.pool.snapshot()
        try:
            self._admit(rows, rollback)
        except sim.ReadInFlightError:
            assert self.pool.snapshot() == before  # nothing changes

    @precondition(lambda self: self.pool is not None and self.pool.holders())
    @rule(count=st.integers(1, 3))
    def finish(self, count):
        """The oldest requests that hold slots end (a wave of teardowns frees slots)."""
        for rid in sorted(self.pool.holders())[:count]:
            self.remove(rid)

    @rule(rid=consumes(requests))
    def remove(self, rid):
        if rid not in self.pool.requests:  # finished already
            return
        req = self.pool.requests[rid]
        retiring = req.adapter is not None and not self.pool.serves(req.adapter)
        last = req.adapter is not None and sum(
            r.adapter == req.adapter for r in self.pool.requests.values()) == 1
        before = self.pool.snapshot()
        self.pool.remove_request(rid)
        after = self.pool.snapshot()
        if req.slot is not None:
            assert after.refcounts[req.slot] == before.refcounts[req.slot] - 1
        assert after.adapters == before.adapters  # a remove overwrites nothing
        if retiring and last:
            assert req.adapter not in self.pool.adapters and self.pool.slots.slot_of(req.adapter) is None

    @invariant()
    def valid(self):
        if self.pool is not None:
            self.pool.check_valid()


TestSimPoolMachine = SimPoolMachine.TestCase
TestSimPoolMachine.settings = hypothesis_settings(max_examples=500, stateful_step_count=60)


# --------------------------------------------------------------------------------------------
# Named cases
# --------------------------------------------------------------------------------------------
def _pool(num_slots, *names, decides=True):
    p = sim.SimPool(num_slots, decides=decides)
    for n in names:
        p.load_adapter(n)
    return p


def _run(p, rid, name, ok=True):
    """Ingest, read, reserve, admit and commit one request; returns the admit."""
    if p.ingest_request(rid, name):
        p.complete_read(name, ok)
    p.reserve(rid)
    res = p.admit([rid])
    p.commit()
    return res


def test_resident_first_spares_an_adapter_a_later_row_names():
    p = _pool(3, "x", "y", "z")
    _run(p, 1, "x")
    _run(p, 2, "y")
    p.remove_request(1)
    p.remove_request(2)
    # x is the least recently used unheld slot; a step [z (miss), x (hit)] must not evict it.
    for rid, name in ((3, "z"), (4, "x")):
        p.ingest_request(rid, name)
        p.complete_read(name)
    res = p.admit([3, 4])
    assert res.hits == (4,)
    assert [(a, old) for a, _, old in res.loads] == [("z", "y")]
    assert p.requests[4].slot == p.slots.slot_of("x")


def test_empty_slot_before_lru_and_lru_by_admits_not_time():
    p = _pool(4, "a", "b", "c", "d")
    slots = [_run(p, i, n).slots[0][1] for i, n in enumerate("ab")]
    assert slots == [1, 2]  # empty slots, lowest first
    for i in range(2):
        p.remove_request(i)
    _run(p, 10, "b")  # b used again: a is now the least recently used
    p.remove_request(10)
    assert _run(p, 11, "c").loads == (("c", 3, None),)  # slot 3 is still empty
    p.remove_request(11)
    assert _run(p, 12, "d").loads == (("d", 1, "a"),)


def test_reservations_never_promise_more_than_exist():
    p = _pool(3, "a", "b", "c")
    for rid, n in enumerate("abc"):
        p.ingest_request(rid, n)
        p.complete_read(n)
    assert [p.reserve(r) for r in range(3)] == [Reserve.GRANTED, Reserve.GRANTED, Reserve.WAIT]
    assert p.ask(0) is None  # holds a reservation already
    assert p.reserve(0) is Reserve.NONE
    p.ingest_request(9, "a")  # a second row on a reserved adapter needs no second slot
    assert p.reserve(9) is Reserve.GRANTED
    res = p.admit([0, 1, 9])
    assert {s for _, s in res.slots} == {1, 2}
    p.commit()
    assert p.reserve(2) is Reserve.WAIT
    p.remove_request(1)
    assert p.reserve(2) is Reserve.GRANTED


def test_reservation_pins_no_slot():
    p = _pool(3, "a", "b", "c")
    _run(p, 0, "a")
    _run(p, 1, "b")
    p.remove_request(0)
    p.remove_request(1)
    p.ingest_request(2, "a")
    p.complete_read("a")
    assert p.reserve(2) is Reserve.GRANTED  # a is resident, unheld: it counts like any other
    p.ingest_request(3, "c")
    p.complete_read("c")
    assert p.reserve(3) is Reserve.GRANTED
    res = p.admit([3])  # c takes the LRU slot, which is a's: reservations pin none
    assert res.loads == (("c", 1, "a"),)
    p.commit()
    assert p.admit([2]).loads == (("a", 2, "b"),)  # and the reserved row still finds one


def test_failed_read_fails_at_admit_before_any_slot():
    p = _pool(2, "bad", "good")
    p.ingest_request(0, "bad")
    p.complete_read("bad", ok=False)
    assert p.ask(0) is Ask.FAIL
    assert p.reserve(0) is Reserve.THROUGH  # let through at once, counting nothing
    p.ingest_request(1, "good")
    p.complete_read("good")
    assert p.reserve(1) is Reserve.GRANTED  # the one slot is still free for a counted row
    res = p.admit([0, 1])  # the failed row comes first and still takes nothing
    assert res.failed == (0,) and res.slots == ((1, 1),)
    assert p.requests[0].slot is None and p.plan([0, 1]).tolist() == [0, 1]


def test_failed_read_of_a_resident_adapter_runs_on_its_slot():
    p = _pool(2, "a")
    _run(p, 0, "a")
    p.remove_request(0)  # the copy goes, the slot keeps a
    p.ingest_request(1, "a")
    p.complete_read("a", ok=False)
    assert p.ask(1) is Ask.NEED and p.reserve(1) is Reserve.GRANTED
    res = p.admit([1])
    assert res.hits == (1,) and res.failed == ()


def test_rollback_gives_back_what_admit_took_and_keeps_the_cache():
    p = _pool(3, "a", "b")
    _run(p, 0, "a")
    before = p.snapshot().refcounts
    for rid, n in ((1, "a"), (2, "b")):
        p.ingest_request(rid, n)
        p.complete_read(n)
    res = p.admit([0, 1, 2])
    assert dict(res.slots) == {1: 1, 2: 2}
    assert sorted(p.rollback_admit()) == [(1, 1), (2, 2)]
    assert p.snapshot().refcounts == before and p.slots.slot_of("b") == 2
    assert p.admit([2]).hits == (2,)  # the loaded adapter stayed as a cache


def test_unload_forgets_at_last_remove_and_weights_stay():
    p = _pool(3, "a")
    _run(p, 0, "a")
    _run(p, 1, "a")
    assert p.unload_adapter("a") is False  # two live requests name it
    with pytest.raises(sim.UnknownAdapterError):
        p.ingest_request(2, "a")
    p.remove_request(0)
    assert p.slots.slot_of("a") == 1  # the last live request still runs on it
    p.remove_request(1)
    assert "a" not in p.adapters and p.slots.slot_of("a") is None and "a" not in p.tier
    assert p.slots.adapters[1] == "a"  # old weights, unheld, until reused
    p.load_adapter("a")  # reloaded: a miss, not a hit on the stale slot
    res = _run(p, 3, "a")
    assert res.hits == () and res.loads == (("a", 2, None),)  # empty slot 2 before stale slot 1
    assert p.unload_adapter("missing") is False


def test_follower_keeps_no_reservations():
    p = _pool(2, "a", decides=False)
    p.ingest_request(0, "a")
    p.complete_read("a")
    assert p.ask(0) is None and p.reserve(0) is Reserve.NONE
    assert p.admit([0]).loads == (("a", 1, None),)


def test_admit_backstop_reads_only_the_table_and_read_in_flight_changes_nothing():
    p = _pool(3, "a", "b", "c")
    _run(p, 0, "a")
    p.ingest_request(1, "b")
    with pytest.raises(sim.ReadInFlightError):
        p.admit([1])
    p.complete_read("b")
    assert p.reserve(1) is Reserve.GRANTED  # b is promised the one unheld slot
    p.ingest_request(2, "c")
    p.complete_read("c")
    res = p.admit([2])  # uncounted: it takes the slot anyway, and b's promise is taken back
    assert res.slots == ((2, 2),) and not res.refused and not p.requests[1].reserved
    p.check_valid()
    res = p.admit([1])  # b's row, no longer counted, finds no slot left
    assert res.refused == (1,) and res.slots == ()


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.booleans()), min_size=1, max_size=40),
       st.integers(2, 5))
@hypothesis_settings(max_examples=60)
def test_same_history_same_decisions(history, num_slots):
    """Invariant 5: decisions depend only on the history (two pools, one history), not on
    what else differs between ranks: the order adapters were loaded in, the request ids."""
    pools = [_pool(num_slots, *"abcdef"), _pool(num_slots, *"fedcba")]
    outs = [[], []]
    for k, p in enumerate(pools):
        live = []
        for i, (name, drop) in enumerate(history):
            rid = i if k == 0 else ("rank1", -i)
            if p.ingest_request(rid, name):
                p.complete_read(name)
            if p.reserve(rid) is Reserve.WAIT:
                for old in live:
                    p.remove_request(old)
                live = []
                p.reserve(rid)
            res = p.admit([rid])
            outs[k].append((res.loads, [s for _, s in res.slots], len(res.hits)))
            p.commit()
            live.append(rid)
            if drop:
                p.remove_request(live.pop(0))
    assert outs[0] == outs[1] and pools[0].snapshot() == pools[1].snapshot()


# --------------------------------------------------------------------------------------------
# Two pools: the encoder before the LLM never deadlocks (invariant 11)
# --------------------------------------------------------------------------------------------
@given(node_workloads(), st.randoms(use_true_random=False))
@hypothesis_settings(max_examples=200)
def test_encoder_before_llm_always_drains(workload, rnd):
    adapters, reqs, enc, llm = workload
    res = sim.drain(reqs, adapters, encoder_slots=enc, llm_slots=llm, order="encoder-first",
                    shuffle=lambda xs: rnd.sample(xs, len(xs)))
    assert res.drained, f"stuck: {res.stuck}"
    assert sorted(res.completed) == sorted(r.rid for r in reqs)


def test_encoder_after_llm_can_deadlock():
    """A walk that reaches the encoder while holding an LLM slot: the check above can fail."""
    adapters = [sim.NodeAdapter("x", True, True), sim.NodeAdapter("y", True, True)]
    reqs = [sim.NodeRequest(0, "x", True, 2, encoder_after_llm=True), sim.NodeRequest(1, "y", True, 2)]
    # Request 0 takes the LLM's one slot, request 1 the encoder's: each waits on the other.
    res = sim.drain(reqs, adapters, encoder_slots=2, llm_slots=2, order="as-walked")
    assert not res.drained and res.stuck == {0: "encoder", 1: "llm"}
    ok = sim.drain(reqs, adapters, encoder_slots=2, llm_slots=2, order="encoder-first")
    assert ok.drained and sorted(ok.completed) == [0, 1]


# --------------------------------------------------------------------------------------------
# The workload player
# --------------------------------------------------------------------------------------------
def _spaced_trace(names: list[str], gap: float) -> sim.Trace:
    uniq = sorted(set(names))
    idx = np.array([uniq.index(n) for n in names], np.int64)
    return sim.Trace(np.arange(len(names)) * gap, idx, np.ones(len(names), np.int64), tuple(uniq),
                     np.full(len(uniq), 8, np.int64))


@given(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=60), st.integers(1, 5))
@hypothesis_settings(max_examples=100)
def test_player_without_contention_is_an_lru_cache(names, usable):
    """Requests that never overlap: the hit count is that of an LRU cache of ``usable`` entries."""
    cfg = sim.PlayerConfig(num_slots=usable + 1, max_batch=4, step_time=0.01, read_base=0.0,
                           read_per_rank=0.0)
    res = sim.play(_spaced_trace(names, gap=0.05), cfg)
    cache: OrderedDict = OrderedDict()
    hits = evictions = 0
    for n in names:
        if n in cache:
            hits += 1
            cache.move_to_end(n)
        else:
            if len(cache) == usable:
                cache.popitem(last=False)
                evictions += 1
            cache[n] = True
    assert (res.hits, res.misses, res.evictions) == (hits, len(names) - hits, evictions)
    assert res.loads == res.misses
    assert (res.waits < cfg.step_time + 1e-12).all()  # nobody queued


def test_player_generated_trace_metrics_are_consistent():
    trace = sim.generate_trace(800, rate=40.0, num_adapters=24, zipf=1.1, seed=None,
                               rank_mix={8: 1, 64: 1}, base_fraction=0.1)
    small, big = sim.sweep_slots(trace, [3, 33], sim.PlayerConfig(max_batch=16))
    n_adapter = int((trace.adapter >= 0).sum())
    for r in (small, big):
        assert r.adapter_requests == n_adapter and r.requests == 800
        assert r.loads <= r.misses and r.evictions <= r.loads
        assert (r.waits >= 0).all() and r.p99_wait >= np.median(r.waits)
        assert (r.held <= r.config.num_slots - 1).all() and (r.resident <= r.config.num_slots - 1).all()
        assert (r.held <= r.resident).all() and (r.running <= 16).all()
    # 32 usable slots hold every one of 24 adapters: only cold misses, no eviction.
    assert big.evictions == 0 and big.loads == len(set(trace.adapter[trace.adapter >= 0].tolist()))
    assert small.evictions > 0 and small.mean_wait >= big.mean_wait


def test_player_progress_bar(capsys):
    trace = sim.generate_trace(50, rate=100.0, num_adapters=4, seed=None)
    sim.play(trace, progress=True)
    assert "playing trace" in capsys.readouterr().err


def test_trace_files_round_trip(tmp_path):
    trace = sim.generate_trace(40, rate=5.0, num_adapters=6, base_fraction=0.2, seed=None)
    for suffix in (".csv", ".json"):
        back = sim.read_trace(trace.write(tmp_path / f"t{suffix}"))
        assert np.allclose(back.arrival, trace.arrival)
        assert [back.adapter_name(i) for i in range(40)] == [trace.adapter_name(i) for i in range(40)]
        assert (back.tokens == trace.tokens).all()
        used = sorted(set(trace.adapter[trace.adapter >= 0].tolist()))
        assert dict(zip(back.adapters, back.ranks.tolist())) == {
            trace.adapters[k]: int(trace.ranks[k]) for k in used}


@pytest.mark.parametrize("text, match", [
    ("arrival,adapter\n0,a\n", "missing column"),
    ("arrival,adapter,tokens\n0,a,0\n", "line 2: tokens must be >= 1"),
    ("arrival,adapter,tokens\nsoon,a,3\n", "line 2: needs a number 'arrival'"),
    ("arrival,adapter,tokens,rank\n0,a,3,8\n1,a,3,16\n", "line 3: adapter 'a' has rank 16"),
    ("arrival,adapter,tokens\n", "no requests"),
])
def test_bad_csv_traces_name_file_line_and_reason(tmp_path, text, match):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(sim.TraceError, match=match) as e:
        sim.read_trace(f)
    assert str(f) in str(e.value)


def test_bad_json_and_missing_traces(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("{not json")
    with pytest.raises(sim.TraceError, match="not valid JSON"):
        sim.read_trace(f)
    f.write_text(json.dumps({"requests": [{"arrival": -1, "adapter": "a", "tokens": 2}]}))
    with pytest.raises(sim.TraceError, match="request 0: arrival must be"):
        sim.read_trace(f)
    with pytest.raises(sim.TraceError, match="cannot be read"):
        sim.read_trace(tmp_path / "nope.csv")
    with pytest.raises(sim.TraceError, match="rate"):
        sim.generate_trace(5, rate=0.0, num_adapters=2)
    with pytest.raises(sim.TraceError, match="rank mix"):
        sim.parse_rank_mix("8:x")
    with pytest.raises(sim.TraceError, match="num_slots"):
        sim.PlayerConfig(num_slots=1)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sim", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})


def test_cli_help_and_bad_arguments(tmp_path):
    out = _cli("--help", cwd=tmp_path)
    assert out.returncode == 0
    for opt in ("--trace", "--slots", "--zipf", "--rank-mix", "--admission", "--plot", "--json"):
        assert opt in out.stdout
    for bad, words in ((["--slots", "1"], "slot counts must be >= 2"),
                       (["--rate", "-3"], "must be a finite number > 0"),
                       (["--rank-mix", "8:"], "rank mix"),
                       (["--plot", "x.svg"], "must name a .png"),
                       (["--trace", "missing.csv"], "cannot be read")):
        res = _cli(*bad, cwd=tmp_path)
        assert res.returncode == 2 and words in res.stderr, (bad, res.stderr)


def test_cli_writes_plot_and_json(tmp_path):
    trace = sim.generate_trace(300, rate=30.0, num_adapters=10, seed=None)
    trace.write(tmp_path / "t.csv")
    res = _cli("--trace", "t.csv", "--slots", "3,5", "--plot", "p.png", "--json", "r.json",
               "--no-progress", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "r.json").read_text())
    direct = sim.play(sim.read_trace(tmp_path / "t.csv"), sim.PlayerConfig(num_slots=5))
    assert data["summary"]["hits"] == direct.hits and data["summary"]["evictions"] == direct.evictions
    assert [s["num_slots"] for s in data["sweep"]] == [3, 5]
    assert len(data["occupancy"]["held"]) == len(data["occupancy"]["time_s"]) > 0
    assert "hit_rate" in res.stdout and "p99_wait_s" in res.stdout


def test_sim_stands_alone():
    """``import sim`` (and a play) pulls in neither the library it models nor the plotting
    and test stacks: the model is an independent restatement."""
    code = ("import sys, sim; sim.play(sim.generate_trace(20, rate=5.0, num_adapters=3)); "
            "print(sorted(m for m in ('lora_cupy', 'matplotlib', 'hypothesis', 'torch', 'cupy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
