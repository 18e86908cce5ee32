"""Backends run the slot-grouped delta against a step's addressing.

``reference`` is NumPy (the CPU backend and the kernels' oracle); ``cupy`` runs the RawKernels
in ``raw_kernels/``. Both implement :class:`LoraBackend`.
"""

from .base import LoraBackend, LayerWeights

__all__ = ["LoraBackend", "LayerWeights"]
