"""AdapterCatalog: which adapters a pool serves, their runtime loads and unloads, and the live
requests naming them.

Its state is guarded by the pool's lock, which it is handed; reads go to the store's reader
thread and futures are settled outside the lock. Runtime loads and unloads
touch nothing an admit decides from (refcounts, which slot holds an adapter, the LRU clock), so
each rank may apply them whenever its control message arrives (seed 000). An adapter moves
``loading -> served``; ``unload`` makes it ``retiring`` while live requests still name it, and
forgotten (name, record, and, through the pool, its name -> slot entry) with the last of them:
the README's invariant 9.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass

from .errors import AdapterNotFoundError, AdapterStateError
from .slots import SlotTable
from .store import LoraAdapterStore


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter the pool serves: its file, the digest its reads must match, the targets it
    has something for here (empty: it runs with no slot in this pool), its host copy's size."""

    name: str
    path: str
    digest: str
    targets: frozenset[str]
    image_bytes: int


@dataclass
class Request:
    """A live request as the pool sees it: the adapter it names (None: the base model), and
    whether that adapter has something for this pool's targets (else it needs no slot here)."""

    adapter: str | None
    covers: bool


class AdapterCatalog:
    """Served, retiring and loading adapters, and the live requests (``requests``: rid ->
    :class:`Request`, ``live``: adapter -> how many name it). ``lock`` is the pool's;
    ``forget(name)`` drops an adapter's name -> slot entry (the slot table's)."""

    def __init__(self, store: LoraAdapterStore, lock: threading.Lock, forget: Callable[[str], object]):
        self._store, self._lock, self._forget = store, lock, forget
        self.served: dict[str, ServedAdapter] = {}
        self.retiring: dict[str, ServedAdapter] = {}  # unloaded, still named by live requests
        self.loading: dict[str, Future] = {}
        self.live: Counter = Counter()  # adapter -> live requests naming it
        self.requests: dict[Hashable, Request] = {}

    def info(self, name: str) -> ServedAdapter | None:
        return self.served.get(name) or self.retiring.get(name)

    def load_async(self, name: str, path, digest: str | None = None) -> Future:
        """Serve ``name`` from ``path`` once read on the reader thread and checked (spec, digest,
        the host tier's bound); the future gives its :class:`ServedAdapter` or the refusal.
        Refusals visible now (served already, loading, still retiring) raise here."""
        with self._lock:
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
        read = self._store.read_async(name, path, digest)
        read.add_done_callback(lambda f: self._finish_load(name, str(path), f, out))
        return out

    def _finish_load(self, name: str, path: str, read: Future, out: Future) -> None:
        err, info = read.exception(), None
        if err is None:
            w = read.result()
            targets = frozenset(w.targets)
            info = ServedAdapter(name, path, w.digest, targets, self._store.image_bytes(targets))
        with self._lock:
            if self.loading.get(name) is not out:
                err = AdapterStateError("it was unloaded while it loaded", adapter=name, path=path)
            else:
                del self.loading[name]
                if err is None:
                    self.served[name] = info
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(info)

    def open_request(self, rid: Hashable, name: str | None) -> Request:
        """A request ingested (under the lock) on ``name`` (None: the base model): counted live,
        and its host copy acquired (the read queued) where the adapter has something for this
        pool. Refused unless ``name`` is served."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} was ingested already")
        info = None
        if name is not None:
            info = self.served.get(name)
            if info is None:
                why = ("is retiring from an unload" if name in self.retiring else
                       "is still loading" if name in self.loading else "is not served by this pool")
                raise AdapterNotFoundError(f"request {rid!r} names it, but it {why}", adapter=name)
            self.live[name] += 1
            if info.targets:
                self._store.acquire(name, info.path, info.digest, info.image_bytes)
        req = self.requests[rid] = Request(name, info is not None and bool(info.targets))
        return req

    def close_request(self, rid: Hashable) -> Request | None:
        """A request removed (under the lock): its host copy released; the last request of a
        retiring adapter forgets it. None if it was not open."""
        req = self.requests.pop(rid, None)
        if req is None or req.adapter is None:
            return req
        if req.covers:
            self._store.release(req.adapter)
        self.live[req.adapter] -= 1
        if self.live[req.adapter] <= 0:
            del self.live[req.adapter]
            if self.retiring.pop(req.adapter, None) is not None:
                self._forget(req.adapter)
        return req

    def unload(self, name: str) -> bool:
        """Stop serving ``name``: forgotten now (True) if no live request names it or its load
        was still in flight (cancelled), else once the last of them is removed (False); an
        adapter not served at all is a no-op (False)."""
        with self._lock:
            if self.loading.pop(name, None) is not None:
                return True
            info = self.served.pop(name, None)
            if info is None:
                return False
            if self.live.get(name, 0) > 0:
                self.retiring[name] = info
                return False
            self._forget(name)
            return True

    def check_valid(self, table: SlotTable, settled: dict) -> None:
        """Invariants 2 and 9 as the requests see them: every holder of a slot (``table``) is a
        live request on that slot's adapter, and the slot its rows address (``settled``); every
        reservation is for a request that needs a slot; the host tier holds one user per live
        request whose adapter covers the pool; retiring adapters still have live requests, and
        a forgotten one has no name -> slot entry left."""
        for rid, s in table.holders.items():
            req = self.requests.get(rid)
            assert req is not None, f"removed request {rid!r} still holds slot {s} (invariant 2)"
            assert table.adapters[s] == req.adapter, \
                f"request {rid!r} on {req.adapter!r} holds slot {s} of {table.adapters[s]!r} (invariant 2)"
        for rid, s in settled.items():
            req = self.requests.get(rid)
            assert req is not None, f"removed request {rid!r} is still settled"
            assert (s == 0 and not req.covers) or table.holders.get(rid) == s, \
                f"request {rid!r} addresses slot {s}, holds {table.holders.get(rid)} (invariant 2)"
        assert table.holders.keys() <= settled.keys(), "a request holds a slot its rows do not address"
        for rid in table.reserved:
            req = self.requests.get(rid)
            assert req is not None and req.covers, f"reservation for {rid!r}, which needs no slot"
        live = Counter(r.adapter for r in self.requests.values() if r.adapter is not None)
        assert live == +self.live, f"live counts {dict(self.live)} != {dict(live)}"
        for name, n in Counter(r.adapter for r in self.requests.values() if r.covers).items():
            assert self._store.users(name) == n, f"adapter {name!r}: {self._store.users(name)} tier users, {n} requests"
        assert not (self.served.keys() & self.retiring.keys()), "an adapter both served and retiring (invariant 9)"
        for name in self.retiring:
            assert self.live.get(name, 0) > 0, f"adapter {name!r} retires with no live request (invariant 9)"
        for name in table.entries:
            assert name in self.served or name in self.retiring, \
                f"forgotten adapter {name!r} keeps its name -> slot entry (invariant 9)"
