"""One code path on two devices: arrays, streams, events and copies for "cpu" and "cuda:N".

- ``"cpu"``: NumPy arrays, the NumPy reference backend, and a :class:`HostStream` (work queued
  to one worker thread, run in order; :class:`HostEvent` completes once the work queued before
  it has run). Copies "to the device" are queued, so the pool's asynchrony (a copy issued now,
  read by a later step) is real on a machine with no GPU.
- ``"cuda:N"``: CuPy arrays, pinned host memory for staging, a CuPy stream and events, and the
  RawKernel backend. CuPy is imported only here and only for a CUDA device.

The pool issues every copy on :attr:`Device.stream`; a step that reads what it copied runs on
that stream (or after an event recorded there), which is what orders the copy before the read.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .backends.cupy import CupyBackend
from .backends.reference import ReferenceBackend
from .dtypes import numpy_dtype


class HostEvent:
    """Completes once the host stream has run everything queued before it."""

    def __init__(self, done: bool = False):
        self._flag = threading.Event()
        if done:
            self._flag.set()

    def _set(self) -> None:
        self._flag.set()

    @property
    def done(self) -> bool:
        return self._flag.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._flag.wait(timeout):
            raise TimeoutError("host stream event did not complete in time")


class HostStream:
    """A stream on the host: callables run in order on one worker thread.

    An exception in queued work is kept and raised by the next :meth:`synchronize` (as a
    CUDA error surfaces at the next sync); the work after it still runs.
    """

    def __init__(self, name: str = "lora-host-stream"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException as e:  # kept for the next synchronize
                self._error = e

    def enqueue(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the stream, after everything queued before."""
        self._queue.put((fn, args))

    def record(self) -> HostEvent:
        ev = HostEvent()
        self._queue.put((ev._set, ()))
        return ev

    def wait_event(self, event) -> None:
        """Work queued after this waits for ``event`` (recorded on another stream)."""
        if not event.done:
            self._queue.put((event.synchronize, ()))

    def synchronize(self) -> None:
        if self._closed:  # its thread runs what was queued before the close, then ends
            self._thread.join()
        else:
            self.record().synchronize()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Run what is queued, then stop; a later :meth:`synchronize` waits for that, not forever."""
        self._closed = True
        self._queue.put(None)


@dataclass
class _KeepAlive:
    event: Any
    obj: Any


class Device:
    """Arrays, one stream and copies on ``"cpu"`` or ``"cuda:N"``.

    ``stream`` (CUDA only) is where the pool's copies go; by default the CuPy stream that is
    current when the device is made (the null stream unless the caller set another).
    """

    def __init__(self, name: str | Any = "cpu", stream=None):
        name = str(name)
        if name == "cuda":
            name = "cuda:0"
        if name == "cpu":
            self.kind, self.index = "cpu", None
        elif name.startswith("cuda:") and name[5:].isdigit():
            self.kind, self.index = "cuda", int(name[5:])
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda:N', got {name!r}")
        self.name = name
        self._alive: deque[_KeepAlive] = deque()
        self._alive_lock = threading.Lock()
        if self.kind == "cpu":
            self.xp = np
            self.stream = HostStream()
        else:
            import cupy

            self.xp = cupy
            with cupy.cuda.Device(self.index):
                self.stream = stream if stream is not None else cupy.cuda.get_current_stream()

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def activate(self):
        """A context making this the current device on the calling thread (a no-op on cpu)."""
        if self.kind == "cpu":
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(self.index)

    # -- memory ----------------------------------------------------------------------------
    def zeros(self, shape, dtype) -> Any:
        """A zeroed device array (NumPy on cpu, CuPy on cuda)."""
        dt = _dtype(dtype)
        if self.kind == "cpu":
            return np.zeros(shape, dt)
        with self.activate():
            return self.xp.zeros(shape, dt)

    def host_empty(self, shape, dtype) -> np.ndarray:
        """Host memory that copies start from: pinned on cuda, so a copy can be non-blocking."""
        dt = _dtype(dtype)
        if self.kind == "cpu":
            return np.empty(shape, dt)
        import cupyx

        with self.activate():
            return cupyx.empty_pinned(shape, dt)

    def host_zeros(self, shape, dtype) -> np.ndarray:
        out = self.host_empty(shape, dtype)
        out[...] = 0
        return out

    def to_host(self, arr) -> np.ndarray:
        """A blocking copy of a device array to a new NumPy array, after the stream's work."""
        if self.kind == "cpu":
            self.stream.synchronize()
            return np.array(arr)
        with self.activate():
            self.stream.synchronize()
            return arr.get()

    # -- copies, in stream order ---------------------------------------------------------------
    def copy_to_device(self, dst, src: np.ndarray) -> None:
        """Queue ``dst[...] = src`` on the stream; ``src`` must stay unchanged until it has run.

        ``dst`` is a device view whose axes after the first are contiguous (a slot's weights
        over every layer: ``A[:, s]``); ``src`` a C-contiguous host array of its shape.
        """
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"copy of {src.shape} into {dst.shape}")
        if self.kind == "cpu":
            self.stream.enqueue(np.copyto, dst, src)
            return
        from cupy.cuda import runtime

        if src.size == 0:
            return
        if not src.flags.c_contiguous:
            raise ValueError("the host side of a copy must be C-contiguous")
        if dst.flags.c_contiguous:
            runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                                runtime.memcpyHostToDevice, self.stream.ptr)
            return
        rows = dst.shape[0]
        width = src.nbytes // rows
        inner = dst[0] if dst.ndim > 1 else None
        if inner is None or not inner.flags.c_contiguous or dst.strides[0] < width:
            raise ValueError(f"cannot copy into a view with strides {dst.strides}")
        runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0], src.ctypes.data, width, width, rows,
                              runtime.memcpyHostToDevice, self.stream.ptr)

    def copy_batch(self, pairs, reuse=None):
        """Queue ``dst[...] = src`` for each ``(dst, src)`` (as :meth:`copy_to_device`), then an
        event after them, which is returned; on cpu one job on the host stream does it all."""
        if self.kind == "cpu":
            ev = HostEvent()
            self.stream.enqueue(_copy_all, pairs, ev)
            return ev
        for dst, src in pairs:
            self.copy_to_device(dst, src)
        return self.record(reuse=reuse)

    def fill_zero(self, dst) -> None:
        """Queue ``dst[...] = 0`` on the stream."""
        if self.kind == "cpu":
            self.stream.enqueue(dst.fill, 0)
            return
        with self.activate(), self.stream:
            dst.fill(0)

    def record(self, reuse=None):
        """An event that completes once the work queued on the stream so far has run.

        ``reuse``: on cuda, an event this device made before, recorded again (no new event
        is created: plan records one per step); a host event is never reused.
        """
        if self.kind == "cpu":
            return self.stream.record()
        if reuse is not None:
            reuse.record(self.stream)
            return reuse
        import cupy

        with self.activate():
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)
            return ev

    def keep_alive(self, obj) -> None:
        """Hold ``obj`` (host memory a queued copy reads) until the stream has run that copy."""
        if self.kind == "cpu":
            self.stream.enqueue(_noop, obj)  # the queue holds obj until then
            return
        ev = self.record()
        with self._alive_lock:
            self._alive.append(_KeepAlive(ev, obj))
            while self._alive and self._alive[0].event.done:
                self._alive.popleft()

    def synchronize(self) -> None:
        if self.kind == "cpu":
            self.stream.synchronize()
        else:
            with self.activate():
                self.stream.synchronize()
        with self._alive_lock:
            self._alive.clear()

    def backend(self, spec=None):
        """The backend this device runs deltas with: NumPy reference on cpu, RawKernels on cuda."""
        if self.kind == "cpu":
            return ReferenceBackend()
        # early_reads: the pool writes the step's addressing and installs weights with copies (a
        # fill kernel only zeroes a slot no row addresses), so no kernel just before a delta writes them
        return CupyBackend(spec, device=self.index, early_reads=True)

    def close(self) -> None:
        if self.kind == "cpu":
            self.stream.close()

    def __repr__(self) -> str:
        return f"Device({self.name!r})"


def as_device(device) -> Device:
    """A :class:`Device` from a Device, a name (``"cpu"``, ``"cuda:0"``) or a torch.device."""
    if isinstance(device, Device):
        return device
    return Device(str(device))


def _dtype(dtype) -> np.dtype:
    try:
        return numpy_dtype(dtype)
    except ValueError:
        return np.dtype(dtype)


def _noop(*_args) -> None:
    return None


def _copy_all(pairs, event: HostEvent) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)
    event._set()
