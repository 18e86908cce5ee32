"""Steps that run beside a worker's main chain, on a stream of their own (seed 002).

A node whose node group sets ``side_stream: true`` (a codec) runs on a lane of its own: the
scheduler hands the lane only its keys (``MicroScheduler.lane_of``), its steps are issued on the
GPU thread between two chain steps, and they land on the lane's stream while the chain carries
on. Submit and postprocess are the chain's own (``Worker._submit_step``, ``Worker._finish_step``),
keyed by lane.

One step in flight at a time; windows that come ready meanwhile batch into the next one. Its
graphs (one per bucket of windows) are captured on the lane's own stream, which is what makes
overlapping them with the chain's safe. A step here holds no resource (``EngineManager.build``
refuses a resourced node on the lane), so it is admitted and planned inline, never speculated,
planned ahead or lockstep.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .scheduler import SIDE_LANE, ScheduledBatch
from .graphs import StepGraphs
from .streams import Mark


@dataclass
class NodeBatch:
    """A side step's node and what it runs on: the windows' token ids, in batch order."""

    node: str
    windows: list


@dataclass
class SideRun:
    """A side step issued on the lane's stream: its output and the marks around it."""

    out: Any = None
    start: Mark | None = None
    landed: Mark | None = None
    error: BaseException | None = None


_PLANNED: Future = Future()  # a side step is planned inline: its plan future is done as it is made
_PLANNED.set_result(None)


@dataclass
class _InFlight:
    batch: Any
    future: Future  # the GPU thread's execute: a SideRun
    run: SideRun | None = None  # its result, kept once done (a pass that finds it not landed asks only the mark)


class SideStepLane:
    """A side lane's stream and the one step in flight on it."""

    def __init__(self, worker, lane: int = SIDE_LANE):
        self.worker = worker
        self.lane = lane
        self.node = worker.model.side_node
        self.stream = worker.new_stream(f"side{lane}")
        self.graphs = StepGraphs(self.stream, enabled=worker.use_graphs)  # captured on the lane's own stream
        self._inflight: _InFlight | None = None

    @property
    def busy(self) -> bool:
        return self._inflight is not None

    def launch(self, gpu_executor) -> None:
        """Queue the lane's next step on the GPU thread, if the stream is free."""
        if self._inflight is not None:
            return
        w = self.worker
        work = w.scheduler.take(self.lane)
        if not work:
            return
        windows = [x for _key, ws in work for x in ws]
        batch = ScheduledBatch(self.lane, w._next_seq(), self.node, tuple([x.rid for x in windows]), windows)
        node_batch = NodeBatch(self.node, [x.tokens for x in windows])
        w._submit_step(self.lane, batch)
        # planned inline: a side node holds no resource, so there is nothing to plan
        self._inflight = _InFlight(batch, gpu_executor.submit(self.execute, batch, node_batch, _PLANNED))

    def execute(self, batch, node_batch: NodeBatch, plan_future: Future) -> SideRun:
        """The GPU thread's step, on the lane's stream, with nothing to wait for on the main
        one: the tokens it reads landed before they were routed here (postprocess waits for the
        step that made them), and the windows are collated on this stream."""
        plan_future.result()
        run = SideRun()
        model = self.worker.model
        windows, graphs = node_batch.windows, self.graphs
        if self.stream.is_cuda:
            def work():
                run.out = model.codec(windows, graphs=graphs)
        else:
            faults, lane = getattr(model, "faults", None), self.lane

            def work():
                try:
                    if faults is not None:
                        faults.enter(lane)
                    out = model.codec(windows, graphs=graphs)
                    out.landed = True
                    run.out = out
                except BaseException as e:
                    run.error = e
        run.start, run.landed = self.stream.run_marked(work, self.worker._notify)
        return run

    def finish(self, block: bool = False) -> None:
        """Postprocess the step in flight once it has landed; ``block`` waits.

        Never before the step has landed: postprocess frees its inputs, and a step that failed
        fails its requests with its error (the chain carries on)."""
        f = self._inflight
        if f is None:
            return
        run, error = f.run, None
        if run is None:
            if not block and not f.future.done():
                return
            error = f.future.exception()
            if error is None:
                run = f.run = f.future.result()
        if run is not None and not run.landed.done:
            if not block:
                return
            run.landed.synchronize()
        self._inflight = None
        if run is not None:
            if run.out is not None and self.stream.is_cuda:
                run.out.landed = run.landed.done
            error = run.error
            self.worker.marks.append((self.lane, f.batch.seq, run.start, run.landed))
        self.worker._finish_step(self.lane, f.batch, None if run is None else run.out, error)

    def close(self) -> None:
        self.stream.close()
