"""The real pool and the simulator, side by side, through the same random histories.

A Hypothesis ``RuleBasedStateMachine`` drives a ``LoraAdapterPool`` on the CPU device and a
``sim.SimPool`` with ingests (reads that land, fail, or stall on the reader thread), ask /
reserve, admits of reserved rows and of any rows (with and without failed reads), plan,
commit, rollback_admit, removes, runtime loads and unloads. After every rule it compares
every slot decision (ask and reserve answers, hits, loads, victims, failed and refused rows,
each row's planned slot) and the whole slot table (refcounts, residents, LRU stamps and
clock, name -> slot, holders, reservations), and runs both ``check_valid``s.

A second machine runs 2-4 real pools of one tensor-parallel instance (each admit on a thread
of its own, meeting in an ``agree`` all-reduce) under a ``sim.SimInstance``: ingests, control
messages, teardowns and reads land per rank in different interleavings, and every rank's
table must equal its simulated rank's, hence every other rank's, also when a rank's read
is still in flight at an admit and then fails.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 multiple, precondition, rule)

import sim
from lora_cupy.engine.resource import AdmitOutcome, LoraStep, ResourceReqConfig, StepContext
from lora_cupy.errors import AdapterFileError, AdapterNotFoundError, AdapterStateError, CapacityError
from lora_cupy.pool import LoraAdapterPool
from lora_cupy.store import FAILED, READING, READY
from sim.pool import Ask, Copy, Reserve
from sim.testing import hypothesis_settings, node_workloads
from tests.pool_helpers import SyntheticReader, small_spec

NODE = "llm"
TIMEOUT = 20.0
TOUCHES = [("qkv_proj", "o_proj"), ("o_proj",), ()]  # () : nothing for this pool
COPY_OF = {READY: Copy.OK, READING: Copy.PENDING, FAILED: Copy.FAILED}


class HarnessReader:
    """Synthetic weights read on the pool's reader thread; while ``gate`` is closed every
    read stalls there (so copies stay in flight); a name in ``fail_next`` fails its next read."""

    def __init__(self, inner):
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, path, spec, name=None):
        if not self.gate.wait(TIMEOUT):
            raise TimeoutError(f"read of {name!r}: gate never opened")
        with self._lock:
            fail = name in self.fail_next
            self.fail_next.discard(name)
        if fail:
            raise AdapterFileError("planted read failure", adapter=name, path=path)
        return self.inner(path, spec, name=name)


def real_ask(pool, rid):
    o = pool.ask(rid, NODE, (NODE,))
    if o is None:
        return None
    return "fail" if o.failed else "need" if o.asks else "ok"


def sim_ask(model, rid):
    a = model.ask(rid)
    return None if a is None else "fail" if a is Ask.FAIL else "need"


def real_reserve(pool, rid):
    return {1: "counted", 0: "wait", None: "none"}[pool.reserve(rid, NODE, (NODE,), False)]


def sim_reserve(model, rid):
    got = model.reserve(rid)
    if got is Reserve.NONE:
        return "counted" if model.requests[rid].reserved else "none"
    return {Reserve.GRANTED: "counted", Reserve.WAIT: "wait", Reserve.THROUGH: "none"}[got]


def planned_slots(addr, n: int) -> list[int]:
    """Each row's slot from a step's addressing (one token per row)."""
    order = np.asarray(addr.token_order)
    indptr = np.asarray(addr.slot_indptr)
    out = [-1] * n
    for s in range(len(indptr) - 1):
        for p in range(indptr[s], indptr[s + 1]):
            out[int(order[p])] = s
    return out


#: The slot table's fields, named alike in lora_cupy/slots.py and sim/slots.py.
TABLE_FIELDS = ("adapters", "current", "refcounts", "last_used", "clock")


def assert_same_table(pool, model, where: str = "") -> None:
    """The pool's slot table equals the model's, field by field, under the same names."""
    snap, ms = pool.snapshot(), model.snapshot()
    got = {k: getattr(snap, k) for k in TABLE_FIELDS}
    want = {k: getattr(ms, k) for k in TABLE_FIELDS}
    got.update(holders=snap.holders, reserved=set(snap.reserved))
    want.update(holders=model.holders(), reserved={rid for rid, r in model.requests.items() if r.reserved})
    for k in got:
        assert got[k] == want[k], f"{where}: {k}: pool {got[k]} != sim {want[k]}"


class PoolVsSimMachine(RuleBasedStateMachine):
    """One LoraAdapterPool (device "cpu") and one SimPool, driven alike and compared."""

    adapters = Bundle("adapters")
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.pool = None
        self.model = None
        self.rids = 0
        self.in_flight: list[tuple[str, bool, object]] = []  # reads stalled: (adapter, ok, entry)
        self.touches: dict[str, tuple] = {}
        self.loads = 0

    # -- set-up ---------------------------------------------------------------------------------
    @initialize(target=adapters, num_slots=st.integers(2, 5), data=st.data())
    def start(self, num_slots, data):
        n = data.draw(st.integers(3, 7), label="adapters")
        self.touches = {f"a{i}": data.draw(st.sampled_from(TOUCHES[:2] * 3 + TOUCHES[2:]),
                                           label=f"a{i} touches") for i in range(n)}
        self.ranks = {"a0": 1, "a1": 8, "a2": 20}  # the rest at the spec's maximum, 32
        self.reader = HarnessReader(SyntheticReader(self.touches, rank=self.ranks))
        self.pool = LoraAdapterPool(small_spec(num_slots=num_slots, max_rank=32), "cpu", reader=self.reader,
                                    adapters={a: f"synthetic/{a}" for a in self.touches})
        self.model = sim.SimPool(num_slots)
        for a, t in self.touches.items():
            self.model.load_adapter(a, touches=bool(t))
        return multiple(*self.touches)

    def teardown(self):
        if self.pool is not None:
            self.reader.gate.set()
            self.pool.close()

    # -- reads ----------------------------------------------------------------------------------
    def _land(self, name: str, ok: bool, entry) -> None:
        entry.wait(TIMEOUT)  # READY or FAILED; a copy dropped meanwhile just finishes
        self.reader.fail_next.discard(name)  # unused if its request went before the read ran
        if self.pool.store.get(name) is entry:
            self.model.complete_read(name, ok)
        else:  # only a dropped copy (its requests all removed) may land on no copy of the sim's
            assert entry.users <= 0, f"{name}: a copy still in use was replaced in the store"

    def _release_reads(self) -> None:
        """Open the gate: every stalled read lands, in the order the reader queued them."""
        self.reader.gate.set()
        for name, ok, entry in self.in_flight:
            self._land(name, ok, entry)
        self.in_flight.clear()

    @precondition(lambda self: self.pool is not None and self.reader.gate.is_set())
    @rule()
    def stall_reads(self):
        self.reader.gate.clear()

    @precondition(lambda self: self.pool is not None and not self.reader.gate.is_set())
    @rule()
    def release_reads(self):
        self._release_reads()

    # -- requests -------------------------------------------------------------------------------
    @rule(target=requests, name=adapters, base=st.sampled_from([False] * 5 + [True]),
          ok=st.sampled_from([True] * 7 + [False]))
    def ingest(self, name, base, ok):
        rid = self.rids
        self.rids += 1
        name = None if base else name
        if name is not None and not self.model.serves(name):
            with pytest.raises(AdapterNotFoundError):
                self.pool.ingest_request(rid, ResourceReqConfig(name))
            with pytest.raises(sim.UnknownAdapterError):
                self.model.ingest_request(rid, name)
            name = None
        starts = name is not None and bool(self.touches[name]) and self.pool.store.get(name) is None
        if starts and any(n == name for n, _, _ in self.in_flight):
            self._release_reads()  # one read per adapter in flight: outcomes stay paired
        if starts and not ok:
            self.reader.fail_next.add(name)
        self.pool.ingest_request(rid, ResourceReqConfig(name))
        assert self.model.ingest_request(rid, name) == starts
        if starts:
            entry = self.pool.store.get(name)
            if self.reader.gate.is_set():
                self._land(name, ok, entry)
            else:
                self.in_flight.append((name, ok, entry))
        return rid

    def _remove(self, rid) -> None:
        self.pool.remove_request(rid)
        self.model.remove_request(rid)
        assert_same_table(self.pool, self.model, f"remove {rid}")

    @precondition(lambda self: self.pool is not None and self.model.holders())
    @rule(count=st.integers(1, 3))
    def finish(self, count):
        """The oldest requests holding slots end (a wave of teardowns frees slots)."""
        for rid in sorted(self.model.holders())[:count]:
            self._remove(rid)

    @rule(rid=consumes(requests))
    def remove(self, rid):
        if rid in self.model.requests:
            self._remove(rid)

    # -- adapters -------------------------------------------------------------------------------
    @rule(name=adapters, now=st.sampled_from([True] + [False] * 4))
    def unload(self, name, now):
        if now:  # rarer than the rest, so adapters stay served long enough to matter
            assert self.pool.unload_adapter(name) == self.model.unload_adapter(name)
            assert_same_table(self.pool, self.model, f"unload {name}")

    @rule(name=adapters)
    def reload(self, name):
        if name in self.model.adapters:
            with pytest.raises(AdapterStateError):
                self.pool.load_adapter_async(name, f"synthetic/{name}")
            with pytest.raises(sim.AdapterStateError):
                self.model.load_adapter(name)
            return
        self._release_reads()  # the one reader thread reads loads behind queued copies
        self.pool.load_adapter_async(name, f"synthetic/{name}").result(TIMEOUT)
        self.model.load_adapter(name, touches=bool(self.touches[name]))

    # -- steps ----------------------------------------------------------------------------------
    def _ready(self) -> list:
        """Live rows the runner may put in a step: counted, let through, holding or needing nothing."""
        out = []
        for rid, r in self.model.requests.items():
            if not r.touches or r.slot is not None or r.reserved:
                out.append(rid)
            elif self.model.tier.get(r.adapter) is Copy.FAILED and self.model.slots.slot_of(r.adapter) is None:
                out.append(rid)
        return out

    def _check_rank_class(self, settled, addr, ctx) -> None:
        """Invariant 12: each row's slot carries its adapter's rank on the host, and the step's
        launch views the smallest class holding the largest (None: the pool's maximum, 32)."""
        most = 0
        for rid in settled:
            name = self.model.requests[rid].adapter
            want = self.ranks.get(name, 32) if name is not None and self.touches[name] else 0
            slot = self.pool._settled[rid]
            assert self.pool._slot_weights.slot_ranks[slot] == want, f"row {rid} ({name}) on slot {slot}"
            most = max(most, want)
        cls = None if most == 0 or most > 16 else 16
        assert addr.rank_bound == ctx.plan_results[self.pool].launch[1].rank_bound == cls, (settled, most)

    def _step(self, rows, finish: str) -> sim.AdmitResult:
        rows = list(rows)
        if any(self.model.tier.get(self.model.requests[r].adapter) is Copy.PENDING for r in rows):
            self._release_reads()  # a copy in flight: the admit would wait for it
        step, ctx = LoraStep(rows, node=NODE), StepContext()
        loads = self.pool.stats["loads"]
        out = self.pool.admit(step, ctx)
        res = self.model.admit(rows)
        refused = {r for r, e in out.failed.items() if isinstance(e, CapacityError)}
        failed = set(out.failed) - refused
        assert (failed, refused) == (set(res.failed), set(res.refused)), (
            f"admit {rows}: pool failed {failed} refused {refused}, sim {res}")
        assert self.pool.stats["loads"] - loads == len(res.loads), f"admit {rows}: loads differ ({res})"
        assert_same_table(self.pool, self.model, f"admit {rows}")
        settled = [r for r in rows if r not in out.failed]
        if settled:
            pstep = LoraStep(settled, node=NODE)
            addr = self.pool.plan(pstep, ctx)
            self.pool.device.synchronize()
            assert planned_slots(addr, len(settled)) == self.model.plan(settled).tolist(), f"plan {settled}"
            self._check_rank_class(settled, addr, ctx)
        if finish == "rollback":
            self.pool.rollback_admit(step, ctx)
            self.model.rollback_admit()
        else:
            self.pool.commit(step, ctx)
            self.model.commit()
        assert_same_table(self.pool, self.model, f"{finish} {rows}")
        for rid in res.failed:  # the runner fails them: the worker removes them
            self._remove(rid)
        return res

    @precondition(lambda self: self.pool is not None and self.model.requests)
    @rule(data=st.data(), finish=st.sampled_from(["commit"] * 3 + ["rollback"]))
    def step(self, data, finish):
        """The runner: ask / reserve every waiting request (random order), admit some ready rows."""
        for rid in data.draw(st.permutations(sorted(self.model.requests)), label="asked"):
            assert real_ask(self.pool, rid) == sim_ask(self.model, rid), f"ask {rid}"
            assert real_reserve(self.pool, rid) == sim_reserve(self.model, rid), f"reserve {rid}"
        ready = self._ready()
        if ready:
            rows = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True), label="rows")
            res = self._step(rows, finish)
            assert not res.refused, "a counted row was refused its slot (invariant 6)"

    @precondition(lambda self: self.pool is not None and self.model.requests)
    @rule(data=st.data(), finish=st.sampled_from(["commit", "rollback"]))
    def admit_any(self, data, finish):
        """Rows the runner never asked for: the backstop refuses what would break a promise."""
        rows = data.draw(st.lists(st.sampled_from(sorted(self.model.requests)), min_size=1, unique=True),
                         label="rows")
        self._step(rows, finish)

    @invariant()
    def valid(self):
        if self.pool is not None:
            self.pool.check_valid()
            self.model.check_valid()
            assert_same_table(self.pool, self.model, "invariant")
            for name, c in self.model.tier.items():
                e = self.pool.store.get(name)
                assert e is not None and COPY_OF[e.outcome()] is c, f"host copy of {name}"
            assert {n for n in self.touches if self.pool.store.get(n) is not None} == set(self.model.tier)


