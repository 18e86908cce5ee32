"""Refusals the simulator raises: its own small hierarchy, since `sim` never imports `lora_cupy`."""

from __future__ import annotations


class SimError(Exception):
    """Base class of every refusal the simulator raises."""


class UnknownAdapterError(SimError, KeyError):
    """A request, load or read that names an adapter the simulated pool does not serve."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class AdapterStateError(SimError):
    """A load the adapter's state refuses: served already, or still retiring from an unload."""


class RequestStateError(SimError):
    """A request id used out of turn: ingested twice, or never ingested."""


class ReadInFlightError(SimError):
    """An admit that would need a host copy whose read has not completed yet.

    The real pool waits for the read; the simulator asks its caller to complete it first
    (`SimPool.complete_read`), or, for several ranks, `SimInstance` does so at the agreement.
    """


class TraceError(SimError, ValueError):
    """A workload trace or player setting that cannot be played: the message says which and why."""
