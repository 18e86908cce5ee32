"""Attaching a pool to a torch model: every target linear adds its rows' adapter deltas.

:func:`attach` puts a forward hook on each linear of the model that a pool target names, at
each stack layer: after the linear computes ``y = x @ W.T (+ b)``, the hook adds
``pool.layer_delta(target, layer)(y, x)`` in place, so rows on an adapter get its delta and
rows on the base model (slot 0) nothing. While the pool holds no plan with adapter rows, or
the attachment is disabled (``enabled = False``, :meth:`Attachment.paused`), a hook returns at
once. :meth:`Attachment.detach` removes the hooks: the model's parameters and
buffers are never written, so detaching restores every output bit for bit.

A fused target whose slices are separate linears of the model reading the same input
(``q_proj``/``k_proj``/``v_proj`` for a ``qkv_proj`` target, ``gate_proj``/``up_proj`` for
``gate_up_proj``: a spec from ``LoraSpec.from_model(..., fuse=True)``) runs as one fused-slice
launch: the first member called computes the whole target's delta on the shared input into a
scratch ``[T, out]`` and every member adds its column range. A step of at least
``Attachment.members_in_place_rows`` rows (a prefill) whose deltas run in line (not forked to the
side stream, below) instead runs one launch per member, straight into that member's output
(:meth:`~lora_cupy.pool.LoraAdapterPool.layer_delta` with ``member``): the
scratch's zeroing, its write, its read and the members' adds cost more than a launch per slice
there (at 4096 rows, gate/up's scratch is 235 MB). The group's first member runs the whole
target's shrink (every slice's v from one read of x) and each member the expand of its own slice
(:meth:`~lora_cupy.delta.LoraLayerDelta.shrink` / ``expand``). A model that fuses them itself (Phi-3's
``qkv_proj``) is one linear, one hook.

Overlap (CUDA): a delta need not wait for the linear it adds to, only for its input. A
pre-hook forks a side stream off torch's current stream as the linear is called; on it the delta
(a fused group's whole delta) runs into a zeroed scratch while the base GEMM runs on the main
stream; the forward hook joins the side stream back and adds the scratch into the output. What
stays on the main stream per linear is one element-wise add. Inside a CUDA graph capture the fork
and the join are edges of the graph. The scratch is allocated on the main stream before the fork
and dropped after the join, so the caching allocator never hands it out while the side stream
can still write it. What it buys is measured (``lora-cupy bench overlap``, on an H200): the
launch gaps between GEMM and delta (6-7 us a linear at decode sizes), not the delta's own time,
since a decode GEMM keeps every multiprocessor until it drains and the delta's blocks wait for
them (the side stream's priority changes nothing inside a graph). ``overlap="graphs"`` (the
default on CUDA) forks only while a CUDA graph is being captured: an eager step pays the fork and
the join in host time per linear (on an H200, a 64-row eager decode step of a Llama-shaped model
took 6.7 ms forked against 5.6 ms in line), while a graph pays them once, at capture. ``True``
forks always, ``False`` never.

Rows: a ``[B, q, in]`` input is ``B * q`` token rows in batch order; the step's addressing
(``LoraStep`` rows in the same order, ``q`` tokens each) says which slot each row reads. On
the CPU the delta runs on NumPy views of the torch tensors (no copy); on CUDA torch tensors
go to the kernels as they are, on torch's current stream, so a CUDA graph records them.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

from ..errors import ShapeMismatchError, TargetMismatchError
from ..spec import layer_index

_ATTACHED: "weakref.WeakSet" = weakref.WeakSet()
#: Rows of a step from which each member of a fused group runs its own slice, in place (the
#: default of ``Attachment.members_in_place_rows``).
MEMBERS_IN_PLACE_ROWS = 512


def torch_dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def as_backend_array(t, device_is_cuda: bool):
    """The array the pool's backend takes for a 2-D torch tensor, sharing its memory: the
    tensor itself on CUDA, a NumPy view on the CPU (bfloat16 through its bits)."""
    if device_is_cuda:
        return t
    import torch

    if t.dtype == torch.bfloat16:
        from ..dtypes import bfloat16

        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


@dataclass
class _Site:
    """One hooked linear: the target and layer it serves, and its columns of the target's y."""

    path: str
    target: str
    layer: int
    col0: int
    col1: int


