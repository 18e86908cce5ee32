"""LoraLayerDelta: ``y += delta(x)`` for one target linear at one stack layer, over the current step."""

from __future__ import annotations

from .backends.base import LayerWeights


class LoraLayerDelta:
    """``y[t] += scaling[s] * (x[t] @ A[s].T) @ B[s].T`` for each row t on slot s of the step.

    A layer computes its base output, then calls this before anything consumes ``y`` (for a
    row-parallel linear, before its all-reduce). Rows on the base model address the zero
    adapter, which the kernels skip; a step with no adapter row returns ``y`` untouched
    without calling the backend. The layer's slot weights are views resolved once, here;
    a call reads only the step's addressing, handed to the backend as views of the bucket's
    fixed buffer with ``token_order`` spanning the whole bucket: positions past the step's
    rows address nothing, and a CUDA graph captured on one step replays for every later step
    of its bucket. ``x[T, in]`` and ``y[T, out]`` (this rank's features) are NumPy on cpu,
    CuPy or torch on cuda; ``T`` may exceed the step's rows (a capture bucket's padding rows
    address nothing). Changes ``y`` in place and returns it.
    """

    def __init__(self, pool, target: str, layer_idx: int):
        t = pool.spec.target(target)
        self.pool = pool
        self.target = target
        self.layer_idx = layer_idx
        self.grouping = t.row_grouping
        self.weights: LayerWeights = pool.layer_weights(target, layer_idx)
        self.in_features = t.local_in_features(pool.spec.tp_size)
        self.out_features = t.local_out_features(pool.spec.tp_size)

    def __call__(self, y, x):
        plan = self.pool.current_plan()
        if plan is None:
            return y
        addr = plan.addressing[self.grouping]
        if len(x.shape) != 2 or len(y.shape) != 2 or x.shape[1] != self.in_features \
                or y.shape[1] != self.out_features or y.shape[0] != x.shape[0]:
            raise ValueError(f"{self.target}[{self.layer_idx}]: x {tuple(x.shape)} and y {tuple(y.shape)} do not "
                             f"fit [T, {self.in_features}] and [T, {self.out_features}]")
        if x.shape[0] < addr.num_tokens:
            raise ValueError(f"{self.target}[{self.layer_idx}]: {x.shape[0]} rows, but the step addresses "
                             f"{addr.num_tokens} at row grouping {self.grouping}")
        token_order, slot_indptr = plan.launch[self.grouping]
        plan.wait_host()
        self.pool.backend.delta(y, x, self.weights, token_order, slot_indptr)
        return y

    def __repr__(self) -> str:
        return f"LoraLayerDelta({self.target!r}, layer={self.layer_idx})"
