"""The worker: one main chain of steps, one GPU thread, deferred teardown, one admission queue.

The main loop (:meth:`Worker.run_once`, looped by :meth:`Worker.start`) runs one chain
(``CHAIN_LANE``, :class:`~lora_cupy.engine.chain.ChainLane`): step N on the device while step
N+1 is admitted, planned and launched behind it. Every piece of device work (admit, plan, copies
in and out, launches, commit, rollback) is issued by one GPU thread, one call at a time; the main
loop only schedules, postprocesses and tears down.

Admission. A request is ingested by every resource as it arrives, then waits in one
:class:`AdmissionQueue` over every resource that asks (the LoRA pools, the KV cache): it holds
nothing there until every one of them can take it, so a full pool makes it wait without KV
pages and a full KV cache without a slot, and rows already running never lose a step to it.

Lanes. Submit and postprocess are keyed by lane (:meth:`_submit_step`, :meth:`_finish_step`):
the chain's steps and, where a node runs on a side lane (``side_steps.SideStepLane``), that
lane's steps. A request's windows go to the micro-scheduler under ``(rid, codec)``; the side
lane takes them, or, with no side lane, the chain runs them as steps of its own.

Teardown. A request is removed (finished, failed or cancelled) only once no in-flight step on
any lane references it; then ``remove_request`` runs on every resource (README invariant 3: a
slot is overwritten only once no step still on the device reads it).

Failures. A failed chain step is rolled back and its rows run again (``chain.py``); a side step
that fails fails its requests with its error, while the chain carries on.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .admission import AdmissionQueue
from .chain import ChainLane
from .kv import KVReqConfig
from .scheduler import MicroScheduler, ScheduledBatch
from .streams import LaneStream

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
    next_cut: int = field(default=0, init=False)  # the token count completing its next window (0: none);
    # _window_end(cut), kept so the per-token check is one comparison
    chain_failures: int = 0
    removing: bool = False
    windows_total: int = field(default=0, init=False)  # how many windows it makes (from req)

    def __post_init__(self):
        w = self.req.window
        self.windows_total = 0 if w <= 0 else -(-self.req.max_new_tokens // w)
        self.next_cut = self._window_end(0)

    def _window_end(self, start: int) -> int:
        w = self.req.window
        return 0 if w <= 0 or start >= self.req.max_new_tokens else min(start + w, self.req.max_new_tokens)


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
        self.use_graphs = graphs
        self.max_rows = min(max_rows or model.buckets[-1], model.buckets[-1])
        self.max_chain_failures = max_chain_failures
        self.side_lanes: dict[int, Any] = {}
        self._live: dict[Hashable, _Live] = {}
        self._running: dict[Hashable, _Live] = {}  # admitted to the chain, in admission order
        self._refs: Counter = Counter()  # rid -> in-flight steps referencing it
        self._inbox: deque = deque()
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.loop_error: BaseException | None = None
        self.stats: Counter = Counter()
        self._stat_keys: dict = {}  # (lane, node) -> its stats' keys
        self.removed: deque = deque(maxlen=1 << 16)  # rids in the order their remove_request ran
        self.trace: deque = deque(maxlen=1 << 16)  # (event, lane, seq, rids) in the main loop's order
        self.marks: deque = deque(maxlen=4096)  # (lane, seq, start, landed) of recent landed steps
        self.chain = ChainLane(self, graphs=graphs, preplan=preplan)

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
        return not self._live and not self.chain.busy and all(not s.busy for s in self.side_lanes.values())

    # -- the main loop ----------------------------------------------------------------------------
    def run_once(self, block: bool = False, timeout: float = 0.05) -> None:
        """One pass: arrivals and removals, admission, the chain, the side lanes, teardown.
        ``block``: wait (up to ``timeout``) for a step to land when nothing else can move."""
        self._wake.clear()
        self._take_inbox()
        self._admit_waiting()
        while self.chain.finish(block=False):
            pass
        self.chain.launch(self.gpu)
        # The side lanes after the chain's launch: their postprocess runs while the GPU thread
        # issues the chain's step (not before it), their next step queues on the GPU thread
        # behind that one, and windows the chain's finish just cut go in this pass.
        for lane in self.side_lanes.values():
            lane.finish(block=False)
            lane.launch(self.gpu)
        if self.chain.full:
            # N+1 is launched: wait for N (here, or at the next pass when not blocking)
            self.chain.finish(block=block)
        elif block and (self.chain.busy or any(s.busy for s in self.side_lanes.values())):
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
        self._refs.update(batch.rids)
        self.trace.append(("submit", lane, batch.seq, batch.rids))
        keys = self._stat_keys.get((lane, batch.node))
        if keys is None:
            keys = self._stat_keys[(lane, batch.node)] = (f"steps_lane{lane}", f"steps_{batch.node}")
        stats = self.stats
        stats[keys[0]] += 1
        stats[keys[1]] += 1

    def _finish_step(self, lane: int, batch: ScheduledBatch, out, error: BaseException | None = None) -> None:
        """Postprocess a landed step (``out``), or fail what it carried (``error``, side lanes)."""
        self.trace.append(("finish", lane, batch.seq, batch.rids))
        try:
            if batch.node == self.model.side_node:
                self._postprocess_windows(batch, out, error)
            elif out is not None:
                self._postprocess_chain(batch, out)
        finally:
            refs = self._refs
            for rid in batch.rids:
                refs[rid] -= 1
            for rid in batch.rids:
                if refs[rid] <= 0:  # no other in-flight step reads it: it may go now
                    self._maybe_remove(rid)

    def _postprocess_chain(self, batch: ScheduledBatch, out) -> None:
        tokens, hidden = self._on_gpu_thread(self.model.read, out)
        cut = []  # windows this step completes, queued for the codec at once
        for i, (rid, pos, _prompt) in enumerate(batch.items):
            live = self._live.get(rid)
            if live is None or live.removing:
                continue
            if pos != len(live.tokens):
                raise AssertionError(f"request {rid!r}: token {pos} landed after {len(live.tokens)} tokens")
            live.tokens.append(int(tokens[i]))
            live.hidden.append(hidden[i])
            if len(live.tokens) == live.next_cut:
                self._cut_window(live, cut)
            self._maybe_done(live)
        if cut:
            self.scheduler.put_many(cut)
            self._wake.set()

    def _cut_window(self, live: _Live, cut: list) -> None:
        """Append ``live``'s next window (its tokens are all there) to ``cut``."""
        tokens = live.tokens
        n, rid, made = len(tokens), live.req.rid, live.windows_made
        cut.append(((rid, self.model.side_node), Window(rid, made, tuple(tokens[live.cut:n]))))
        live.cut = n
        live.windows_made = made + 1
        live.next_cut = live._window_end(n)

    def _postprocess_windows(self, batch: ScheduledBatch, out, error) -> None:
        """A landed codec step's windows, each to its request in window order. Its output was
        copied to the host in the step's own stream order (the GPU thread issued that copy), so
        reading it touches host memory only: no round trip to the GPU thread."""
        if error is not None:
            for rid in dict.fromkeys(batch.rids):
                live = self._live.get(rid)
                if live is not None:
                    self._fail(live, error)
            return
        vecs = self.model.read_codec(out)
        lives = self._live
        for win, vec in zip(batch.items, vecs):
            live = lives.get(win.rid)
            if live is None or live.removing:
                continue
            windows = live.windows
            n = len(windows)
            if win.index != n:
                raise AssertionError(f"request {win.rid!r}: window {win.index} landed after {n}")
            windows.append(vec)
            if n + 1 == live.windows_total:
                self._maybe_done(live)

    def _next_seq(self) -> int:
        """The next step's number, across lanes (the main loop's thread only)."""
        self._seq += 1
        return self._seq

    def _on_gpu_thread(self, fn, *args):
        """Run ``fn`` on the GPU thread and wait: every copy off the device goes from there too."""
        return self.gpu.submit(fn, *args).result()

    def _maybe_done(self, live: _Live) -> None:
        if len(live.tokens) == live.req.max_new_tokens and len(live.windows) == live.windows_total:
            self._done(live)

    def check_valid(self) -> None:
        """Every resource's own check, and the worker's: no removed request is referenced."""
        for r in self.resources:
            check = getattr(r, "check_valid", None)
            if check is not None:
                check()
        for rid, n in self._refs.items():
            assert n >= 0, f"request {rid!r}: {n} references"
            assert n == 0 or rid in self._live, f"removed request {rid!r} is still referenced"

