"""LoraGenerator: greedy generation for many requests on many adapters, through one pool.

Requests (a prompt and an adapter name, or none) are submitted at any time and wait in an
:class:`~lora_cupy.engine.AdmissionQueue` in front of the pool: one whose adapter can find no
slot waits there holding nothing, and runs once a slot frees (the pool evicts the least
recently used unheld adapter). Each scheduler step runs the attached model over mixed batches,
rows on any adapters or none: the running requests decode one token each in one forward, and
the newly admitted ones prefill their prompts in another, right-padded to the longest (see
:mod:`.kv_cache`). Each forward is one pool step whose rows are the batch's rows in order,
``q`` tokens each, so the hooked linears' ``[B * q, in]`` inputs line up with the addressing.
Tokens are greedy (argmax) and streamed per request as :class:`TokenEvent`; a request finishes
at ``max_new_tokens`` or its end-of-sequence token, is removed from the pool (its slot's
refcount drops) and its cache row is reused.

On a CUDA device the decode forward replays a CUDA graph
(:class:`~lora_cupy.integrations.graphs.DecodeGraphs`); prefill forwards run eagerly.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ..engine.admission import AdmissionQueue
from ..engine.resource import LoraStep, ResourceReqConfig, StepContext
from ..errors import LoraError
from .attach import attach, torch_dtype_name
from .kv_cache import RowKVCache, step_inputs


@dataclass(frozen=True)
class GenerationRequest:
    """One request: prompt token ids, the adapter it runs on (None: the base model), how many
    tokens to generate, and its end-of-sequence token (None: the generator's default)."""

    rid: Hashable
    prompt: Sequence[int]
    adapter: str | None = None
    max_new_tokens: int = 16
    eos_token_id: int | None = None


@dataclass(frozen=True)
class TokenEvent:
    """A token of request ``rid`` (its ``index``-th), at scheduler step ``step``; ``done`` on
    its last. A request refused at admit (its adapter failed to read) gets one event with
    ``token=None`` and the ``error``."""

    rid: Hashable
    token: int | None
    index: int
    step: int
    done: bool
    error: BaseException | None = None


@dataclass
class RequestRecord:
    """A request's life: the steps at which it was submitted, admitted and finished, whether its
    adapter was resident at admit (a slot hit), its tokens, and its error if refused."""

    request: GenerationRequest
    submitted: int
    admitted: int | None = None
    finished: int | None = None
    hit: bool | None = None
    tokens: list = field(default_factory=list)
    error: BaseException | None = None


@dataclass
class StepRecord:
    """One step as the notebook plots it: rows that decoded and prefilled, requests waiting at
    admission, and each slot's refcount and adapter after the step's admit."""

    step: int
    decode_rows: int
    prefill_rows: int
    waiting: int
    refcounts: tuple
    adapters: tuple
    graph: bool


def model_geometry(model) -> dict:
    """Layers, KV heads and head size of a Hugging Face decoder from its config."""
    cfg = model.config
    heads = cfg.num_attention_heads
    return {
        "num_layers": cfg.num_hidden_layers,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    }


def _sliding(cfg) -> tuple[int | None, tuple[str, ...] | None]:
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None, None
    types = getattr(cfg, "layer_types", None)
    return int(window), (tuple(types) if types else None)


class LoraGenerator:
    """Greedy generation of many requests through ``pool``, attached to ``model`` (a Hugging
    Face causal LM: ``get_decoder()`` and ``get_output_embeddings()``) until :meth:`close`.

    ``max_batch``: running requests at once (cache rows; default: the largest capture bucket
    of the pool that fits 64). ``max_len``: positions per request, prompt plus generated
    tokens. ``max_prefill``: requests that start in one step. ``cuda_graphs``: replay decode
    steps as CUDA graphs (default: on a CUDA device); ``static_decode`` runs decode steps as the
    graphs would (static cache, batch buckets) but eagerly, on any device. ``eos_token_id``: the default stop token
    (default: the model's generation config's, if any). ``overlap``: when each delta runs on a side
    stream beside its linear (:func:`~lora_cupy.integrations.attach.attach`; default: inside the
    decode graphs' captures on CUDA); ``shrink_in_base``: when a small step's shrink rides on
    each target's first GEMM (the same function; default: inside the decode graphs' captures,
    where it fits on CUDA); ``glu``: whether a gated MLP runs its activation with the gate / up
    delta folded in at prefill steps of 512 rows or more (the same function; default: where it
    fits on one CUDA device).

    A long-running server bounds what the generator keeps: ``keep_finished=False`` drops each
    request's record once its last event is out (``records`` then holds the queued and running
    ones; :meth:`stats` counts from running totals either way), and ``history_limit`` keeps the
    last that many step records (a few more between trims; None: every step).
    :meth:`forget` drops one finished request's record.
    """

    def __init__(self, model, pool, *, max_batch: int | None = None, max_len: int = 256,
                 max_prefill: int = 8, cuda_graphs: bool | None = None, static_decode: bool = False,
                 eos_token_id="model", overlap: bool | str | None = None, keep_finished: bool = True,
                 history_limit: int | None = 10_000, shrink_in_base: bool | str | None = None,
                 glu: bool | None = None):
        if history_limit is not None and history_limit < 1:
            raise ValueError(f"history_limit must be at least 1 step (or None), not {history_limit}")
        import torch

        self.model, self.pool = model, pool
        spec = pool.spec
        param = next(model.parameters())
        self.torch_device = param.device
        if (param.device.type == "cuda") != pool.device.is_cuda:
            raise ValueError(f"the model is on {param.device} but the pool on {pool.device.name}")
        if torch_dtype_name(param.dtype) != spec.dtype:
            raise ValueError(f"the model is {torch_dtype_name(param.dtype)} but the pool's slots are {spec.dtype}")
        buckets = [b for b in spec.capture_buckets if b <= 64]
        self.max_batch = max_batch or (buckets[-1] if buckets else spec.capture_buckets[0])
        if self.max_batch > spec.max_tokens:
            raise ValueError(f"max_batch {self.max_batch} exceeds the pool's largest capture bucket {spec.max_tokens}")
        self.max_len, self.max_prefill = max_len, max(1, max_prefill)
        if eos_token_id == "model":
            gc = getattr(model, "generation_config", None)
            eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
            if isinstance(eos_token_id, (list, tuple)):
                eos_token_id = eos_token_id[0] if eos_token_id else None
        self.eos_token_id = eos_token_id
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.window, self.layer_types = _sliding(model.config)
        geo = model_geometry(model)
        self.cache = RowKVCache(geo["num_layers"], spec.bucket_for(self.max_batch), geo["kv_heads"], geo["head_dim"],
                                max_len, param.dtype, param.device)
        self.queue = AdmissionQueue([pool])
        self.attachment = attach(model, pool, overlap=overlap, shrink_in_base=shrink_in_base, glu=glu)
        self.attachment.enabled = False  # the hooks add deltas only inside this generator's steps
        self.records: dict[Hashable, RequestRecord] = {}
        self.history: list[StepRecord] = []
        self.keep_finished, self.history_limit = keep_finished, history_limit
        self._adapter_admits = 0  # admitted requests on an adapter, and of those the slot hits
        self._hits = 0
        self._graph_steps = 0  # steps whose decode ran the static (graph) path
        self.running: list[Hashable] = []  # cache row i holds running[i]
        self._lengths: list[int] = []  # tokens cached per running row
        self._next: list[int] = []  # each running row's next input token
        self._step = 0  # scheduler steps
        self._seq = 0  # pool steps (a scheduler step runs one to decode, one to prefill)
        self._evictions = 0
        self._loads0 = int(pool.stats["loads"])
        self._tokens = 0
        self._busy = 0.0
        self.graphs = None
        if cuda_graphs is None:
            cuda_graphs = pool.device.is_cuda
        if cuda_graphs and not pool.device.is_cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        if cuda_graphs or static_decode:
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, capture=bool(cuda_graphs))
        self._torch = torch

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> None:
        """Queue a request at admission. Refuses an adapter the pool does not serve
        (``AdapterNotFoundError``) and a prompt that does not fit (``ValueError``)."""
        n = len(request.prompt)
        if request.rid in self.records:
            raise ValueError(f"request {request.rid!r} was submitted already")
        if n < 1 or request.max_new_tokens < 1:
            raise ValueError(f"request {request.rid!r}: an empty prompt or max_new_tokens < 1")
        if n + request.max_new_tokens > self.max_len - 1:
            raise ValueError(f"request {request.rid!r}: {n} prompt + {request.max_new_tokens} new tokens "
                             f"exceed max_len - 1 = {self.max_len - 1} positions")
        if n > self.pool.spec.max_tokens:
            raise ValueError(f"request {request.rid!r}: a {n}-token prompt exceeds the pool's largest "
                             f"capture bucket {self.pool.spec.max_tokens}")
        self.pool.ingest_request(request.rid, ResourceReqConfig(request.adapter))
        self.records[request.rid] = RequestRecord(request, self._step)
        self.queue.submit(request.rid, self.pool.spec.node)

    @property
    def pending(self) -> int:
        """Requests submitted and not finished."""
        return len(self.queue) + len(self.running)

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, requests: Iterable[GenerationRequest] = (), timeout: float = 60.0) -> dict:
        """Submit ``requests``, generate until every request finished; ``{rid: tokens}`` of every
        request the generator keeps a record of (``keep_finished=False``: of those this call
        streamed events for), a request refused at admit with no tokens."""
        for r in requests:
            self.submit(r)
        streamed: dict[Hashable, list] = {}
        for ev in self.stream(timeout=timeout):
            got = streamed.setdefault(ev.rid, [])  # a request refused at admit: no token
            if ev.token is not None:
                got.append(ev.token)
        if not self.keep_finished:  # the records are gone: what this call streamed
            return streamed
        return {rid: list(rec.tokens) for rid, rec in self.records.items()}

    def stream(self, timeout: float = 60.0) -> Iterator[TokenEvent]:
        """Run steps until nothing is pending, yielding each token as it is chosen. Raises
        ``RuntimeError`` when no request could run for ``timeout`` seconds."""
        idle_since = None
        while self.pending:
            events = self.step()
            if events:
                idle_since = None
                yield from events
                continue
            # Nothing ran: the queue's head waits for its adapter's host copy (read on the
            # pool's reader thread). Wait a little for it.
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > timeout:
                raise RuntimeError(f"no request could run for {timeout} s: waiting {self.queue.waiting[:3]}")
            time.sleep(0.001)

    def step(self) -> list[TokenEvent]:
        """One scheduler step: admit what may start; the running requests decode one token each
        (one forward; a graph replay on CUDA), the newly admitted ones prefill their prompts
        (one forward, rows right-padded to the longest prompt); one token per request."""
        events, new = self._admit_new()
        if not self.running:
            return events
        started = time.perf_counter()
        self._step += 1
        old = self.running[:len(self.running) - len(new)]
        planned = []
        use_graph = False
        chosen: list[int] = []
        before = None  # the slots' adapters before the prefill's admit (its hits and evictions)
        try:
            if old:
                planned.append(self._pool_step(old, 1, []))
                use_graph = self.graphs is not None
                n = len(old)
                chosen += (self.graphs.run(n, self._next[:n], self._lengths[:n], planned[-1][1]) if use_graph
                           else self._forward(0, [[t] for t in self._next[:n]]))
            if new:
                adapters = self.pool.slot_state()[1]
                got = self._pool_step(new, max(len(self.records[r].request.prompt) for r in new), new, events)
                if got is not None:
                    planned.append(got)
                    before = adapters
                    chosen += self._forward(len(old), [list(self.records[r].request.prompt) for r in new])
        except BaseException:
            for step, ctx in planned:
                self.pool.rollback_admit(step, ctx)
            raise
        for step, ctx in planned:
            self.pool.commit(step, ctx)
        for i in range(len(old)):
            self._lengths[i] += 1
        for k, rid in enumerate(new):
            self._lengths[len(old) + k] += len(self.records[rid].request.prompt)
        refcounts, adapters = self.pool.slot_state()  # as the admit left them: the forward changes no slot
        if before is not None:
            self._count_slots(before, adapters, new)
        self.history.append(StepRecord(self._step, len(old), len(new), len(self.queue), refcounts, adapters,
                                       use_graph))
        self._graph_steps += use_graph
        limit = self.history_limit
        if limit is not None and len(self.history) > limit + limit // 8 + 1:  # trimmed in batches
            del self.history[:-limit]
        events += self._emit(chosen)
        self._busy += time.perf_counter() - started
        return events

    def _pool_step(self, rids: list, q: int, new: list, events: list | None = None):
        """Admit and plan one pool step of ``rids``, ``q`` tokens each: ``(step, ctx)``, or None
        when every row was refused. A row refused at admit (its adapter's read failed, on some
        rank) is a new one: what the admit took is given back, the request is refused (an event
        in ``events``) and the rest are admitted again."""
        while True:
            self._seq += 1
            step, ctx = LoraStep(rids, [q] * len(rids), node=self.pool.spec.node, seq=self._seq), \
                StepContext(seq=self._seq)
            outcome = self.pool.admit(step, ctx)
            if outcome.ok:
                self.pool.plan(step, ctx)
                return step, ctx
            self.pool.rollback_admit(step, ctx)
            for rid, err in outcome.failed.items():
                if rid not in new:
                    raise LoraError(f"step {self._step}: running request {rid!r} refused at admit: {err}")
                i = self.running.index(rid)
                for seq in (self.running, self._lengths, self._next):
                    seq.pop(i)
                new.remove(rid)
                rids = [r for r in rids if r != rid]
                events.append(self._refuse(rid, err))
            if not rids:
                return None
            q = max(len(self.records[r].request.prompt) for r in rids)

    def _admit_new(self) -> tuple[list[TokenEvent], list[Hashable]]:
        """Let requests through admission while cache rows, ``max_prefill`` and the prefill's
        tokens (the pool's largest capture bucket) allow."""
        events, new = [], []
        q = 1
        while len(self.running) < self.max_batch and len(new) < self.max_prefill and len(self.queue):
            head = self.queue.waiting[0].rid
            n = len(self.records[head].request.prompt)
            if (len(new) + 1) * max(q, n) > self.pool.spec.max_tokens:
                break
            granted = self.queue.pump(limit=1)
            if not granted:
                break
            g = granted[0]
            rec = self.records[g.rid]
            if g.failed:
                events.append(self._refuse(g.rid, next(iter(g.failed.values()))))
                continue
            rec.admitted = self._step + 1
            q = max(q, n)
            new.append(g.rid)
            self.running.append(g.rid)
            self._lengths.append(0)
            self._next.append(None)
        return events, new

    def _count_slots(self, before: tuple, after: tuple, new: list) -> None:
        """Slot hits (the adapter was resident before this admit) and evictions (a slot that
        held another adapter took a new one); ``before`` / ``after``: each slot's adapter."""
        resident = set(before)
        for rid in new:
            rec = self.records[rid]
            if rec.request.adapter is not None:
                rec.hit = rec.request.adapter in resident
                self._adapter_admits += 1
                self._hits += rec.hit
        self._evictions += sum(1 for a, b in zip(before, after) if a is not None and a != b)

    def _forward(self, row0: int, inputs: list[list[int]]) -> list[int]:
        """One eager forward of cache rows ``row0..`` (one per input), right-padded to the
        longest input; the greedy token after each row's last input."""
        torch = self._torch
        B, q = len(inputs), max(len(t) for t in inputs)
        dev = self.torch_device
        ids = torch.zeros((B, q), dtype=torch.long)
        for i, toks in enumerate(inputs):
            ids[i, :len(toks)] = torch.as_tensor(toks, dtype=torch.long)
        rows = self._lengths[row0:row0 + B]
        lengths = torch.as_tensor(rows, dtype=torch.long, device=dev)
        kv_len = min(self.max_len, max(n + q for n in rows))
        dtype = next(self.model.parameters()).dtype
        si = step_inputs(lengths, q, kv_len, self.max_len, dtype, window=self.window, layer_types=self.layer_types)
        self.cache.begin(si.write_cols, kv_len, row0)
        with torch.inference_mode(), self.adding():
            out = self.decoder(input_ids=ids.to(dev), attention_mask=si.mask, position_ids=si.position_ids,
                               use_cache=True, **{self._cache_kw: self.cache})
            h = out.last_hidden_state  # [B, q, hidden]
            last = torch.as_tensor([len(t) - 1 for t in inputs], device=dev)
            logits = self.lm_head(h[torch.arange(B, device=dev), last])  # [B, vocab]
            return logits.argmax(-1).tolist()

    @contextlib.contextmanager
    def adding(self):
        """Within: the attached hooks add the current step's deltas."""
        self.attachment.enabled = True
        try:
            yield
        finally:
            self.attachment.enabled = False

    def _emit(self, chosen: list[int]) -> list[TokenEvent]:
        events, done = [], []
        for i, rid in enumerate(self.running):
            rec = self.records[rid]
            tok = int(chosen[i])
            rec.tokens.append(tok)
            self._tokens += 1
            eos = rec.request.eos_token_id if rec.request.eos_token_id is not None else self.eos_token_id
            finished = len(rec.tokens) >= rec.request.max_new_tokens or (eos is not None and tok == eos)
            events.append(TokenEvent(rid, tok, len(rec.tokens) - 1, self._step, finished))
            self._next[i] = tok
            if finished:
                done.append(i)
        if done:
            self._finish(done)
        return events

    def _finish(self, done: list[int]) -> None:
        """Close the requests at rows ``done`` (ascending) and pack the rest into the first rows:
        each row left past the new batch size moves into a finished row below it, so a cache row
        is copied only for a request that goes on (one copy per such row, none when the finished
        rows are the last ones or all of them)."""
        n, keep = len(self.running), len(self.running) - len(done)
        holes = [i for i in done if i < keep]
        finished = set(done)
        movers = [j for j in range(keep, n) if j not in finished]
        rids = [self.running[i] for i in done]
        for dst, src in zip(holes, movers):
            self.cache.move_row(src, dst)
            for seq in (self.running, self._lengths, self._next):
                seq[dst] = seq[src]
        for seq in (self.running, self._lengths, self._next):
            del seq[keep:]
        for rid in rids:
            self.records[rid].finished = self._step
            self.pool.remove_request(rid)
            self.queue.cancel(rid)
            if not self.keep_finished:
                del self.records[rid]

    def _refuse(self, rid: Hashable, err: BaseException) -> TokenEvent:
        rec = self.records[rid]
        rec.error, rec.finished = err, self._step
        self.pool.remove_request(rid)
        self.queue.cancel(rid)
        if not self.keep_finished:
            del self.records[rid]
        return TokenEvent(rid, None, 0, self._step, True, err)

    def forget(self, rid: Hashable) -> RequestRecord:
        """Drop finished request ``rid``'s record and return it (its rid may then be submitted
        again). KeyError: no record of it; ValueError: it is still queued or running."""
        rec = self.records[rid]
        if rec.finished is None:
            raise ValueError(f"request {rid!r} has not finished: forget it once its last event is out")
        return self.records.pop(rid)

    # -- results ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Steps, tokens, busy seconds and tokens per second, adapter loads, slot hits and
        evictions over the generator's life."""
        hits, adapter_admits = self._hits, self._adapter_admits
        return {
            "steps": self._step,
            "tokens": self._tokens,
            "seconds": round(self._busy, 3),
            "tokens_per_second": round(self._tokens / self._busy, 1) if self._busy else 0.0,
            "slot_loads": int(self.pool.stats["loads"]) - self._loads0,
            "slot_hits": hits,
            "slot_hit_rate": round(hits / adapter_admits, 3) if adapter_admits else 1.0,
            "evictions": self._evictions,
            "graph_steps": self.graphs.replays if self.graphs is not None and self.graphs.capture else 0,
            "static_decode_steps": self._graph_steps,
        }

    def close(self) -> None:
        """Detach from the model (the pool stays the caller's)."""
        self.attachment.detach()
        if self.graphs is not None:
            self.graphs.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