class _SideStream:
    """The stream an attachment's deltas run on beside their linears (``overlap``)."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-100)  # clamped to the highest
        self.forks = 0

    def fork(self, fn) -> None:
        """Run ``fn()`` on the side stream, after everything queued so far on the current one."""
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()
        self.forks += 1

    def join(self) -> None:
        """The current stream waits for everything forked so far."""
        self.torch.cuda.current_stream(self.device).wait_stream(self.stream)


class _FusedGroup:
    """Separate linears reading one input, served by one fused-slice launch per forward.

    The first member called with a new input computes the whole target's delta into a scratch
    ``[T, out]`` (:meth:`part`; with ``overlap``, :meth:`fork` starts it on the side stream from
    the member's pre-hook and :meth:`take` joins it in the member's forward hook); each member
    adds its columns. The scratch and the input are dropped once every member has taken its part.
    """

    def __init__(self, attachment: "Attachment", target: str, layer: int, members: int):
        self.attachment = attachment
        self.delta = attachment.pool.layer_delta(target, layer)
        self.target, self.layer = target, layer
        self.members = members
        self._x = None
        self._x2d = None  # the forked delta's input rows: alive until the join
        self._d = None
        self._served = 0
        self._joined = False
        self._forked = False
        self._shrunk = None  # the input whose shrink ran in line for the members' expands (large steps)

    def _scratch(self, x2d):
        import torch

        return torch.empty((x2d.shape[0], self.delta.out_features), dtype=x2d.dtype, device=x2d.device)

    def part(self, x, x2d):
        """The whole target's delta for input ``x`` (``x2d``: its ``[T, in]`` rows)."""
        if self._x is not x:
            d = self._scratch(x2d).zero_()
            cuda = self.attachment.pool.device.is_cuda
            self.delta(as_backend_array(d, cuda), as_backend_array(x2d, cuda))
            self._x, self._d, self._served, self._forked = x, d, 0, False
        return self._served_one()

    def fork(self, x, x2d) -> None:
        """Start the whole target's delta for input ``x`` on the side stream (once per input)."""
        if self._x is x:
            return
        self.attachment.pool.close_halves()  # the fork's delta runs on the side stream: settled here first
        self._drop_stale()
        d = self._scratch(x2d)  # on the main stream: see the module docstring

        def run():
            d.zero_()
            self.delta(d, x2d)

        self.attachment.side.fork(run)
        self._x, self._x2d, self._d, self._served, self._joined, self._forked = x, x2d, d, 0, False, True

    def take(self, x):
        """The delta forked for input ``x``, joined into the current stream (None: none was)."""
        if not self._forked or self._x is not x:
            self._drop_stale()
            return None
        if not self._joined:
            self.attachment.side.join()
            self._joined = True
        return self._served_one()

    def member(self, j: int):
        """Slice ``j``'s delta alone, into that member's own output (large steps)."""
        return self.attachment.pool.layer_delta(self.target, self.layer, member=j)

    def in_place(self, x, x2d, j: int, y2d) -> None:
        """Member ``j``'s slice of the delta for input ``x``, in line, straight into its own
        output rows ``y2d`` (large steps): the first member called with ``x`` runs the whole
        target's shrink (every slice's v from one read of x), each member the expand of its own
        slice, which zeroes that slice's v. A shrink whose members did not all expand (a forward
        that raised between them) is zeroed by the pool before any other delta runs."""
        cuda = self.attachment.pool.device.is_cuda
        member = self.member(j)
        if self._shrunk is not x or not member.shrink_open():
            self.delta.shrink(as_backend_array(x2d, cuda))
            self._shrunk = x
        member.expand(as_backend_array(y2d, cuda))
        if self.attachment.pool.open_halves is None:
            self._shrunk = None

    def _drop_stale(self) -> None:
        """Forget a fork no member took (a forward that raised after its pre-hook), once the side
        stream is done with its tensors: added to a later input, it would be a wrong delta."""
        if self._forked:
            if not self._joined:
                self.attachment.side.join()
            self._x = self._x2d = self._d = None
            self._forked = False

    def _served_one(self):
        d = self._d
        self._served += 1
        if self._served >= self.members:
            self._x, self._x2d, self._d, self._forked = None, None, None, False
        return d


