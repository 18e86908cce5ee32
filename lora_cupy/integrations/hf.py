"""From a Hugging Face model and adapter directories to a pool attached and a generator.

A user names adapter directories and nothing else: :func:`adapter_modules` reads each
adapter's safetensors header (no weights) for the module names it holds and its largest rank,
:func:`spec_for_adapters` builds the spec from the model's linears with
``LoraSpec.from_model`` (separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
fused into targets of slices, so each group runs as one launch), and :func:`serve` makes the
pool, loads the adapters and returns a :class:`~lora_cupy.integrations.generate.LoraGenerator`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..errors import AdapterNotFoundError
from ..peft import WEIGHTS_NAME, canonical_key, read_header
from ..spec import FUSED_TARGETS, PEFT_MODULES, LoraSpec


def adapter_modules(path: str | os.PathLike, name: str | None = None) -> tuple[set[str], int]:
    """The module names (last path component) an adapter holds weights for, and its largest rank."""
    path = Path(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterNotFoundError(f"no {WEIGHTS_NAME} in the adapter directory", adapter=name or path.name,
                                   path=path)
    modules, rank = set(), 0
    for key, info in read_header(weights, name or path.name).items():
        key = canonical_key(key)
        if ".lora_A." in key:
            modules.add(key.split(".lora_A.")[0].rsplit(".", 1)[-1])
            rank = max(rank, int(info.shape[0]))
    return modules, rank


def spec_for_adapters(model, adapters: Mapping[str, str | os.PathLike], *, num_slots: int,
                      max_rank: int | None = None, **kwargs) -> LoraSpec:
    """A spec for ``model`` covering every module the ``adapters`` (name -> directory) hold.

    Separate projections that share an input and an adapter touches are fused into one target
    of slices (every slice of the group is kept, so another adapter on a sibling fits too).
    ``max_rank`` defaults to the adapters' largest rank; other keywords go to ``LoraSpec``.
    """
    wanted, rank = set(), 0
    for name, path in adapters.items():
        m, r = adapter_modules(path, name)
        wanted |= m
        rank = max(rank, r)
    if not wanted:
        raise ValueError("no adapter holds any LoRA weight")
    for fused, parts in FUSED_TARGETS.items():
        if wanted & set(parts):
            wanted |= set(parts) | {fused}
    order = [m for m in (*FUSED_TARGETS, *PEFT_MODULES) if m in wanted] + sorted(wanted - set(PEFT_MODULES)
                                                                                 - set(FUSED_TARGETS))
    return LoraSpec.from_model(model, order, num_slots=num_slots, max_rank=max_rank or max(rank, 1),
                               fuse=True, **kwargs)


def serve(model, adapters: Mapping[str, str | os.PathLike], *, num_slots: int, device: str | None = None,
          max_rank: int | None = None, spec_kwargs: Mapping | None = None, **generator_kwargs):
    """Build the spec and the pool for ``adapters`` on ``model``'s device, load every adapter,
    and return a generator attached to the model (``generator.pool`` is the pool; close both)."""
    from ..pool import LoraAdapterPool
    from .generate import LoraGenerator

    if device is None:
        dev = next(model.parameters()).device
        device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    spec = spec_for_adapters(model, adapters, num_slots=num_slots, max_rank=max_rank, **dict(spec_kwargs or {}))
    pool = LoraAdapterPool(spec, device, adapters={k: str(v) for k, v in adapters.items()})
    try:
        return LoraGenerator(model, pool, **generator_kwargs)
    except BaseException:
        pool.close()
        raise
