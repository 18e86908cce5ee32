"""LoraAdapterStore: the host tier, and the one reader thread that fills it.

A request names an adapter; the pool acquires its host copy (:meth:`~LoraAdapterStore.acquire`)
as it ingests the request, which queues the read, and releases it as the request is removed. The
tier holds exactly what live requests name: a copy goes with the last request naming it.

Files are read only on the reader thread. Nobody else ever waits on a file: ``acquire`` and
``release`` only queue and count, and a caller that needs a copy asks :meth:`HostCopy.outcome`
(or, outside every lock, :meth:`HostCopy.wait`). A copy is held as a *slot image*: each
target's weights padded to the pool's maximum rank, in the pool's dtype, in pinned memory on
CUDA, so it reaches a slot by one non-blocking copy per array.

The tier is bounded in bytes. A read starts only once its image fits (reads start in the
order they were queued, so the earliest request is never starved by later ones): a request
whose copy does not fit yet waits at admission, holding nothing, until removes make room. An
adapter whose image could never fit fails with :class:`~lora_cupy.errors.CapacityError`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from .adapter import AdapterWeights, TargetWeights
from .device import Device, as_device
from .dtypes import numpy_dtype
from .errors import (AdapterFileError, CapacityError, DigestMismatchError, LoraError, RankTooLargeError,
                     ShapeMismatchError, TargetMismatchError)
from .peft import read_peft_adapter
from .spec import LoraSpec, put_blocked

#: Where a host copy stands, as the agreement across ranks encodes it (the max wins).
READY, READING, FAILED = 0, 1, 2

Reader = Callable[..., AdapterWeights]
_ALIGN = 256  # bytes: where each array of an image starts in its host block


def default_reader(path, spec: LoraSpec, name: str | None = None) -> AdapterWeights:
    """A PEFT adapter directory, read and checked (:func:`lora_cupy.peft.read_peft_adapter`)."""
    return read_peft_adapter(path, spec, name=name)


@dataclass
class HostCopy:
    """One adapter's entry in the tier: how many live requests name it, and its read."""

    name: str
    path: str
    digest: str | None  # what the read must match (the digest checked at load)
    need: int  # bytes the image takes (known from the load), or an upper bound
    users: int = 0
    state: int = READING
    image: AdapterWeights | None = None
    held: int = 0  # bytes the tier counts for the image (its nbytes, taken once when it came in)
    error: LoraError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def outcome(self) -> int:
        """READY, READING or FAILED: this rank's side of the agreement before an admit waits."""
        return self.state

    def wait(self, timeout: float | None = None) -> int:
        """Block until the read has finished (call outside every lock); returns the outcome."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"adapter {self.name!r}: read still in flight after {timeout}s")
        return self.state


@dataclass
class _ReadJob:
    entry: HostCopy


@dataclass
class _LoadJob:
    name: str
    path: str
    digest: str | None
    future: Future


class LoraAdapterStore:
    """The host tier of one pool: slot images of the adapters live requests name.

    ``reader(path, spec, name=...) -> AdapterWeights`` reads and checks one adapter (default:
    :func:`lora_cupy.peft.read_peft_adapter`). ``max_bytes`` bounds the images held (None:
    unbounded). ``dtype`` is the pool's weight dtype (default: the spec's).
    """

    def __init__(self, spec: LoraSpec, device: Device | str = "cpu", reader: Reader | None = None,
                 max_bytes: int | None = None, dtype=None):
        self.spec = spec
        self.device = as_device(device)
        self.reader = reader or default_reader
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.dtype = numpy_dtype(dtype or spec.dtype)
        self._entries: dict[str, HostCopy] = {}
        self._jobs: deque = deque()
        # The condition's lock (an RLock, as Condition() makes by default) is also taken bare by
        # get, users and release, the calls a step makes per request: it skips Condition's
        # Python-level __enter__ and __exit__.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._held = 0  # bytes of images held, plus those being read
        # Images dropped from the tier, and their entries, freed on the reader thread before its
        # next job (so before it allocates another image): not on the thread that removed the last
        # request, which a serving loop runs between steps.
        self._trash: list[AdapterWeights | HostCopy] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lora-adapter-reader", daemon=True)
        self._thread.start()

    # -- sizes -----------------------------------------------------------------------------
    def image_bytes(self, targets) -> int:
        """Bytes of a slot image covering ``targets`` (names): padded to the maximum rank."""
        total = 0
        R, tp = self.spec.max_rank, self.spec.tp_size
        for name in targets:
            t = self.spec.target(name)
            L, n = t.num_layers, t.num_slices
            total += (L * n * R * t.local_in_features(tp) + L * t.local_out_features(tp) * R) * self.dtype.itemsize
            total += L * n * 8
        return total

    @property
    def nbytes(self) -> int:
        """Host bytes the tier holds now (images, and reads in flight at their full size)."""
        with self._cond:
            return self._held

    def stats(self) -> dict:
        with self._cond:
            states = [e.state for e in self._entries.values()]
            return {"nbytes": self._held, "max_bytes": self.max_bytes, "entries": len(states),
                    "ready": states.count(READY), "reading": states.count(READING),
                    "failed": states.count(FAILED), "queued_jobs": len(self._jobs)}

    # -- the tier ----------------------------------------------------------------------------
    def too_big(self, name: str, path, need: int) -> CapacityError | None:
        """The refusal of an adapter whose image of ``need`` bytes could never fit the tier."""
        if self.max_bytes is None or need <= self.max_bytes:
            return None
        return CapacityError(f"its host copy takes {need} bytes; the host tier holds at most {self.max_bytes}",
                             adapter=name, path=path)

    def acquire(self, name: str, path, digest: str | None = None, need: int | None = None) -> HostCopy:
        """One more live request names ``name``: its copy is kept, and read if not held yet.

        ``need``: the bytes its image takes (:meth:`image_bytes` of the targets it covers,
        known from its load); None sizes the read for every target. Never blocks on a file.
        """
        if need is None:
            need = self.image_bytes(self.spec.target_names)
        with self._cond:
            self._check_open()
            e = self._entries.get(name)
            if e is None:
                e = self._entries[name] = HostCopy(name, str(path), digest, need)
                err = self.too_big(name, path, need)
                if err is not None:
                    self._fail(e, err)
                else:
                    self._jobs.append(_ReadJob(e))
                    self._cond.notify_all()
            e.users += 1
            return e

    def release(self, name: str) -> None:
        """One live request naming ``name`` went; the copy goes with the last one."""
        with self._lock:
            e = self._entries.get(name)
            if e is None:
                return
            e.users -= 1
            if e.users <= 0:
                self._drop(e)

    def get(self, name: str) -> HostCopy | None:
        with self._lock:
            return self._entries.get(name)

    def users(self, name: str) -> int:
        with self._lock:
            e = self._entries.get(name)
            return 0 if e is None else e.users

    def _drop(self, e: HostCopy) -> None:
        """Forget ``e`` (under the lock): its bytes leave the count now, its image's memory (and
        the entry) when the reader thread takes its next job, before that job reads (a copy into a
        slot keeps the image alive itself: the pool's keep_alive). The reader is woken only where a
        job waits (a read may now fit the bound), so an idle tier keeps its last dropped images'
        memory, which :attr:`nbytes` no longer counts, until its next read or :meth:`close`."""
        if self._entries.get(e.name) is e:
            del self._entries[e.name]
        if e.state == READY and e.image is not None:
            self._held -= e.held
            if not self._closed:  # no reader thread after close: freed here
                self._trash.append(e.image)
            e.image, e.held = None, 0
        if not self._closed:  # the entry too (its Event and Condition): freed there, not in a step
            self._trash.append(e)
        if self._jobs:
            self._cond.notify_all()

    def _fail(self, e: HostCopy, err: LoraError) -> None:
        e.error, e.state = err, FAILED
        e.done.set()

    # -- loads (read, checked, not kept) -----------------------------------------------------
    def read_async(self, name: str, path, digest: str | None = None) -> Future:
        """Read ``name`` on the reader thread and check it: against the spec, its digest, and the
        size of its image against the tier's bound (the same check a request's read meets). The
        future gives the :class:`AdapterWeights`, which the tier does not keep."""
        fut: Future = Future()
        with self._cond:
            self._check_open()
            self._jobs.append(_LoadJob(name, str(path), digest, fut))
            self._cond.notify_all()
        return fut

    # -- the reader thread ---------------------------------------------------------------------
    def _next_job(self):
        """The first job that may run: a load always; the oldest read once its image fits."""
        first_read = True
        for job in self._jobs:
            if isinstance(job, _LoadJob):
                return job
            if not first_read:
                continue
            first_read = False
            e = job.entry
            if e.users <= 0 or self.max_bytes is None or self._held + e.need <= self.max_bytes:
                return job
        return None

    def _run(self) -> None:
        while True:
            skip = False
            with self._cond:
                job = self._next_job()
                while job is None and not self._closed:
                    self._cond.wait()
                    job = self._next_job()
                trash, self._trash = self._trash, []  # taken with the job: freed before it reads
                if job is not None:
                    self._jobs.remove(job)
                    if isinstance(job, _ReadJob):
                        e = job.entry
                        if e.users <= 0 or self._entries.get(e.name) is not e:
                            e.done.set()
                            skip = True  # released before its read began
                        else:
                            self._held += e.need
            trash.clear()  # the dropped images' memory, released outside the lock
            if job is None:
                return
            if skip:
                continue
            if isinstance(job, _LoadJob):
                self._load(job)
            else:
                self._read(job.entry)

    def _load(self, job: _LoadJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            w = self._read_checked(job.name, job.path, job.digest)
            err = self.too_big(job.name, job.path, self.image_bytes(w.targets))
            if err is not None:
                raise err
        except BaseException as err:
            job.future.set_exception(_typed(err, job.name, job.path))
        else:
            job.future.set_result(w)

    def _read(self, e: HostCopy) -> None:
        image, err = None, None
        try:
            w = self._read_checked(e.name, e.path, e.digest)
            image = self.build_image(w)
        except BaseException as exc:
            err = _typed(exc, e.name, e.path)
        with self._cond:
            self._held -= e.need
            current = self._entries.get(e.name) is e and e.users > 0
            if err is None and current:
                e.image, e.state, e.held = image, READY, image.nbytes
                self._held += e.held
                e.done.set()
            elif err is not None:
                self._fail(e, err)
            else:
                e.done.set()
            self._cond.notify_all()

    def _read_checked(self, name: str, path: str, digest: str | None) -> AdapterWeights:
        w = self.reader(path, self.spec, name=name)
        if digest is not None and w.digest.lower() != digest.lower():
            raise DigestMismatchError(f"weights have sha256 {w.digest}, expected {digest}",
                                      adapter=name, path=path)
        return w

    def build_image(self, w: AdapterWeights) -> AdapterWeights:
        """``w`` padded to the pool's maximum rank and in its layout (B rank-blocked where
        :attr:`LoraSpec.b_blocked`), in host memory copies can start from: one
        zeroed block whose aligned views are the targets' arrays, so an image is one host
        allocation, not four per target (on CUDA each is a pinned-pool block and two gc-tracked
        objects, alive from the read until the image is dropped)."""
        R, tp = self.spec.max_rank, self.spec.tp_size
        layout = []  # (target, its weights, their rank, [(shape, dtype)] of a, b, ranks, scaling)
        for tname, tw in w.targets.items():
            try:
                t = self.spec.target(tname)
            except KeyError:
                raise TargetMismatchError(f"target {tname!r} is not in the pool's spec",
                                          adapter=w.name, path=w.path) from None
            L, n = t.num_layers, t.num_slices
            inl, outl = t.local_in_features(tp), t.local_out_features(tp)
            r = tw.a.shape[2] if tw.a.ndim == 4 else -1
            if tw.a.shape != (L, n, r, inl) or tw.b.shape != (L, outl, r) \
                    or tw.ranks.shape != (L, n) or tw.scaling.shape != (L, n):
                raise ShapeMismatchError(
                    f"target {tname!r}: a {tw.a.shape}, b {tw.b.shape}, ranks {tw.ranks.shape} do not fit "
                    f"a [{L}, {n}, r, {inl}], b [{L}, {outl}, r], ranks [{L}, {n}]", adapter=w.name, path=w.path)
            if r > R or int(tw.ranks.max(initial=0)) > r:
                raise RankTooLargeError(f"target {tname!r} has rank {max(r, int(tw.ranks.max()))}, above the "
                                        f"pool's max_rank {R}", adapter=w.name, path=w.path)
            b_shape = self.spec.b_shape(t)
            layout.append((tname, tw, r, [((L, n, R, inl), self.dtype), ((L, *b_shape[2:]), self.dtype),
                                          ((L, n), np.dtype(np.int32)), ((L, n), np.dtype(np.float32))]))
        spans, end = [], 0  # (first byte, end byte, shape, dtype) of each array in the block
        for *_, parts in layout:
            for shape, dt in parts:
                start = -(-end // _ALIGN) * _ALIGN
                end = start + int(np.prod(shape)) * dt.itemsize
                spans.append((start, end, shape, dt))
        block = self.device.host_zeros(end, np.uint8)
        arrays = [block[a:b].view(dt).reshape(shape) for a, b, shape, dt in spans]
        targets = {}
        for k, (tname, tw, r, _) in enumerate(layout):
            img = targets[tname] = TargetWeights(*arrays[4 * k:4 * k + 4])
            img.a[:, :, :r] = tw.a
            if self.spec.b_blocked:  # [L, ceil(R / 16), out, 16], written in place
                put_blocked(img.b, tw.b)
            else:
                img.b[:, :, :r] = tw.b
            img.ranks[...] = tw.ranks
            img.scaling[...] = tw.scaling
        return AdapterWeights(w.name, w.path, w.digest, targets)

    # -- shutdown ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the adapter store is closed")

    def close(self) -> None:
        """Stop the reader thread after the job it is on; queued loads fail."""
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs), deque()
            self._trash.clear()
            self._cond.notify_all()
        for job in jobs:
            if isinstance(job, _LoadJob) and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("the adapter store closed before the load ran"))
            elif isinstance(job, _ReadJob):
                self._fail(job.entry, LoraError("the adapter store closed before the read ran",
                                                adapter=job.entry.name, path=job.entry.path))
        self._thread.join(timeout=5)


def _typed(err: BaseException, name: str, path) -> BaseException:
    """A reader's failure as a LoraError naming the adapter and file (others wrapped)."""
    if isinstance(err, LoraError) or not isinstance(err, Exception):
        return err
    cls = AdapterFileError if isinstance(err, OSError) else LoraError
    wrapped = cls(f"read failed: {type(err).__name__}: {err}", adapter=name, path=path)
    wrapped.__cause__ = err
    return wrapped


