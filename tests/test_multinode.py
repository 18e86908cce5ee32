"""Pools on several nodes (a vision encoder before an LLM): own rows only, a slot in each pool
an adapter touches, and waits that cannot form a cycle."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lora_cupy.engine.admission import AdmissionQueue
from lora_cupy.engine.resource import LoraStep, StepContext
from lora_cupy.pool import LoraAdapterPool
from lora_cupy.spec import LoraSpec, LoraTarget
from tests.pool_helpers import SyntheticReader, check_delta, ingest, small_spec, wait_reads

WALK = ("encoder", "llm")


def make_pools(touches, enc_slots=3, llm_slots=3):
    reader = SyntheticReader(touches, seed=random.randrange(1 << 30))
    enc_spec = LoraSpec((LoraTarget("vision_proj", 16, 24, 1),), num_slots=enc_slots, max_rank=4,
                        dtype="float32", capture_buckets=(8, 64), node="encoder")
    llm_spec = small_spec(num_slots=llm_slots, num_layers=1)
    served = {name: f"/adapters/{name}" for name in touches}
    enc = LoraAdapterPool(enc_spec, adapters=served, reader=reader)
    llm = LoraAdapterPool(llm_spec, adapters=served, reader=reader)
    return enc, llm


def open_in_both(pools, rid, name):
    for p in pools:
        ingest(p, rid, name)
    for p in pools:
        wait_reads(p, [name] if name else [])


def step_on(pool, rids, node, seq=0):
    step = LoraStep(rids, nodes=[node] * len(rids), seq=seq)
    ctx = StepContext(seq=seq)
    out = pool.admit(step, ctx)
    assert out.ok, out.failed
    pool.plan(step, ctx)
    pool.commit(step, ctx)
    return step


def test_each_pool_admits_only_its_nodes_rows():
    enc, llm = make_pools({"both": ["vision_proj", "qkv_proj", "o_proj"]})
    try:
        for rid in (1, 2):
            open_in_both((enc, llm), rid, "both")
        step = LoraStep([1, 2], nodes=["encoder", "llm"])
        ctx = StepContext()
        assert enc.admit(step, ctx).ok and llm.admit(step, ctx).ok
        assert set(enc.snapshot().holders) == {1} and set(llm.snapshot().holders) == {2}
        enc_addr, llm_addr = enc.plan(step, ctx), llm.plan(step, ctx)
        assert enc_addr.num_tokens == 1 and llm_addr.num_tokens == 1
        assert enc.ask(2, "llm", WALK) is None and llm.ask(1, "encoder", WALK) is None
        enc.check_valid(), llm.check_valid()
    finally:
        enc.close(), llm.close()


def test_a_request_holds_a_slot_only_where_its_adapter_touches():
    enc, llm = make_pools({"both": ["vision_proj", "o_proj"], "text": ["qkv_proj"], "vision": ["vision_proj"]})
    try:
        for rid, name in ((1, "both"), (2, "text"), (3, "vision")):
            open_in_both((enc, llm), rid, name)
        assert enc.runs_adapters([1]) and not enc.runs_adapters([2]) and enc.runs_adapters([3])
        assert llm.runs_adapters([1, 2]) and not llm.runs_adapters([3])
        assert enc.ask(2, "encoder", WALK) is None and llm.ask(3, "llm", WALK) is None
        step_on(enc, [1, 2, 3], "encoder")
        step_on(llm, [1, 2, 3], "llm")
        assert set(enc.snapshot().holders) == {1, 3} and set(llm.snapshot().holders) == {1, 2}
        assert enc.store.get("text") is None and llm.store.get("vision") is None  # nothing held for them
        rng = np.random.default_rng()
        check_delta(enc, [1, 2, 3], None, rng)
        check_delta(llm, [1, 2, 3], None, rng)
        for rid in (1, 2, 3):
            enc.remove_request(rid), llm.remove_request(rid)
        assert not any(enc.snapshot().refcounts) and not any(llm.snapshot().refcounts)
    finally:
        enc.close(), llm.close()


def waits_have_no_cycle(q: AdmissionQueue, pools: dict) -> None:
    """Edges: a waiting request -> every request holding a slot in the pool it waits on, and
    -> every request queued ahead of it that the queue's order makes it wait behind (new
    requests behind anyone, running ones behind running ones). Assert no cycle, and that no
    request waits on the encoder while holding an LLM slot."""
    edges: dict = {}
    ahead: list = []
    for w in q.waiting:
        pool = pools[w.node]
        holders = set(pool.snapshot().holders) - {w.rid}
        running = bool(q.holds(w.rid))
        edges.setdefault(w.rid, set()).update(holders)
        edges[w.rid].update(r for r, r_running in ahead if r != w.rid and (r_running or not running))
        ahead.append((w.rid, running))
        if w.node == "encoder":
            assert w.rid not in pools["llm"].snapshot().holders, f"{w.rid} waits on the encoder holding an LLM slot"
    state: dict = {}

    def visit(v):
        state[v] = 1
        for u in edges.get(v, ()):
            if state.get(u) == 1:
                raise AssertionError(f"a cycle of waits through {v!r} and {u!r}")
            if u not in state:
                visit(u)
        state[v] = 2

    for v in list(edges):
        if v not in state:
            visit(v)


def test_encoder_before_llm_keeps_waits_acyclic_and_everyone_finishes():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    names = [f"a{i}" for i in range(6)]
    touches = {n: ["vision_proj", "qkv_proj"] if i % 2 == 0 else ["vision_proj", "o_proj"] for i, n in enumerate(names)}
    enc, llm = make_pools(touches, enc_slots=3, llm_slots=3)  # two adapter slots each: plenty of waiting
    pools = {"encoder": enc, "llm": llm}
    q = AdmissionQueue([enc, llm], node_order=WALK)
    try:
        total, nxt = 40, 0
        llm_left: dict[int, int] = {}
        done = 0
        waited_holding_encoder = False
        for seq in range(600):
            if nxt < total and rng.random() < 0.6:
                open_in_both((enc, llm), nxt, rng.choice(names))
                q.submit(nxt, "encoder", WALK)
                nxt += 1
            granted = q.pump()
            enc_rows = [g.rid for g in granted if g.node == "encoder"]
            for g in granted:
                assert not g.failed, f"seed {seed}"
                if g.node == "llm":
                    llm_left[g.rid] = rng.randint(1, 4)
            if enc_rows:  # the encoder runs once per request, then the request asks the LLM
                step_on(enc, enc_rows, "encoder", seq)
                for rid in enc_rows:
                    q.submit(rid, "llm", WALK)
            if llm_left:
                step_on(llm, sorted(llm_left), "llm", seq)
            for rid in [r for r, k in llm_left.items() if k <= 1]:
                del llm_left[rid]
                for p in (enc, llm):
                    p.remove_request(rid)
                q.cancel(rid)
                done += 1
            for rid in llm_left:
                llm_left[rid] -= 1
            waited_holding_encoder |= any(w.node == "llm" and w.rid in enc.snapshot().holders for w in q.waiting)
            waits_have_no_cycle(q, pools)
            enc.check_valid(), llm.check_valid()
            if done == total:
                break
        assert done == total, f"seed {seed}: {total - done} requests never finished (waiting: {q.waiting})"
        assert waited_holding_encoder, f"seed {seed}: the workload never made a request wait holding a slot"
        assert not any(enc.snapshot().refcounts) and not any(llm.snapshot().refcounts)
    finally:
        enc.close(), llm.close()


def test_llm_before_encoder_is_refused_where_it_could_deadlock():
    enc, llm = make_pools({"both": ["vision_proj", "qkv_proj"]})
    try:
        q = AdmissionQueue([enc, llm], node_order=WALK)
        open_in_both((enc, llm), 1, "both")
        q.submit(1, "llm", ("llm", "encoder"))
        assert [g.rid for g in q.pump()] == [1]
        step_on(llm, [1], "llm")
        with pytest.raises(ValueError, match="cycle"):
            q.submit(1, "encoder", ("llm", "encoder"))
    finally:
        enc.close(), llm.close()
