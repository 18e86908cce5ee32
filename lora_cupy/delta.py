"""LoraLayerDelta: ``y += delta(x)`` for one target linear at one stack layer, over the current step."""

from __future__ import annotations

from .backends.base import LayerWeights


class LoraLayerDelta:
    """``y[t] += scaling[s] * (x[t] @ A[s].T) @ B[s].T`` for each row t on slot s of the step.

    A layer computes its base output, then calls this before anything consumes ``y`` (for a
    row-parallel linear, before its all-reduce). Rows on the base model address the zero
    adapter (slot 0), which the kernels skip; a step with no adapter row returns ``y`` untouched
    without calling the backend. ``x[T, in]`` and ``y[T, out]`` (this rank's features) are NumPy
    on cpu, CuPy or torch on cuda; ``T`` may exceed the step's rows (a capture bucket's padding
    rows sit past every slot's range and address nothing). Changes ``y`` in place and returns it.

    Everything but x and y is resolved here, once: the layer's slot weights (views), the
    backend's prepared launch for them (:meth:`LoraBackend.prepare`), which packs each capture
    bucket's launch on first use. A call reads the step's launch views (the bucket's fixed
    addressing buffers, ``token_order`` spanning the whole bucket, so a CUDA graph captured on
    one step replays for every later step of its bucket), checks x and y, and launches.
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
        self._launch = pool.backend.prepare(self.weights)

    def __call__(self, y, x):
        plan = self.pool.current_plan()
        if plan is None:
            return y
        if plan.ready is not None:
            plan.wait_host()
        g = self.grouping
        try:
            self._launch(y, x, plan.launch[g], plan.rows[g])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{self.target}[{self.layer_idx}]: {e}") from None
        return y

    def __repr__(self) -> str:
        return f"LoraLayerDelta({self.target!r}, layer={self.layer_idx})"
