"""Workload traces: arrival times, the adapter each request names, its tokens; read or generated.

A trace file is CSV (header ``arrival,adapter,tokens`` and optionally ``rank``) or JSON (a list
of objects with those keys, or ``{"requests": [...]}``). An empty adapter (or ``-``) is a
base-model request. ``generate_trace`` draws Poisson arrivals, zipf adapter popularity and a
rank mix from a seed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import TraceError

DEFAULT_RANK_MIX = {8: 0.5, 16: 0.3, 64: 0.2}


@dataclass(frozen=True)
class Trace:
    """``N`` requests over ``A`` adapters.

    ``arrival[N]`` float64 seconds, non-decreasing; ``adapter[N]`` int64 index into
    ``adapters`` (-1: base model); ``tokens[N]`` int64 >= 1, the decode steps a request runs;
    ``ranks[A]`` int64, each adapter's LoRA rank (what its read costs).
    """

    arrival: np.ndarray
    adapter: np.ndarray
    tokens: np.ndarray
    adapters: tuple[str, ...]
    ranks: np.ndarray

    def __post_init__(self):
        n = self.arrival.shape[0]
        if self.arrival.ndim != 1 or self.adapter.shape != (n,) or self.tokens.shape != (n,):
            raise TraceError(f"trace arrays disagree: arrival {self.arrival.shape}, "
                             f"adapter {self.adapter.shape}, tokens {self.tokens.shape}")
        if self.ranks.shape != (len(self.adapters),):
            raise TraceError(f"{len(self.adapters)} adapters but {self.ranks.shape[0]} ranks")
        if n and (not np.isfinite(self.arrival).all() or self.arrival.min() < 0):
            raise TraceError("arrival times must be finite and >= 0")
        if n > 1 and (np.diff(self.arrival) < 0).any():
            raise TraceError("arrival times must be non-decreasing")
        if n and (self.tokens.min() < 1):
            raise TraceError("every request needs tokens >= 1")
        if n and (self.adapter.min() < -1 or self.adapter.max() >= len(self.adapters)):
            raise TraceError("adapter index out of range")
        if len(self.adapters) and self.ranks.min() < 1:
            raise TraceError("adapter ranks must be >= 1")

    @property
    def num_requests(self) -> int:
        return int(self.arrival.shape[0])

    def adapter_name(self, i: int) -> str | None:
        a = int(self.adapter[i])
        return None if a < 0 else self.adapters[a]

    def write(self, path) -> Path:
        """Write the trace as CSV (``.csv``) or JSON (anything else)."""
        path = Path(path)
        rows = [{"arrival": float(self.arrival[i]), "adapter": self.adapter_name(i) or "",
                 "tokens": int(self.tokens[i]),
                 "rank": int(self.ranks[self.adapter[i]]) if self.adapter[i] >= 0 else ""}
                for i in range(self.num_requests)]
        if path.suffix.lower() == ".csv":
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=["arrival", "adapter", "tokens", "rank"])
                w.writeheader()
                w.writerows(rows)
        else:
            path.write_text(json.dumps({"requests": rows}, indent=1))
        return path


def parse_rank_mix(text: str) -> dict[int, float]:
    """``"8:0.5,16:0.3,64:0.2"`` -> ``{8: 0.5, 16: 0.3, 64: 0.2}`` (weights need not sum to 1)."""
    mix: dict[int, float] = {}
    for part in text.split(","):
        rank, sep, weight = part.strip().partition(":")
        try:
            r, w = int(rank), float(weight) if sep else 1.0
        except ValueError:
            raise TraceError(f"rank mix {text!r}: {part!r} is not RANK:WEIGHT") from None
        if r < 1 or not w > 0 or not math.isfinite(w):
            raise TraceError(f"rank mix {text!r}: rank must be >= 1 and weight > 0, got {part!r}")
        mix[r] = mix.get(r, 0.0) + w
    return mix


def generate_trace(num_requests: int, *, rate: float, num_adapters: int, zipf: float = 1.0,
                   rank_mix: Mapping[int, float] | None = None, mean_tokens: float = 64.0,
                   base_fraction: float = 0.0, seed: int | None = 0) -> Trace:
    """Poisson arrivals at ``rate`` requests/s; adapter ``k`` (0-based popularity rank) drawn
    with weight ``1 / (k + 1) ** zipf``; each adapter's rank drawn from ``rank_mix``; tokens
    geometric with mean ``mean_tokens``; a ``base_fraction`` of requests on the base model."""
    if int(num_requests) < 0:
        raise TraceError(f"num_requests must be >= 0, got {num_requests}")
    if not (rate > 0 and math.isfinite(rate)):
        raise TraceError(f"rate must be a positive number of requests per second, got {rate}")
    if int(num_adapters) < 1:
        raise TraceError(f"num_adapters must be >= 1, got {num_adapters}")
    if not (zipf >= 0 and math.isfinite(zipf)):
        raise TraceError(f"zipf exponent must be >= 0, got {zipf}")
    if not mean_tokens >= 1:
        raise TraceError(f"mean_tokens must be >= 1, got {mean_tokens}")
    if not 0 <= base_fraction <= 1:
        raise TraceError(f"base_fraction must lie in [0, 1], got {base_fraction}")
    mix = dict(DEFAULT_RANK_MIX if rank_mix is None else rank_mix)
    if not mix or any(int(r) < 1 or not (w > 0 and math.isfinite(w)) for r, w in mix.items()):
        raise TraceError(f"rank mix needs ranks >= 1 with finite positive weights, got {mix}")
    rng = np.random.default_rng(seed)
    n, a = int(num_requests), int(num_adapters)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))  # [N]
    pop = 1.0 / np.arange(1, a + 1, dtype=np.float64) ** zipf  # [A]
    adapter = rng.choice(a, size=n, p=pop / pop.sum()).astype(np.int64)  # [N]
    adapter[rng.random(n) < base_fraction] = -1
    tokens = rng.geometric(1.0 / mean_tokens, n).astype(np.int64)  # [N], mean mean_tokens
    r_vals = np.array(sorted(mix), np.int64)
    r_w = np.array([mix[r] for r in sorted(mix)], np.float64)
    ranks = rng.choice(r_vals, size=a, p=r_w / r_w.sum()).astype(np.int64)  # [A]
    names = tuple(f"adapter-{k:0{max(3, len(str(a - 1)))}d}" for k in range(a))
    return Trace(arrival, adapter, tokens, names, ranks)


def read_trace(path, *, default_rank: int = 16) -> Trace:
    """Read a CSV or JSON trace; rows are sorted by arrival. Errors name the file, row and reason."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(f"trace file {path}: cannot be read ({e.strerror or e})") from None
    if path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        if not rows:
            raise TraceError(f"trace file {path}: no requests (want a header arrival,adapter,tokens)")
        missing = {"arrival", "adapter", "tokens"} - set(rows[0])
        if missing:
            raise TraceError(f"trace file {path}: missing column(s) {sorted(missing)}")
        first_row = 2  # the header is line 1
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"trace file {path}: not CSV (by suffix) and not valid JSON ({e})") from None
        rows = data.get("requests") if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TraceError(f"trace file {path}: JSON must be a list of request objects "
                             f"or {{\"requests\": [...]}}")
        first_row = 0
    names: dict[str, int] = {}
    ranks: dict[str, int] = {}
    arrival, adapter, tokens = [], [], []
    for i, row in enumerate(rows):
        where = f"trace file {path}, {'line' if first_row else 'request'} {i + first_row}"
        try:
            t = float(row["arrival"])
            k = int(row["tokens"])
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{where}: needs a number 'arrival' and an integer 'tokens', "
                             f"got {row!r}") from None
        if not math.isfinite(t) or t < 0:
            raise TraceError(f"{where}: arrival must be a finite time >= 0, got {t}")
        if k < 1:
            raise TraceError(f"{where}: tokens must be >= 1, got {k}")
        name = row.get("adapter")
        name = None if name in (None, "", "-") else str(name)
        if name is not None:
            r = row.get("rank")
            try:
                r = default_rank if r in (None, "") else int(r)
            except (TypeError, ValueError):
                raise TraceError(f"{where}: rank must be an integer, got {r!r}") from None
            if r < 1:
                raise TraceError(f"{where}: rank must be >= 1, got {r}")
            if ranks.setdefault(name, r) != r:
                raise TraceError(f"{where}: adapter {name!r} has rank {r} here, {ranks[name]} before")
            names.setdefault(name, len(names))
        arrival.append(t)
        adapter.append(-1 if name is None else names[name])
        tokens.append(k)
    order = np.argsort(np.asarray(arrival, np.float64), kind="stable")
    return Trace(np.asarray(arrival, np.float64)[order], np.asarray(adapter, np.int64)[order],
                 np.asarray(tokens, np.int64)[order], tuple(names),
                 np.array([ranks[n] for n in names], np.int64))
