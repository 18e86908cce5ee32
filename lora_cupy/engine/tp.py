"""Tensor parallelism over torch.distributed: one process per rank, every rank's pools in lockstep.

The leader (rank 0 of the instance's group) chooses batches. Each step it broadcasts a
:class:`StepOrder`: the step's rows, the teardowns issued since the last admit (each lands
between the same two admits on every rank: ``after_tp_seq``), and whether the last step's
admit was rolled back. Every rank applies them in that order to its own pools (the leader's
with ``decides=True``, the followers' without reservations) and so makes the same slot
decisions with no journal (README invariant 5). Ingests, loads and unloads come from the
conductor, on any thread, whenever they arrive on a rank; a step or teardown that names a
request this rank has not ingested yet waits for it, for at most ``ingest_timeout``.

``agree`` (what each pool is built with, :meth:`LockstepRank.pool_kwargs`) is one
``all_reduce(MAX)`` over the admit's per-miss read outcomes on the instance's group (invariant
7). Where the answer says a copy is still in flight somewhere, each rank's pool waits for its
own, outside every lock, for at most its ``read_timeout``; a copy still in flight then counts
as failed, and the pools agree once more, so the row fails on every rank instead of the step
hanging.

A collective that fails or outlives the group's timeout (another rank died, or stopped
answering) raises :class:`RankFailureError`, which names this rank and what it was doing.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from ..errors import LoraError
from .resource import AdmitOutcome, LoraStep, ResourceReqConfig, StepContext


class RankFailureError(LoraError):
    """Another rank of the instance died or stopped answering: a collective failed or timed out."""


class LockstepError(LoraError):
    """The lockstep protocol was broken on this rank (a request never ingested in time, a
    teardown out of its place, a follower asked to decide), or two ranks' tables differ."""


@dataclass(frozen=True)
class Teardown:
    """A remove the leader issued after admit ``after_tp_seq``; it lands before the next one."""

    rid: Hashable
    after_tp_seq: int


@dataclass(frozen=True)
class StepOrder:
    """What the leader broadcasts for one step: admit ``seq``'s rows (``nodes[i]``: row i's
    node, None: all on the pools' default), the teardowns to land before it, whether admit
    ``seq - 1`` was rolled back, and anything the caller sends along (``payload``)."""

    seq: int
    rids: tuple = ()
    num_tokens: tuple | None = None
    nodes: tuple | None = None
    teardowns: tuple[Teardown, ...] = ()
    rollback_last: bool = False
    payload: Any = None
    stop: bool = False

    def step(self) -> LoraStep:
        return LoraStep(self.rids, self.num_tokens, self.nodes, seq=self.seq)


@dataclass
class StepResult:
    """One step on this rank: the order, the admitted step and its context (for commit or
    rollback), the rows every rank failed (rid -> error), and the step of the rows that run,
    planned on every pool."""

    order: StepOrder
    step: LoraStep
    ctx: StepContext
    failed: dict = field(default_factory=dict)
    running: LoraStep | None = None


class TPGroup:
    """The collectives of one instance: the leader's broadcast and the per-admit agreement.

    ``group``: the instance's process group (None: the default group); ``agree`` runs on it
    (NCCL on GPUs: a tiny tensor on this rank's device). The step orders are Python objects,
    sent on ``control_group`` (default: ``group`` when it is gloo, else a new gloo group of the
    same ranks). ``timeout``: seconds any collective may take before :class:`RankFailureError`
    (the process group's own timeout, set at ``init_process_group``, bounds what cannot wait
    with one: object broadcasts).
    """

    def __init__(self, group=None, *, control_group=None, timeout: float = 60.0):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise LockstepError("torch.distributed is not initialized: call init_process_group first")
        self._dist, self._torch = dist, torch
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = float(timeout)
        self.backend = str(dist.get_backend(group))
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        self.leader_global = ranks[0]
        if control_group is None:
            control_group = group if self.backend == "gloo" else dist.new_group(ranks, backend="gloo")
        self.control_group = control_group
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _fail(self, what: str, started: float, err: BaseException) -> RankFailureError:
        return RankFailureError(
            f"rank {self.rank} of {self.world_size}: {what} failed after {time.monotonic() - started:.1f}s: "
            f"another rank of the instance died or stopped answering ({type(err).__name__}: {err})")

    def _wait(self, work, what: str, started: float) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001  (gloo / NCCL raise RuntimeError subclasses)
            raise self._fail(what, started, e) from e
        if ok is False:
            raise self._fail(what, started, TimeoutError(f"no answer within {self.timeout:.1f}s"))

    def broadcast(self, obj: Any, what: str) -> Any:
        """The leader's ``obj`` on every rank (followers pass None)."""
        started = time.monotonic()
        box = [obj]
        try:
            self._dist.broadcast_object_list(box, src=self.leader_global, group=self.control_group)
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, started, e) from e
        return box[0]

    def all_reduce_max(self, values: np.ndarray, what: str) -> np.ndarray:
        """Elementwise maximum over the ranks of ``values`` (small int arrays)."""
        started = time.monotonic()
        t = self._torch.from_numpy(np.ascontiguousarray(values, np.int32)).to(self.device)
        work = self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait(work, what, started)
        return t.cpu().numpy().astype(values.dtype, copy=False)

    def all_gather_object(self, obj: Any, what: str) -> list:
        started = time.monotonic()
        out = [None] * self.world_size
        try:
            self._dist.all_gather_object(out, obj, group=self.control_group)
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, started, e) from e
        return out

    def barrier(self, what: str = "barrier") -> None:
        """Every rank reaches this point; a rank that does not within the timeout is named."""
        started = time.monotonic()
        try:
            if self.backend == "gloo" or self.control_group is not self.group:
                self._dist.monitored_barrier(group=self.control_group, timeout=timedelta(seconds=self.timeout),
                                             wait_all_ranks=True)
            else:
                self._wait(self._dist.barrier(group=self.group, async_op=True), what, started)
        except RankFailureError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, started, e) from e


