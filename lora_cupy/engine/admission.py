"""The runner's admission queue: one queue for every resource that asks.

A request that wants to run on a node is submitted here. :meth:`AdmissionQueue.pump` lets
requests through in order while every resource lets them: each resource is asked (``ask``),
and those that ask are asked to ``reserve``. A reservation of 0 means "not yet": what the
request got from the others in that pass is given back, so it waits holding nothing. A
resource whose answer fails the row lets it through at once: the step's admit fails it on
every rank alike, before any slot is handed out.

Order. New requests pass in arrival order: one that must wait holds back every new request
behind it, so none starves. A request that already runs (let through on an earlier node of
its walk, or submitted ``published``) is not held back by new requests ahead of it, only by
running ones: it may hold a slot a waiting new request needs, so waiting behind that request
would close a cycle.

With pools on several nodes the queue also keeps the pools' waits acyclic: given
``node_order`` (e.g. ``("encoder", "llm")``), a request may wait on a node only while it holds
nothing on a later one. A request that walks the encoder before the LLM always does, so a
request holding an LLM slot never waits on the encoder's pool; LLM holders wait on nothing,
encoder holders only on LLM holders, and no cycle of waits can form.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .resource import Resource


@dataclass
class Waiting:
    """A request waiting at admission to run on ``node``."""

    rid: Hashable
    node: str
    graph_walk: tuple[str, ...]
    published: bool = False


@dataclass
class Granted:
    """A request let through to run on ``node``; ``failed`` holds the errors that fail its row
    at admit (a read failed), by resource."""

    rid: Hashable
    node: str
    failed: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


class AdmissionQueue:
    """FIFO admission over ``resources``; ``node_order`` (optional) orders pools' nodes."""

    def __init__(self, resources: Sequence[Resource], node_order: Sequence[str] | None = None):
        self.resources = list(resources)
        self.node_order = None if node_order is None else {n: i for i, n in enumerate(node_order)}
        self._queue: deque[Waiting] = deque()
        self._holds: dict[Hashable, set[str]] = {}

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def waiting(self) -> list[Waiting]:
        return list(self._queue)

    def holds(self, rid: Hashable) -> frozenset[str]:
        """Nodes on which ``rid`` was let through (and holds whatever it took there)."""
        return frozenset(self._holds.get(rid, ()))

    def submit(self, rid: Hashable, node: str, graph_walk: Sequence[str] = (), published: bool = False) -> None:
        """Queue ``rid`` to run on ``node``. Refuses (ValueError) a wait that could close a cycle:
        waiting on ``node`` while holding something on a node after it in ``node_order``."""
        if self.node_order is not None:
            mine = self.node_order.get(node)
            if mine is None:
                raise ValueError(f"node {node!r} is not in the admission's node order {list(self.node_order)}")
            later = [n for n in self._holds.get(rid, ()) if self.node_order.get(n, -1) > mine]
            if later:
                raise ValueError(f"request {rid!r} would wait on node {node!r} while holding {sorted(later)}, "
                                 "which come after it: waits between pools could form a cycle")
        if any(w.rid == rid and w.node == node for w in self._queue):
            raise ValueError(f"request {rid!r} is queued for node {node!r} already")
        self._queue.append(Waiting(rid, node, tuple(graph_walk) or (node,), published))

    def cancel(self, rid: Hashable) -> None:
        """Forget ``rid`` here (it was removed): its queued entries, and what it held."""
        self._queue = deque(w for w in self._queue if w.rid != rid)
        self._holds.pop(rid, None)

    def _published(self, w: Waiting) -> bool:
        return w.published or w.rid in self._holds

    def pump(self, limit: int | None = None) -> list[Granted]:
        """Let requests through, in order, until nothing more may pass (or ``limit``)."""
        out: list[Granted] = []
        held_back_new = False
        for w in list(self._queue):
            if limit is not None and len(out) >= limit:
                break
            published = self._published(w)
            if held_back_new and not published:
                continue
            granted = self._try(w)
            if granted is None:
                if published:
                    break  # a running request waits: everything behind it waits too
                held_back_new = True
                continue
            self._queue.remove(w)
            self._holds.setdefault(w.rid, set()).add(w.node)
            out.append(granted)
        return out

    def _try(self, w: Waiting) -> Granted | None:
        """Ask and reserve ``w`` at every resource; None (holding nothing) if it must wait."""
        failed: dict = {}
        asking = []
        for r in self.resources:
            o = r.ask(w.rid, w.node, w.graph_walk)
            if o is None:
                continue
            if o.failed:
                failed[r] = o.failed.get(w.rid, next(iter(o.failed.values())))
            elif o.asks:
                asking.append(r)
        got = []
        for r in asking:
            n = r.reserve(w.rid, w.node, w.graph_walk, self._published(w))
            if n is None:
                continue  # let through: its admit fails the row
            if n == 0:
                for g in got:
                    g.unreserve(w.rid)
                return None
            got.append(r)
        return Granted(w.rid, w.node, failed)
