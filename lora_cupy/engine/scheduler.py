"""The micro-scheduler: which lane each piece of ready work belongs to, and the work itself.

Work is keyed by ``(rid, node)``. A node whose node group sets ``side_stream: true`` runs on
the side lane (``SIDE_LANE``); every other node on the main chain (``CHAIN_LANE``). A lane is
handed only its own keys (:meth:`MicroScheduler.take`), so the chain never picks up a codec
window and the side lane never a decode row. Items under one key stay in the order they were
put, which is what keeps a request's windows in order.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

CHAIN_LANE = 0
SIDE_LANE = 1


@dataclass
class ScheduledBatch:
    """One step of one lane: its sequence number, node, and the rows (or windows) it carries."""

    lane: int
    seq: int
    node: str
    rids: tuple
    items: list = field(default_factory=list)  # chain: (rid, position, prompt); codec: windows


class MicroScheduler:
    """Ready work per ``(rid, node)`` key; ``side_nodes`` run on ``SIDE_LANE``."""

    def __init__(self, side_nodes: Iterable[str] = ()):
        self.side_nodes = frozenset(side_nodes)
        self._lock = threading.Lock()
        self._ready: dict[int, OrderedDict[tuple, list]] = {CHAIN_LANE: OrderedDict(), SIDE_LANE: OrderedDict()}

    def lane_of(self, key: tuple[Hashable, str]) -> int:
        """The lane a key's work runs on: by its node."""
        _rid, node = key
        return SIDE_LANE if node in self.side_nodes else CHAIN_LANE

    def put(self, key: tuple[Hashable, str], item: Any) -> None:
        """Queue ``item`` under ``key``, after what is queued there already."""
        self.put_many(((key, item),))

    def put_many(self, items: Iterable[tuple[tuple[Hashable, str], Any]]) -> None:
        """``put(key, item)`` for each ``(key, item)``, in order, under one lock."""
        side, chain, side_nodes = self._ready[SIDE_LANE], self._ready[CHAIN_LANE], self.side_nodes
        with self._lock:
            for key, item in items:
                ready = side if key[1] in side_nodes else chain  # lane_of(key)
                queued = ready.get(key)
                if queued is None:
                    ready[key] = [item]
                else:
                    queued.append(item)

    def take(self, lane: int, limit: int | None = None) -> list[tuple[tuple, list]]:
        """Everything ready on ``lane`` (up to ``limit`` keys), oldest key first; taken off."""
        with self._lock:
            ready = self._ready[lane]
            if limit is None or limit >= len(ready):  # all of it, in one go
                out = list(ready.items())
                ready.clear()
                return out
            out = []
            while ready and len(out) < limit:
                out.append(ready.popitem(last=False))
            return out

    def pending(self, lane: int) -> int:
        with self._lock:
            return sum(len(v) for v in self._ready[lane].values())

    def drop(self, rid: Hashable) -> list:
        """Forget every queued item of ``rid`` (it was removed or failed); returns them."""
        with self._lock:
            out = []
            for ready in self._ready.values():
                for key in [k for k in ready if k[0] == rid]:
                    out.extend(ready.pop(key))
            return out