TestPoolVsSim = PoolVsSimMachine.TestCase
TestPoolVsSim.settings = hypothesis_settings(max_examples=500, stateful_step_count=60)


def test_the_outcome_vocabulary_is_the_pools():
    """The normalisation above reads the pool's own answers (a cheap guard on the mapping)."""
    assert AdmitOutcome.ASKS.asks and not AdmitOutcome.ASKS.failed
    assert AdmitOutcome.fail({1: ValueError()}).failed and not AdmitOutcome.OK.asks


# --------------------------------------------------------------------------------------------
# Several ranks: real pools under a SimInstance, messages and reads in per-rank interleavings
# --------------------------------------------------------------------------------------------
class BarrierAgree:
    """The instance's collective over per-miss read outcomes (all-reduce MAX) for pools whose
    admits run on one thread each."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=TIMEOUT)
        self.values: dict[int, np.ndarray] = {}

    def for_rank(self, rank: int):
        def agree(local: np.ndarray) -> np.ndarray:
            self.values[rank] = np.asarray(local)
            self.barrier.wait()
            out = np.max(np.stack([self.values[r] for r in range(self.world)]), axis=0)
            self.barrier.wait()
            return out
        return agree


def admit_on_every_rank(pools, rows, readers=()):
    """Each rank's admit on a thread of its own (they meet in ``agree``); the readers' gates
    open once the admits have started, so a rank whose copy is in flight waits for it."""
    steps = [(LoraStep(rows, node=NODE), StepContext()) for _ in pools]
    outs: list = [None] * len(pools)
    errs: list = [None] * len(pools)

    def run(r):
        try:
            outs[r] = pools[r].admit(*steps[r])
        except BaseException as e:  # noqa: BLE001  (re-raised on the test's thread)
            errs[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(pools))]
    for t in threads:
        t.start()
    for reader in readers:
        reader.gate.set()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "an admit never returned (ranks disagree on their misses?)"
    for e in errs:
        if e is not None:
            raise e
    return outs, steps


class MirroredInstance(sim.SimInstance):
    """A SimInstance that applies every message, teardown and admit to real pools as well."""

    def __init__(self, harness, num_slots, world):
        super().__init__(num_slots, world)
        self.h = harness

    def deliver(self, rank, count=1):
        done = 0
        while self.inbox[rank] and done < count:
            msg = self.inbox[rank][0]
            if msg[0] == "load":
                self.h.release(rank)  # the one reader thread reads loads behind queued copies
            super().deliver(rank, 1)
            self.h.apply(rank, msg)
            done += 1
        return done

    def land_teardown(self, rank):
        t = super().land_teardown(rank)
        if t is not None:
            self.h.pools[rank].remove_request(t.rid)
        return t

    def admit(self, rids):
        rids = list(rids)
        self.land_before_admit(rids)
        outs, steps = admit_on_every_rank(self.h.pools, rids, self.h.readers)
        for r in range(self.world_size):
            self.h.release(r)  # what the real ranks waited for has landed: mirror it
        res = super().admit(rids)
        self.h.steps = steps
        for r, out in enumerate(outs):
            refused = {k for k, e in out.failed.items() if isinstance(e, CapacityError)}
            assert (set(out.failed) - refused, refused) == (set(res.failed), set(res.refused)), (
                f"rank {r} admit {rids}: {out.failed} vs sim {res}")
        return res


class PoolRanksMachine(RuleBasedStateMachine):
    """2-4 real pools of one instance (rank 0 decides), driven under a MirroredInstance."""

    adapters = Bundle("adapters")
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.pools = []
        self.inst = None
        self.rids = 0
        self.fail_on: dict = {}  # rid -> ranks whose read of its adapter fails (if one starts)
        self.in_flight: list = []
        self.steps = None

    @initialize(target=adapters, world=st.integers(2, 4), num_slots=st.integers(2, 3),
                names=st.integers(3, 5))
    def start(self, world, num_slots, names):
        self.touches = {f"a{i}": TOUCHES[0] if i != 2 else TOUCHES[2] for i in range(names)}
        agree = BarrierAgree(world)
        self.readers = [HarnessReader(SyntheticReader(self.touches)) for _ in range(world)]
        self.pools = [LoraAdapterPool(small_spec(num_slots=num_slots), "cpu", rank=r, world_size=world,
                                      agree=agree.for_rank(r), decides=r == 0, reader=self.readers[r])
                      for r in range(world)]
        self.in_flight = [[] for _ in range(world)]
        self.inst = MirroredInstance(self, num_slots, world)
        for a in self.touches:
            self.inst.load_adapter(a, touches=bool(self.touches[a]))
        return multiple(*self.touches)

    def teardown(self):
        for r, p in enumerate(self.pools):
            self.readers[r].gate.set()
            p.close()

    # -- what the MirroredInstance calls ------------------------------------------------------
    def apply(self, rank, msg):
        pool, model = self.pools[rank], self.inst.ranks[rank]
        if msg[0] == "load":
            pool.load_adapter_async(msg[1], f"synthetic/{msg[1]}").result(TIMEOUT)
        elif msg[0] == "unload":
            pool.unload_adapter(msg[1])
        else:
            _, rid, name = msg
            starts = name is not None and bool(self.touches[name]) and pool.store.get(name) is None
            if starts and any(n == name for n, _, _ in self.in_flight[rank]):
                # One read per adapter in flight on a rank. The sim's copy started already:
                # land the old real one, then the new read starts below as usual.
                self.release(rank)
            gate_open = self.readers[rank].gate.is_set()
            fails = starts and rank in self.fail_on.get(rid, ())
            if fails:
                self.readers[rank].fail_next.add(name)
            pool.ingest_request(rid, ResourceReqConfig(name))
            if starts:
                entry = pool.store.get(name)
                if gate_open:
                    entry.wait(TIMEOUT)
                    self.readers[rank].fail_next.discard(name)
                    model.complete_read(name, not fails)
                else:
                    self.in_flight[rank].append((name, entry, not fails))

    def release(self, rank):
        """Open ``rank``'s gate: its stalled reads land, in the order its reader queued them."""
        self.readers[rank].gate.set()
        for name, entry, ok in self.in_flight[rank]:
            entry.wait(TIMEOUT)
            self.readers[rank].fail_next.discard(name)
            # A copy dropped meanwhile (its requests removed) finishes on no copy of the sim's:
            # the sim's copy of that name, if any, is a newer read's (an ingest after the removes).
            if self.pools[rank].store.get(name) is entry:
                self.inst.ranks[rank].complete_read(name, ok)
            else:
                assert entry.users <= 0, f"rank {rank}: {name}'s copy still in use was replaced in the store"
        self.in_flight[rank] = []

    # -- rules ---------------------------------------------------------------------------------
    def _ranks(self):
        return st.integers(0, len(self.pools) - 1)

    @rule(target=requests, names=st.lists(adapters, min_size=1, max_size=3),
          base=st.sampled_from([False] * 5 + [True]), data=st.data())
    def ingest(self, names, base, data):
        """The conductor sends 1-3 new requests to every rank; the leader may take them now."""
        rids = []
        for name in names:
            rid = self.rids
            self.rids += 1
            name = None if base or name not in self.inst.served else name
            self.fail_on[rid] = data.draw(st.sets(self._ranks(), max_size=1) | st.just(set()),
                                          label="fails on")
            self.inst.ingest_request(rid, name)
            rids.append(rid)
        if data.draw(st.booleans(), label="leader now"):
            self.inst.deliver(0, len(self.inst.inbox[0]))
        return multiple(*rids)

    @precondition(lambda self: self.inst is not None)
    @rule(data=st.data(), kind=st.sampled_from(["deliver", "deliver", "teardown", "stall", "release"]))
    def progress(self, data, kind):
        """One rank moves on alone: takes messages, lands a teardown, stalls or frees its reads."""
        rank = data.draw(self._ranks(), label="rank")
        if kind == "deliver":
            self.inst.deliver(rank, data.draw(st.integers(1, 4), label="count"))
        elif kind == "teardown":
            self.inst.land_teardown(rank)
        elif kind == "stall":
            self.readers[rank].gate.clear()
        else:
            self.release(rank)

    @rule(name=adapters, kind=st.sampled_from(["unload", "unload-leader-now", "reload"] + ["none"] * 3))
    def control(self, name, kind):
        """Runtime unload (the leader applying it at once, or not) and reload."""
        if kind.startswith("unload"):
            self.inst.unload_adapter(name)
            if kind == "unload-leader-now":
                self.inst.deliver(0, len(self.inst.inbox[0]))
        elif kind == "reload" and name not in self.inst.served and name not in self.inst.live.values():
            self.inst.load_adapter(name, touches=bool(self.touches[name]))

    @precondition(lambda self: self.inst is not None and self.inst.live)
    @rule(data=st.data(), finish=st.sampled_from(["commit"] * 3 + ["rollback"]))
    def step(self, data, finish):
        leader, model = self.pools[0], self.inst.leader
        ready = []
        for rid in data.draw(st.permutations(sorted(self.inst.live)), label="asked"):
            self.inst._deliver_until_ingested(0, rid)
            assert real_ask(leader, rid) == sim_ask(model, rid), f"ask {rid}"
            assert real_reserve(leader, rid) == sim_reserve(model, rid), f"reserve {rid}"
            r = model.requests[rid]
            if not r.touches or r.slot is not None or r.reserved or (
                    model.tier.get(r.adapter) is Copy.FAILED and model.slots.slot_of(r.adapter) is None):
                ready.append(rid)
        if not ready:
            return
        rows = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True), label="rows")
        res = self.inst.admit(rows)
        assert not res.refused
        self._finish(res, finish)

    @precondition(lambda self: self.inst is not None and self.inst.live)
    @rule(data=st.data(), finish=st.sampled_from(["commit", "commit", "rollback"]))
    def admit_any(self, data, finish):
        """The leader reserves for what waits, then admits rows it let in and rows it never
        asked for (unreserved admits): every rank still decides alike."""
        for rid in data.draw(st.permutations(sorted(self.inst.live)), label="asked"):
            self.inst._deliver_until_ingested(0, rid)
            assert real_reserve(self.pools[0], rid) == sim_reserve(self.inst.leader, rid), f"reserve {rid}"
        rows = data.draw(st.lists(st.sampled_from(sorted(self.inst.live)), min_size=1, unique=True),
                         label="rows")
        self._finish(self.inst.admit(rows), finish)

    def _finish(self, res, finish):
        for r, pool in enumerate(self.pools):
            if finish == "rollback":
                pool.rollback_admit(*self.steps[r])
            else:
                pool.commit(*self.steps[r])
        if finish == "rollback":
            self.inst.rollback_admit()
        else:
            self.inst.commit()
        for rid in res.failed:
            self.inst.remove_request(rid)

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
    def same_decisions(self):
        if self.inst is None:
            return
        self.inst.check_valid()
        for r, pool in enumerate(self.pools):
            pool.check_valid()
            assert_same_table(pool, self.inst.ranks[r], f"rank {r}")