class LockstepRank:
    """One rank of a lockstep instance: its pools, the leader's orders, and ``agree``.

    Build each pool with :meth:`pool_kwargs` (this rank's ``agree``, ``decides``, rank, world
    size and read timeout), then :meth:`add_pool` it. The leader calls :meth:`lead` per step and
    :meth:`remove_request` for teardowns; a follower loops on :meth:`follow` until it
    returns None. Every rank calls :meth:`finish` once the step ran (or never will). In each
    rank's process, once ``torch.distributed`` is initialized (``torchrun`` or ``mp.spawn``)::

        tp = LockstepRank(TPGroup())
        tp.add_pool(LoraAdapterPool(spec, f"cuda:{tp.rank}", adapters=served, **tp.pool_kwargs()))
        # the conductor, on any thread: tp.ingest_request(rid, ResourceReqConfig(name)), ...
        if tp.is_leader:
            res = tp.lead(rids, num_tokens)  # run the model on res.running, then:
            tp.finish()
            tp.remove_request(rid)  # a request that ended
        else:
            while (res := tp.follow()) is not None:
                ...  # run the model on res.running
                tp.finish()
    """

    def __init__(self, group: TPGroup, *, ingest_timeout: float = 30.0):
        self.group = group
        self.ingest_timeout = float(ingest_timeout)
        self.pools: list = []
        self.seq = 0  # admits done on this rank
        self.stats = Counter()
        self._cond = threading.Condition()
        self._adapter: dict[Hashable, str | None] = {}  # ingested rid -> the adapter it names
        self._teardowns: list[Teardown] = []  # leader: issued since the last admit
        self._last: StepResult | None = None
        self._finished = True
        self._rollback_last = False

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    def pool_kwargs(self, read_timeout: float = 30.0) -> dict:
        """What a ``LoraAdapterPool`` of this rank is built with: rank, world size, ``agree``,
        ``decides``, and ``read_timeout``, which bounds an admit's wait for a copy still in
        flight (the row then fails on every rank)."""
        return dict(rank=self.rank, world_size=self.world_size, agree=self.agree, decides=self.is_leader,
                    read_timeout=read_timeout)

    def add_pool(self, pool) -> None:
        """Drive ``pool`` in lockstep (built with this rank's ``agree`` and ``decides``)."""
        if pool.decides != self.is_leader:
            raise LockstepError(f"rank {self.rank}: a pool with decides={pool.decides} on a "
                                f"{'leader' if self.is_leader else 'follower'}")
        if getattr(pool, "world_size", self.world_size) != self.world_size:
            raise LockstepError(f"rank {self.rank}: pool built for world_size {pool.world_size}, "
                                f"instance has {self.world_size}")
        self.pools.append(pool)

    # -- the conductor's messages: any thread, whenever they arrive on this rank ---------------
    def ingest_request(self, rid: Hashable, overrides: ResourceReqConfig | None = None) -> None:
        """Open ``rid`` on every pool (its copy starts reading now)."""
        for pool in self.pools:
            pool.ingest_request(rid, overrides)
        with self._cond:
            self._adapter[rid] = None if overrides is None else overrides.adapter
            self._cond.notify_all()

    def load_adapter(self, name: str, path, digest: str | None = None) -> list:
        """Serve ``name`` on every pool; the futures of their loads.

        A reload can reach a follower before the teardowns of the adapter's last requests
        land there (they come with the leader's next order): it waits for them, for at most
        ``ingest_timeout``, rather than be refused as still retiring on this rank alone.
        """
        deadline = time.monotonic() + self.ingest_timeout
        with self._cond:
            while any(p.adapter_info(name) is not None and name not in p.served for p in self.pools):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockstepError(f"rank {self.rank}: reload of {name!r} while it still retires here "
                                        f"after {self.ingest_timeout:.1f}s", adapter=name, path=path)
                self.stats["reload_waits"] += 1
                self._cond.wait(left)
        return [pool.load_adapter_async(name, path, digest) for pool in self.pools]

    def unload_adapter(self, name: str) -> None:
        for pool in self.pools:
            pool.unload_adapter(name)

    def ingested(self, rid: Hashable) -> bool:
        with self._cond:
            return rid in self._adapter

    def _await_ingest(self, rids: Sequence[Hashable], why: str) -> None:
        deadline = time.monotonic() + self.ingest_timeout
        with self._cond:
            for rid in rids:
                while rid not in self._adapter:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LockstepError(f"rank {self.rank}: request {rid!r} was not ingested here within "
                                            f"{self.ingest_timeout:.1f}s ({why})")
                    self.stats["ingest_waits"] += 1
                    self._cond.wait(left)

    def _remove_here(self, rid: Hashable) -> None:
        for pool in self.pools:
            pool.remove_request(rid)
        with self._cond:
            self._adapter.pop(rid, None)
            self._cond.notify_all()

    # -- the leader ------------------------------------------------------------------------------
    def remove_request(self, rid: Hashable) -> Teardown:
        """The leader's teardown of ``rid`` (no in-flight step references it): lands here now
        and on every follower before the next admit."""
        if not self.is_leader:
            raise LockstepError(f"rank {self.rank}: a follower takes removes from the leader's orders")
        t = Teardown(rid, self.seq)
        self._remove_here(rid)
        self._teardowns.append(t)
        return t

    def lead(self, rids: Sequence[Hashable], num_tokens=None, nodes=None, *, payload: Any = None) -> StepResult:
        """Broadcast the next step and run its admit and plan here (leader only)."""
        if not self.is_leader:
            raise LockstepError(f"rank {self.rank}: only the leader chooses batches")
        self._check_finished()
        tokens = None if num_tokens is None else tuple(int(n) for n in num_tokens)
        order = StepOrder(self.seq + 1, tuple(rids), tokens, None if nodes is None else tuple(nodes),
                          tuple(self._teardowns), self._rollback_last, payload)
        self._teardowns, self._rollback_last = [], False
        self.group.broadcast(order, f"broadcast of step {order.seq}")
        return self._run(order)

    def stop(self, payload: Any = None) -> None:
        """Tell the followers there are no more steps (leader only)."""
        if not self.is_leader:
            raise LockstepError(f"rank {self.rank}: only the leader stops the instance")
        self._check_finished()
        if self._last is not None:
            for pool in self.pools:
                pool.commit(self._last.step, self._last.ctx)
            self._last = None
        order = StepOrder(self.seq + 1, teardowns=tuple(self._teardowns), rollback_last=self._rollback_last,
                          payload=payload, stop=True)
        self._teardowns, self._rollback_last = [], False
        self.group.broadcast(order, "broadcast of the stop")

    # -- a follower --------------------------------------------------------------------------------
    def follow(self, on_order=None) -> StepResult | None:
        """Take the leader's next order and run its admit and plan here; None once it stops.

        ``on_order(order)`` runs as soon as the order arrives, before anything lands: the
        place to hand its payload on (conductor messages the admit may wait for).
        """
        if self.is_leader:
            raise LockstepError("the leader does not follow")
        self._check_finished()
        order = self.group.broadcast(None, f"wait for step {self.seq + 1}")
        if not isinstance(order, StepOrder):
            raise LockstepError(f"rank {self.rank}: the leader sent {type(order).__name__}, not a StepOrder")
        if on_order is not None:
            on_order(order)
        self._land(order)
        if order.stop:
            return None
        return self._admit(order)

    # -- every rank --------------------------------------------------------------------------------
    def _check_finished(self) -> None:
        if not self._finished:
            raise LockstepError(f"rank {self.rank}: step {self.seq} was not finished (call finish)")

    def _land(self, order: StepOrder) -> None:
        """Before admit ``order.seq``: the last admit's rollback, then its teardowns."""
        if order.seq != self.seq + 1:
            raise LockstepError(f"rank {self.rank}: order for admit {order.seq} after admit {self.seq}")
        last, self._last = self._last, None
        if last is not None:
            for pool in self.pools:
                if order.rollback_last:
                    pool.rollback_admit(last.step, last.ctx)
                else:
                    pool.commit(last.step, last.ctx)
        for t in order.teardowns:
            if t.after_tp_seq != self.seq:
                raise LockstepError(f"rank {self.rank}: teardown of {t.rid!r} issued after admit "
                                    f"{t.after_tp_seq} arrived after admit {self.seq}")
            self._await_ingest([t.rid], f"its teardown lands before admit {order.seq}")
            self._remove_here(t.rid)

    def _run(self, order: StepOrder) -> StepResult:
        if self.is_leader:  # its rollback and teardowns landed already
            if self._last is not None:
                for pool in self.pools:
                    pool.commit(self._last.step, self._last.ctx)
                self._last = None
        return self._admit(order)

    def _admit(self, order: StepOrder) -> StepResult:
        self._await_ingest(order.rids, f"admit {order.seq} names it")
        step, ctx = order.step(), StepContext(seq=order.seq)
        failed: dict = {}
        self._finished = False
        for pool in self.pools:
            out: AdmitOutcome = pool.admit(step, ctx)
            for rid, err in out.failed.items():
                failed.setdefault(rid, err)
        self.seq = order.seq
        res = StepResult(order, step, ctx, failed)
        keep = [i for i, rid in enumerate(order.rids) if rid not in failed]
        if keep:
            n = None if order.num_tokens is None else [order.num_tokens[i] for i in keep]
            nodes = None if order.nodes is None else [order.nodes[i] for i in keep]
            res.running = LoraStep([order.rids[i] for i in keep], n, nodes, seq=order.seq)
        for pool in self.pools:
            pool.plan(res.running if res.running is not None else LoraStep(()), ctx)
        self._last = res
        self.stats["admits"] += 1
        self.stats["failed_rows"] += len(failed)
        return res

    def finish(self, rollback: bool = False) -> None:
        """The step ran (or, ``rollback``, never will). The leader rolls back now and tells the
        followers with the next order; they ignore ``rollback`` and take the leader's word."""
        if self._finished:
            raise LockstepError(f"rank {self.rank}: no step to finish")
        self._finished = True
        if self.is_leader and rollback:
            last, self._last = self._last, None
            for pool in self.pools:
                pool.rollback_admit(last.step, last.ctx)
            self._rollback_last = True
            self.stats["rollbacks"] += 1

    # -- agree ---------------------------------------------------------------------------------------
    def agree(self, local: np.ndarray) -> np.ndarray:
        """The pools' ``agree``: the instance's elementwise maximum of each miss's read outcome,
        one all-reduce on the group. A pool calls it a second time in one admit only when the
        first answer said some copy was still in flight (every rank then does)."""
        out = self.group.all_reduce_max(local, f"agree of admit {self.seq + 1}")
        self.stats["agrees"] += 1
        return out

    # -- checks --------------------------------------------------------------------------------------
    def tables(self) -> list[dict]:
        """What every rank must hold alike, per pool: refcounts, residents, LRU stamps, clock,
        holders (name -> slot entries may differ while an unload lands in each rank's time)."""
        out = []
        for pool in self.pools:
            s = pool.snapshot()
            out.append({"refcounts": tuple(s.refcounts), "adapters": tuple(s.adapters),
                        "last_used": tuple(s.last_used), "clock": s.clock, "holders": dict(s.holders)})
        return out

    def check_lockstep(self, extra: Any = None) -> list:
        """Gather every rank's :meth:`tables` (and ``extra``, e.g. the step's failed rows) and
        raise :class:`LockstepError` naming the first rank that differs from the leader.
        Collective: every rank calls it at the same point. Returns the gathered values."""
        mine = (self.seq, self.tables(), extra)
        got = self.group.all_gather_object(mine, f"lockstep check after admit {self.seq}")
        for r, theirs in enumerate(got[1:], start=1):
            if theirs != got[0]:
                raise LockstepError(f"after admit {self.seq}: rank {r} holds {theirs}, the leader {got[0]}")
        return got
