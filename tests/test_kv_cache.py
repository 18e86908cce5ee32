"""The paged KV cache as a Resource: pages counted at admission, handed out at admit, freed at removal."""

from __future__ import annotations

import pytest

from lora_cupy.engine.admission import AdmissionQueue
from lora_cupy.engine.kv import KVReqConfig, PagedKVCache
from lora_cupy.engine.resource import AdmitOutcome, LoraStep, StepContext
from lora_cupy.errors import CapacityError


def ingest(kv, rid, tokens):
    kv.ingest_request(rid, KVReqConfig(max_tokens=tokens))


def admit(kv, rids, seq=0):
    step, ctx = LoraStep(rids, seq=seq), StepContext(seq=seq)
    return kv.admit(step, ctx), step, ctx


def test_pages_counted_at_reserve_handed_out_at_admit_freed_at_remove():
    kv = PagedKVCache(num_pages=7, page_size=4, width=8)  # 6 pages past the null one
    ingest(kv, "a", 9)  # 3 pages
    ingest(kv, "b", 8)  # 2 pages
    ingest(kv, "c", 5)  # 2 pages
    assert kv.ask("a", "llm") is AdmitOutcome.ASKS
    assert kv.ask("a", "encoder") is None  # another node's rows need nothing here
    assert kv.reserve("a", "llm") == 1 and kv.reserve("b", "llm") == 1
    assert kv.reserved_pages == 5
    assert kv.reserve("c", "llm") == 0, "only one page is left unpromised"
    kv.check_valid()
    out, step, ctx = admit(kv, ["a", "b"])
    assert out.ok
    assert len(kv.pages("a")) == 3 and len(kv.pages("b")) == 2
    assert 0 not in kv.pages("a") + kv.pages("b")
    assert kv.ask("a", "llm") is None and kv.reserve("a", "llm") is None  # it holds its pages
    kv.commit(step, ctx)
    # token p of a lives on its p // 4-th page
    pa = kv.pages("a")
    assert [kv.slot_of("a", p) for p in (0, 3, 4, 8)] == [pa[0] * 4, pa[0] * 4 + 3, pa[1] * 4, pa[2] * 4]
    with pytest.raises(IndexError):
        kv.slot_of("a", 12)
    assert kv.reserve("c", "llm") == 0
    kv.remove_request("a")
    assert kv.free_pages == 4 and kv.reserve("c", "llm") == 1
    kv.check_valid()
    kv.remove_request("b")
    kv.remove_request("c")
    assert kv.free_pages == 6 and kv.held_pages == 0 and kv.reserved_pages == 0
    kv.check_valid()


def test_rollback_gives_back_exactly_what_the_admit_took():
    kv = PagedKVCache(num_pages=9, page_size=2, width=4)
    for rid in "ab":
        ingest(kv, rid, 4)
        assert kv.reserve(rid, "llm") == 1
    out, step, ctx = admit(kv, ["a"], seq=1)
    kv.commit(step, ctx)
    held_a = kv.pages("a")
    out, step, ctx = admit(kv, ["a", "b"], seq=2)  # a holds its pages already: only b takes some
    assert out.ok and len(kv.pages("b")) == 2
    kv.rollback_admit(step, ctx)
    assert kv.pages("a") == held_a and kv.pages("b") == ()
    assert kv.free_pages == 6 and kv.reserved_pages == 0, "a rolled-back row keeps no reservation"
    kv.check_valid()


def test_a_row_without_reservation_is_refused_when_the_pages_are_promised():
    kv = PagedKVCache(num_pages=3, page_size=2, width=4)  # 2 pages
    ingest(kv, "a", 4)
    ingest(kv, "b", 2)
    assert kv.reserve("a", "llm") == 1
    out, step, ctx = admit(kv, ["b"])
    assert isinstance(out.failed["b"], CapacityError) and kv.pages("b") == ()
    kv.check_valid()


def test_refusals():
    kv = PagedKVCache(num_pages=3, page_size=2, width=4)
    with pytest.raises(CapacityError, match="needs 3 KV pages"):
        ingest(kv, "big", 5)
    with pytest.raises(ValueError, match="never ingested"):
        kv.ask("nobody", "llm")
    ingest(kv, "a", 1)
    with pytest.raises(ValueError, match="ingested already"):
        ingest(kv, "a", 1)
    with pytest.raises(ValueError, match="holds no KV pages"):
        kv.slot_of("a", 0)
    with pytest.raises(ValueError):
        PagedKVCache(num_pages=1, page_size=2, width=4)


def test_admission_queue_over_kv_is_fifo_and_holds_nothing_while_waiting():
    kv = PagedKVCache(num_pages=5, page_size=2, width=4)  # 4 pages
    q = AdmissionQueue([kv])
    for rid, tokens in (("a", 6), ("b", 4), ("c", 1)):
        ingest(kv, rid, tokens)
        q.submit(rid, "llm")
    got = [g.rid for g in q.pump()]
    assert got == ["a"], "b needs 2 pages with 1 left; c, behind it, may not overtake"
    assert kv.reserved_pages == 3 and q.waiting[0].rid == "b"
    out, step, ctx = admit(kv, ["a"])
    kv.commit(step, ctx)
    kv.remove_request("a")
    q.cancel("a")
    assert [g.rid for g in q.pump()] == ["b", "c"]
    kv.check_valid()


def test_an_admit_that_raises_midway_can_still_be_rolled_back():
    kv = PagedKVCache(num_pages=5, page_size=2, width=4)
    ingest(kv, "a", 2)
    assert kv.reserve("a", "llm") == 1
    step, ctx = LoraStep(["a", "stranger"]), StepContext()
    with pytest.raises(ValueError, match="never ingested"):
        kv.admit(step, ctx)
    assert kv.pages("a")
    kv.rollback_admit(step, ctx)
    assert kv.pages("a") == () and kv.free_pages == 4
    kv.check_valid()


def test_slots_of_matches_slot_of():
    kv = PagedKVCache(num_pages=9, page_size=3, width=4)
    for rid, tokens in (("a", 7), ("b", 5)):
        ingest(kv, rid, tokens)
        assert kv.reserve(rid, "llm") == 1
    admit(kv, ["b", "a"])
    rids, pos = ["a", "b", "a", "b", "a"], [0, 4, 6, -1, 3]
    want = [kv.slot_of(r, p) if p >= 0 else 0 for r, p in zip(rids, pos)]
    assert kv.slots_of(rids, pos).tolist() == want
    with pytest.raises(IndexError):
        kv.slots_of(["b"], [6])
