"""SimInstance: the ranks of one tensor-parallel instance, each with its own SimPool.

What every rank sees in the same order: the leader's admits (and their commits/rollbacks).
What each rank sees in its own order: ingests and load/unload control messages (one FIFO per
rank, delivered whenever the caller says), read completions, and teardowns, each of which
lands between the same two admits on every rank (``after_tp_seq``). The admit is a
collective: the ranks agree which misses' reads failed anywhere, then each decides alone.
The model checks after every admit that all ranks decided the same and hold equal tables.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .errors import AdapterStateError, RequestStateError, SimError, UnknownAdapterError
from .pool import AdmitResult, Ask, Copy, Reserve, SimPool


@dataclass(frozen=True)
class Teardown:
    """A remove issued after admit ``after_tp_seq``; it lands before admit ``after_tp_seq + 1``."""

    rid: object
    after_tp_seq: int


class DivergenceError(SimError, AssertionError):
    """Two ranks of one instance made different slot decisions from the same admits."""


class SimInstance:
    """``world_size`` ranks (rank 0 decides) over ``num_slots`` slots each.

    ``read_outcome(rank, adapter) -> bool | None`` says whether a read lands ok; it is asked
    when a read is completed without an explicit outcome (a rank that must wait for its copy).
    None at an admit: the copy is still in flight when the rank's wait times out; the miss
    fails on every rank like a failed read, and the copy lands later (``complete_read``).
    """

    def __init__(self, num_slots: int, world_size: int, read_outcome=None):
        if not 1 <= int(world_size):
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.ranks = [SimPool(num_slots, decides=(r == 0), name=f"rank{r}") for r in range(world_size)]
        self.read_outcome = read_outcome or (lambda rank, adapter: True)
        self.seq = 0  # admits so far
        self.inbox: list[deque] = [deque() for _ in self.ranks]  # ("ingest", rid, a) / ("load", a, t) / ("unload", a)
        self.teardowns: list[list[Teardown]] = [[] for _ in self.ranks]
        self.live: dict[object, str | None] = {}  # rid -> adapter, as the leader's conductor sees it
        self.served: set[str] = set()  # adapters the API server serves now

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> SimPool:
        return self.ranks[0]

    # -- messages each rank takes in its own time ----------------------------------------------
    def load_adapter(self, name: str, touches: bool = True) -> None:
        """Serve ``name`` once no live request names it any more (a reload after an unload)."""
        if name in self.served or name in self.live.values():
            raise AdapterStateError(f"adapter {name!r}: served, or still named by a live request")
        self.served.add(name)
        for box in self.inbox:
            box.append(("load", name, touches))

    def unload_adapter(self, name: str) -> None:
        self.served.discard(name)
        for box in self.inbox:
            box.append(("unload", name))

    def ingest_request(self, rid, adapter: str | None) -> None:
        if rid in self.live:
            raise RequestStateError(f"request {rid!r} ingested twice")
        if adapter is not None and adapter not in self.served:
            raise UnknownAdapterError(f"adapter {adapter!r}: not served (request {rid!r})")
        self.live[rid] = adapter
        for box in self.inbox:
            box.append(("ingest", rid, adapter))

    def deliver(self, rank: int, count: int = 1) -> int:
        """Apply up to ``count`` of ``rank``'s queued messages, in order; returns how many."""
        done = 0
        pool, box = self.ranks[rank], self.inbox[rank]
        while box and done < count:
            msg = box.popleft()
            if msg[0] == "ingest":
                pool.ingest_request(msg[1], msg[2])
            elif msg[0] == "load":
                # The last requests on an unloaded adapter were torn down before this reload was
                # issued; landing their teardowns first is one of the orders that can happen.
                while msg[1] in pool.adapters and not pool.serves(msg[1]):
                    if self.land_teardown(rank) is None:
                        raise SimError(f"rank {rank}: reload of {msg[1]!r} while it still retires "
                                       "and no teardown is pending")
                pool.load_adapter(msg[1], touches=msg[2])
            else:
                pool.unload_adapter(msg[1])
            done += 1
        return done

    def _deliver_until_ingested(self, rank: int, rid) -> None:
        while rid not in self.ranks[rank].requests:
            if not self.deliver(rank):
                raise RequestStateError(f"request {rid!r} was never ingested on rank {rank}")

    def complete_read(self, rank: int, adapter: str, ok: bool | None = None) -> bool:
        """Land ``rank``'s read of ``adapter`` (outcome from ``read_outcome`` when None)."""
        if ok is None:
            ok = self.read_outcome(rank, adapter)
        return self.ranks[rank].complete_read(adapter, ok)

    def remove_request(self, rid) -> Teardown:
        """Issue ``rid``'s teardown after the current admit; each rank lands it in its own time."""
        if self.live.pop(rid, "absent") == "absent":
            raise RequestStateError(f"request {rid!r} removed but not live")
        t = Teardown(rid, self.seq)
        for queue in self.teardowns:
            queue.append(t)
        return t

    def land_teardown(self, rank: int) -> Teardown | None:
        """Land ``rank``'s oldest pending teardown (delivering its ingest first if need be)."""
        if not self.teardowns[rank]:
            return None
        t = self.teardowns[rank].pop(0)
        assert t.after_tp_seq == self.seq, "a teardown outlived the admit after which it had to land"
        self._deliver_until_ingested(rank, t.rid)
        self.ranks[rank].remove_request(t.rid)
        return t

    # -- the leader's decisions ----------------------------------------------------------------
    def ask(self, rid) -> Ask | None:
        self._deliver_until_ingested(0, rid)
        return self.leader.ask(rid)

    def reserve(self, rid) -> Reserve:
        self._deliver_until_ingested(0, rid)
        return self.leader.reserve(rid)

    def land_before_admit(self, rids) -> None:
        """What every rank must have seen before admitting ``rids``: every teardown issued
        since the last admit, and the messages up to each row's ingest."""
        for r in range(self.world_size):
            while self.teardowns[r]:
                self.land_teardown(r)
            for rid in rids:
                self._deliver_until_ingested(r, rid)

    def admit(self, rids) -> AdmitResult:
        """Admit ``rids`` on every rank, after every teardown issued since the last admit."""
        rids = list(rids)
        self.land_before_admit(rids)
        # The collective: where each miss's copy stands, on every rank. A rank whose copy is
        # still in flight waits for it; any rank's failure fails the miss everywhere.
        failed: set[str] = set()
        for r, pool in enumerate(self.ranks):
            for rid in rids:
                req = pool.requests[rid]
                if not req.touches or req.slot is not None or pool.slots.slot_of(req.adapter) is not None:
                    continue
                if pool.tier.get(req.adapter) is Copy.PENDING:
                    ok = self.read_outcome(r, req.adapter)
                    if ok is None:  # still in flight after the wait's timeout: fails everywhere
                        failed.add(req.adapter)
                        continue
                    self.complete_read(r, req.adapter, ok)
                if pool.tier.get(req.adapter) is Copy.FAILED:
                    failed.add(req.adapter)
        results = [pool.admit(rids, failed=failed) for pool in self.ranks]
        self.seq += 1
        self._check_same(results, f"admit {self.seq} of {rids}")
        return results[0]

    def commit(self) -> None:
        for pool in self.ranks:
            pool.commit()

    def rollback_admit(self) -> None:
        given = [pool.rollback_admit() for pool in self.ranks]
        self._check_same(given, "rollback")

    # -- checking ------------------------------------------------------------------------------
    def _check_same(self, per_rank, what: str) -> None:
        for r in range(1, self.world_size):
            if per_rank[r] != per_rank[0]:
                raise DivergenceError(f"{what}: rank {r} decided {per_rank[r]}, rank 0 {per_rank[0]}")
        snaps = [p.snapshot() for p in self.ranks]
        for r in range(1, self.world_size):
            # ``current`` may differ: an unload lands on each rank in its own time.
            if (snaps[r].adapters, snaps[r].refcounts, snaps[r].last_used, snaps[r].clock) != \
                    (snaps[0].adapters, snaps[0].refcounts, snaps[0].last_used, snaps[0].clock):
                raise DivergenceError(f"after {what}: rank {r} table {snaps[r]} != rank 0 {snaps[0]}")

    def check_valid(self) -> None:
        for pool in self.ranks:
            pool.check_valid()
