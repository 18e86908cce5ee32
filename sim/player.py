"""The workload player: a trace through one SimPool, for sizing a pool's slots.

Time runs in steps of ``step_time`` seconds. A request is ingested at its arrival, which
starts the read of its adapter's host copy (``read_base + read_per_rank * rank`` seconds,
shared by every live request on that adapter). At each step the runner removes the requests
that finished, then walks its admission queue in arrival order: a request is admitted when the
batch has room and ``reserve`` grants it (its copy is in and a slot can take its adapter).
A request still waiting for its copy lets later ones pass; one waiting for a slot stops the
walk (``admission="fifo"``, so a popular adapter's stream of hits cannot starve it) or lets
later ones pass too (``"pass"``). The admitted rows go through one ``admit`` and then run
``tokens`` steps. Steps where nothing can change are skipped, so long traces stay cheap.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .errors import TraceError
from .pool import Copy, Reserve, SimPool
from .workload import Trace

ADMISSION = ("fifo", "pass")
PROGRESS_MIN_REQUESTS = 5000  # a progress bar is shown by default from this many requests


@dataclass(frozen=True)
class PlayerConfig:
    """The pool and runner being sized. ``num_slots`` counts slot 0 (the zero adapter)."""

    num_slots: int = 9
    max_batch: int = 32
    step_time: float = 0.02
    read_base: float = 0.005
    read_per_rank: float = 0.0005
    admission: str = "fifo"  # or "pass": later requests may pass one waiting for a slot

    def __post_init__(self):
        if self.admission not in ADMISSION:
            raise TraceError(f"admission must be one of {ADMISSION}, got {self.admission!r}")
        if int(self.num_slots) < 2:
            raise TraceError(f"num_slots must be >= 2 (slot 0 is the zero adapter), got {self.num_slots}")
        if int(self.max_batch) < 1:
            raise TraceError(f"max_batch must be >= 1, got {self.max_batch}")
        if not (self.step_time > 0 and math.isfinite(self.step_time)):
            raise TraceError(f"step_time must be > 0 seconds, got {self.step_time}")
        if not (self.read_base >= 0 and self.read_per_rank >= 0):
            raise TraceError("read_base and read_per_rank must be >= 0 seconds")

    def read_seconds(self, rank: int) -> float:
        return self.read_base + self.read_per_rank * rank


@dataclass
class PlayResult:
    """What a trace did to the pool.

    ``waits[N]``: seconds from each request's arrival to its admit; ``hits`` / ``misses``:
    adapter requests whose adapter was / was not resident at their admit; ``loads``: adapters
    written into a slot, ``evictions`` those that overwrote another adapter's weights.
    The occupancy series (one sample per simulated step that changed anything) are
    ``times``, ``held`` (slots some request holds), ``resident`` (slots with a current
    adapter), ``running`` and ``queued`` requests.
    """

    config: PlayerConfig
    requests: int
    hits: int
    misses: int
    loads: int
    evictions: int
    waits: np.ndarray
    times: np.ndarray
    held: np.ndarray
    resident: np.ndarray
    running: np.ndarray
    queued: np.ndarray
    makespan: float

    @property
    def adapter_requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.adapter_requests if self.adapter_requests else float("nan")

    @property
    def mean_wait(self) -> float:
        return float(self.waits.mean()) if self.waits.size else float("nan")

    @property
    def p99_wait(self) -> float:
        return float(np.percentile(self.waits, 99)) if self.waits.size else float("nan")

    def mean_occupancy(self) -> float:
        """Time-weighted mean of held slots over the run (samples held until the next one)."""
        if self.times.size < 2:
            return float(self.held[0]) if self.held.size else 0.0
        dt = np.diff(self.times)
        return float((self.held[:-1] * dt).sum() / max(dt.sum(), 1e-12))

    def summary(self) -> dict:
        return {"num_slots": self.config.num_slots, "requests": self.requests,
                "adapter_requests": self.adapter_requests, "hit_rate": self.hit_rate,
                "hits": self.hits, "misses": self.misses, "loads": self.loads,
                "evictions": self.evictions, "mean_wait_s": self.mean_wait,
                "p99_wait_s": self.p99_wait, "mean_held_slots": self.mean_occupancy(),
                "makespan_s": self.makespan}

    def to_dict(self, *, series: bool = True) -> dict:
        """The config and summary (and with ``series`` the occupancy series and waits) as plain data."""
        out = {"config": asdict(self.config), "summary": self.summary()}
        if series:
            out["occupancy"] = {"time_s": self.times.tolist(), "held": self.held.tolist(),
                                "resident": self.resident.tolist(), "running": self.running.tolist(),
                                "queued": self.queued.tolist()}
            out["waits_s"] = self.waits.tolist()
        return out

    def to_json(self, path=None, *, series: bool = True) -> str:
        """``to_dict`` as JSON, also written to ``path`` when given."""
        text = json.dumps(self.to_dict(series=series), indent=1, allow_nan=True)
        if path is not None:
            Path(path).write_text(text)
        return text


def play(trace: Trace, config: PlayerConfig | None = None, *, progress: bool | None = None) -> PlayResult:
    """Play ``trace`` through a SimPool sized by ``config``; ``progress``: a tqdm bar (None:
    only for traces of at least ``PROGRESS_MIN_REQUESTS`` requests)."""
    config = config or PlayerConfig()
    n = trace.num_requests
    pool = SimPool(config.num_slots)
    for name in trace.adapters:
        pool.load_adapter(name)
    dt = config.step_time
    arrive_step = np.ceil(trace.arrival / dt - 1e-9).astype(np.int64)  # [N] first step it can act
    bar = _progress_bar(n, progress)
    waits = np.zeros(n, np.float64)
    samples: list[tuple[float, int, int, int, int]] = []
    reads: list[tuple[int, str]] = []  # heap of (step the read lands, adapter)
    finishing: list[tuple[int, int]] = []  # heap of (step it is removed, request)
    queue: list[int] = []  # waiting requests, arrival order
    hits = misses = loads = evictions = 0
    nxt = 0  # next request to arrive
    running = 0
    step = int(arrive_step[0]) if n else 0
    while nxt < n or queue or finishing:
        while finishing and finishing[0][0] <= step:
            _, i = heapq.heappop(finishing)
            pool.remove_request(i)
            running -= 1
        while nxt < n and arrive_step[nxt] <= step:
            name = trace.adapter_name(nxt)
            if pool.ingest_request(nxt, name):
                land = trace.arrival[nxt] + config.read_seconds(int(trace.ranks[trace.adapter[nxt]]))
                heapq.heappush(reads, (int(math.ceil(land / dt - 1e-9)), name))
            queue.append(nxt)
            nxt += 1
        while reads and reads[0][0] <= step:
            pool.complete_read(heapq.heappop(reads)[1], ok=True)
        rows, left = [], []
        for k, i in enumerate(queue):
            if running + len(rows) >= config.max_batch:
                left.extend(queue[k:])
                break
            got = pool.reserve(i)
            if got is not Reserve.WAIT:
                rows.append(i)
            elif config.admission == "fifo" and pool.tier.get(trace.adapter_name(i)) is not Copy.PENDING:
                left.extend(queue[k:])  # waits for a slot: everyone behind it waits too
                break
            else:
                left.append(i)
        queue = left
        if rows:
            res = pool.admit(rows)
            pool.commit()
            hit_set = set(res.hits)
            for i in rows:
                if trace.adapter[i] >= 0:
                    hits += i in hit_set
                    misses += i not in hit_set
                waits[i] = max(0.0, step * dt - trace.arrival[i])
                heapq.heappush(finishing, (step + int(trace.tokens[i]), i))
            loads += len(res.loads)
            evictions += res.evictions
            running += len(rows)
            if bar is not None:
                bar.update(len(rows))  # requests admitted so far
        samples.append((step * dt, pool.slots.held_count(), pool.slots.resident_count(),
                        running, len(queue)))
        # Nothing changes before the next finish, arrival or landed read.
        events = [finishing[0][0] if finishing else None, int(arrive_step[nxt]) if nxt < n else None,
                  reads[0][0] if reads else None]
        events = [e for e in events if e is not None]
        if not events:
            if queue:  # cannot happen: an idle pool always takes the head of the queue
                raise RuntimeError(f"player stalled at step {step} with {len(queue)} queued")
            break
        step = max(step + 1, min(events))
    if bar is not None:
        bar.close()
    s = np.array(samples, np.float64).reshape(-1, 5)
    return PlayResult(config, n, hits, misses, loads, evictions, waits, s[:, 0],
                      s[:, 1].astype(np.int64), s[:, 2].astype(np.int64), s[:, 3].astype(np.int64),
                      s[:, 4].astype(np.int64), float(s[-1, 0]) if len(s) else 0.0)


def sweep_slots(trace: Trace, slot_counts: Iterable[int], config: PlayerConfig | None = None,
                *, progress: bool | None = False) -> list[PlayResult]:
    """The same trace played once per slot count (each counting slot 0)."""
    config = config or PlayerConfig()
    out = []
    for s in slot_counts:
        c = dataclasses.replace(config, num_slots=int(s))
        out.append(play(trace, c, progress=progress))
    return out


def _progress_bar(total: int, progress: bool | None):
    if progress is None:
        progress = total >= PROGRESS_MIN_REQUESTS
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", desc="playing trace (admitted)", leave=False)
