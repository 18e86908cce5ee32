"""The worker: one main chain of steps, one GPU thread, deferred teardown, one admission queue.

The main loop (:meth:`Worker.run_once`, looped by :meth:`Worker.start`) runs one chain
(``CHAIN_LANE``): step N on the device while step N+1 is admitted, planned and launched behind
it, never deeper, so step N is postprocessed before step N+2 reuses its buffers. Every piece of
device work (admit, plan, copies in and out, launches, commit, rollback) is issued by one GPU
thread, one call at a time; the main loop only schedules, postprocesses and tears down.

Admission. A request is ingested by every resource as it arrives, then waits in one
:class:`AdmissionQueue` over every resource that asks (the LoRA pools, the KV cache): it holds
nothing there until every one of them can take it, so a full pool makes it wait without KV
pages and a full KV cache without a slot, and rows already running never lose a step to it.

Lanes. Submit and postprocess are keyed by lane (:meth:`_submit_step`, :meth:`_finish_step`):
the chain's decode steps and, where a node runs on a side lane (``side_steps.SideStepLane``),
that lane's steps. A request's windows go to the micro-scheduler under ``(rid, codec)``; the
side lane takes them, or, with no side lane, the chain runs them as steps of its own.

Teardown. A request is removed (finished, failed or cancelled) only once no in-flight step on
any lane references it; then ``remove_request`` runs on every resource (README invariant 3: a
slot is overwritten only once no step still on the device reads it).

Failures. A chain step that fails (at admit, launch or on the device) rolls back what its admit
took, and so does every chain step behind it (they read its output); their rows run again,
those whose first admit it was from the admission queue. A side step that fails fails its
requests with its error, while the chain carries on.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .admission import AdmissionQueue
from .graphs import StepGraphs
from .kv import KVReqConfig
from .resource import LoraStep, StepContext
from .scheduler import CHAIN_LANE, MicroScheduler, ScheduledBatch
from .streams import LaneStream, Mark

CHAIN_DEPTH = 2  # step N on the device, N+1 behind it
POLL_S = 2e-4  # how often the main loop looks at cuda marks while steps are in flight


@dataclass(frozen=True)
class Request:
    """A request: its adapter (None: base model), a prompt token, how many tokens to generate,
    and its codec window (every ``window`` generated tokens; 0: no codec work)."""

    rid: Hashable
    adapter: str | None = None
    prompt: int = 0
    max_new_tokens: int = 1
    window: int = 0


@dataclass
class RequestResult:
    """What a finished request gives: its tokens, each token's hidden state, its codec windows'
    outputs (in window order)."""

    rid: Hashable
    tokens: list
    hidden: list
    windows: list


@dataclass
class Window:
    """``tokens[start:start + len(tokens)]`` of a request, its ``index``-th window."""

    rid: Hashable
    index: int
    tokens: tuple


@dataclass
class _Live:
    req: Request
    future: Future
    state: str = "new"  # new -> waiting -> running -> done / failed
    scheduled: int = 0  # tokens in chain steps launched (in flight or landed)
    first_seq: int | None = None  # the chain step that carries its first admit
    tokens: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    windows_made: int = 0
    windows: list = field(default_factory=list)
    cut: int = 0  # tokens already in a window
    chain_failures: int = 0
    removing: bool = False

    @property
    def windows_total(self) -> int:
        w = self.req.window
        return 0 if w <= 0 else -(-self.req.max_new_tokens // w)


@dataclass
class ChainStep:
    """A chain step between its submit and its finish."""

    batch: ScheduledBatch
    launched: Future | None = None  # the GPU thread's launch (admit, plan, device work)
    ctx: StepContext | None = None
    step: LoraStep | None = None
    admitted: list = field(default_factory=list)
    landed: Mark | None = None
    start: Mark | None = None
    out: Any = None
    error: BaseException | None = None  # from its device work
    failed_rows: dict = field(default_factory=dict)
    doomed: bool = False
    key: Any = None


class Worker:
    """Runs ``model`` (``DecodeModel``'s interface) over ``resources`` on ``device``.

    ``side_nodes``: nodes given a side lane (``EngineManager.build`` decides; empty: their
    windows run on the chain). ``graphs``: capture the chain's steps (cuda). ``preplan``:
    plan step N+1 while step N runs, where every resource ``supports_preplan``.
    ``max_chain_failures``: a row whose chain steps failed this often fails its request.
    """

    def __init__(self, model, resources: Sequence, device, side_nodes: Sequence[str] = (),
                 graphs: bool = True, preplan: bool = True, max_rows: int | None = None,
                 max_chain_failures: int = 3):
        self.model = model
        self.resources = list(resources)
        self.device = device
        for r in self.resources:
            d = getattr(r, "device", None)
            if d is not None and d is not device:
                raise ValueError(f"resource {r!r} queues its copies on {d!r}, not the worker's device: "
                                 "the chain's steps must run on the stream its plans are copied on")
        self.scheduler = MicroScheduler(side_nodes)
        self.admission = AdmissionQueue(self.resources)
        self.gpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-gpu")
        self.chain_stream = LaneStream(device, device.stream, name="chain")
        self.use_graphs = graphs
        self.graphs = StepGraphs(self.chain_stream, enabled=graphs)
        self.preplan = preplan and all(getattr(r, "supports_preplan", False) for r in self.resources)
        self.double_buffer = self.preplan or any(r.force_double_buffer for r in self.resources)
        # On cuda a step's kernels take the current plan's views as they launch, so plan(N+1) may
        # follow launch(N) whatever the resources do; on the cpu the step runs later, on the host
        # stream, and reads a plan it activates there, which only a pre-planned step has.
        self.depth = CHAIN_DEPTH if (self.preplan or device.is_cuda) else 1
        self.buckets = tuple(model.buckets)
        self.max_rows = min(max_rows or self.buckets[-1], self.buckets[-1])
        self.max_chain_failures = max_chain_failures
        self.side_lanes: dict[int, Any] = {}
        self._live: dict[Hashable, _Live] = {}
        self._running: dict[Hashable, _Live] = {}  # admitted to the chain, in admission order
        self._chain: deque[ChainStep] = deque()
        self._refs: Counter = Counter()  # rid -> in-flight steps referencing it
        self._inbox: deque = deque()
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._seq = 0
        self._parity = 0
        self._codec_parity = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.loop_error: BaseException | None = None
        self.stats: Counter = Counter()
        self.removed: deque = deque(maxlen=1 << 16)  # rids in the order their remove_request ran
        self.trace: deque = deque(maxlen=1 << 16)  # (event, lane, seq, rids) in the main loop's order
        self.marks: deque = deque(maxlen=4096)  # (lane, seq, start, landed) of recent landed steps

    # -- the public side (any thread) -------------------------------------------------------------
    def submit(self, req: Request) -> Future:
        """Queue ``req``; its future gives a :class:`RequestResult` or fails with its error."""
        if req.max_new_tokens < 1:
            raise ValueError(f"request {req.rid!r}: max_new_tokens must be >= 1")
        most = getattr(self.model, "max_window", None)
        if req.window < 0 or (most is not None and req.window > most):
            raise ValueError(f"request {req.rid!r}: window {req.window} outside [0, {most}]")
        fut: Future = Future()
        with self._inbox_lock:
            self._inbox.append(("add", req, fut))
        self._wake.set()
        return fut

    def remove(self, rid: Hashable) -> None:
        """Cancel ``rid``: it leaves every lane, and is removed once no in-flight step reads it."""
        with self._inbox_lock:
            self._inbox.append(("remove", rid, None))
        self._wake.set()

    def add_side_lane(self, lane) -> None:
        self.side_lanes[lane.lane] = lane

    def new_stream(self, name: str) -> LaneStream:
        return LaneStream(self.device, name=name)

    @property
    def live(self) -> int:
        return len(self._live)

    def idle(self) -> bool:
        with self._inbox_lock:
            if self._inbox:
                return False
        return not self._live and not self._chain and all(not s.busy for s in self.side_lanes.values())

    # -- the main loop ----------------------------------------------------------------------------
    def run_once(self, block: bool = False, timeout: float = 0.05) -> None:
        """One pass: arrivals and removals, admission, the side lanes, the chain, teardown.
        ``block``: wait (up to ``timeout``) for a step to land when nothing else can move."""
        self._wake.clear()
        self._take_inbox()
        self._admit_waiting()
        for lane in self.side_lanes.values():
            lane.finish(block=False)
            lane.launch(self.gpu)
        while self._chain and self._finish_chain(block=False):
            pass
        if len(self._chain) < self.depth:
            self._launch_chain()
        if len(self._chain) >= self.depth:
            # N+1 is launched: wait for N (here, or at the next pass when not blocking)
            self._finish_chain(block=block)
        elif block and (self._chain or any(s.busy for s in self.side_lanes.values())):
            # host streams wake us as a step lands; on cuda we poll the marks (streams.py)
            self._wake.wait(POLL_S if self.device.is_cuda else timeout)

    def drain(self, timeout: float = 30.0) -> None:
        """Run the loop here until every request has finished or failed (tests, one-shot use)."""
        import time

        end = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > end:
                raise TimeoutError(f"worker not idle after {timeout}s: {self.live} live requests")
            self.run_once(block=True)

    def start(self) -> None:
        """Run the main loop on a thread of its own."""
        if self._thread is not None:
            raise RuntimeError("the worker is running already")
        self._thread = threading.Thread(target=self._loop, name="lora-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.run_once(block=True)
                if self.idle():
                    self._wake.wait(0.05)
        except BaseException as e:  # kept for stop() to raise
            self.loop_error = e

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.loop_error is not None:
            raise self.loop_error

    def close(self) -> None:
        if self._thread is not None:
            self.stop()
        self.gpu.shutdown(wait=True)
        for lane in self.side_lanes.values():
            lane.close()

    def _notify(self) -> None:
        self._wake.set()

    # -- arrivals, admission, removal ----------------------------------------------------------------
    def _take_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = list(self._inbox), deque()
        for kind, x, fut in items:
            if kind == "add":
                self._ingest(x, fut)
            else:
                live = self._live.get(x)
                if live is not None:
                    self._fail(live, CancelledError(f"request {x!r} was removed"))

    def _ingest(self, req: Request, fut: Future) -> None:
        if req.rid in self._live:
            fut.set_exception(ValueError(f"request {req.rid!r} is live already"))
            return
        live = _Live(req, fut)
        cfg = KVReqConfig(adapter=req.adapter, max_tokens=req.max_new_tokens)
        done = []
        try:
            for r in self.resources:
                r.ingest_request(req.rid, cfg)
                done.append(r)
        except Exception as e:
            for r in done:
                r.remove_request(req.rid)
            fut.set_exception(e)
            return
        self._live[req.rid] = live
        live.state = "waiting"
        self.admission.submit(req.rid, self.model.chain_node, self._walk(req))

    def _walk(self, req: Request) -> tuple:
        return (self.model.chain_node, self.model.side_node) if req.window > 0 else (self.model.chain_node,)

    def _admit_waiting(self) -> None:
        for g in self.admission.pump():
            live = self._live.get(g.rid)
            if live is None:
                continue
            if g.failed:
                self._fail(live, next(iter(g.failed.values())))
                continue
            live.state = "running"
            self._running[g.rid] = live

    def _requeue(self, live: _Live) -> None:
        """Back to admission: its first admit was rolled back, so it holds nothing."""
        rid = live.req.rid
        self._running.pop(rid, None)
        self.admission.cancel(rid)
        live.state = "waiting"
        live.first_seq = None
        self.admission.submit(rid, self.model.chain_node, self._walk(live.req))

    def _fail(self, live: _Live, err: BaseException) -> None:
        if live.state in ("done", "failed"):
            return
        live.state = "failed"
        if not live.future.cancelled():  # a caller may cancel the future; the request still tears down
            live.future.set_exception(err)
        self.stats["failed"] += 1
        self._teardown(live)

    def _done(self, live: _Live) -> None:
        live.state = "done"
        if not live.future.cancelled():
            live.future.set_result(RequestResult(live.req.rid, live.tokens, live.hidden, live.windows))
        self.stats["done"] += 1
        self._teardown(live)

    def _teardown(self, live: _Live) -> None:
        """Leave every lane now; the resources let go once no in-flight step references it."""
        rid = live.req.rid
        live.removing = True
        self._running.pop(rid, None)
        self.admission.cancel(rid)
        self.scheduler.drop(rid)
        self._maybe_remove(rid)

    def _maybe_remove(self, rid: Hashable) -> None:
        live = self._live.get(rid)
        if live is None or not live.removing or self._refs[rid] > 0:
            return
        del self._live[rid]
        del self._refs[rid]
        for r in self.resources:
            r.remove_request(rid)
        self.removed.append(rid)
        self.trace.append(("remove", None, None, (rid,)))

    # -- submit and finish, keyed by lane ----------------------------------------------------------------
    def _submit_step(self, lane: int, batch: ScheduledBatch) -> None:
        for rid in batch.rids:
            self._refs[rid] += 1
        self.trace.append(("submit", lane, batch.seq, batch.rids))
        self.stats[f"steps_lane{lane}"] += 1
        self.stats[f"steps_{batch.node}"] += 1

    def _finish_step(self, lane: int, batch: ScheduledBatch, out, error: BaseException | None = None) -> None:
        """Postprocess a landed step (``out``), or fail what it carried (``error``, side lanes)."""
        self.trace.append(("finish", lane, batch.seq, batch.rids))
        try:
            if batch.node == self.model.side_node:
                self._postprocess_windows(batch, out, error)
            elif out is not None:
                self._postprocess_chain(batch, out)
        finally:
            for rid in batch.rids:
                self._refs[rid] -= 1
            for rid in batch.rids:
                self._maybe_remove(rid)

    def _postprocess_chain(self, batch: ScheduledBatch, out) -> None:
        tokens, hidden = self._on_gpu_thread(self.model.read, out)
        for i, (rid, pos, _prompt) in enumerate(batch.items):
            live = self._live.get(rid)
            if live is None or live.removing:
                continue
            if pos != len(live.tokens):
                raise AssertionError(f"request {rid!r}: token {pos} landed after {len(live.tokens)} tokens")
            live.tokens.append(int(tokens[i]))
            live.hidden.append(hidden[i])
            self._cut_window(live)
            self._maybe_done(live)

    def _cut_window(self, live: _Live) -> None:
        w, n = live.req.window, len(live.tokens)
        if w <= 0 or not (n - live.cut == w or n == live.req.max_new_tokens) or n == live.cut:
            return
        win = Window(live.req.rid, live.windows_made, tuple(live.tokens[live.cut:n]))
        live.cut = n
        live.windows_made += 1
        self.scheduler.put((live.req.rid, self.model.side_node), win)
        self._wake.set()

    def _postprocess_windows(self, batch: ScheduledBatch, out, error) -> None:
        if error is not None:
            for rid in dict.fromkeys(batch.rids):
                live = self._live.get(rid)
                if live is not None:
                    self._fail(live, error)
            return
        vecs = self._on_gpu_thread(self.model.read_codec, out)
        for i, win in enumerate(batch.items):
            live = self._live.get(win.rid)
            if live is None or live.removing:
                continue
            if win.index != len(live.windows):
                raise AssertionError(f"request {win.rid!r}: window {win.index} landed after {len(live.windows)}")
            live.windows.append(vecs[i])
            self._maybe_done(live)

    def _on_gpu_thread(self, fn, *args):
        """Run ``fn`` on the GPU thread and wait: every copy off the device goes from there too."""
        return self.gpu.submit(fn, *args).result()

    def _maybe_done(self, live: _Live) -> None:
        if len(live.tokens) == live.req.max_new_tokens and len(live.windows) == live.windows_total:
            self._done(live)

    # -- the chain ----------------------------------------------------------------------------------
    def _launch_chain(self) -> None:
        """Submit the next chain step: windows waiting on the chain (no side lane), else decode
        rows of every running request with tokens still to schedule."""
        if any(s.doomed for s in self._chain):
            return  # nothing new behind a step that will be rolled back: it read that step's output
        work = self.scheduler.take(CHAIN_LANE)
        if work:
            items = [w for _key, ws in work for w in ws]
            batch = ScheduledBatch(CHAIN_LANE, self._next_seq(), self.model.side_node,
                                   tuple(w.rid for w in items), items)
        else:
            rows = []
            for rid, live in self._running.items():
                if live.scheduled < live.req.max_new_tokens and not live.removing:
                    rows.append(live)
                    if len(rows) == self.max_rows:
                        break
            if not rows:
                return
            seq = self._next_seq()
            items = []
            for live in rows:
                items.append((live.req.rid, live.scheduled, live.req.prompt))
                live.scheduled += 1
                if live.first_seq is None:
                    live.first_seq = seq
            batch = ScheduledBatch(CHAIN_LANE, seq, self.model.chain_node, tuple(r.req.rid for r in rows), items)
        rec = ChainStep(batch)
        self._submit_step(CHAIN_LANE, batch)
        rec.launched = self.gpu.submit(self._chain_launch, rec)
        self._chain.append(rec)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _chain_launch(self, rec: ChainStep) -> None:
        """The GPU thread's part of a chain step: admit and plan on every resource, then the
        device work on the chain's stream (a graph per key); on failure, roll back the admits."""
        batch = rec.batch
        if batch.node == self.model.side_node:  # windows on the chain: buffers alternate, as N+1 runs ahead
            self._codec_parity ^= 1
            parity, windows = self._codec_parity, [w.tokens for w in batch.items]
            self._launch_device(rec, lambda: self.model.codec(windows, parity, self.graphs))
            return
        step = rec.step = LoraStep(batch.rids, node=batch.node, seq=batch.seq)
        ctx = rec.ctx = StepContext(seq=batch.seq, preplanned=self.preplan)
        try:
            failed = {}
            for r in self.resources:
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
            plans = [r.plan(step, ctx) for r in self.resources]  # each resource's addressing (or None)
            staged = self.model.stage(items, bucket)
        except BaseException:
            self._rollback(rec)
            raise
        bufs = self.model.buffers(bucket, parity)
        # the graph key: what the step's launch shape and buffers depend on (graphs.py)
        active = tuple(bool(getattr(p, "active", False)) for p in plans)
        rec.key = (bucket, parity, active)
        reads = tuple(_addr(getattr(p, "slot_indptr", None)) for p in plans)
        out = self.model.output(bufs, n)
        model, graphs, resources = self.model, self.graphs, self.resources

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
        """Issue ``work`` (returns the step's ``StepOutput``) on the chain's stream between two
        marks. On cuda it launches now, on this (the GPU) thread; on the cpu it is a job on the
        host stream, whose exception is kept on the step (a device error, seen at finish)."""
        stream = self.chain_stream
        rec.start = stream.mark()
        if stream.is_cuda:
            with self.device.activate(), stream.stream:
                rec.out = work()
        else:
            faults = getattr(self.model, "faults", None)

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
        stream.notify(self._notify)

    def _finish_chain(self, block: bool) -> bool:
        """Finish the oldest chain step if it has landed (``block``: wait for it)."""
        rec = self._chain[0]
        if not rec.launched.done():
            if not block:
                return False
            rec.launched.exception()
        launch_error = rec.launched.exception()
        if launch_error is None and rec.landed is not None and not rec.landed.done:
            if not block:
                return False
            rec.landed.synchronize()
        self._chain.popleft()
        if rec.start is not None and rec.landed is not None:
            self.marks.append((CHAIN_LANE, rec.batch.seq, rec.start, rec.landed))
        error = launch_error or rec.error
        out = rec.out
        if out is not None and self.chain_stream.is_cuda:
            out.landed = rec.landed.done
        batch = rec.batch
        if batch.node == self.model.side_node:  # windows run on the chain: no resource took anything
            self._finish_step(CHAIN_LANE, batch, out, error)
            return True
        if error is not None or rec.doomed:
            for later in self._chain:
                later.doomed = True
            self._on_gpu_thread(self._rollback, rec)
            self._finish_rolled_back(rec, error)
            return True
        if rec.ctx is not None:
            self._on_gpu_thread(self._commit, rec)
        for rid, err in rec.failed_rows.items():
            live = self._live.get(rid)
            if live is not None:
                live.scheduled -= 1
                self._fail(live, err)
        if rec.failed_rows:
            batch.items = [it for it in batch.items if it[0] not in rec.failed_rows]
        self._finish_step(CHAIN_LANE, batch, out if batch.items else None)
        return True

    def _finish_rolled_back(self, rec: ChainStep, error) -> None:
        batch = rec.batch
        for rid, pos, _p in batch.items:
            live = self._live.get(rid)
            if live is None or live.removing:
                continue
            live.scheduled = min(live.scheduled, pos)
            if error is not None:
                live.chain_failures += 1
                if live.chain_failures >= self.max_chain_failures:
                    self._fail(live, error)
                    continue
            if live.first_seq == batch.seq:
                self._requeue(live)
        self.stats["chain_rollbacks"] += 1
        self._finish_step(CHAIN_LANE, batch, None)

    def _rollback(self, rec: ChainStep) -> None:
        """Give back what the step's admit took, on every resource that admitted it."""
        for r in reversed(rec.admitted):
            r.rollback_admit(rec.step, rec.ctx)
        rec.admitted = []

    def _commit(self, rec: ChainStep) -> None:
        for r in self.resources:
            r.commit(rec.step, rec.ctx)

    def check_valid(self) -> None:
        """Every resource's own check, and the worker's: no removed request is referenced."""
        for r in self.resources:
            check = getattr(r, "check_valid", None)
            if check is not None:
                check()
        for rid, n in self._refs.items():
            assert n >= 0, f"request {rid!r}: {n} references"
            assert n == 0 or rid in self._live, f"removed request {rid!r} is still referenced"


def _addr(arr) -> int | None:
    if arr is None:
        return None
    if hasattr(arr, "data") and hasattr(arr.data, "ptr"):
        return int(arr.data.ptr)
    return int(arr.__array_interface__["data"][0])


