"""A pure-NumPy simulator of every slot decision the LoRA adapter pool makes.

An independent restatement of the pool's invariants (never imports ``lora_cupy``): the
stateful tests drive it and the real pool through the same histories and compare every
decision, and its workload player sizes a pool's slots from a trace.

- ``SimSlots`` / ``SimPool``: one rank's slot table and pool (``sim.slots``, ``sim.pool``).
- ``SimInstance``: the ranks of a tensor-parallel instance (``sim.tp``).
- ``drain``: an encoder pool and an LLM pool under one runner (``sim.nodes``).
- ``Trace``, ``generate_trace``, ``read_trace``, ``play``, ``sweep_slots``: sizing
  (``sim.workload``, ``sim.player``; plots in ``sim.plots``, CLI ``python -m sim``).
"""

from .errors import (AdapterStateError, ReadInFlightError, RequestStateError, SimError, TraceError,
                     UnknownAdapterError)
from .nodes import DrainResult, NodeAdapter, NodeRequest, drain
from .player import PlayerConfig, PlayResult, play, sweep_slots
from .pool import AdmitResult, Ask, Copy, Reserve, SimPool
from .slots import SimSlots, SlotSnapshot
from .tp import DivergenceError, SimInstance, Teardown
from .workload import Trace, generate_trace, parse_rank_mix, read_trace

__all__ = [
    "AdapterStateError", "AdmitResult", "Ask", "Copy", "DivergenceError", "DrainResult",
    "NodeAdapter", "NodeRequest", "PlayResult", "PlayerConfig", "ReadInFlightError", "Reserve",
    "RequestStateError", "SimError", "SimInstance", "SimPool", "SimSlots", "SlotSnapshot",
    "Teardown", "Trace", "TraceError", "UnknownAdapterError", "drain",
    "generate_trace", "parse_rank_mix", "play", "read_trace", "sweep_slots",
]
