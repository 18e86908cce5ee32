"""lora-cupy: many LoRA adapters served at once from a fixed set of GPU slots.

The public names load lazily, so ``import lora_cupy`` stays cheap and needs no GPU.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LoraSpec": "spec", "LoraTarget": "spec", "LoraSlice": "spec",
    "LoraAddressing": "addressing",
    "LoraAdapterPool": "pool",
    "LoraAdapterStore": "store",
    "LoraLayerDelta": "delta",
    "AdapterWeights": "adapter", "TargetWeights": "adapter",
    "read_peft_adapter": "peft",
    "LoraError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'lora_cupy' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
