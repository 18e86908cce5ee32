"""The admit's backstop decides from what every rank of a lockstep instance shares.

The history of the issue (a third reading of seed 000): three slots with slot 0, rows r1, r2, r3
on adapters a, b, c; the leader reserves r1 and r3, which promises both unheld slots; every
rank then admits r2, which nobody asked for. A backstop that read the leader's reservations
refused r2 on the leader and gave it slot 1 on a follower, which keeps none: the tables split.
Now every rank gives r2 slot 1 (the table alone decides) and the leader takes back the
promise made last (r3's); r1 still finds its slot and r3, no longer counted, finds none, on
every rank alike. Pinned in the simulator and on real pools whose admits meet in ``agree``.
"""

from __future__ import annotations

import pytest

import sim
from lora_cupy.engine.resource import ResourceReqConfig
from lora_cupy.errors import CapacityError
from lora_cupy.pool import LoraAdapterPool
from sim.pool import Copy, Reserve
from tests.pool_helpers import SyntheticReader, small_spec
from tests.test_stateful_pool import TIMEOUT, TOUCHES, BarrierAgree, admit_on_every_rank

NODE = "llm"
ROWS = {"r1": "a", "r2": "b", "r3": "c"}


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_decide_an_unreserved_admit_alike(world):
    inst = sim.SimInstance(3, world)
    for a in "abc":
        inst.load_adapter(a)
    for rid, a in ROWS.items():
        inst.ingest_request(rid, a)
    for r in range(world):
        inst.deliver(r, len(inst.inbox[r]))
        for a in "abc":
            inst.complete_read(r, a)
    assert inst.reserve("r1") is Reserve.GRANTED and inst.reserve("r3") is Reserve.GRANTED
    res = inst.admit(["r2"])  # DivergenceError if a rank decided otherwise
    assert res.slots == (("r2", 1),) and not res.refused
    assert not inst.leader.requests["r3"].reserved and inst.leader.requests["r1"].reserved
    inst.commit()
    assert inst.admit(["r1"]).slots == (("r1", 2),)
    inst.commit()
    assert inst.reserve("r3") is Reserve.WAIT  # asks again: no slot is unheld
    assert inst.admit(["r3"]).refused == ("r3",)
    inst.check_valid()


def test_the_old_backstop_diverges_on_this_history():
    """The control: a rank that refuses from its own reservations splits the tables here."""

    class LeaderOnlyBackstop(sim.SimPool):
        def admit(self, rids, failed=None):
            if self.decides and any(self.requests[r].adapter not in self._reserved and
                                    len(self.demand()) >= self.slots.unheld_count() for r in rids):
                return sim.AdmitResult(refused=tuple(rids))
            return super().admit(rids, failed)

    inst = sim.SimInstance(3, 2)
    inst.ranks = [LeaderOnlyBackstop(3, decides=r == 0, name=f"rank{r}") for r in range(2)]
    for a in "abc":
        inst.load_adapter(a)
    for rid, a in ROWS.items():
        inst.ingest_request(rid, a)
    for r in range(2):
        inst.deliver(r, len(inst.inbox[r]))
        for a in "abc":
            inst.complete_read(r, a)
    inst.reserve("r1"), inst.reserve("r3")
    with pytest.raises(sim.DivergenceError):
        inst.admit(["r2"])


@pytest.mark.parametrize("world", [2, 3])
def test_real_ranks_decide_an_unreserved_admit_alike(world):
    touches = {a: TOUCHES[0] for a in "abc"}
    agree = BarrierAgree(world)
    pools = [LoraAdapterPool(small_spec(num_slots=3), "cpu", rank=r, world_size=world, agree=agree.for_rank(r),
                             decides=r == 0, reader=SyntheticReader(touches),
                             adapters={a: f"synthetic/{a}" for a in touches})
             for r in range(world)]
    try:
        for p in pools:
            for rid, a in ROWS.items():
                p.ingest_request(rid, ResourceReqConfig(a))
            for a in "abc":
                p.store.get(a).wait(TIMEOUT)
        leader = pools[0]
        assert leader.reserve("r1", NODE, (NODE,), False) == 1
        assert leader.reserve("r3", NODE, (NODE,), False) == 1

        def step(rows):
            outs, steps = admit_on_every_rank(pools, rows)
            for p, (s, ctx) in zip(pools, steps):
                p.commit(s, ctx)
            snaps = [p.snapshot() for p in pools]
            for snap in snaps[1:]:
                assert (snap.refcounts, snap.adapters, snap.last_used, snap.holders, snap.clock) == (
                    snaps[0].refcounts, snaps[0].adapters, snaps[0].last_used, snaps[0].holders, snaps[0].clock)
            for p in pools:
                p.check_valid()
            return outs, snaps[0]

        outs, snap = step(["r2"])
        assert all(o.ok for o in outs) and snap.holders == {"r2": 1}
        assert set(leader.slots.reserved) == {"r1"}  # r3's promise, made last, was taken back
        outs, snap = step(["r1"])
        assert all(o.ok for o in outs) and snap.holders == {"r2": 1, "r1": 2}
        outs, snap = step(["r3"])
        assert all(isinstance(o.failed.get("r3"), CapacityError) for o in outs)
        assert snap.holders == {"r2": 1, "r1": 2}
    finally:
        for p in pools:
            p.close()


def test_a_counted_miss_after_an_uncounted_one_in_one_step():
    """Within one admit: the uncounted row's take sheds the promise the later row relied on,
    and that row is refused for want of a victim (the same answer a follower gives)."""
    t = sim.SimPool(3)
    for a in "xyz":
        t.load_adapter(a)
    for rid, a in (("u", "x"), ("k1", "y"), ("k2", "z")):
        t.ingest_request(rid, a)
        t.complete_read(a)
    assert t.reserve("k1") is Reserve.GRANTED and t.reserve("k2") is Reserve.GRANTED
    follower = sim.SimPool(3, decides=False)
    for a in "xyz":
        follower.load_adapter(a)
    for rid, a in (("u", "x"), ("k1", "y"), ("k2", "z")):
        follower.ingest_request(rid, a)
        follower.complete_read(a)
    res, fres = t.admit(["u", "k1", "k2"]), follower.admit(["u", "k1", "k2"])
    assert res == fres and res.slots == (("u", 1), ("k1", 2)) and res.refused == ("k2",)
    assert t.snapshot() == follower.snapshot()
    t.check_valid()


def test_simulated_copy_timeout_fails_the_row_everywhere_and_the_copy_lands_later():
    """The sim's mirror of ``LockstepRank``'s copy timeout: rank 1's copy is still in flight when
    its wait gives up, so the row fails on every rank; the copy then lands, and the next admit
    of a request on that adapter installs it on every rank alike."""
    slow = {(1, "a")}
    inst = sim.SimInstance(3, 2, read_outcome=lambda r, a: None if (r, a) in slow else True)
    inst.load_adapter("a")
    inst.ingest_request("r", "a")
    inst.deliver(0, len(inst.inbox[0]))
    inst.complete_read(0, "a")
    assert inst.reserve("r") is Reserve.GRANTED
    res = inst.admit(["r"])
    assert res.failed == ("r",) and not res.slots
    assert inst.ranks[1].tier["a"] is Copy.PENDING  # still reading there
    inst.commit()
    inst.ingest_request("r2", "a")  # before r's teardown: the copy is kept on every rank
    inst.remove_request("r")
    slow.clear()
    res = inst.admit(["r2"])
    assert res.slots == (("r2", 1),)
    inst.check_valid()
