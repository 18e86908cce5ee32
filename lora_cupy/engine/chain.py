"""The worker's main chain (``CHAIN_LANE``): step N on the device, step N+1 launched behind it.

A chain step is built on the main loop (the rows of every running request with tokens left, or,
with no side lane, the windows waiting on the chain), then issued on the GPU thread: admit on
every resource, plan, the model's inputs staged, and its device work on the chain's stream
between two marks, under a graph per key (``graphs.py``). The chain never runs deeper than two
steps, so step N is postprocessed before step N+2 reuses its buffers.

Pre-planning. Where every resource ``supports_preplan``, a step is planned with
``ctx.preplanned`` and activated in stream order (``activate(ctx)``), so plan(N+1) may run while
step N is on the device. On cuda a step's kernels take the plan's views as they launch, so that
holds whatever the resources do; on the cpu the step runs later, on the host stream, and a chain
whose resources cannot be pre-planned runs one step at a time.

Failures. A step that fails (at admit, launch or on the device) rolls back what its admit took,
and so does every step behind it (they read its output), and nothing new is launched until they
are rolled back; their rows run again, those whose first admit it was from the admission queue.
Rows an admit refuses fail alone; the rest of the step runs.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .graphs import StepGraphs
from .resource import LoraStep, StepContext
from .scheduler import CHAIN_LANE, ScheduledBatch
from .streams import LaneStream, Mark

CHAIN_DEPTH = 2  # step N on the device, N+1 behind it


@dataclass
class ChainStep:
    """A chain step between its submit and its finish."""

    batch: ScheduledBatch
    launched: Future | None = None  # the GPU thread's part (admit, plan, device work)
    ctx: StepContext | None = None
    step: LoraStep | None = None
    admitted: list = field(default_factory=list)
    start: Mark | None = None
    landed: Mark | None = None
    out: Any = None
    error: BaseException | None = None  # from its device work
    failed_rows: dict = field(default_factory=dict)
    doomed: bool = False
    key: Any = None


class ChainLane:
    """The main chain of ``worker``: its stream (the device's own, where the pools' copies go),
    its graphs, and the steps in flight on it."""

    lane = CHAIN_LANE

    def __init__(self, worker, graphs: bool = True, preplan: bool = True):
        self.worker = worker
        resources = worker.resources
        self.stream = LaneStream(worker.device, worker.device.stream, name="chain")
        self.graphs = StepGraphs(self.stream, enabled=graphs)
        self.preplan = preplan and all(getattr(r, "supports_preplan", False) for r in resources)
        self.double_buffer = self.preplan or any(r.force_double_buffer for r in resources)
        self.depth = CHAIN_DEPTH if (self.preplan or worker.device.is_cuda) else 1
        self.buckets = tuple(worker.model.buckets)
        self._steps: deque[ChainStep] = deque()
        self._parity = 0  # flips every decode step (see _execute)
        self._codec_parity = 0

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def busy(self) -> bool:
        return bool(self._steps)

    @property
    def full(self) -> bool:
        return len(self._steps) >= self.depth

    # -- the main loop's part ---------------------------------------------------------------------
    def launch(self, gpu_executor) -> None:
        """Submit the next step, if there is room and work: windows waiting on the chain (no side
        lane), else a decode row of every running request with tokens still to schedule."""
        w = self.worker
        if self.full or any(s.doomed for s in self._steps):
            return  # nothing new behind a step that will be rolled back: it read that step's output
        work = w.scheduler.take(CHAIN_LANE)
        if work:
            items = [x for _key, xs in work for x in xs]
            batch = ScheduledBatch(CHAIN_LANE, w._next_seq(), w.model.side_node, tuple(x.rid for x in items), items)
        else:
            rows = []
            for live in w._running.values():
                if live.scheduled < live.req.max_new_tokens and not live.removing:
                    rows.append(live)
                    if len(rows) == w.max_rows:
                        break
            if not rows:
                return
            seq = w._next_seq()
            items = []
            for live in rows:
                items.append((live.req.rid, live.scheduled, live.req.prompt))
                live.scheduled += 1
                if live.first_seq is None:
                    live.first_seq = seq
            batch = ScheduledBatch(CHAIN_LANE, seq, w.model.chain_node, tuple(r.req.rid for r in rows), items)
        rec = ChainStep(batch)
        w._submit_step(CHAIN_LANE, batch)
        rec.launched = gpu_executor.submit(self._execute, rec)
        self._steps.append(rec)

    def finish(self, block: bool = False) -> bool:
        """Finish the oldest step once it has landed (``block``: wait for it): commit and
        postprocess it, or roll it back. Whether one was finished."""
        if not self._steps:
            return False
        w = self.worker
        rec = self._steps[0]
        if not rec.launched.done() and not block:
            return False
        launch_error = rec.launched.exception()
        if launch_error is None and rec.landed is not None and not rec.landed.done:
            if not block:
                return False
            rec.landed.synchronize()
        self._steps.popleft()
        if rec.start is not None and rec.landed is not None:
            w.marks.append((CHAIN_LANE, rec.batch.seq, rec.start, rec.landed))
        error = launch_error or rec.error
        out = rec.out
        if out is not None and self.stream.is_cuda:
            out.landed = rec.landed.done
        batch = rec.batch
        if batch.node == w.model.side_node:  # windows on the chain: no resource took anything
            w._finish_step(CHAIN_LANE, batch, out, error)
            return True
        if error is not None or rec.doomed:
            for later in self._steps:
                later.doomed = True
            w._on_gpu_thread(self._rollback, rec)
            self._finish_rolled_back(rec, error)
            return True
        if rec.ctx is not None:
            w._on_gpu_thread(self._commit, rec)
        for rid, err in rec.failed_rows.items():
            live = w._live.get(rid)
            if live is not None:
                live.scheduled -= 1
                w._fail(live, err)
        if rec.failed_rows:
            batch.items = [it for it in batch.items if it[0] not in rec.failed_rows]
        w._finish_step(CHAIN_LANE, batch, out if batch.items else None)
        return True

    def _finish_rolled_back(self, rec: ChainStep, error) -> None:
        w = self.worker
        batch = rec.batch
        for rid, pos, _prompt in batch.items:
            live = w._live.get(rid)
            if live is None or live.removing:
                continue
            live.scheduled = min(live.scheduled, pos)
            if error is not None:
                live.chain_failures += 1
                if live.chain_failures >= w.max_chain_failures:
                    w._fail(live, error)
                    continue
            if live.first_seq == batch.seq:
                w._requeue(live)
        w.stats["chain_rollbacks"] += 1
        w._finish_step(CHAIN_LANE, batch, None)

    # -- the GPU thread's part ------------------------------------------------------------------------
    def _execute(self, rec: ChainStep) -> None:
        """Admit and plan on every resource, then the device work on the chain's stream (a graph
        per key); on failure, roll back the admits."""
        w = self.worker
        model, resources = w.model, w.resources
        batch = rec.batch
        if batch.node == model.side_node:  # windows on the chain: buffers alternate, as N+1 runs ahead
            self._codec_parity ^= 1
            parity, windows = self._codec_parity, [x.tokens for x in batch.items]
            self._launch_device(rec, lambda: model.codec(windows, parity, self.graphs))
            return
        step = rec.step = LoraStep(batch.rids, node=batch.node, seq=batch.seq)
        ctx = rec.ctx = StepContext(seq=batch.seq, preplanned=self.preplan)
        try:
            failed = {}
            for r in resources:
                out = r.admit(step, ctx)
                rec.admitted.append(r)
                failed.update(out.failed)
            items = batch.items
            if failed:  # those rows fail; the rest run
                rec.failed_rows = failed
                items = [it for it in items if it[0] not in failed]
                if not items:
                    return
                step = rec.step = LoraStep([it[0] for it in items], node=batch.node, seq=batch.seq)
            n = len(items)
            bucket = next(b for b in self.buckets if b >= n)
            # The runner's parity flips every decode step: its own outputs are read after step N+1
            # is launched, so they alternate. A double-buffered resource flips with it (one flip
            # per plan), one that is not keeps parity 0: a key's buffers are fixed either way.
            self._parity ^= 1
            parity = self._parity
            plans = [r.plan(step, ctx) for r in resources]  # each resource's addressing (or None)
            staged = model.stage(items, bucket)
        except BaseException:
            self._rollback(rec)
            raise
        bufs = model.buffers(bucket, parity)
        # the graph key: what the step's launch shape and buffers depend on (graphs.py)
        active = tuple(bool(getattr(p, "active", False)) for p in plans)
        # a pool's launches also depend on the rank class its step's slots need (planning.LaunchViews)
        rec.key = (bucket, parity, active, tuple(getattr(p, "rank_bound", None) for p in plans))
        reads = tuple(_addr(getattr(p, "slot_indptr", None)) for p in plans)
        out = model.output(bufs, n)
        graphs = self.graphs

        def device_work():  # in stream order: inputs in, the pre-planned plans made current, the step
            model.load_inputs(bufs, staged)
            if ctx.preplanned:
                for r in resources:
                    if hasattr(r, "activate"):
                        r.activate(ctx)
            graphs.launch(rec.key, lambda: model.forward(bufs), reads=reads)
            return out

        self._launch_device(rec, device_work)

    def _launch_device(self, rec: ChainStep, work) -> None:
        """Issue ``work`` (returns the step's output) on the chain's stream between two marks.
        On cuda it launches now, on this (the GPU) thread; on the cpu it is a job on the host
        stream, whose exception is kept on the step (a device error, seen at finish)."""
        stream = self.stream
        rec.start = stream.mark()
        if stream.is_cuda:
            with self.worker.device.activate(), stream.stream:
                rec.out = work()
        else:
            faults = getattr(self.worker.model, "faults", None)

            def job():
                try:
                    if faults is not None:
                        faults.enter(CHAIN_LANE)
                    res = work()
                    res.landed = True  # its device work has run
                    rec.out = res
                except BaseException as e:
                    rec.error = e
            stream.run(job)
        rec.landed = stream.mark()
        stream.notify(self.worker._notify)

    def _rollback(self, rec: ChainStep) -> None:
        """Give back what the step's admit took, on every resource that admitted it."""
        for r in reversed(rec.admitted):
            r.rollback_admit(rec.step, rec.ctx)
        rec.admitted = []

    def _commit(self, rec: ChainStep) -> None:
        for r in self.worker.resources:
            r.commit(rec.step, rec.ctx)


def _addr(arr) -> int | None:
    """A device or host array's data address (what a captured graph bakes in)."""
    if arr is None:
        return None
    if hasattr(arr, "data") and hasattr(arr.data, "ptr"):
        return int(arr.data.ptr)
    return int(arr.__array_interface__["data"][0])
