"""The runner's admission queue in front of the pool: FIFO, holding nothing, never over-promising."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from lora_cupy.engine.admission import AdmissionQueue
from lora_cupy.engine.resource import AdmitOutcome, LoraStep, Resource, StepContext
from lora_cupy.errors import LoraError
from lora_cupy.pool import LoraAdapterPool
from tests.pool_helpers import GatedReader, ingest, make_adapters, run_step, small_spec, wait_reads


class Pages:
    """A second resource (KV pages, say): ``capacity`` reservations at most."""

    decides = True
    force_double_buffer = False

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.reserved: set = set()

    def ingest_request(self, rid, overrides=None):
        pass

    def ask(self, rid, node_name, graph_walk):
        return None if rid in self.reserved else AdmitOutcome.ASKS

    def reserve(self, rid, node_name, graph_walk, published):
        if len(self.reserved) >= self.capacity:
            return 0
        self.reserved.add(rid)
        return 1

    def unreserve(self, rid):
        self.reserved.discard(rid)

    def admit(self, step, ctx):
        return AdmitOutcome.OK

    def plan(self, step, ctx):
        return None

    def commit(self, step, ctx):
        pass

    def rollback_admit(self, step, ctx):
        pass

    def remove_request(self, rid):
        self.reserved.discard(rid)


@pytest.fixture
def spec():
    return small_spec(num_slots=3)  # two adapter slots


@pytest.fixture
def paths(tmp_path, spec):
    return make_adapters(tmp_path, spec, 5, seed=int(np.random.default_rng().integers(1 << 30)))


@pytest.fixture
def pool(spec, paths):
    p = LoraAdapterPool(spec, adapters=paths)
    yield p
    p.close()


def open_all(pool, names):
    for rid, n in names.items():
        ingest(pool, rid, n)
    wait_reads(pool, {n for n in names.values() if n})


def test_protocol_is_met_by_the_pool_and_the_test_resource(pool):
    assert isinstance(pool, Resource) and isinstance(Pages(1), Resource)


def test_fifo_head_waits_and_nobody_overtakes_it(pool):
    open_all(pool, {"r1": "ad0", "r2": "ad1", "r3": "ad2", "r4": None})
    q = AdmissionQueue([pool])
    for rid in ("r1", "r2", "r3", "r4"):
        q.submit(rid, "llm")
    got = [g.rid for g in q.pump()]
    assert got == ["r1", "r2"]  # r3 needs a third slot; r4 (base) waits behind it
    assert [w.rid for w in q.waiting] == ["r3", "r4"] and "r3" not in pool.snapshot().reserved
    assert run_step(pool, ["r1", "r2"])[0].ok
    assert q.pump() == []  # both slots held
    pool.remove_request("r1")
    assert [g.rid for g in q.pump()] == ["r3", "r4"]
    assert run_step(pool, ["r2", "r3", "r4"])[0].ok
    pool.check_valid()


def test_a_waiting_request_holds_nothing(pool):
    open_all(pool, {"r1": "ad0", "r2": "ad1"})
    pages = Pages(capacity=1)
    q = AdmissionQueue([pool, pages])
    q.submit("r1", "llm")
    q.submit("r2", "llm")
    assert [g.rid for g in q.pump()] == ["r1"]
    # r2 got a slot counted by the pool, then no page: the count was given back
    assert pool.snapshot().reserved == {"r1": "ad0"} and pages.reserved == {"r1"}
    pages.remove_request("r1")
    assert [g.rid for g in q.pump()] == ["r2"]
    assert pool.snapshot().reserved == {"r1": "ad0", "r2": "ad1"}


def test_a_request_waits_for_its_read(spec, paths):
    reader = GatedReader()
    pool = LoraAdapterPool(spec, adapters=paths, reader=reader)
    try:
        reader.close("ad0")
        ingest(pool, "r", "ad0")
        q = AdmissionQueue([pool])
        q.submit("r", "llm")
        assert q.pump() == [] and len(q) == 1
        reader.open("ad0")
        wait_reads(pool, ["ad0"])
        assert [g.rid for g in q.pump()] == ["r"]
    finally:
        pool.close()


def test_a_failed_read_is_let_through_at_once_and_fails_at_admit(pool, paths):
    open_all(pool, {"r1": "ad0", "r2": "ad1"})
    shutil.rmtree(paths["ad2"])
    ingest(pool, "bad", "ad2")
    wait_reads(pool, ["ad2"])
    q = AdmissionQueue([pool])
    for rid in ("r1", "r2", "bad"):
        q.submit(rid, "llm")
    got = q.pump()
    assert [g.rid for g in got] == ["r1", "r2", "bad"]  # not held back by the full pool
    assert got[2].failed and isinstance(got[2].failed[pool], LoraError) and not got[0].failed
    out = pool.admit(LoraStep(["r1", "r2", "bad"]), StepContext())
    assert set(out.failed) == {"bad"}
    snap = pool.snapshot()
    assert set(snap.holders) == {"r1", "r2"}  # the counted rows found their slots
    pool.check_valid()


def test_reservations_never_promise_more_than_free_and_every_granted_row_admits(tmp_path):
    """A random workload through the queue: after every pump and step check_valid holds
    (need <= free among them), and no row the queue let through is refused a slot."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    spec = small_spec(num_slots=4, num_layers=1)
    names = make_adapters(tmp_path, spec, 7, seed=seed)
    pool = LoraAdapterPool(spec, adapters=names)
    try:
        q = AdmissionQueue([pool])
        running: dict[int, int] = {}  # rid -> steps left
        nxt = 0
        for seq in range(120):
            for _ in range(rng.randint(0, 3)):
                ingest(pool, nxt, rng.choice([None, *names]))
                q.submit(nxt, "llm")
                nxt += 1
            wait_reads(pool, names)
            for g in q.pump(limit=rng.randint(1, 6)):
                assert not g.failed, f"seed {seed}"
                running[g.rid] = rng.randint(1, 4)
            pool.check_valid()
            if running:
                out, _, _ = run_step(pool, sorted(running), seq=seq)
                assert out.ok, f"seed {seed}: a granted row was refused: {out.failed}"
            for rid in [r for r, left in running.items() if left <= 1]:
                pool.remove_request(rid)
                del running[rid]
            for rid in running:
                running[rid] -= 1
            pool.check_valid()
        assert pool.stats["loads"] > 3, f"seed {seed}: the workload never evicted"
    finally:
        pool.close()


def test_cancel_and_duplicate_submit(pool):
    open_all(pool, {"r1": "ad0"})
    q = AdmissionQueue([pool])
    q.submit("r1", "llm")
    with pytest.raises(ValueError, match="queued"):
        q.submit("r1", "llm")
    q.cancel("r1")
    assert len(q) == 0 and q.pump() == []


def test_node_order_refuses_a_wait_that_could_close_a_cycle(pool):
    open_all(pool, {"r1": None})
    q = AdmissionQueue([pool], node_order=("encoder", "llm"))
    q.submit("r1", "llm")
    assert [g.rid for g in q.pump()] == ["r1"] and q.holds("r1") == {"llm"}
    with pytest.raises(ValueError, match="cycle"):
        q.submit("r1", "encoder")  # holds an LLM slot: may not wait on the encoder
    with pytest.raises(ValueError, match="node order"):
        q.submit("r1", "audio")
