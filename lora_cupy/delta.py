"""LoraLayerDelta: ``y += delta(x)`` for one target linear at one stack layer, over the current step."""

from __future__ import annotations

import functools

from .backends.base import LayerWeights, member_weights


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

    ``member``: slice ``member`` of a fused target alone, into an output of that slice's width
    (a separate linear of the model that the target fuses, when a step is large enough that one
    launch per slice, each into its own output, beats one launch into a scratch it then adds).
    """

    def __init__(self, pool, target: str, layer_idx: int, member: int | None = None):
        t = pool.spec.target(target)
        self.pool = pool
        self.target = target
        self.layer_idx = layer_idx
        self.member = member
        self.grouping = t.row_grouping
        self.in_features = t.local_in_features(pool.spec.tp_size)
        self.out_features = t.local_out_features(pool.spec.tp_size)
        if member is not None and not 0 <= member < t.num_slices:
            raise ValueError(f"target {target!r} has {t.num_slices} slices, not a slice {member}")
        self.resolve()
        #: the slices this delta's expand serves: one for a ``member``, else every slice
        self.slices = (member,) if member is not None else tuple(range(len(self.weights.out_offsets) - 1))

    def resolve(self) -> None:
        """Take the layer's slot weights (views) and prepare their launch: at construction, and
        again after the pool moved the layer's A (:meth:`LoraAdapterPool.bind_a
        <lora_cupy.pool.LoraAdapterPool.bind_a>`)."""
        self.weights: LayerWeights = self.pool.layer_weights(self.target, self.layer_idx)
        if self.member is not None:
            self.weights = member_weights(self.weights, self.member)
            self.out_features = self.weights.out_offsets[-1]
        self._launch = self.pool.backend.prepare(self.weights)

    def expand_v(self, ys, v, after_gemm: bool = False, compact: int = 0):
        """The delta when the base GEMM already computed v: ``ys[j][t] += scaling[s, j] *
        v[t, (s*n + j)*R : +r] @ B[s, cols_j, :r].T`` for each row t of the step on slot s and
        each slice j (``r = ranks[s, j]``). ``v`` ``[T, S*n*R]`` holds every slot's ``x @ A.T`` side
        by side, as a GEMM of x with the layer's A rows appended to the base weight writes them
        (:meth:`LoraAdapterPool.bind_a <lora_cupy.pool.LoraAdapterPool.bind_a>`); ``ys`` holds one
        output per slice (``[T, cols_j]``). Rows past the step's and slot 0's are untouched.
        Changes each y in place; touches no workspace. A whole target's delta only (not a
        ``member``'s). ``after_gemm``: the kernel queued just before on the stream writes nothing
        of what the delta reads but y and v (on CUDA the expand then may overlap that kernel's
        tail: :meth:`LayerLaunch.expand_v <lora_cupy.backends.cupy.LayerLaunch.expand_v>`).
        ``compact`` = kb > 0: ``v`` ``[T, kb*n*R]`` holds the blocks of the step's slots with
        positions alone, the k-th at block ``kb - 1 - k`` (a GEMM over the A rows the backend's
        ``gather_a`` placed before the base weight writes them so); kb >= the step's rows."""
        if self.member is not None:
            raise ValueError(f"{self!r}.expand_v: a member's delta; call the whole target's")
        self._run(functools.partial(self._launch.expand_v, after_gemm=after_gemm, compact=compact), " expand_v",
                  tuple(ys), v)
        return ys

    def __call__(self, y, x):
        if self.pool.open_halves is not None:  # v of a shrink whose expands did not all run
            self.pool.close_halves()
        self._run(self._launch, "", y, x)
        return y

    def _run(self, fn, what: str, *args) -> bool:
        """``fn(*args, views, rows)`` under the current plan (its host copy waited for), errors
        named by target, layer and ``what``; False (nothing run): no plan."""
        plan = self.pool.current_plan()
        if plan is None:
            return False
        if plan.ready is not None:
            plan.wait_host()
        g = self.grouping
        try:
            fn(*args, plan.launch[g], plan.rows[g])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{self.target}[{self.layer_idx}]{what}: {e}") from None
        return True

    def shrink(self, x) -> None:
        """The delta's first half: ``v = x @ A.T`` for the step's rows, into the backend's
        workspace (no output yet). :meth:`expand` adds it into y. A target's shrink serves the
        expands of all its slices (:meth:`expand` of each ``member``'s delta): a large step's
        separate q/k/v linears read x once. v is shared by every delta of the pool: the shrink is
        open (``pool.open_halves``) until the expands of all its slices have run, and any other
        delta, shrink or graph replay of the pool first zeroes what an open one left
        (:meth:`~lora_cupy.pool.LoraAdapterPool.close_halves`: a forward that raised between them).
        A step with no adapter row: nothing."""
        self.pool.close_halves()
        if self._run(self._halves(), " shrink", "shrink", x):
            self.pool.open_halves = (self.target, self.layer_idx, set(self.slices))

    def expand(self, y):
        """The delta's second half, after :meth:`shrink` of the same step and target:
        ``y += scaling * v @ B.T`` (this delta's slices: one, for a ``member``), and the v it read
        is zero again. Changes y in place and returns it. RuntimeError: no shrink of this target
        and layer is open for these slices (nothing is added)."""
        if self.pool.current_plan() is None:
            return y
        if not self.shrink_open():
            raise RuntimeError(f"{self!r}.expand: no shrink of {self.target}[{self.layer_idx}] is open for "
                               f"slices {list(self.slices)} (open: {self.pool.open_halves})")
        self._run(self._halves(), " expand", "expand", y)
        left = self.pool.open_halves[2]
        left.difference_update(self.slices)
        if not left:
            self.pool.open_halves = None
        return y

    def glu(self, g, u, h):
        """A gated MLP's activation with this gate_up target's delta folded in: ``h = silu(g + dg) *
        (u + du)`` for the step's rows, g and u the model's gate and up outputs (``[T, inter]``,
        base GEMMs only), dg / du the delta's two slices (CUDA: ``lora_expand_glu``). With a plan,
        after :meth:`shrink` of the same step, target and layer (whose v it reads and zeroes); with
        no plan (no adapter row), the plain fused activation of every row of g. h may be g.
        Returns h. RuntimeError: a plan, but no shrink of this target open for both slices."""
        if self.member is not None:
            raise ValueError(f"{self!r}.glu: a member's delta; call the whole target's")
        fn = getattr(self._launch, "glu", None)
        if fn is None:
            raise NotImplementedError(f"the {self.pool.backend.name} backend has no fused gated activation")
        plan = self.pool.current_plan()
        if plan is None:
            try:
                fn(g, u, h, None, g.shape[0])
            except (TypeError, ValueError) as e:
                raise type(e)(f"{self.target}[{self.layer_idx}] glu: {e}") from None
            return h
        rows = plan.rows[self.grouping]
        if g.shape[0] != rows:  # a row the addressing does not cover would keep g, not h
            raise ValueError(f"{self.target}[{self.layer_idx}] glu: g has {g.shape[0]} rows, the step addresses {rows}")
        if not self.shrink_open():
            raise RuntimeError(f"{self!r}.glu: no shrink of {self.target}[{self.layer_idx}] is open for "
                               f"slices {list(self.slices)} (open: {self.pool.open_halves})")
        self._run(fn, " glu", g, u, h)
        self.pool.open_halves = None
        return h

    def shrink_open(self) -> bool:
        """Whether the pool's open shrink (:meth:`shrink`) is this target's and layer's, with this
        delta's slices still to expand."""
        h = self.pool.open_halves
        return h is not None and h[:2] == (self.target, self.layer_idx) and h[2].issuperset(self.slices)

    def _halves(self):
        half = getattr(self._launch, "half", None)
        if half is None:
            raise NotImplementedError(f"the {self.pool.backend.name} backend runs the delta whole, not in halves")
        return half

    def __repr__(self) -> str:
        member = "" if self.member is None else f", member={self.member}"
        return f"LoraLayerDelta({self.target!r}, layer={self.layer_idx}{member})"
