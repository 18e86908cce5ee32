"""The worker's main chain on the cpu (host streams, real threads): outputs against a float64
reference, the pipeline depth, deferred teardown, the two admission waits, failed chain steps,
and the graph key the runner picks."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lora_cupy.device import Device
from lora_cupy.engine.decode_model import RandomAdapters, decode_engine, decode_spec
from lora_cupy.engine.scheduler import CHAIN_LANE
from lora_cupy.engine.worker import Request
from lora_cupy.errors import AdapterNotFoundError
from lora_cupy.pool import LoraAdapterPool

ADAPTERS = {"a0": 8, "a1": 3, "a2": 5, "a3": 1}


def make_engine(adapters=ADAPTERS, num_slots=4, seed=0, force_double_buffer=True, **kw):
    reader = RandomAdapters(adapters, seed=seed)
    pool = LoraAdapterPool(decode_spec(num_slots=num_slots), Device("cpu"), reader=reader,
                           adapters={n: f"memory:{n}" for n in adapters}, force_double_buffer=force_double_buffer)
    eng = decode_engine(pool, seed=seed, **kw)
    eng.reader = reader
    return eng


@pytest.fixture
def engine(request):
    engines = []

    def make(**kw):
        e = make_engine(**kw)
        engines.append(e)
        return e
    yield make
    for e in engines:
        e.model.faults.release(CHAIN_LANE)
        e.model.faults.release(1)
        e.close()


def check_result(eng, req, res):
    """Hidden states against the float64 reference, each window against the codec's."""
    weights = None if req.adapter is None else eng.reader("memory", eng.pool.spec, name=req.adapter)
    ref = eng.model.reference(weights, req.prompt, req.max_new_tokens)
    np.testing.assert_allclose(np.array(res.hidden), ref, atol=2e-4, rtol=0, err_msg=f"request {req.rid}")
    assert len(res.tokens) == req.max_new_tokens
    if req.window:
        cuts = list(range(0, req.max_new_tokens, req.window))
        assert len(res.windows) == len(cuts)
        for w, c in zip(res.windows, cuts):
            np.testing.assert_allclose(w, eng.model.codec_reference(res.tokens[c:c + req.window]), atol=1e-5)
    else:
        assert res.windows == []


def check_empty(eng):
    eng.worker.check_valid()
    snap = eng.pool.snapshot()
    assert not any(snap.refcounts) and not snap.holders and not snap.reserved
    assert eng.kv.held_pages == 0 and eng.kv.reserved_pages == 0 and eng.kv.free_pages == eng.kv.num_pages - 1
    assert eng.model.early_reads == 0


