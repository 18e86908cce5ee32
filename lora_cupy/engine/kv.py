"""A paged KV cache as a Resource: pages per request, counted at admission, freed at removal.

A request names how many tokens it will hold (``KVReqConfig.max_tokens``). At the runner's
admission it ASKS, and ``reserve`` counts its pages against the free ones (0: wait, holding
nothing). Its first admit hands it those pages, which it holds until ``remove_request``; a
rolled-back admit gives them back, and the reservation with them (the runner queues the row
again). Page 0 is the null page: never handed out, where a capture bucket's padding rows write.

``kv[pages, page_size, width]`` is the cache itself, a device array (NumPy on cpu, CuPy on
cuda); token ``p`` of a request lives at flat row ``page_table[rid][p // page_size] * page_size
+ p % page_size`` (:meth:`slot_of`). ``plan`` gives each row's flat row for this step's token.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError
from .resource import AdmitOutcome, LoraStep, ResourceReqConfig, StepContext


@dataclass(frozen=True)
class KVReqConfig(ResourceReqConfig):
    """A request's settings for every resource: its adapter (the LoRA pools) and the most tokens
    it will hold in the KV cache (prompt and generated)."""

    max_tokens: int = 1


class PagedKVCache:
    """``num_pages - 1`` pages of ``page_size`` token rows of ``width`` values, for node ``node``."""

    supports_preplan = True
    force_double_buffer = False

    def __init__(self, num_pages: int, page_size: int, width: int, node: str = "llm", device=None,
                 dtype="float32", decides: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size < 1 or width < 1:
            raise ValueError(f"page_size and width must be >= 1, got {page_size}, {width}")
        self.num_pages, self.page_size, self.width, self.node = num_pages, page_size, width, node
        self.decides = decides
        self.device = device
        self.kv = (np.zeros((num_pages * page_size, width), dtype) if device is None
                   else device.zeros((num_pages * page_size, width), dtype))  # [pages * page_size, width]
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # a stack: lowest page first
        self._need: dict[Hashable, int] = {}  # rid -> pages it will hold (ingested requests)
        self._reserved: dict[Hashable, int] = {}
        self._pages: dict[Hashable, list[int]] = {}  # rid -> its pages, in token order

    # -- requests ---------------------------------------------------------------------------
    def pages_for(self, max_tokens: int) -> int:
        return -(-int(max_tokens) // self.page_size)

    def ingest_request(self, rid: Hashable, overrides: ResourceReqConfig | None = None) -> None:
        tokens = getattr(overrides, "max_tokens", 1)
        need = self.pages_for(tokens)
        if tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {tokens}")
        if need > self.num_pages - 1:
            raise CapacityError(f"request {rid!r} needs {need} KV pages ({tokens} tokens), "
                                f"the cache has {self.num_pages - 1}")
        with self._lock:
            if rid in self._need:
                raise ValueError(f"request {rid!r} was ingested already")
            self._need[rid] = need

    def remove_request(self, rid: Hashable) -> None:
        """Free the request's pages (the worker calls this once no in-flight step reads them)."""
        with self._lock:
            self._need.pop(rid, None)
            self._reserved.pop(rid, None)
            self._free.extend(reversed(self._pages.pop(rid, [])))

    # -- admission ----------------------------------------------------------------------------
    def ask(self, rid: Hashable, node_name: str, graph_walk: Sequence[str] = ()) -> AdmitOutcome | None:
        if not self.decides or node_name != self.node:
            return None
        with self._lock:
            self._check_ingested(rid)
            if rid in self._pages or rid in self._reserved:
                return None
            return AdmitOutcome.ASKS

    def reserve(self, rid: Hashable, node_name: str, graph_walk: Sequence[str] = (),
                published: bool = False) -> int | None:
        """1 when the request's pages are counted against the free ones, 0 to wait."""
        if not self.decides or node_name != self.node:
            return None
        with self._lock:
            self._check_ingested(rid)
            if rid in self._pages:
                return None
            if rid in self._reserved:
                return 1
            need = self._need[rid]
            if need > len(self._free) - sum(self._reserved.values()):
                return 0
            self._reserved[rid] = need
            return 1

    def unreserve(self, rid: Hashable) -> None:
        with self._lock:
            self._reserved.pop(rid, None)

    def _check_ingested(self, rid: Hashable) -> None:
        if rid not in self._need:
            raise ValueError(f"request {rid!r} was never ingested by the KV cache")

    # -- a step ------------------------------------------------------------------------------
    def admit(self, step: LoraStep, ctx: StepContext) -> AdmitOutcome:
        """Hand each row that holds no pages yet its pages: the reserved count, or, for a row
        that reached the step without a reservation (a non-deciding rank), as many as are free."""
        rows = step.rows_for(self.node)
        taken, failed = [], {}
        ctx.state[self] = taken  # filled as pages are handed out: a rollback gives back what was taken
        with self._lock:
            for rid in rows.rids:
                if rid in self._pages:
                    continue
                if rid not in self._need:
                    raise ValueError(f"row {rid!r} of step {ctx.seq} was never ingested by the KV cache")
                need = self._reserved.pop(rid, None)
                if need is None:
                    need = self._need[rid]
                    if need > len(self._free) - sum(self._reserved.values()):
                        failed[rid] = CapacityError(f"request {rid!r} gets no KV pages: {need} needed, "
                                                    f"{len(self._free)} free and some promised")
                        continue
                self._pages[rid] = [self._free.pop() for _ in range(need)]
                taken.append(rid)
        return AdmitOutcome.fail(failed) if failed else AdmitOutcome.OK

    def rollback_admit(self, step: LoraStep, ctx: StepContext) -> None:
        """Give back the pages this step's admit handed out (and no reservation is kept)."""
        taken = ctx.state.pop(self, None) or []
        with self._lock:
            for rid in taken:
                self._free.extend(reversed(self._pages.pop(rid, [])))

    def plan(self, step: LoraStep, ctx: StepContext):
        ctx.plan_results[self] = None
        return None

    def commit(self, step: LoraStep, ctx: StepContext) -> None:
        ctx.state.pop(self, None)

    # -- addressing ----------------------------------------------------------------------------
    def slot_of(self, rid: Hashable, position: int) -> int:
        """The flat row of ``kv`` that holds token ``position`` of ``rid``."""
        with self._lock:
            pages = self._pages.get(rid)
            if pages is None:
                raise ValueError(f"request {rid!r} holds no KV pages")
        page = position // self.page_size
        if not 0 <= page < len(pages):
            raise IndexError(f"request {rid!r}: token {position} is past its {len(pages)} pages")
        return pages[page] * self.page_size + position % self.page_size

    def slots_of(self, rids, positions) -> np.ndarray:
        """``[rows]`` int64: the flat row of ``kv`` holding token ``positions[i]`` of ``rids[i]``,
        0 (the null page's first row) where a position is negative."""
        positions = np.asarray(positions, np.int64)
        out = np.zeros(len(positions), np.int64)
        ps = self.page_size
        with self._lock:
            for i, (rid, p) in enumerate(zip(rids, positions.tolist())):
                if p < 0:
                    continue
                pages = self._pages.get(rid)
                if pages is None:
                    raise ValueError(f"request {rid!r} holds no KV pages")
                if p // ps >= len(pages):
                    raise IndexError(f"request {rid!r}: token {p} is past its {len(pages)} pages")
                out[i] = pages[p // ps] * ps + p % ps
        return out

    def pages(self, rid: Hashable) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._pages.get(rid, ()))

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def held_pages(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._pages.values())

    @property
    def reserved_pages(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

    def check_valid(self) -> None:
        """Every page but the null one is free or held by exactly one request; reservations
        never promise more pages than are free; only ingested requests hold or reserve."""
        with self._lock:
            held = [p for pages in self._pages.values() for p in pages]
            every = held + self._free
            assert 0 not in every, "the null page was handed out"
            assert len(every) == len(set(every)), "a KV page is free and held, or held twice"
            assert sorted(every) == list(range(1, self.num_pages)), "a KV page was lost"
            assert sum(self._reserved.values()) <= len(self._free), "KV reservations promise more than is free"
            for rid in (*self._pages, *self._reserved):
                assert rid in self._need, f"removed request {rid!r} holds or reserves KV pages"
            assert not set(self._pages) & set(self._reserved), "a request holds pages and a reservation"
