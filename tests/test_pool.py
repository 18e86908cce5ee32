"""LoraAdapterPool on the CPU device: every method of the seed's interface."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lora_cupy.addressing import group_by_slot
from lora_cupy.engine.resource import AdmitOutcome, EngineResourceInfo, LoraStep, StepContext
from lora_cupy.errors import LoraError
from lora_cupy.pool import LoraAdapterPool
from lora_cupy.store import FAILED, READING, READY, LoraAdapterStore
from tests.pool_helpers import (GatedReader, assert_slot_holds, check_delta, ingest, make_adapters,
                                reserve_all, run_step, small_spec, step_alone, wait_reads)


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.fixture
def spec():
    return small_spec(num_slots=4)


@pytest.fixture
def paths(tmp_path, spec, rng):
    return make_adapters(tmp_path, spec, 6, seed=int(rng.integers(1 << 30)))


@pytest.fixture
def pool(spec, paths):
    p = LoraAdapterPool(spec, "cpu", adapters=paths)
    yield p
    p.close()


def open_requests(pool, adapters):
    """Ingest one request per adapter name (None: base) as rids 0.., wait for their reads."""
    for rid, name in enumerate(adapters):
        ingest(pool, rid, name)
    wait_reads(pool, {a for a in adapters if a})
    return list(range(len(adapters)))


def test_build_serves_startup_adapters(spec, paths):
    pool = LoraAdapterPool.build(spec, EngineResourceInfo(device="cpu", adapters=paths))
    try:
        assert pool.served == frozenset(paths)
        assert isinstance(pool.store, LoraAdapterStore) and pool.store.nbytes == 0  # loads are not kept
        assert pool.decides and pool.force_double_buffer
        info = pool.adapter_info("ad0")
        assert info.path == paths["ad0"] and info.targets == {"qkv_proj", "o_proj"}
        assert pool.adapter_info("ad2").targets == {"qkv_proj", "o_proj"}  # q_proj lives in qkv_proj
    finally:
        pool.close()


def test_ingest_starts_the_read_and_remove_releases_it(pool):
    ingest(pool, "r", "ad1")
    e = pool.store.get("ad1")
    assert e is not None and e.users == 1
    e.wait(10)
    assert pool.store.nbytes > 0
    pool.remove_request("r")
    assert pool.store.get("ad1") is None and pool.store.nbytes == 0
    pool.remove_request("r")  # twice: a no-op
    pool.check_valid()


def test_base_requests_need_nothing(pool):
    ingest(pool, "b", None)
    assert pool.ask("b", "llm", ("llm",)) is None
    assert pool.reserve("b", "llm", ("llm",), False) is None
    assert not pool.runs_adapters(["b"])
    out, addr, _ = run_step(pool, ["b"])
    assert out.ok and not addr.active
    assert pool.store.nbytes == 0 and not any(pool.snapshot().refcounts)


def test_ask_and_reserve_follow_the_read(spec, paths):
    reader = GatedReader()
    pool = LoraAdapterPool(spec, adapters=paths, reader=reader)
    try:
        reader.close("ad0")
        ingest(pool, "r", "ad0")
        assert pool.ask("r", "llm", ("llm",)) is AdmitOutcome.ASKS
        assert pool.reserve("r", "llm", ("llm",), False) == 0  # its copy is not in yet
        assert pool.ask("r", "other-node", ("other-node",)) is None
        reader.open("ad0")
        wait_reads(pool, ["ad0"])
        assert pool.reserve("r", "llm", ("llm",), False) == 1
        assert pool.snapshot().reserved == {"r": "ad0"}
        assert pool.ask("r", "llm", ("llm",)) is None  # holds a reservation
        pool.unreserve("r")
        assert pool.snapshot().reserved == {}
        pool.check_valid()
    finally:
        pool.close()


def test_admit_loads_misses_and_rows_get_correct_deltas(pool, rng):
    names = ["ad0", "ad1", None, "ad0", "ad2"]
    rids = open_requests(pool, names)
    assert all(v in (1, None) for v in reserve_all(pool, rids).values())
    tokens = rng.integers(1, 5, len(rids))
    out, addr, _ = run_step(pool, rids, tokens)
    assert out.ok and addr.active
    snap = pool.snapshot()
    assert snap.holders[0] == snap.holders[3] == snap.entries["ad0"]
    assert 2 not in snap.holders and not snap.reserved
    for name in ("ad0", "ad1", "ad2"):
        assert_slot_holds(pool, snap.entries[name], name)
    check_delta(pool, rids, tokens, rng)
    pool.check_valid()


def test_steady_state_admit_is_a_set_check(pool):
    rids = open_requests(pool, ["ad0", "ad1"])
    reserve_all(pool, rids)
    run_step(pool, rids)
    clock = pool.snapshot().clock
    calls = []
    pool.slots.begin_admit = lambda rows: calls.append(rows)  # would be called on any miss/hit
    ctx = StepContext()
    assert pool.admit(LoraStep(rids), ctx) is AdmitOutcome.OK
    assert not calls and pool.snapshot().clock == clock and pool not in ctx.state


def test_plan_groups_rows_by_slot(pool, rng):
    names = ["ad1", None, "ad0", "ad1", "ad2", None, "ad0"]
    rids = open_requests(pool, names)
    reserve_all(pool, rids)
    tokens = rng.integers(1, 6, len(rids))
    step = LoraStep(rids, tokens)
    ctx = StepContext(seq=3)
    assert pool.admit(step, ctx).ok
    addr = pool.plan(step, ctx)
    assert ctx.plan_results[pool].addressing[1] is addr and pool.addressing(1) is addr
    pool.device.synchronize()
    row_slots = np.repeat([pool._settled[r] for r in rids], tokens)
    want_order, want_indptr = group_by_slot(row_slots, pool.spec.num_slots)
    np.testing.assert_array_equal(np.asarray(addr.token_order), want_order)
    np.testing.assert_array_equal(np.asarray(addr.slot_indptr), want_indptr)
    assert addr.num_tokens == tokens.sum()
    # views of the fixed per-bucket device buffer
    views = ctx.plan_results[pool].launch[1]
    assert views.bucket == pool.spec.bucket_for(int(tokens.sum())) and len(views.token_order) == views.bucket
    buf = pool._planner.buffers[1].dev[(views.bucket, views.parity)]
    assert np.shares_memory(addr.token_order, buf) and np.shares_memory(addr.slot_indptr, buf)
    assert np.shares_memory(views.token_order, buf) and views.slot_indptr is addr.slot_indptr


def test_plan_double_buffers_so_the_next_plan_never_overwrites_this_one(pool, rng):
    rids = open_requests(pool, ["ad0", "ad1", None])
    reserve_all(pool, rids)
    s1, c1 = LoraStep(rids, [2, 3, 1]), StepContext(seq=1)
    pool.admit(s1, c1)
    a1 = pool.plan(s1, c1)
    pool.device.synchronize()
    first = (np.array(a1.token_order), np.array(a1.slot_indptr))
    s2, c2 = LoraStep([rids[2], rids[1], rids[0]], [1, 1, 2]), StepContext(seq=2)
    pool.admit(s2, c2)
    a2 = pool.plan(s2, c2)
    pool.device.synchronize()
    assert not np.shares_memory(a1.slot_indptr, a2.slot_indptr)
    np.testing.assert_array_equal(np.asarray(a1.token_order), first[0])
    np.testing.assert_array_equal(np.asarray(a1.slot_indptr), first[1])


def test_preplanned_step_becomes_current_when_activated(pool):
    rids = open_requests(pool, ["ad0"])
    reserve_all(pool, rids)
    run_step(pool, rids)
    ctx = StepContext(seq=9, preplanned=True)
    step = LoraStep(rids, [3])
    pool.admit(step, ctx)
    current = pool.current_plan()
    pool.plan(step, ctx)
    assert pool.current_plan() is current  # still the running step
    pool.activate(ctx)
    assert pool.current_plan() is ctx.plan_results[pool] and pool.addressing().num_tokens == 3


def test_addressing_for_grouped_rows(tmp_path, rng):
    spec = small_spec(num_slots=4, row_grouping=4)
    paths = make_adapters(tmp_path, spec, 3, seed=int(rng.integers(1 << 30)))
    pool = LoraAdapterPool(spec, adapters=paths)
    try:
        rids = open_requests(pool, ["ad0", None, "ad1", "ad0"])
        reserve_all(pool, rids)
        tokens = np.array([5, 1, 8, 3])
        out, addr, _ = run_step(pool, rids, tokens)
        assert out.ok
        g = pool.addressing(4)
        pool.device.synchronize()
        rows_per = (tokens + 3) // 4  # one row per 4 tokens, at least one per segment
        want_order, want_indptr = group_by_slot(np.repeat([pool._settled[r] for r in rids], rows_per),
                                                spec.num_slots)
        np.testing.assert_array_equal(np.asarray(g.token_order), want_order)
        np.testing.assert_array_equal(np.asarray(g.slot_indptr), want_indptr)
        assert addr.num_tokens == tokens.sum() and g.num_tokens == rows_per.sum()
        check_delta(pool, rids, tokens, rng)  # o_proj runs on the grouped rows
        with pytest.raises(ValueError):
            pool.addressing(3)
    finally:
        pool.close()


def test_commit_records_consumption(pool):
    rids = open_requests(pool, ["ad0", None])
    reserve_all(pool, rids)
    run_step(pool, rids, [4, 2])
    assert pool.stats["steps"] == 1 and pool.stats["tokens"] == 6 and pool.stats["rows"] == 2


def test_rollback_admit_gives_back_exactly_what_admit_took(pool):
    rids = open_requests(pool, ["ad0", "ad1", "ad0"])
    reserve_all(pool, rids[:1])
    run_step(pool, rids[:1])  # rid 0 holds ad0's slot before the step
    reserve_all(pool, rids[1:])
    step, ctx = LoraStep(rids), StepContext()
    assert pool.admit(step, ctx).ok
    slot_ad1 = pool.snapshot().entries["ad1"]
    pool.rollback_admit(step, ctx)
    snap = pool.snapshot()
    assert snap.holders == {0: snap.entries["ad0"]}  # only what the step took went back
    assert snap.entries["ad1"] == slot_ad1 and snap.refcounts[slot_ad1] == 0  # a cache
    assert_slot_holds(pool, slot_ad1, "ad1")
    assert pool.ask(1, "llm", ("llm",)) is AdmitOutcome.ASKS  # asks again
    pool.rollback_admit(step, ctx)  # a second rollback: nothing
    assert pool.snapshot().holders == snap.holders
    pool.check_valid()


def test_remove_request_gives_the_slot_back(pool):
    rids = open_requests(pool, ["ad0", "ad0"])
    reserve_all(pool, rids)
    run_step(pool, rids)
    s = pool.snapshot().entries["ad0"]
    pool.remove_request(0)
    assert pool.snapshot().refcounts[s] == 1
    pool.remove_request(1)
    assert pool.snapshot().refcounts[s] == 0 and pool.snapshot().entries["ad0"] == s
    pool.check_valid()


def test_lru_eviction_reuses_slots_with_the_new_weights(pool, rng):
    # 3 slots, 5 adapters in turn: every slot is evicted and rewritten
    order = ["ad0", "ad1", "ad2", "ad3", "ad4", "ad0", "ad2"]
    for k, name in enumerate(order):
        s = step_alone(pool, k, name, 2, seq=k)
        assert_slot_holds(pool, s, name)
        check_delta(pool, [k], [2], rng)
        pool.remove_request(k)
    assert pool.stats["loads"] >= 6
    pool.check_valid()


def test_runs_adapters_only_for_adapters_touching_this_pool(tmp_path, rng):
    spec = small_spec()
    from tests.pool_helpers import SyntheticReader

    reader = SyntheticReader({"qkv_only": ["qkv_proj"], "elsewhere": ["vision_proj"]})
    pool = LoraAdapterPool(spec, adapters={"qkv_only": "x", "elsewhere": "y"}, reader=reader)
    try:
        ingest(pool, 1, "qkv_only")
        ingest(pool, 2, "elsewhere")
        ingest(pool, 3, None)
        assert pool.runs_adapters([1]) and pool.runs_adapters([3, 1])
        assert not pool.runs_adapters([2, 3])
        assert pool.adapter_info("elsewhere").targets == frozenset()
        assert pool.ask(2, "llm", ("llm",)) is None and pool.store.get("elsewhere") is None
        wait_reads(pool, ["qkv_only"])
        reserve_all(pool, [1])
        out, addr, _ = run_step(pool, [1, 2, 3])
        assert out.ok and pool.snapshot().holders == {1: 1}
        s = pool.snapshot().holders[1]
        assert pool.layer_ranks("o_proj", 0)[s] == 0 and pool.layer_ranks("qkv_proj", 0)[s] == spec.max_rank
        check_delta(pool, [1, 2, 3], None, rng)
    finally:
        pool.close()


class SpyBackend:
    name = "spy"

    def __init__(self):
        from lora_cupy.backends.reference import ReferenceBackend

        self.inner, self.calls = ReferenceBackend(), 0

    def delta(self, *args):
        self.calls += 1
        self.inner.delta(*args)

    def prepare(self, w):
        launch = self.inner.prepare(w)

        def run(y, x, views, rows):
            self.calls += 1
            launch(y, x, views, rows)

        return run


def test_layer_delta_skips_the_backend_without_adapter_rows(spec, paths, rng):
    spy = SpyBackend()
    pool = LoraAdapterPool(spec, backend=spy, adapters=paths)
    try:
        rids = open_requests(pool, [None, None, "ad0"])
        d = pool.layer_delta("o_proj", 1)
        assert d is pool.layer_delta("o_proj", 1)  # resolved once
        x = rng.standard_normal((2, 32)).astype(np.float32)
        y = rng.standard_normal((2, 32)).astype(np.float32)
        y0 = y.copy()
        assert d(y, x) is y and spy.calls == 0  # no step planned yet
        run_step(pool, rids[:2])
        assert not pool.active
        d(y, x)
        assert spy.calls == 0 and np.array_equal(y, y0)
        reserve_all(pool, rids)
        run_step(pool, rids)
        assert pool.active
        y3 = rng.standard_normal((3, 32)).astype(np.float32)
        d(y3, rng.standard_normal((3, 32)).astype(np.float32))
        assert spy.calls == 1
        with pytest.raises(ValueError):
            d(y3[:2], x)  # fewer rows than the step addresses
        with pytest.raises(ValueError):
            d(rng.standard_normal((3, 48)).astype(np.float32), rng.standard_normal((3, 32)).astype(np.float32))
    finally:
        pool.close()


def test_base_only_adds_nothing_on_this_thread_only(pool, rng):
    rids = open_requests(pool, ["ad0"])
    reserve_all(pool, rids)
    run_step(pool, rids, [2])
    d = pool.layer_delta("qkv_proj", 0)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    y = rng.standard_normal((2, 48)).astype(np.float32)
    y0 = y.copy()
    seen = []
    with pool.base_only():
        d(y, x)
        assert np.array_equal(y, y0) and not pool.active
        t = threading.Thread(target=lambda: seen.append(pool.active))
        t.start(), t.join()
    assert seen == [True]
    d(y, x)
    assert not np.array_equal(y, y0)


def test_layer_ranks_follow_the_resident_adapters(pool):
    rids = open_requests(pool, ["ad0", "ad2"])
    reserve_all(pool, rids)
    run_step(pool, rids)
    snap = pool.snapshot()
    for name in ("ad0", "ad2"):
        w = pool.store.reader(pool.adapter_info(name).path, pool.spec, name=name)
        s = snap.entries[name]
        for t in pool.spec.targets:
            ranks = pool.layer_ranks(t.name, 1)
            assert ranks.shape == (pool.spec.num_slots,) and ranks[0] == 0
            want = int(w.targets[t.name].ranks[1].max()) if t.name in w.targets else 0
            assert ranks[s] == want
    with pytest.raises(IndexError):
        pool.layer_ranks("o_proj", 7)


def test_load_then_unload_at_runtime(pool, tmp_path):
    extra = make_adapters(tmp_path / "more", pool.spec, 1, prefix="late")
    fut = pool.load_adapter_async("late0", extra["late0"])
    info = fut.result(10)
    assert info.name == "late0" and "late0" in pool.served and pool.store.nbytes == 0
    ingest(pool, "r", "late0")
    wait_reads(pool, ["late0"])
    reserve_all(pool, ["r"])
    assert run_step(pool, ["r"])[0].ok
    s = pool.snapshot().entries["late0"]
    assert pool.unload_adapter("late0") is False  # a live request still runs on it
    assert "late0" not in pool.served and pool.snapshot().entries["late0"] == s
    assert run_step(pool, ["r"])[0].ok  # runs to its end on its weights
    assert_slot_holds(pool, s, "late0")
    pool.remove_request("r")  # the last one: forgotten now
    snap = pool.snapshot()
    assert "late0" not in snap.entries and snap.adapters[s] == "late0"  # weights stay until reused
    assert pool.store.get("late0") is None
    assert pool.unload_adapter("late0") is False  # not served: a no-op
    assert pool.load_adapter_async("late0", extra["late0"]).result(10).name == "late0"  # reload
    assert pool.unload_adapter("late0") is True  # no live request: forgotten now
    pool.check_valid()


def test_follower_keeps_no_reservations_and_admits_the_same_way(spec, paths):
    leader = LoraAdapterPool(spec, adapters=paths)
    follower = LoraAdapterPool(spec, adapters=paths, decides=False)
    try:
        names = ["ad0", "ad1", "ad2", "ad0", "ad3", "ad1"]
        for p in (leader, follower):
            for rid, n in enumerate(names):
                ingest(p, rid, n)
        wait_reads(leader, set(names))
        assert follower.ask(0, "llm", ("llm",)) is None and follower.reserve(0, "llm", (), False) is None
        for batch in ([0, 1, 2], [3], [4, 5]):
            reserve_all(leader, batch)
            outs = [run_step(p, batch)[0] for p in (leader, follower)]  # follower waits for its reads
            assert all(o.ok for o in outs)
            a, b = leader.snapshot(), follower.snapshot()
            assert (a.entries, a.holders, a.refcounts, a.last_used) == (b.entries, b.holders, b.refcounts, b.last_used)
            leader.remove_request(batch[0]), follower.remove_request(batch[0])
        follower.check_valid(), leader.check_valid()
    finally:
        leader.close(), follower.close()


def test_agree_is_one_call_per_admit_with_misses_and_fails_rows_another_rank_failed(spec, paths):
    calls = []

    def agree(outcomes):
        calls.append(outcomes.copy())
        out = outcomes.copy()
        if len(calls) == 1:
            out[0] = FAILED  # the first miss failed to read on another rank
        return out

    pool = LoraAdapterPool(spec, adapters=paths, agree=agree)
    try:
        rids = open_requests(pool, ["ad0", "ad1", "ad1", "ad2"])
        reserve_all(pool, rids[:3])
        out, _, _ = run_step(pool, rids[:3])
        assert len(calls) == 1 and calls[0].tolist() == [READY, READY]
        assert set(out.failed) == {0} and isinstance(out.failed[0], LoraError) and "another rank" in str(out.failed[0])
        assert out.failed[0].adapter == "ad0" and out.failed[0].path == paths["ad0"]
        snap = pool.snapshot()
        assert "ad0" not in snap.entries and snap.entries["ad1"] == 1  # ad1 got the first victim
        assert 0 not in snap.reserved  # the failed row holds nothing
        reserve_all(pool, [1, 2])
        assert run_step(pool, [1, 2])[0].ok and len(calls) == 1  # a hit on the cached slot: no collective
        run_step(pool, [1, 2])
        assert len(calls) == 1  # the steady state calls none either
        reserve_all(pool, [3])
        assert run_step(pool, [1, 2, 3])[0].ok and len(calls) == 2 and calls[1].tolist() == [READY]
    finally:
        pool.close()


def test_admit_waits_for_a_copy_in_flight_outside_the_lock(spec, paths):
    reader = GatedReader()
    pool = LoraAdapterPool(spec, adapters=paths, reader=reader, decides=False)
    try:
        reader.close("ad1")
        ingest(pool, 0, "ad1")
        assert pool.store.get("ad1").outcome() == READING
        done = []
        t = threading.Thread(target=lambda: done.append(run_step(pool, [0])[0]))
        t.start()
        reader.wait_started("ad1", 2)
        ingest(pool, 1, "ad0")  # the pool's lock is free while the admit waits
        pool.remove_request(1)
        assert pool.snapshot().holders == {} and not done
        reader.open("ad1")
        t.join(10)
        assert done and done[0].ok and pool.snapshot().holders == {0: 1}
        assert_slot_holds(pool, 1, "ad1")
    finally:
        pool.close()


def test_pool_dtype_override_and_bf16_slots(tmp_path, rng):
    spec = small_spec(dtype="float32")
    paths = make_adapters(tmp_path, spec, 2, seed=int(rng.integers(1 << 30)))
    pool = LoraAdapterPool(spec, dtype="bfloat16", adapters=paths)
    try:
        assert pool.spec.dtype == "bfloat16" and pool.layer_weights("o_proj", 0).a.dtype.name == "bfloat16"
        rids = open_requests(pool, ["ad0", "ad1"])
        reserve_all(pool, rids)
        assert run_step(pool, rids, [2, 3])[0].ok
        check_delta(pool, rids, [2, 3], rng, atol_scale=2e-2)
    finally:
        pool.close()


def test_constructor_checks(spec):
    with pytest.raises(ValueError):
        LoraAdapterPool(spec, world_size=2, rank=1)  # needs agree
    with pytest.raises(ValueError):
        LoraAdapterPool(spec, rank=2, world_size=2, agree=lambda o: o)
    with pytest.raises(ValueError):
        LoraAdapterPool(spec, device="tpu:0")
    p = LoraAdapterPool(spec, world_size=2, rank=1, agree=lambda o: o, force_double_buffer=False)
    assert not p.force_double_buffer and p.rank == 1
    p.close()


def test_snapshot_and_check_valid_see_the_pool(pool):
    rids = open_requests(pool, ["ad0", "ad1", None])
    reserve_all(pool, rids)
    run_step(pool, rids)
    pool.check_valid()
    pool._settled[0] = 3  # a row addressing a slot it does not hold
    with pytest.raises(AssertionError):
        pool.check_valid()
    pool._settled[0] = pool.snapshot().holders[0]
    pool._catalog.live["ad0"] += 1
    with pytest.raises(AssertionError):
        pool.check_valid()


def test_bench_pool_reports_medians(tmp_path, capsys):
    import json

    from lora_cupy.bench.pool import main

    out = tmp_path / "pool.json"
    assert main(["--rows", "64", "--slots", "8", "--steps", "40", "--tokens", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["rows"] == 64 and r["slots"] == 8 and r["steps"] == 40
    assert 0 < r["admit_us_median"] < r["plan_us_median"]
    assert "admit" in capsys.readouterr().out


def test_a_follower_read_failing_after_the_first_agreement_fails_the_rows_on_every_rank(spec, paths):
    """The follower's copy is in flight at the agreement and then fails: the instance agrees
    a second time, so both ranks fail the row and their tables stay equal."""
    barrier = threading.Barrier(2, timeout=10)
    seen: dict = {}
    calls = [0, 0]

    def agree_for(rank):
        def agree(local):
            calls[rank] += 1
            seen[rank] = np.asarray(local)
            barrier.wait()
            out = np.maximum(seen[0], seen[1])
            barrier.wait()
            return out
        return agree

    readers = [GatedReader(), GatedReader(fail={})]
    pools = [LoraAdapterPool(spec, rank=r, world_size=2, agree=agree_for(r), decides=r == 0, reader=readers[r],
                             adapters={"ad0": paths["ad0"], "ad1": paths["ad1"]}) for r in range(2)]
    try:
        readers[1].close("ad1")
        readers[1].fail["ad1"] = OSError("lost the file")
        for p in pools:
            ingest(p, 0, "ad0")
            ingest(p, 1, "ad1")
        wait_reads(pools[0], ["ad0", "ad1"])
        wait_reads(pools[1], ["ad0"])
        reserve_all(pools[0], [0, 1])
        outs = [None, None]

        def run(r):
            outs[r] = pools[r].admit(LoraStep([0, 1]), StepContext())

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        readers[1].wait_started("ad1", 2)
        readers[1].open("ad1")
        for t in threads:
            t.join(10)
        assert set(outs[0].failed) == set(outs[1].failed) == {1}
        assert "another rank" in str(outs[0].failed[1]) and "lost the file" in str(outs[1].failed[1])
        a, b = pools[0].snapshot(), pools[1].snapshot()
        assert (a.entries, a.holders, a.refcounts, a.last_used) == (b.entries, b.holders, b.refcounts, b.last_used)
        assert calls == [2, 2]  # the second agreement, only because a copy was in flight
        for p in pools:
            p.check_valid()
    finally:
        for p in pools:
            p.close()


def test_a_steps_launch_views_carry_the_rank_class_its_slots_need(tmp_path):
    """A pool of maximum rank 128: a step of rank-16 adapters is launched for rank 16 (a rank-16
    pool's kernels), one with a rank-40 adapter for 64, one with a rank-100 adapter for 128 (no
    bound); each bound its own views over the same buffers, so its own launches and graphs."""
    spec = small_spec(num_slots=5, max_rank=128)
    paths = make_adapters(tmp_path, spec, 4, ranks=(16, 9, 40, 100))
    with LoraAdapterPool(spec, "cpu", adapters=paths) as pool:
        rids = open_requests(pool, ["ad0", "ad1", None, "ad2", "ad3"])
        reserve_all(pool, rids)
        seen = {}
        for batch, want in (([0, 1, 2], 16), ([1, 2], 16), ([0, 3], 64), ([3, 4, 0], None), ([2], None)):
            _, addr, ctx = run_step(pool, [rids[i] for i in batch])
            views = ctx.plan_results[pool].launch[1]
            assert addr.rank_bound == views.rank_bound == want, batch
            slots = [pool._settled[rids[i]] for i in batch]
            if want is not None:  # every slot of the step within the class, and the class the smallest
                assert all(pool._slot_weights.slot_ranks[s] <= want for s in slots)
            plain = pool._planner.buffers[1].launch[(views.bucket, views.parity)]
            assert views.token_order is plain.token_order and views.slot_indptr is plain.slot_indptr
            assert (views is plain) == (want is None)
            assert seen.setdefault((views.bucket, views.parity, want), views) is views  # one object a bound
        ranks = pool._slot_weights.slot_ranks
        assert ranks[0] == 0 and sorted(ranks[ranks > 0].tolist()) == [9, 16, 40, 100]