TestPoolRanks = PoolRanksMachine.TestCase
TestPoolRanks.settings = hypothesis_settings(max_examples=300, stateful_step_count=50)


def test_a_follower_read_that_fails_after_the_agreement_fails_everywhere():
    """The seed: whether an adapter loaded is agreed across the instance before anything is
    installed. Here the follower's copy is still in flight at the agreement and then fails."""
    touches = {"a": TOUCHES[0]}
    agree = BarrierAgree(2)
    readers = [HarnessReader(SyntheticReader(touches)) for _ in range(2)]
    pools = [LoraAdapterPool(small_spec(num_slots=3), "cpu", rank=r, world_size=2, agree=agree.for_rank(r),
                             decides=r == 0, reader=readers[r], adapters={"a": "synthetic/a"})
             for r in range(2)]
    try:
        readers[1].gate.clear()
        readers[1].fail_next.add("a")
        for p in pools:
            p.ingest_request(0, ResourceReqConfig("a"))
        pools[0].store.get("a").wait(TIMEOUT)
        assert pools[0].reserve(0, NODE, (NODE,), False) == 1
        outs, _ = admit_on_every_rank(pools, [0], readers)
        assert set(outs[0].failed) == set(outs[1].failed) == {0}
        assert not isinstance(outs[0].failed[0], CapacityError)  # failed on the read, not refused
        snaps = [p.snapshot() for p in pools]
        assert snaps[0].refcounts == snaps[1].refcounts and not any(snaps[0].refcounts)
        assert snaps[0].adapters == snaps[1].adapters and "a" not in snaps[0].entries
    finally:
        for p in pools:
            p.close()