class Attachment:
    """A pool attached to a model's linears (see the module docstring); :meth:`detach` undoes it.

    ``sites`` lists every hooked linear. Use as a context manager to detach on exit.
    """

    def __init__(self, model, pool, overlap: bool | str | None = None):
        modes = {True: "always", False: "never", "always": "always", "never": "never", "graphs": "graphs"}
        if overlap is None:
            overlap = "graphs" if pool.device.is_cuda else "never"
        if overlap not in modes:
            raise ValueError(f"overlap {overlap!r}: one of True / 'always', 'graphs', False / 'never'")
        mode = modes[overlap]
        if mode != "never" and not pool.device.is_cuda:
            raise ValueError(f"overlap runs the deltas on a second CUDA stream; the pool is on {pool.device.name}")
        self.model = model
        self.pool = pool
        self.overlap_mode = mode
        self.side = None
        if mode != "never":
            self.side = _SideStream(next(model.parameters()).device)
        self.sites: list[_Site] = []
        self._handles = []
        self._modules = []
        self.enabled = True
        self._num_groups = 0
        #: Rows of a step from which a fused group's members each run their own slice into their
        #: own output instead of sharing one launch into a scratch (module docstring).
        self.members_in_place_rows = MEMBERS_IN_PLACE_ROWS
        plan = _plan_sites(model, pool.spec)
        for path, mod, *_ in plan:
            if mod in _ATTACHED:
                raise ValueError(f"linear {path!r} is attached to a pool already: detach that one first")
        groups: dict[tuple, _FusedGroup] = {}
        members: dict[tuple, int] = {}
        for *_, g, _j in plan:
            if g is not None:
                members[g] = members.get(g, 0) + 1
        try:
            for path, mod, t, layer, c0, c1, g, j in plan:
                if g is None:
                    pre, hook = self._direct_hooks(pool.layer_delta(t.name, layer))
                else:
                    if g not in groups:
                        groups[g] = _FusedGroup(self, t.name, layer, members[g])
                    pre, hook = self._fused_hooks(groups[g], j, c0, c1)
                if pre is not None:
                    self._handles.append(mod.register_forward_pre_hook(pre))
                self._handles.append(mod.register_forward_hook(hook))
                _ATTACHED.add(mod)
                self._modules.append(mod)
                self.sites.append(_Site(path, t.name, layer, c0, c1))
        except BaseException:
            self.detach()
            raise
        self._num_groups = len(groups)

    @property
    def overlap(self) -> bool:
        """Whether any delta may run on the side stream (``overlap_mode`` says when)."""
        return self.overlap_mode != "never"

    def _active(self) -> bool:
        return self.enabled and self.pool.current_plan() is not None

    def _forking(self) -> bool:
        """Whether this call's delta runs on the side stream: always, or inside a graph capture."""
        if self.overlap_mode == "always":
            return True
        if self.overlap_mode == "never":
            return False
        import torch

        return torch.cuda.is_current_stream_capturing()

    def _rows(self, args, in_f: int):
        x2d = args[0].reshape(-1, in_f)
        return x2d if x2d.is_contiguous() else x2d.contiguous()

    def _direct_hooks(self, delta):
        """(pre-hook or None, forward hook) of a linear that is its target's own."""
        cuda = self.pool.device.is_cuda
        in_f, out_f = delta.in_features, delta.out_features
        # what the pre-hook forked: (input, its rows, scratch), held until the forward hook's join
        # (the side stream reads the rows and writes the scratch until then)
        forked = [None]

        def pre(_mod, args):
            if forked[0] is not None:  # a forward that raised after its pre-hook: forget its fork
                self.side.join()
                forked[0] = None
            if not self._forking() or not self._active():
                return None
            import torch

            x2d = self._rows(args, in_f)
            d = torch.empty((x2d.shape[0], out_f), dtype=x2d.dtype, device=x2d.device)

            def run():
                d.zero_()
                delta(d, x2d)

            self.pool.close_halves()  # the fork's delta runs on the side stream: settled here first
            self.side.fork(run)
            forked[0] = (args[0], x2d, d)
            return None

        def hook(_mod, args, out):
            entry, forked[0] = forked[0], None
            if entry is not None and entry[0] is not args[0]:
                self.side.join()  # not this input's: dropped once the side stream is done with it
                entry = None
            if entry is None and not self._active():
                return None
            import torch

            if torch.is_grad_enabled() or not out.is_contiguous():
                out = out.clone()
            if entry is not None:  # forked by the pre-hook: join, add
                self.side.join()
                out.view(-1, out_f).add_(entry[2])
            else:  # in line: the delta accumulates into the output
                delta(as_backend_array(out.view(-1, out_f), cuda), as_backend_array(self._rows(args, in_f), cuda))
            return out

        return (pre if self.overlap else None), hook

    def _fused_hooks(self, group: _FusedGroup, j: int, c0: int, c1: int):
        """(pre-hook or None, forward hook) of member ``j`` (columns ``c0:c1``) of a fused group."""
        in_f = group.delta.in_features

        def pre(_mod, args):
            if group._x is not args[0] and self._forking() and self._active():
                group.fork(args[0], self._rows(args, in_f))
            return None

        def hook(_mod, args, out):
            import torch

            d = group.take(args[0])
            if d is None:
                if not self._active():
                    return None
                x2d = self._rows(args, in_f)
                if x2d.shape[0] >= self.members_in_place_rows:  # a large step: this slice alone, in place
                    if torch.is_grad_enabled() or not out.is_contiguous():
                        out = out.clone()
                    group.in_place(args[0], x2d, j, out.view(-1, c1 - c0))
                    return out
                d = group.part(args[0], x2d)
            if torch.is_grad_enabled():
                out = out.clone()
            out.view(-1, c1 - c0).add_(d[:, c0:c1])
            return out

        return (pre if self.overlap else None), hook

    @contextlib.contextmanager
    def paused(self):
        """Within: the hooks add nothing (the base model), whatever plan the pool holds."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    @property
    def fused_groups(self) -> int:
        """How many groups of separate linears share one fused-slice launch."""
        return self._num_groups

    def detach(self) -> None:
        """Remove every hook: the model computes exactly what it did before :func:`attach`."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._modules:
            _ATTACHED.discard(m)
        self._modules = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()
        return False

    def __repr__(self) -> str:
        return f"Attachment({len(self.sites)} linears, {'attached' if self.attached else 'detached'})"


