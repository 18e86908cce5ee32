"""A lane's stream: where its steps' device work goes, and the marks that say when it landed.

On ``"cpu"`` a :class:`~lora_cupy.device.HostStream` (one worker thread; ``run`` queues the
work, so a step really runs while the issuing thread goes on), on ``"cuda:N"`` a CuPy stream
(``run`` launches the work now, on the calling thread, with the stream current). A
:class:`Mark` completes once the work queued before it has run, and carries its time: host
time on cpu, a CUDA timing event on cuda, comparable across the lanes of one device through
:meth:`Mark.seconds_since`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..device import Device, HostEvent, HostStream

#: CUDA stream priorities (lower is higher). A side lane's stream takes the lowest, so where the
#: chain's stream has the highest, the device schedules the chain's blocks first and the side
#: lane's fill the rest. CUDA clamps a priority to the device's range.
CHAIN_PRIORITY = -5
SIDE_PRIORITY = 0


class Mark:
    """An event on a lane's stream, with the time its work finished."""

    def __init__(self, event, host_time: list | None = None):
        self.event = event
        self._host_time = host_time  # cpu: [perf_counter] once run

    @property
    def done(self) -> bool:
        if self._host_time is not None:
            return bool(self._host_time)
        return self.event.done

    def synchronize(self, timeout: float | None = None) -> None:
        if self._host_time is not None:
            self.event.synchronize(timeout)
        else:
            self.event.synchronize()

    def seconds_since(self, other: "Mark") -> float:
        """Seconds from ``other`` to this mark (both landed; cuda: recorded on one device)."""
        if self._host_time is not None:
            return self._host_time[0] - other._host_time[0]
        import cupy

        return cupy.cuda.get_elapsed_time(other.event, self.event) / 1e3


class LaneStream:
    """One lane's stream on ``device``; ``stream``: an existing one (the chain takes the
    device's own, where the pools queue their copies), else a new one at ``SIDE_PRIORITY``."""

    def __init__(self, device: Device, stream=None, name: str = "lane"):
        self.device = device
        self.owned = stream is None
        if device.is_cuda:
            import cupy

            with device.activate():
                self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True,
                                                                                 priority=SIDE_PRIORITY)
        else:
            self.stream = stream if stream is not None else HostStream(name=f"lora-{name}-stream")

    @property
    def is_cuda(self) -> bool:
        return self.device.is_cuda

    def run(self, fn: Callable, *args) -> None:
        """Queue ``fn(*args)`` (cpu) or launch it now with the stream current (cuda)."""
        if self.is_cuda:
            with self.device.activate(), self.stream:
                fn(*args)
        else:
            self.stream.enqueue(fn, *args)

    def mark(self) -> Mark:
        if self.is_cuda:
            import cupy

            with self.device.activate():
                ev = cupy.cuda.Event(block=False, disable_timing=False)
                ev.record(self.stream)
            return Mark(ev)
        stamp: list = []
        self.stream.enqueue(lambda: stamp.append(time.perf_counter()))
        return Mark(self.stream.record(), stamp)

    def run_marked(self, fn: Callable[[], Any], notify: Callable[[], Any] | None = None) -> tuple[Mark, Mark]:
        """``run(fn)`` between two marks, then ``notify()``: ``(start, landed)``, as
        ``mark(); run(fn); mark(); notify(notify)`` would give, for less: on cuda both events are
        recorded under one activation of the device, on the cpu it is one job on the host stream
        (one event, which the start mark shares: waiting on it waits for the landing)."""
        if self.is_cuda:
            import cupy

            Event = cupy.cuda.Event
            stream = self.stream
            with self.device.activate(), stream:
                start = Event(block=False, disable_timing=False)
                start.record(stream)
                fn()
                landed = Event(block=False, disable_timing=False)
                landed.record(stream)
            return Mark(start), Mark(landed)
        t0: list = []
        t1: list = []
        ev = HostEvent()

        def job():
            t0.append(time.perf_counter())
            try:
                fn()
            finally:
                t1.append(time.perf_counter())
                ev._set()
                if notify is not None:
                    notify()
        self.stream.enqueue(job)
        return Mark(ev, t0), Mark(ev, t1)

    def notify(self, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` on the host once the work queued so far has run (to wake a waiter).

        Host streams only: on cuda a host function in the stream would hold the stream until
        the callback gets the interpreter, so a waiter polls the marks there instead."""
        if not self.is_cuda:
            self.stream.enqueue(fn)

    def close(self) -> None:
        if self.owned and not self.is_cuda:
            self.stream.close()
