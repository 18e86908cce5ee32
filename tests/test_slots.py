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
    assert t.refcount[0] == 0 and t.resident[0] is None
    t.check_valid()


def test_refcount_counts_holders_and_release_frees():
    t = SlotTable(3)
    got = admit(t, [("a", "x"), ("b", "x"), ("c", "x")])
    s = got["a"]
    assert got["b"] == got["c"] == s and t.refcount[s] == 3 and t.free == 1
    assert t.release("b") == s and t.refcount[s] == 2
    assert t.release("b") is None  # twice is a no-op
    t.release("a"), t.release("c")
    assert t.refcount[s] == 0 and t.free == 2 and t.lookup("x") == s  # stays resident, unheld
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
    assert got["r5"] == second and t.lookup("b") is None and t.lookup("d") == second
    got = admit(t, [("r6", "e")])
    assert got["r6"] == third  # then c
    assert t.lookup("a") == first
    t.check_valid()


def test_clock_advances_once_per_admit_that_takes_and_stamps_taken_slots():
    t = SlotTable(4)
    assert t.clock == 0 and t.last_use == [NEVER] * 4
    admit(t, [("r1", "a"), ("r2", "b")])
    assert t.clock == 1 and t.last_use[1] == t.last_use[2] == 1 and t.last_use[3] == NEVER
    admit(t, [])
    assert t.clock == 1  # took nothing
    t.release("r1")
    assert t.last_use[1] == 1  # releases stamp nothing
    admit(t, [("r3", "a")])
    assert t.clock == 2 and t.last_use[1] == 2


def test_hits_take_their_slot_before_any_miss_picks_a_victim():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    admit(t, [("r2", "b")])
    t.release("r1"), t.release("r2")
    # a is the LRU unheld slot; a miss listed first must not evict it from under a later hit
    got = admit(t, [("m", "c"), ("h", "a")])
    assert got["h"] == t.lookup("a") == 1
    assert got["m"] == 2 and t.lookup("b") is None
    t.check_valid()


def test_failed_miss_takes_no_slot_and_the_next_gets_its_victim():
    t = SlotTable(4)
    picks = t.begin_admit([("r1", "a"), ("r2", "b")])
    assert picks.victims == [1, 2]
    # a's read failed: the miss for b takes the first victim
    s = t.finish_miss(picks, picks.misses[1])
    assert s == 1 and t.lookup("b") == 1 and t.lookup("a") is None and "r1" not in t.held
    t.check_valid()


def test_no_victim_left_refuses_without_change():
    t = SlotTable(2)
    admit(t, [("r1", "a")])
    before = t.snapshot()
    got = admit(t, [("r2", "b")])
    assert got["r2"] is None
    after = t.snapshot()
    assert after.slot_of == before.slot_of and after.refcount == before.refcount and after.held == before.held


def test_reservations_count_adapters_not_rows_and_never_exceed_free():
    t = SlotTable(3)  # two slots
    assert t.can_reserve("a")
    t.reserve("r1", "a")
    t.reserve("r2", "a")  # a is counted already: costs nothing more
    assert t.need == 1
    t.reserve("r3", "b")
    assert t.need == 2 == t.free
    assert not t.can_reserve("c")
    with pytest.raises(ValueError):
        t.reserve("r4", "c")
    got = admit(t, [("r1", "a")])
    assert got["r1"] and "r1" not in t.reserved
    # a is held now: r2's reservation costs nothing, the one free slot stays promised to b
    assert t.need == 1 == t.free and t.can_reserve("a") and not t.can_reserve("c")
    t.check_valid()


def test_unreserved_row_may_not_take_a_promised_slot():
    t = SlotTable(3)
    t.reserve("r1", "a")
    t.reserve("r2", "b")
    got = admit(t, [("x", "c")])
    assert got["x"] is None and t.lookup("c") is None  # the backstop
    got = admit(t, [("r1", "a"), ("r2", "b")])
    assert got["r1"] and got["r2"] and not t.reserved
    t.check_valid()


def test_hit_on_held_slot_spends_the_reservation_for_free():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    t.reserve("r2", "a")
    assert t.need == 0
    picks = t.begin_admit([("r2", "a")])
    assert picks.hits == [("r2", 1)] and picks.spent == [("r2", "a")] and t.free == 1


def test_forget_keeps_weights_resident_and_unheld_until_reused():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    with pytest.raises(ValueError):
        t.forget("a")  # still held
    t.release("r1")
    assert t.forget("a") == 1
    assert t.lookup("a") is None and t.resident[1] == "a"  # stale weights stay
    got = admit(t, [("r2", "a")])  # a reload misses: an empty slot first
    assert got["r2"] == 2
    t.check_valid()


def test_rollback_gives_back_the_slots_and_keeps_the_cache():
    t = SlotTable(4)
    t.reserve("r1", "a")
    got = admit(t, [("r1", "a"), ("r2", "b")])
    assert t.rollback(["r1", "r2"]) == [got["r1"], got["r2"]]
    assert not t.held and t.free == 3 and t.lookup("a") == got["r1"] and t.lookup("b") == got["r2"]
    assert "r1" not in t.reserved  # spent: the row asks again
    t.check_valid()


@pytest.mark.parametrize("tamper", ["refcount", "held_slot0", "slot_of", "reservation", "free", "clock"])
def test_check_valid_catches_each_broken_invariant(tamper):
    t = SlotTable(4)
    admit(t, [("r1", "a"), ("r2", "b")])
    t.reserve("r3", "c")
    t.check_valid()
    if tamper == "refcount":
        t.refcount[1] += 1
    elif tamper == "held_slot0":
        t.held["r1"] = 0
    elif tamper == "slot_of":
        t.slot_of["a"] = 2
    elif tamper == "reservation":
        t.reserved["r4"] = "d"
        t._res_count["d"] = 1
        t.reserved["r5"] = "e"
        t._res_count["e"] = 1
    elif tamper == "free":
        t._free += 1
    elif tamper == "clock":
        t.last_use[2] = t.clock + 5
    with pytest.raises(AssertionError):
        t.check_valid()


def test_snapshot_is_plain_data_detached_from_the_table():
    t = SlotTable(3)
    admit(t, [("r1", "a")])
    snap = t.snapshot()
    t.release("r1")
    assert snap.refcount[1] == 1 and snap.held == {"r1": 1} and t.refcount[1] == 0
    assert snap.resident == (None, "a", None) and snap.clock == 1


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
            held_before = {s: t.resident[s] for s in range(1, t.num_slots) if t.refcount[s]}
            rows = list(dict(rows).items())
            picks = t.begin_admit(rows)
            for m in picks.misses:
                if rng.random() < 0.8:
                    t.finish_miss(picks, m)
            for s, name in held_before.items():
                assert t.resident[s] == name, f"seed {seed}: held slot {s} overwritten"
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
            s = t.lookup(name)
            if s is not None and not t.refcount[s]:
                t.forget(name)
        t.check_valid()
    for rid in list(live):
        t.release(rid)
        t.unreserve(rid)
    t.check_valid()
    assert not any(t.refcount) and t.free == t.num_slots - 1, f"seed {seed}"
