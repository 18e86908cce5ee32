"""Typed refusals. Every error names the adapter, the file and what is wrong."""

from __future__ import annotations


class LoraError(Exception):
    """Base class of every refusal lora-cupy raises for bad input or a bad adapter."""

    def __init__(self, reason: str, *, adapter: str | None = None, path: object = None):
        self.reason = reason
        self.adapter = adapter
        self.path = None if path is None else str(path)
        where = []
        if adapter is not None:
            where.append(f"adapter {adapter!r}")
        if self.path is not None:
            where.append(f"file {self.path}")
        super().__init__(f"{', '.join(where)}: {reason}" if where else reason)


class AdapterNotFoundError(LoraError):
    """An adapter name the pool does not serve, or a directory with no adapter files."""


class AdapterFileError(LoraError):
    """A missing, unreadable, truncated or corrupt adapter file (config or weights)."""


class PickleRefusedError(AdapterFileError):
    """Weights stored as a pickle (.bin / .pt / .pth): only safetensors is ever read."""


class UnsupportedAdapterError(LoraError):
    """A PEFT feature the pool cannot serve: DoRA, bias, modules_to_save, a non-LoRA type."""


class RankTooLargeError(LoraError):
    """An adapter module whose rank is above the pool's maximum."""


class TargetMismatchError(LoraError):
    """A module the spec has no target for, or a layer index outside the target's stack."""


class ShapeMismatchError(LoraError):
    """A weight whose shape does not match the spec's target."""


class NonFiniteWeightsError(LoraError):
    """A weight holding NaN or Inf."""


class DigestMismatchError(LoraError):
    """Weights whose sha256 differs from the digest the caller checked."""


class AdapterStateError(LoraError):
    """A load or unload that the adapter's current state refuses (served already, retiring)."""


class CapacityError(LoraError):
    """No room for it: every slot is held or promised, or a host copy larger than the host tier."""
