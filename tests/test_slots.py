"""The slot table alone: holds, victims, the LRU clock, reservations, forget, check_valid."""

from __future__ import annotations

import random

import pytest

from lora_cupy.slots import NEVER, SlotTable


def admit(t: SlotTable, rows):
    """One full admit where every miss's read succeeded: rid -> slot taken (None: refused)."""
    picks = t.begin_admit(rows)
    got = dict(picks.hits)
    for m in picks.misses:
        s = t.finish_miss(picks, m)
        for rid in m.rids:
            got[rid] = s
    for rid in picks.refused:
        got[rid] = None
    return got


def test_slot_zero_is_never_handed_out_and_empty_slots_fill_by_index():
    t = SlotTable(5)
    got = admit(t, [("r0", "x"), ("r1", "y"), ("r2", "z"), ("r3", "w")])
    assert sorted(got.values()) == [1, 2, 3, 4]
    assert got["r0"] < got["r1"] < got["r2"] < got["r3"]  # misses in row order, empties by index
    assert t.refcounts[0] == 0 and t.adapters[0] is None
    t.check_valid()


def test_refcount_counts_holders_and_release_frees():
    t = SlotTable(3)
    got = admit(t, [("a", "x"), ("b", "x"), ("c", "x")])
    s = got["a"]
    assert got["b"] == got["c"] == s and t.refcounts[s] == 3 and t.unheld_count() == 1
    assert t.release("b") == s and t.refcounts[s] == 2
    assert t.release("b") is None  # twice is a no-op
    t.release("a"), t.release("c")
    assert t.refcounts[s] == 0 and t.unheld_count() == 2 and t.slot_of("x") == s  # stays resident, unheld
    t.check_valid()


def test_lru_victim_is_least_recently_taken_unheld_slot():
    t = SlotTable(4)
    first = admit(t, [("r1", "a")])["r1"]
    second = admit(t, [("r2", "b")])["r2"]
    third = admit(t, [("r3", "c")])["r3"]
    for rid in ("r1", "r2", "r3"):
        t.release(rid)
    admit(t, [("r4", "a")])  # a is used again: b is now the least recently used
    t.release("r4")
    got = admit(t, [("r5", "d")])
    assert got["r5"] == second and t.slot_of("b") is None and t.slot_of("d") == second
    got = admit(t, [("r6", "e")])
    assert got["r6"] == third  # then c
    assert t.slot_of("a") == first
    t.check_valid()


def test_clock_advances_once_per_admit_that_takes_and_stamps_taken_slots():
    t = SlotTable(4)
    assert t.clock == 0 and t.last_used == [NEVER] * 4
    admit(t, [("r1", "a"), ("r2", "b")])
    assert t.clock == 1 and t.last_used[1] == t.last_used[2] == 1 and t.last_used[3] == NEVER
    admit(t, [])
    assert t.clock == 1  # took nothing
    t.release("r1")
    assert t.last_used[1] == 1  # releases stamp nothing
    admit(t, [("r3", "a")])
    assert t.clock == 2 and t.last_used[1] == 2


def test_hits_take_their_slot_before_any_miss_picks_a_victim():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    admit(t, [("r2", "b")])
    t.release("r1"), t.release("r2")
    # a is the LRU unheld slot; a miss listed first must not evict it from under a later hit
    got = admit(t, [("m", "c"), ("h", "a")])
    assert got["h"] == t.slot_of("a") == 1
    assert got["m"] == 2 and t.slot_of("b") is None
    t.check_valid()


def test_failed_miss_takes_no_slot_and_the_next_gets_its_victim():
    t = SlotTable(4)
    picks = t.begin_admit([("r1", "a"), ("r2", "b")])
    assert picks.victims == [1, 2]
    # a's read failed: the miss for b takes the first victim
    s = t.finish_miss(picks, picks.misses[1])
    assert s == 1 and t.slot_of("b") == 1 and t.slot_of("a") is None and "r1" not in t.holders
    t.check_valid()


def test_no_victim_left_refuses_without_change():
    t = SlotTable(2)
    admit(t, [("r1", "a")])
    before = t.snapshot()
    got = admit(t, [("r2", "b")])
    assert got["r2"] is None
    after = t.snapshot()
    assert after.entries == before.entries and after.refcounts == before.refcounts and after.holders == before.holders


def test_reservations_count_adapters_not_rows_and_never_exceed_free():
    t = SlotTable(3)  # two slots
    assert t.can_reserve("a")
    t.reserve("r1", "a")
    t.reserve("r2", "a")  # a is counted already: costs nothing more
    assert len(t.demand()) == 1
    t.reserve("r3", "b")
    assert len(t.demand()) == 2 == t.unheld_count()
    assert not t.can_reserve("c")
    with pytest.raises(ValueError):
        t.reserve("r4", "c")
    got = admit(t, [("r1", "a")])
    assert got["r1"] and "r1" not in t.reserved
    # a is held now: r2's reservation costs nothing, the one free slot stays promised to b
    assert len(t.demand()) == 1 == t.unheld_count() and t.can_reserve("a") and not t.can_reserve("c")
    t.check_valid()


