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
    """One target's slot arrays on the device: ``a[L, S, n, R, in]``, ``b[L, S, out, R]`` (rank-blocked
    where :attr:`LoraSpec.b_blocked`),
    ``ranks``/``scaling[L, S, n]``; and a host mirror of the ranks. A layer's A may be kept in
    an array of its own instead (:meth:`bind`: the rows a base weight was extended by)."""

    def __init__(self, spec: LoraSpec, t: LoraTarget, device: Device):
        L, S, n = t.num_layers, spec.num_slots, t.num_slices
        self.device, self.spec = device, spec
        self.a = device.zeros(spec.a_shape(t), spec.dtype)
        self.b = device.zeros(spec.b_shape(t), spec.dtype)
        self.ranks = device.zeros((L, S, n), np.int32)
        self.scaling = device.zeros((L, S, n), np.float32)
        self.host_ranks = np.zeros((L, S, n), np.int32)
        self._zero_ranks = device.host_zeros((L, n), np.int32)
        self._zero_scaling = device.host_zeros((L, n), np.float32)
        self._clean = np.ones(S, bool)  # the slot's weights are all zero here
        self._offs = t.out_offsets(spec.tp_size)
        #: layer -> its A ``[S, n, R, in]`` kept outside ``a`` (:meth:`bind`); ``a`` is None once
        #: every layer's is
        self.bound: dict[int, object] = {}
        self.layers = [LayerWeights(self.a[l], self.b[l], self.scaling[l], self.ranks[l], self._offs)
                       for l in range(L)]

    def a_layer(self, l: int):
        """Layer ``l``'s A, ``[S, n, R, in]``: where the kernels read it."""
        return self.layers[l].a

    def bind(self, l: int, view) -> None:
        """Keep layer ``l``'s A in ``view`` (a C-contiguous ``[S, n, R, in]`` array of the pool's
        dtype on its device, such as rows appended to a base weight) from now on: what it holds
        now is copied in, and installs write there. ``a`` is freed once every layer is bound."""
        if l in self.bound:
            raise ValueError(f"A of layer {l} is kept in another array already (another attachment's "
                             "extended weight?): unbind it first")
        old = self.a_layer(l)
        if tuple(view.shape) != tuple(old.shape) or view.dtype != old.dtype:
            raise ValueError(f"A of layer {l} is {tuple(old.shape)} {old.dtype}, not {tuple(view.shape)} {view.dtype}")
        if not view.flags.c_contiguous:
            raise ValueError("a bound A must be C-contiguous")
        self._copy(view, old)
        self.bound[l] = view
        self.layers[l] = LayerWeights(view, self.b[l], self.scaling[l], self.ranks[l], self._offs)
        if len(self.bound) == len(self.layers):
            self.a = None

    def unbind(self, l: int, view=None) -> None:
        """Layer ``l``'s A back in the pool's own array (made again if it was freed); a no-op
        for a layer not bound. ``view``: the array it must be bound to (ValueError if another)."""
        if l not in self.bound:
            return
        if view is not None and self.bound[l] is not view:
            raise ValueError(f"A of layer {l} is kept in another array than the one given")
        view = self.bound.pop(l)
        if self.a is None:
            t = self.layers[0].a
            self.a = self.device.zeros((len(self.layers), *t.shape), self.spec.dtype)
            if self.device.is_cuda:  # its zeros were written on CuPy's current stream: done before the copy
                import cupy

                cupy.cuda.get_current_stream().synchronize()
        self._copy(self.a[l], view)
        self.layers[l] = LayerWeights(self.a[l], self.b[l], self.scaling[l], self.ranks[l], self._offs)

    def _copy(self, dst, src) -> None:
        """``dst[...] = src`` between two device arrays, after every copy queued before it."""
        d = self.device
        if d.is_cuda:  # raw bytes: no dtype-specific CuPy kernel (bfloat16)
            from cupy.cuda import runtime

            if not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.nbytes == src.nbytes):
                raise ValueError("a copy between A arrays needs two C-contiguous arrays of one size")
            with d.activate():
                runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, runtime.memcpyDeviceToDevice,
                                    d.stream.ptr)
                d.stream.synchronize()
        else:
            d.synchronize()
            np.copyto(dst, src)

    def install(self, slot: int, img: TargetWeights | None) -> None:
        """Queue the copy of ``img`` (None: nothing here) into ``slot`` on the device's stream."""
        d = self.device
        if img is None:
            if not self._clean[slot]:
                d.copy_to_device(self.ranks[:, slot], self._zero_ranks)
                d.copy_to_device(self.scaling[:, slot], self._zero_scaling)
                if self.bound:
                    for l in range(len(self.layers)):
                        d.fill_zero(self.a_layer(l)[slot])
                else:
                    d.fill_zero(self.a[:, slot])
                d.fill_zero(self.b[:, slot])
                self.host_ranks[:, slot] = 0
                self._clean[slot] = True
            return
        if self.bound:  # layer by layer: some layers' A live elsewhere
            for l in range(len(self.layers)):
                d.copy_to_device(self.a_layer(l)[slot], img.a[l])
        else:
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
        #: ``[slots]`` each slot's largest rank over every target, layer and slice (host): what a
        #: step's planner reads for the rank its launches need (StepPlanner.rank_bound)
        self.slot_ranks = np.zeros(spec.num_slots, np.int32)

    def install(self, slot: int, image: AdapterWeights) -> None:
        """Queue ``image`` into ``slot`` for every target (zeros where it has nothing), keeping
        the image alive until the copies have run."""
        for name, w in self.targets.items():
            w.install(slot, image.targets.get(name))
        self.slot_ranks[slot] = self.largest_rank(slot)
        self.device.keep_alive(image)

    def largest_rank(self, slot: int) -> int:
        """``slot``'s largest rank over every target, layer and slice, from the host ranks."""
        return max((int(w.host_ranks[:, slot].max(initial=0)) for w in self.targets.values()), default=0)

    def layer(self, target: str, layer_idx: int) -> LayerWeights:
        t = self.spec.target(target)
        if not 0 <= layer_idx < t.num_layers:
            raise IndexError(f"target {target!r} has {t.num_layers} layers, not {layer_idx}")
        return self.targets[target].layers[layer_idx]

    def layer_ranks(self, target: str, layer_idx: int) -> np.ndarray:
        """``[slots]``: each slot's largest rank over its slices at one target and layer."""
        self.layer(target, layer_idx)
        return self.targets[target].host_ranks[layer_idx].max(axis=1)