def run_until(worker, cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition never held"
        worker.run_once(block=False)
        time.sleep(0.001)


def test_many_requests_match_the_float64_reference(engine):
    eng = engine(num_slots=3, num_pages=9)  # 2 adapter slots, 8 pages: requests wait and slots are reused
    rng = np.random.default_rng(0)
    names = [None, *ADAPTERS]
    reqs = [Request(f"r{i}", names[i % len(names)], prompt=int(rng.integers(16)),
                    max_new_tokens=int(rng.integers(1, 9)), window=int(rng.integers(0, 4))) for i in range(16)]
    futs = [eng.worker.submit(r) for r in reqs]
    eng.worker.drain()
    for r, f in zip(reqs, futs):
        check_result(eng, r, f.result())
    assert eng.pool.stats["loads"] > len(ADAPTERS), "slots were evicted and reused"
    assert sorted(eng.worker.removed) == sorted(r.rid for r in reqs)
    check_empty(eng)


def test_torch_layers_on_the_same_buffers_match_the_reference(engine):
    """The base matmuls in torch on views of the model's buffers (DLPack on cuda), deltas from the pool."""
    eng = engine(torch_layers=True)
    w = eng.worker
    reqs = [Request(f"r{i}", [None, "a0", "a2"][i % 3], prompt=i, max_new_tokens=4, window=2) for i in range(5)]
    futs = [w.submit(r) for r in reqs]
    w.drain()
    for r, f in zip(reqs, futs):
        check_result(eng, r, f.result())
    bufs = next(iter(b for k, b in eng.model._bufs.items() if k[0] != "codec"))
    assert np.shares_memory(bufs["torch"][1].numpy(), bufs["y"]), "torch writes the model's own buffer"
    check_empty(eng)


def test_step_n_plus_1_is_launched_behind_step_n_never_deeper(engine):
    eng = engine()
    w = eng.worker
    eng.model.faults.hold(CHAIN_LANE)
    f = w.submit(Request("r", "a0", max_new_tokens=5))
    run_until(w, lambda: any(t[0] == "submit" for t in w.trace))
    for _ in range(20):
        w.run_once(block=False)
    submits = [t for t in w.trace if t[0] == "submit"]
    assert len(submits) == 2 and not [t for t in w.trace if t[0] == "finish"]
    assert [s[2] for s in submits] == [1, 2]
    eng.model.faults.release(CHAIN_LANE)
    w.drain()
    assert len(f.result().tokens) == 5
    depth, most = 0, 0
    for kind, lane, _seq, _rids in w.trace:
        depth += {"submit": 1, "finish": -1}.get(kind, 0) if lane == CHAIN_LANE else 0
        most = max(most, depth)
    assert most == 2
    check_empty(eng)


def test_a_remove_waits_for_the_step_in_flight_and_lands_after_it(engine):
    eng = engine()
    w = eng.worker
    eng.model.faults.hold(CHAIN_LANE)
    f = w.submit(Request("r", "a1", max_new_tokens=50))
    run_until(w, lambda: any(t[0] == "submit" for t in w.trace))
    w.remove("r")
    for _ in range(10):
        w.run_once(block=False)
    assert "r" not in w.removed, "removed while a step on the device still reads it"
    assert eng.kv.pages("r") and eng.pool.snapshot().holders.get("r")
    eng.model.faults.release(CHAIN_LANE)
    w.drain()
    with pytest.raises(Exception, match="removed"):
        f.result()
    i_remove = w.trace.index(("remove", None, None, ("r",)))
    finishes = [i for i, t in enumerate(w.trace) if t[0] == "finish" and "r" in t[3]]
    submits = [i for i, t in enumerate(w.trace) if t[0] == "submit" and "r" in t[3]]
    assert len(finishes) == len(submits) >= 1 and max(finishes) < i_remove
    check_empty(eng)


def test_a_full_lora_pool_waits_without_taking_kv_pages(engine):
    eng = engine(num_slots=3)  # two adapter slots
    w = eng.worker
    eng.model.faults.hold(CHAIN_LANE)
    futs = [w.submit(Request(n, n, max_new_tokens=3)) for n in ("a0", "a1", "a2")]
    run_until(w, lambda: len(w.admission) == 1 and len(eng.pool.snapshot().holders) == 2)
    assert w.admission.waiting[0].rid == "a2"
    snap = eng.pool.snapshot()
    assert "a2" not in snap.holders and "a2" not in snap.reserved
    assert eng.kv.pages("a2") == () and eng.kv.reserved_pages == 0, "the waiting request holds KV pages"
    eng.model.faults.release(CHAIN_LANE)
    w.drain()
    assert all(len(f.result().tokens) == 3 for f in futs)
    check_empty(eng)


def test_a_full_kv_cache_waits_without_taking_a_slot(engine):
    eng = engine(num_slots=4, num_pages=3, page_size=4)  # 2 pages: one request of 8 tokens
    w = eng.worker
    eng.model.faults.hold(CHAIN_LANE)
    futs = [w.submit(Request(n, n, max_new_tokens=8)) for n in ("a0", "a1")]
    run_until(w, lambda: len(eng.kv.pages("a0")) == 2)
    for _ in range(5):
        w.run_once(block=False)
    assert [x.rid for x in w.admission.waiting] == ["a1"]
    snap = eng.pool.snapshot()
    assert "a1" not in snap.holders and "a1" not in snap.reserved, "the request waiting for pages holds a slot"
    assert "a1" not in snap.entries, "its adapter was loaded into a slot while it waits"
    eng.model.faults.release(CHAIN_LANE)
    w.drain()
    assert all(len(f.result().tokens) == 8 for f in futs)
    check_empty(eng)


def test_a_failed_chain_step_rolls_back_its_admit_and_its_rows_run_again(engine):
    eng = engine()
    w = eng.worker
    calls = []
    for r in (eng.pool, eng.kv):
        inner = r.rollback_admit
        r.rollback_admit = lambda step, ctx, inner=inner, r=r: (calls.append((type(r).__name__, step.seq)),
                                                                  inner(step, ctx))[1]
    eng.model.faults.fail_next[CHAIN_LANE] = 1
    reqs = [Request("x", "a2", prompt=3, max_new_tokens=4, window=2), Request("y", None, prompt=5, max_new_tokens=3)]
    futs = [w.submit(r) for r in reqs]
    w.drain()
    for r, f in zip(reqs, futs):
        check_result(eng, r, f.result())
    assert ("LoraAdapterPool", 1) in calls and ("PagedKVCache", 1) in calls
    assert w.stats["chain_rollbacks"] >= 1
    check_empty(eng)


def test_a_chain_step_that_keeps_failing_fails_its_requests(engine):
    eng = engine(max_chain_failures=2)
    w = eng.worker
    eng.model.faults.fail_next[CHAIN_LANE] = 10
    f = w.submit(Request("x", "a0", max_new_tokens=3))
    w.drain()
    with pytest.raises(Exception, match="injected failure"):
        f.result()
    eng.model.faults.fail_next[CHAIN_LANE] = 0
    g = w.submit(Request("y", "a0", max_new_tokens=2))
    w.drain()
    assert len(g.result().tokens) == 2
    check_empty(eng)


def test_an_unknown_adapter_fails_its_request_only(engine):
    eng = engine()
    w = eng.worker
    bad = w.submit(Request("bad", "nope", max_new_tokens=2))
    good = w.submit(Request("good", "a3", max_new_tokens=2))
    w.drain()
    with pytest.raises(AdapterNotFoundError, match="nope"):
        bad.result()
    check_result(eng, Request("good", "a3", max_new_tokens=2), good.result())
    check_empty(eng)


def test_the_runner_picks_the_graph_by_bucket_parity_and_active(engine):
    eng = engine()
    w = eng.worker
    assert eng.pool.force_double_buffer and w.chain.double_buffer
    futs = [w.submit(Request(f"r{i}", "a0" if i % 2 else None, max_new_tokens=3 + i)) for i in range(6)]
    w.drain()
    for f in futs:
        f.result()
    keys = set(w.chain.graphs.launches)
    assert {k[1] for k in keys} == {0, 1}, "both buffer parities were used"
    assert {k[0] for k in keys} <= set(eng.pool.spec.capture_buckets)
    # one key, one set of addressing buffers; the two parities never share one
    by_parity = {}
    for key, reads in w.chain.graphs.reads.items():
        by_parity.setdefault((key[0], key[1]), set()).add(reads)
    for (bucket, parity), reads in by_parity.items():
        assert len(reads) == 1
        other = by_parity.get((bucket, 1 - parity))
        if other is not None:
            assert reads != other
    # a base-only step launches no LoRA kernels: its graph is keyed apart
    solo = w.submit(Request("base", None, max_new_tokens=2))
    w.drain()
    solo.result()
    assert any(k[2] == (False, False) for k in w.chain.graphs.launches)
    check_empty(eng)


def test_without_preplan_or_double_buffering_the_cpu_chain_runs_one_step_at_a_time(engine):
    eng = engine(force_double_buffer=False, preplan=False)
    w = eng.worker
    assert not w.chain.preplan and not w.chain.double_buffer and w.chain.depth == 1
    reqs = [Request(f"r{i}", [None, "a0", "a1"][i % 3], prompt=i, max_new_tokens=5, window=2) for i in range(6)]
    futs = [w.submit(r) for r in reqs]
    w.drain()
    for r, f in zip(reqs, futs):
        check_result(eng, r, f.result())
    by_bucket = {}
    for key, reads in w.chain.graphs.reads.items():
        by_bucket.setdefault(key[0], set()).add(reads)
    assert all(len(v) == 1 for v in by_bucket.values()), "a pool that does not double-buffer keeps one buffer"
    check_empty(eng)


def test_submit_refuses_bad_requests(engine):
    eng = engine()
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.worker.submit(Request("r", None, max_new_tokens=0))
    with pytest.raises(ValueError, match="window 17"):
        eng.worker.submit(Request("r", None, max_new_tokens=3, window=17))
    f = eng.worker.submit(Request("big", None, max_new_tokens=10_000))  # more than the KV cache holds
    g = eng.worker.submit(Request("big", None, max_new_tokens=2))
    eng.worker.drain()
    with pytest.raises(Exception, match="KV pages"):
        f.result()
    assert len(g.result().tokens) == 2, "the same id, once the first was refused, is a new request"
    check_empty(eng)


def test_the_worker_refuses_a_resource_on_another_device():
    spec = decode_spec()
    pool = LoraAdapterPool(spec, Device("cpu"), reader=RandomAdapters({}))
    from lora_cupy.engine.decode_model import DecodeModel
    from lora_cupy.engine.kv import PagedKVCache
    from lora_cupy.engine.worker import Worker

    kv = PagedKVCache(5, 4, 32)
    try:
        with pytest.raises(ValueError, match="stream its plans are copied on"):
            Worker(DecodeModel(pool, kv), [pool, kv], Device("cpu"))
    finally:
        pool.close()


def test_the_main_loop_on_its_own_thread(engine):
    eng = engine(side_lane=True)
    w = eng.worker
    w.start()
    reqs = [Request(f"r{i}", [None, "a0", "a1"][i % 3], prompt=i, max_new_tokens=4, window=2) for i in range(8)]
    futs = [w.submit(r) for r in reqs]
    for r, f in zip(reqs, futs):
        check_result(eng, r, f.result(timeout=20))
    end = time.monotonic() + 10
    while not w.idle():
        assert time.monotonic() < end
        time.sleep(0.01)
    w.stop()
    check_empty(eng)


def test_submits_and_removes_from_many_threads_while_the_loop_runs(engine):
    import threading
    from concurrent.futures import CancelledError

    eng = engine(num_slots=3, num_pages=9)
    w = eng.worker
    w.start()
    reqs, futs, removed = {}, {}, set()
    lock = threading.Lock()

    def client(k):
        rng = np.random.default_rng(k)
        for i in range(6):
            r = Request(f"c{k}-{i}", [None, *ADAPTERS][int(rng.integers(5))], prompt=int(rng.integers(16)),
                        max_new_tokens=int(rng.integers(1, 6)), window=int(rng.integers(0, 3)))
            f = w.submit(r)
            with lock:
                reqs[r.rid], futs[r.rid] = r, f
            if rng.random() < 0.3:
                time.sleep(float(rng.uniform(0, 0.003)))
                w.remove(r.rid)
                with lock:
                    removed.add(r.rid)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid, f in futs.items():
        err = f.exception(timeout=30)
        if err is None:
            check_result(eng, reqs[rid], f.result())
        else:
            assert isinstance(err, CancelledError) and rid in removed
    end = time.monotonic() + 10
    while not w.idle():
        assert time.monotonic() < end
        time.sleep(0.01)
    w.stop()
    assert sorted(w.removed) == sorted(futs)
    check_empty(eng)


def test_graph_keys_tell_the_rank_classes_of_a_wide_pool_apart(engine):
    """A pool of maximum rank 128 serving adapters of ranks 4 and 40: steps of the rank-4 adapter alone
    run under rank class 16, steps that hold the rank-40 one under 64, each its own graph key; the
    results stay those of the float64 reference."""
    adapters = {"small": 4, "wide": 40}
    reader = RandomAdapters(adapters, seed=3)
    pool = LoraAdapterPool(decode_spec(num_slots=4, max_rank=128), Device("cpu"), reader=reader,
                           adapters={n: f"memory:{n}" for n in adapters})
    eng = decode_engine(pool, seed=3)
    eng.reader = reader
    try:
        w = eng.worker
        alone = [w.submit(Request("s0", "small", max_new_tokens=2))]
        w.drain()
        both = [w.submit(Request(f"m{i}", a, max_new_tokens=3)) for i, a in enumerate(("small", "wide"))]
        w.drain()
        for (req, f) in zip([Request("s0", "small", max_new_tokens=2), Request("m0", "small", max_new_tokens=3),
                             Request("m1", "wide", max_new_tokens=3)], alone + both):
            check_result(eng, req, f.result())
        at = w.resources.index(pool)
        classes = {k[3][at] for k in w.chain.graphs.launches}
        assert {16, 64} <= classes, classes
        check_empty(eng)
    finally:
        eng.close()
