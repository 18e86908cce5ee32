"""The slot weights a pool owns on its device: ``a``, ``b``, ranks and scalings per target.

Made once, when the pool is built; an admit only writes into them, taking an adapter's host
copy by non-blocking copies on the device's stream. (The addressing buffers are planning's:
:mod:`lora_cupy.planning`.)
"""

from __future__ import annotations

import numpy as np

from .backends.base import LayerWeights
from .device import Device
from .adapter import AdapterWeights, TargetWeights
from .spec import LoraSpec, LoraTarget


# -- the slot weights -----------------------------------------------------------------------
class SlotWeights:
    """One target's slot arrays on the device: ``a[L, S, n, R, in]``, ``b[L, S, out, R]``,
    ``ranks``/``scaling[L, S, n]``; and a host mirror of the ranks."""

    def __init__(self, spec: LoraSpec, t: LoraTarget, device: Device):
        L, S, n = t.num_layers, spec.num_slots, t.num_slices
        self.device = device
        self.a = device.zeros(spec.a_shape(t), spec.dtype)
        self.b = device.zeros(spec.b_shape(t), spec.dtype)
        self.ranks = device.zeros((L, S, n), np.int32)
        self.scaling = device.zeros((L, S, n), np.float32)
        self.host_ranks = np.zeros((L, S, n), np.int32)
        self._zero_ranks = device.host_zeros((L, n), np.int32)
        self._zero_scaling = device.host_zeros((L, n), np.float32)
        self._clean = np.ones(S, bool)  # the slot's weights are all zero here
        offs = t.out_offsets(spec.tp_size)
        self.layers = [LayerWeights(self.a[l], self.b[l], self.scaling[l], self.ranks[l], offs)
                       for l in range(L)]

    def install(self, slot: int, img: TargetWeights | None) -> None:
        """Queue the copy of ``img`` (None: nothing here) into ``slot`` on the device's stream."""
        d = self.device
        if img is None:
            if not self._clean[slot]:
                d.copy_to_device(self.ranks[:, slot], self._zero_ranks)
                d.copy_to_device(self.scaling[:, slot], self._zero_scaling)
                d.fill_zero(self.a[:, slot])
                d.fill_zero(self.b[:, slot])
                self.host_ranks[:, slot] = 0
                self._clean[slot] = True
            return
        d.copy_to_device(self.a[:, slot], img.a)
        d.copy_to_device(self.b[:, slot], img.b)
        d.copy_to_device(self.ranks[:, slot], img.ranks)
        d.copy_to_device(self.scaling[:, slot], img.scaling)
        self.host_ranks[:, slot] = img.ranks
        self._clean[slot] = False


class SlotBank:
    """Every target's :class:`SlotWeights`: what an admit installs a host image into, and what
    a layer's views are taken from."""

    def __init__(self, spec: LoraSpec, device: Device):
        self.spec, self.device = spec, device
        self.targets = {t.name: SlotWeights(spec, t, device) for t in spec.targets}

    def install(self, slot: int, image: AdapterWeights) -> None:
        """Queue ``image`` into ``slot`` for every target (zeros where it has nothing), keeping
        the image alive until the copies have run."""
        for name, w in self.targets.items():
            w.install(slot, image.targets.get(name))
        self.device.keep_alive(image)

    def layer(self, target: str, layer_idx: int) -> LayerWeights:
        t = self.spec.target(target)
        if not 0 <= layer_idx < t.num_layers:
            raise IndexError(f"target {target!r} has {t.num_layers} layers, not {layer_idx}")
        return self.targets[target].layers[layer_idx]

    def layer_ranks(self, target: str, layer_idx: int) -> np.ndarray:
        """``[slots]``: each slot's largest rank over its slices at one target and layer."""
        self.layer(target, layer_idx)
        return self.targets[target].host_ranks[layer_idx].max(axis=1)