def _plan_sites(model, spec) -> list[tuple]:
    """Each linear to hook: ``(path, module, target, layer, col0, col1, group, slice)``, ``group``
    the key of the separate linears sharing one fused-slice launch and ``slice`` the linear's
    slice of the target (both None: the target's own linear).
    Checks every target has a linear of the right shape and dtype at each of its layers."""
    import torch

    tp = spec.tp_size
    linears = {path: mod for path, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and layer_index(path) is not None and spec.owns_module(path)}
    by_leaf: dict[str, list[str]] = {}
    for path in linears:
        by_leaf.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    plan = []
    for t in spec.targets:
        offs = t.out_offsets(tp)
        in_f, out_f = t.local_in_features(tp), t.local_out_features(tp)
        mine = []
        if t.name in by_leaf:
            mine = [(path, linears[path], t, layer_index(path), 0, out_f, None, None) for path in by_leaf[t.name]]
        elif t.num_slices > 1 and all(s.name in by_leaf for s in t.slices):
            for j, s in enumerate(t.slices):
                for path in by_leaf[s.name]:
                    group = (path.rsplit(".", 1)[0], t.name, layer_index(path))
                    mine.append((path, linears[path], t, layer_index(path), offs[j], offs[j + 1], group, j))
        else:
            want = [t.name] + ([s.name for s in t.slices] if t.num_slices > 1 else [])
            raise TargetMismatchError(f"target {t.name!r}: the model has no linear named "
                                      f"{' or '.join(repr(w) for w in want)} inside a 'layers.<i>.' stack")
        for path, mod, _t, layer, c0, c1, *_ in mine:
            if layer >= t.num_layers:
                raise TargetMismatchError(f"linear {path!r}: stack layer {layer} is outside target "
                                          f"{t.name!r}'s {t.num_layers} layers")
            if mod.in_features != in_f or mod.out_features != c1 - c0:
                raise ShapeMismatchError(f"linear {path!r} is [{mod.out_features}, {mod.in_features}] but "
                                         f"target {t.name!r} wants [{c1 - c0}, {in_f}] on this rank")
            if torch_dtype_name(mod.weight.dtype) != spec.dtype:
                raise ShapeMismatchError(f"linear {path!r} holds {torch_dtype_name(mod.weight.dtype)} "
                                         f"weights but the pool's slots are {spec.dtype}")
        missing = sorted(set(range(t.num_layers)) - {m[3] for m in mine})
        if missing:
            raise TargetMismatchError(f"target {t.name!r}: the model has no linear for it at stack layer(s) {missing}")
        plan += mine
    return plan


def attach(model, pool, overlap: bool | str | None = None) -> Attachment:
    """Hook ``pool``'s targets onto ``model``'s linears (see the module docstring).

    ``overlap``: run each delta on a side stream beside its linear's GEMM: ``"graphs"`` (the
    default on a CUDA pool) inside CUDA graph captures only, ``True`` always, ``False`` never;
    refused on a pool that is not on CUDA.

    Refuses, before hooking anything: a target with no linear of its name (or of its slices'
    names) at some stack layer (``TargetMismatchError``), a linear whose shape on this rank or
    dtype differs from the target's (``ShapeMismatchError``), a linear attached already.
    """
    return Attachment(model, pool, overlap)
