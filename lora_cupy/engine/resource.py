"""What a runner hands a resource, and what a resource answers: steps, contexts, outcomes.

A :class:`Resource` (the LoRA pool is one) takes part in a request's life in this order:
``ingest_request`` once; ``ask`` / ``reserve`` at the runner's admission, where a request waits
holding nothing; ``admit`` when a step first carries the request's rows, ``plan`` for every
step; ``commit`` after the step ran, or ``rollback_admit`` if it never will; and
``remove_request`` once no in-flight step references the request.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class ResourceReqConfig:
    """Per-request settings read at ingest: the adapter the request names (None: base model)."""

    adapter: str | None = None


@dataclass(frozen=True)
class EngineResourceInfo:
    """What an engine knows when it builds its resources (``LoraAdapterPool.build``).

    ``adapters`` are served from startup (name -> adapter directory); ``agree`` is the
    instance's collective over per-miss read outcomes (required when ``world_size > 1``).
    """

    device: Any = "cpu"
    rank: int = 0
    world_size: int = 1
    decides: bool = True
    agree: Callable[[np.ndarray], np.ndarray] | None = None
    backend: Any = None
    dtype: Any = None
    adapters: Mapping[str, Any] = field(default_factory=dict)
    reader: Callable | None = None
    max_host_bytes: int | None = None
    force_double_buffer: bool = True


@dataclass(frozen=True, eq=False)
class StepRows:
    """One node's rows of a step, in segment order: one row per request, ``num_tokens[i]`` tokens.

    ``starts[i]`` is row i's first token in the node's packed ``x``. Built once per step by the
    runner, so a resource's per-step work reads precomputed arrays.
    """

    rids: tuple
    num_tokens: np.ndarray  # [rows] int32
    starts: np.ndarray  # [rows] int32
    rid_set: frozenset
    total_tokens: int
    _grouped: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, rids: Sequence[Hashable], num_tokens) -> "StepRows":
        rids = tuple(rids)
        n = np.ones(len(rids), np.int32) if num_tokens is None else np.asarray(num_tokens, np.int32).reshape(-1)
        if n.shape[0] != len(rids):
            raise ValueError(f"{len(rids)} rows but {n.shape[0]} token counts")
        if n.size and n.min() < 1:
            raise ValueError("every row needs at least one token")
        rid_set = frozenset(rids)
        if len(rid_set) != len(rids):
            raise ValueError("a request appears in two rows of one step")
        starts = np.zeros(len(rids), np.int32)
        if len(rids) > 1:
            np.cumsum(n[:-1], out=starts[1:])
        return cls(rids, n, starts, rid_set, int(n.sum()))

    def __len__(self) -> int:
        return len(self.rids)

    def grouped(self, grouping: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(rows per segment, first row of each segment, total rows)`` when ``grouping``
        tokens make one row: a segment of n tokens gives ``ceil(n / grouping)`` rows, so a
        grouping past the longest segment gives one row per segment."""
        got = self._grouped.get(grouping)
        if got is None:
            if grouping == 1:
                got = (self.num_tokens, self.starts, self.total_tokens)
            else:
                per = ((self.num_tokens + grouping - 1) // grouping).astype(np.int32)
                starts = np.zeros(len(per), np.int32)
                if len(per) > 1:
                    np.cumsum(per[:-1], out=starts[1:])
                got = (per, starts, int(per.sum()))
            self._grouped[grouping] = got
        return got


class LoraStep:
    """One step's rows: ``rids[i]`` runs ``num_tokens[i]`` tokens (default 1) on node ``nodes[i]``
    (default: every row on ``node``). A resource reads only its node's rows (:meth:`rows_for`)."""

    def __init__(self, rids: Sequence[Hashable], num_tokens=None, nodes: Sequence[str] | None = None,
                 node: str = "llm", seq: int = 0):
        rids = tuple(rids)
        self.seq = seq
        if nodes is None:
            self._rows = {node: StepRows.of(rids, num_tokens)}
        else:
            nodes = tuple(nodes)
            if len(nodes) != len(rids):
                raise ValueError(f"{len(rids)} rows but {len(nodes)} nodes")
            n = np.ones(len(rids), np.int32) if num_tokens is None else np.asarray(num_tokens, np.int32)
            self._rows = {}
            for name in dict.fromkeys(nodes):
                idx = [i for i, x in enumerate(nodes) if x == name]
                self._rows[name] = StepRows.of([rids[i] for i in idx], n[idx])
        self._empty = StepRows.of((), None)

    def rows_for(self, node: str) -> StepRows:
        return self._rows.get(node, self._empty)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(self._rows)

    def __repr__(self) -> str:
        return f"LoraStep(seq={self.seq}, rows={ {k: len(v) for k, v in self._rows.items()} })"


@dataclass
class StepContext:
    """One step as the runner carries it between admit, plan and commit / rollback.

    ``preplanned``: plan runs ahead of the step before it (the runner activates the plan when
    the step runs). ``plan_results`` holds each resource's plan; ``state`` each resource's
    record of what its admit took.
    """

    seq: int = 0
    preplanned: bool = False
    plan_results: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AdmitOutcome:
    """A resource's answer at admission or admit.

    ``asks``: the row needs something the resource must reserve first (it waits in the
    admission queue). ``failed``: rows that fail, each with its typed error. Neither: go on.
    """

    asks: bool = False
    failed: Mapping[Hashable, BaseException] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.asks and not self.failed

    @classmethod
    def fail(cls, failed: Mapping[Hashable, BaseException]) -> "AdmitOutcome":
        return cls(failed=dict(failed))


AdmitOutcome.OK = AdmitOutcome()
AdmitOutcome.ASKS = AdmitOutcome(asks=True)


@runtime_checkable
class Resource(Protocol):
    """What the runner drives. ``decides``: this rank chooses batches (keeps reservations)."""

    decides: bool

    @property
    def force_double_buffer(self) -> bool: ...

    def ingest_request(self, rid: Hashable, overrides: ResourceReqConfig | None = None) -> None: ...

    def ask(self, rid: Hashable, node_name: str, graph_walk: Sequence[str]) -> AdmitOutcome | None: ...

    def reserve(self, rid: Hashable, node_name: str, graph_walk: Sequence[str], published: bool) -> int | None: ...

    def unreserve(self, rid: Hashable) -> None: ...

    def admit(self, step: LoraStep, ctx: StepContext) -> AdmitOutcome: ...

    def plan(self, step: LoraStep, ctx: StepContext) -> Any: ...

    def commit(self, step: LoraStep, ctx: StepContext) -> None: ...

    def rollback_admit(self, step: LoraStep, ctx: StepContext) -> None: ...

    def remove_request(self, rid: Hashable) -> None: ...