def test_unreserved_row_takes_a_slot_and_the_last_promise_is_taken_back():
    """The backstop reads only the table (what every rank shares): an uncounted row takes an
    unheld slot; the reservation made last, which no unheld slot backs now, is shed."""
    t = SlotTable(3)
    t.reserve("r1", "a")
    t.reserve("r2", "b")
    picks = t.begin_admit([("x", "c")])
    assert t.finish_miss(picks, picks.misses[0]) == 1 and t.slot_of("c") == 1
    assert picks.shed == [("r2", "b")] and t.reserved == {"r1": "a"}
    t.check_valid()  # len(demand()) <= unheld_count() again
    got = admit(t, [("r1", "a"), ("r2", "b")])
    assert got["r1"] == 2 and got["r2"] is None  # the counted row finds its slot; b finds none left
    t.check_valid()


def test_hit_on_held_slot_spends_the_reservation_for_free():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    t.reserve("r2", "a")
    assert len(t.demand()) == 0
    picks = t.begin_admit([("r2", "a")])
    assert picks.hits == [("r2", 1)] and picks.spent == [("r2", "a")] and t.unheld_count() == 1


def test_forget_keeps_weights_resident_and_unheld_until_reused():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    with pytest.raises(ValueError):
        t.forget("a")  # still held
    t.release("r1")
    assert t.forget("a") == 1
    assert t.slot_of("a") is None and t.adapters[1] == "a"  # stale weights stay
    got = admit(t, [("r2", "a")])  # a reload misses: an empty slot first
    assert got["r2"] == 2
    t.check_valid()


def test_rollback_gives_back_the_slots_and_keeps_the_cache():
    t = SlotTable(4)
    t.reserve("r1", "a")
    got = admit(t, [("r1", "a"), ("r2", "b")])
    assert t.rollback(["r1", "r2"]) == [got["r1"], got["r2"]]
    assert not t.holders and t.unheld_count() == 3 and t.slot_of("a") == got["r1"] and t.slot_of("b") == got["r2"]
    assert "r1" not in t.reserved  # spent: the row asks again
    t.check_valid()


@pytest.mark.parametrize("tamper", ["refcount", "held_slot0", "entries", "reservation", "free", "clock"])
def test_check_valid_catches_each_broken_invariant(tamper):
    t = SlotTable(4)
    admit(t, [("r1", "a"), ("r2", "b")])
    t.reserve("r3", "c")
    t.check_valid()
    if tamper == "refcount":
        t.refcounts[1] += 1
    elif tamper == "held_slot0":
        t.holders["r1"] = 0
    elif tamper == "entries":
        t.entries["a"] = 2
    elif tamper == "reservation":
        t.reserved["r4"] = "d"
        t._res_count["d"] = 1
        t.reserved["r5"] = "e"
        t._res_count["e"] = 1
    elif tamper == "free":
        t._free += 1
    elif tamper == "clock":
        t.last_used[2] = t.clock + 5
    with pytest.raises(AssertionError):
        t.check_valid()


def test_snapshot_is_plain_data_detached_from_the_table():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    snap = t.snapshot()
    t.release("r1")
    assert snap.refcounts[1] == 1 and snap.holders == {"r1": 1} and t.refcounts[1] == 0
    assert snap.adapters == (None, "a", None) and snap.clock == 1


def test_random_histories_keep_every_invariant():
    """Random admits (with failed misses), releases, reservations, rollbacks and forgets:
    check_valid holds after each, and no held slot ever changes its adapter."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    t = SlotTable(rng.randint(2, 7))
    names = [f"n{i}" for i in range(9)]
    live: dict[int, str] = {}
    nxt = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            rows = []
            for _ in range(rng.randint(1, 4)):
                rows.append((nxt, rng.choice(names)))
                live[nxt] = rows[-1][1]
                nxt += 1
            rows += [(r, live[r]) for r in rng.sample(sorted(live), min(2, len(live)))]
            held_before = {s: t.adapters[s] for s in range(1, t.num_slots) if t.refcounts[s]}
            rows = list(dict(rows).items())
            picks = t.begin_admit(rows)
            for m in picks.misses:
                if rng.random() < 0.8:
                    t.finish_miss(picks, m)
            for s, name in held_before.items():
                assert t.adapters[s] == name, f"seed {seed}: held slot {s} overwritten"
            if rng.random() < 0.2:
                t.rollback([rid for rid, _ in picks.hits])
        elif op < 0.6 and live:
            rid = rng.choice(sorted(live))
            t.release(rid)
            t.unreserve(rid)
            del live[rid]
        elif op < 0.85:
            rid, name = nxt, rng.choice(names)
            nxt += 1
            live[rid] = name
            if t.can_reserve(name):
                t.reserve(rid, name)
        else:
            name = rng.choice(names)
            s = t.slot_of(name)
            if s is not None and not t.refcounts[s]:
                t.forget(name)
        t.check_valid()
    for rid in list(live):
        t.release(rid)
        t.unreserve(rid)
    t.check_valid()
    assert not any(t.refcounts) and t.unheld_count() == t.num_slots - 1, f"seed {seed}"
