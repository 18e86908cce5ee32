"""Two pools, a vision encoder's and the LLM's, and a runner that drains requests through both.

A request holds a slot in each pool whose targets its adapter touches until it is removed.
With ``order="encoder-first"`` (the order the graph runs, the README's invariant 11) a request
takes its encoder slot, runs the encoder once, then waits for its LLM slot, so a row holding
an LLM slot never waits on the encoder's pool and waits cannot form a cycle: every history
drains. ``order="as-walked"`` lets a request whose walk reaches the encoder after the LLM
(``encoder_after_llm``: an image that comes mid-decode) take them in that order, to show what
the rule buys: two such orders in one pool pair can wait on each other for ever.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .pool import Reserve, SimPool

ORDERS = ("encoder-first", "as-walked")


@dataclass(frozen=True)
class NodeRequest:
    """One request: its adapter (None: base), whether it has an image, its LLM steps, arrival
    tick, and whether its walk reaches the encoder only after the LLM (used by "as-walked")."""

    rid: int
    adapter: str | None
    image: bool
    llm_steps: int
    arrival: int = 0
    encoder_after_llm: bool = False


@dataclass(frozen=True)
class NodeAdapter:
    name: str
    encoder: bool  # has something for the encoder's targets
    llm: bool  # has something for the LLM's targets


@dataclass
class DrainResult:
    """How a run ended: ``drained`` when every request completed; else ``stuck`` says which
    requests were left waiting and on which pool, with nothing running."""

    drained: bool
    ticks: int
    completed: list[int] = field(default_factory=list)
    stuck: dict[int, str] = field(default_factory=dict)


@dataclass
class _State:
    req: NodeRequest
    stages: list[str]  # pools still to take, in order
    steps_left: int
    running: bool = False


def sim_pools(adapters: Sequence[NodeAdapter], encoder_slots: int, llm_slots: int) -> dict[str, SimPool]:
    """The two model pools, serving ``adapters``: what ``drain`` runs unless given others."""
    pools = {"encoder": SimPool(encoder_slots, name="encoder"), "llm": SimPool(llm_slots, name="llm")}
    for a in adapters:
        pools["encoder"].load_adapter(a.name, touches=a.encoder)
        pools["llm"].load_adapter(a.name, touches=a.llm)
    return pools


def drain(requests: Sequence[NodeRequest], adapters: Sequence[NodeAdapter], *, encoder_slots: int,
          llm_slots: int, order: str = "encoder-first",
          shuffle: Callable[[list], list] | None = None, max_ticks: int = 100_000,
          pools: Mapping | None = None) -> DrainResult:
    """Run ``requests`` through both pools until all complete or nothing can move.

    Each tick: running requests take one LLM step (and are removed from both pools when
    done), arrivals are ingested, then waiting requests, in the order ``shuffle`` gives
    (default: arrival order), try to reserve their next pool's slot; each pool then admits
    the rows that reserved. ``encoder_slots`` / ``llm_slots`` count slot 0. ``pools``:
    ``{"encoder": ..., "llm": ...}`` with SimPool's ``ingest_request`` / ``complete_read`` /
    ``reserve`` / ``admit`` / ``commit`` / ``remove_request`` / ``holders`` / ``check_valid``
    (default: ``sim_pools``), so the same runner can drive other pools.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    pools = dict(pools) if pools is not None else sim_pools(adapters, encoder_slots, llm_slots)
    shuffle = shuffle or (lambda xs: xs)
    pending = sorted(requests, key=lambda r: (r.arrival, r.rid))
    states: dict[int, _State] = {}
    result = DrainResult(drained=False, ticks=0)
    for tick in range(max_ticks):
        result.ticks = tick + 1
        for st in [s for s in states.values() if s.running]:
            st.steps_left -= 1
            if st.steps_left <= 0:
                for pool in pools.values():
                    pool.remove_request(st.req.rid)
                del states[st.req.rid]
                result.completed.append(st.req.rid)
        while pending and pending[0].arrival <= tick:
            r = pending.pop(0)
            for pool in pools.values():
                if pool.ingest_request(r.rid, r.adapter):
                    pool.complete_read(r.adapter, ok=True)
            stages = (["encoder"] if r.image else []) + ["llm"]
            if order == "as-walked" and r.encoder_after_llm:
                stages.reverse()
            states[r.rid] = _State(r, stages, max(1, r.llm_steps))
        waiting = [s for s in states.values() if not s.running]
        step_rows: dict[str, list[int]] = {"encoder": [], "llm": []}
        moved = False
        for st in shuffle(list(waiting)):
            # Each waiting request tries its next stage; one stage per tick.
            name = st.stages[0]
            got = pools[name].reserve(st.req.rid)
            if got is Reserve.WAIT:
                _check_no_llm_holder_waits_on_encoder(pools, st, name, order)
                continue
            step_rows[name].append(st.req.rid)
        for name, rows in step_rows.items():
            if rows:
                pools[name].admit(rows)
                pools[name].commit()
                moved = True
                for rid in rows:
                    st = states[rid]
                    st.stages.pop(0)
                    st.running = not st.stages
        for pool in pools.values():
            pool.check_valid()
        if not states and not pending:
            result.drained = True
            return result
        if not moved and not pending and not any(s.running for s in states.values()):
            result.stuck = {rid: s.stages[0] for rid, s in states.items()}
            return result
    return result


def _check_no_llm_holder_waits_on_encoder(pools, st: _State, waits_on: str, order: str) -> None:
    if order == "encoder-first" and waits_on == "encoder":
        holds = st.req.rid in pools["llm"].holders()
        assert not holds, f"request {st.req.rid} holds an LLM slot and waits on the encoder's pool"