# --------------------------------------------------------------------------------------------
# Two real pools, a vision encoder's then the LLM's, under the simulator's runner
# --------------------------------------------------------------------------------------------
class RealNodePool:
    """A LoraAdapterPool of one node behind the calls ``sim.drain`` makes of a pool."""

    def __init__(self, node: str, num_slots: int, touches: dict):
        self.node = node
        self.pool = LoraAdapterPool(small_spec(num_slots=num_slots, node=node), "cpu",
                                    reader=SyntheticReader(touches),
                                    adapters={a: f"synthetic/{a}" for a in touches})
        self._step = None

    def ingest_request(self, rid, adapter) -> bool:
        self.pool.ingest_request(rid, ResourceReqConfig(adapter))
        e = self.pool.store.get(adapter) if adapter is not None else None
        if e is not None:
            e.wait(TIMEOUT)
        return False  # its read has landed already: nothing for the runner to complete

    def complete_read(self, name, ok=True) -> bool:
        return False

    def reserve(self, rid) -> Reserve:
        got = self.pool.reserve(rid, self.node, (self.node,), False)
        return {1: Reserve.GRANTED, 0: Reserve.WAIT, None: Reserve.NONE}[got]

    def admit(self, rids) -> None:
        step, ctx = LoraStep(rids, node=self.node), StepContext()
        out = self.pool.admit(step, ctx)
        assert out.ok, f"{self.node} admit {rids}: {out.failed}"
        self._step = (step, ctx)

    def commit(self) -> None:
        self.pool.commit(*self._step)

    def remove_request(self, rid) -> None:
        self.pool.remove_request(rid)

    def holders(self) -> dict:
        return self.pool.snapshot().holders

    def check_valid(self) -> None:
        self.pool.check_valid()


@given(workload=node_workloads(), rnd=st.randoms(use_true_random=False))
@hypothesis_settings(max_examples=40)
def test_real_encoder_and_llm_pools_drain(workload, rnd):
    """the README's invariant 11 on the real pools: taken encoder first, every history drains."""
    adapters, reqs, enc, llm = workload
    pools = {"encoder": RealNodePool("encoder", enc, {a.name: TOUCHES[0] if a.encoder else () for a in adapters}),
             "llm": RealNodePool("llm", llm, {a.name: TOUCHES[0] if a.llm else () for a in adapters})}
    try:
        res = sim.drain(reqs, adapters, encoder_slots=enc, llm_slots=llm, order="encoder-first",
                        shuffle=lambda xs: rnd.sample(xs, len(xs)), pools=pools)
        assert res.drained, f"stuck: {res.stuck}"
        assert sorted(res.completed) == sorted(r.rid for r in reqs)
        assert all(not p.holders() for p in pools.values())
    finally:
        for p in pools.values():
            p.pool.close()
