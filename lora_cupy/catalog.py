"""AdapterCatalog: which adapters a pool serves, and how many live requests name each.

Pure bookkeeping (no lock, no I/O): the pool calls it under its lock. Runtime loads and unloads
touch nothing an admit decides from (refcounts, which slot holds an adapter, the LRU clock), so
each rank may apply them whenever its control message arrives (seed 000). An adapter moves
``loading -> served``; ``unload`` makes it ``retiring`` while live requests still name it, and
forgotten (name, record, and, through the pool, its name -> slot entry) with the last of them:
the README's invariant 9.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

from .errors import AdapterNotFoundError, AdapterStateError


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter the pool serves: its file, the digest its reads must match, the targets it
    has something for here (empty: it runs with no slot in this pool), its host copy's size."""

    name: str
    path: str
    digest: str
    targets: frozenset[str]
    image_bytes: int


class AdapterCatalog:
    """Served, retiring and loading adapters, and the live requests naming each."""

    def __init__(self):
        self.served: dict[str, ServedAdapter] = {}
        self.retiring: dict[str, ServedAdapter] = {}  # unloaded, still named by live requests
        self.loading: dict[str, Future] = {}
        self.live: Counter = Counter()  # adapter -> live requests naming it

    def info(self, name: str) -> ServedAdapter | None:
        return self.served.get(name) or self.retiring.get(name)

    def begin_load(self, name: str, path) -> Future:
        """The future of a load of ``name``; refuses one served, loading or still retiring."""
        if name in self.served:
            raise AdapterStateError("it is served already", adapter=name, path=path)
        if name in self.loading:
            raise AdapterStateError("it is being loaded already", adapter=name, path=path)
        if name in self.retiring:
            raise AdapterStateError(f"it is still retiring from an unload: {self.live[name]} live "
                                    "request(s) still run on it", adapter=name, path=path)
        out: Future = Future()
        out.set_running_or_notify_cancel()
        self.loading[name] = out
        return out

    def finish_load(self, name: str, path: str, out: Future, info: ServedAdapter | None,
                    err: BaseException | None) -> BaseException | None:
        """Serve ``info`` (its read succeeded) unless the load was cancelled meanwhile; returns
        the error to fail ``out`` with, or None. The caller settles ``out`` outside its lock."""
        if self.loading.get(name) is not out:
            return AdapterStateError("it was unloaded while it loaded", adapter=name, path=path)
        del self.loading[name]
        if err is None:
            self.served[name] = info
        return err

    def name(self, rid, name: str) -> ServedAdapter:
        """A request ingested on ``name``: counted live; refused unless ``name`` is served."""
        info = self.served.get(name)
        if info is None:
            why = ("is retiring from an unload" if name in self.retiring else
                   "is still loading" if name in self.loading else "is not served by this pool")
            raise AdapterNotFoundError(f"request {rid!r} names it, but it {why}", adapter=name)
        self.live[name] += 1
        return info

    def unname(self, name: str) -> bool:
        """A request naming ``name`` was removed; True when that retires the adapter for good."""
        self.live[name] -= 1
        if self.live[name] > 0:
            return False
        del self.live[name]
        return self.retiring.pop(name, None) is not None

    def unload(self, name: str) -> bool | None:
        """Stop serving ``name``: True when it is to be forgotten now (no live request; or a
        load in flight, which is cancelled), False while live requests still name it, None when
        it is not served at all."""
        if self.loading.pop(name, None) is not None:
            return True
        info = self.served.pop(name, None)
        if info is None:
            return None
        if self.live.get(name, 0) > 0:
            self.retiring[name] = info
            return False
        return True

    def check_valid(self, live: Counter, entries) -> None:
        """Invariant 9 as the catalog sees it: ``live`` counts the live requests per adapter,
        ``entries`` the slot table's names."""
        assert live == +self.live, f"live counts {dict(self.live)} != {dict(live)}"
        assert not (self.served.keys() & self.retiring.keys()), "an adapter both served and retiring (invariant 9)"
        for name in self.retiring:
            assert self.live.get(name, 0) > 0, f"adapter {name!r} retires with no live request (invariant 9)"
        for name in entries:
            assert name in self.served or name in self.retiring, \
                f"forgotten adapter {name!r} keeps its name -> slot entry (invariant 9)"

