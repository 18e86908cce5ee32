"""Attaching a pool to a torch model: every target linear adds its rows' adapter deltas.

:func:`attach` puts a forward hook on each linear of the model that a pool target names, at
each stack layer: after the linear computes ``y = x @ W.T (+ b)``, the hook adds
``pool.layer_delta(target, layer)(y, x)`` in place, so rows on an adapter get its delta and
rows on the base model (slot 0) nothing. While the pool holds no plan with adapter rows, or
the attachment is disabled (``enabled = False``, :meth:`Attachment.paused`), a hook returns at
once (on CUDA, an enabled attachment's gated MLPs still run their fused activation at large
steps: "Gated MLPs", below). :meth:`Attachment.detach` removes the hooks: the model's parameters and
buffers keep their values (with ``shrink_in_base``, below, a first member's weight lives in a
larger array while attached, and gets storage of its own back), so detaching restores every
output bit for bit.

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

Shrink in the base GEMM (CUDA, small steps). A decode step's delta costs each linear a chain of
dependent rounds (the split-K shrink, its reduction, the expand) of about 9 us whatever its bytes.
With ``shrink_in_base`` (the default where it fits: a CUDA pool of bfloat16 or float16 with no
tensor parallelism, rank width 8, 16, 32, 64 or 128, at most 3 slices a target), each target's
first linear gets its weight extended by the pool's A rows of every slot, ``[out + S*n*R, in]``
(the pool keeps the layer's A there: :meth:`~lora_cupy.pool.LoraAdapterPool.bind_a`; the
linear's own weight becomes a view of that array, same values), so a step of at most
``Attachment.shrink_in_base_rows`` rows (64) runs one GEMM that writes y and every slot's
``x @ A.T`` side by side, and one launch of ``lora_expand_v`` adds the rest into each member's
output (:meth:`~lora_cupy.delta.LoraLayerDelta.expand_v`). The group's other members run their
own GEMMs at the first member's call (their outputs are kept for their calls). Larger steps, and
any step while the attachment is paused or has no adapter row, run the linears as they are.
Like ``overlap``, it runs by default (``"graphs"``) only while a CUDA graph is being captured: an
eager call pays its host work (checks, packing, the extra GEMM calls) every time, and on an H200
a 64-row eager decode step of the e2e bench's model took 9.58 ms this way against 6.67 ms with
the pool's whole delta (graphs: 2.43 against 2.60 ms). ``True`` (``"always"``) runs it in eager
calls too, ``False`` (``"never"``) not at all.
What the extended GEMM costs is reading every slot's A (which a shrink of the step's adapters
reads in part). A step of at most ``Attachment.compact_rows`` rows (8) reads only its own slots'
A: each extended weight also keeps K = min(8, S-1) blocks of ``n*R`` rows *before* the base
weight (``[K*n*R | out | S*n*R]``), one ``lora_gather_a`` launch a forward copies the A of the
step's slots with positions into them (every target at once), and the GEMM takes the kb blocks
next to the weight (kb: the step's rows); on an H200 this took the e2e bench's batch-1 decode
step from 1.126x to 1.070x its base step. ``lora_expand_v`` launches with programmatic
dependent launch after its GEMM where the device allows. :meth:`Attachment.detach` gives each
linear a weight of its own again and the pool its A.

Gated MLPs at large steps (CUDA, ``glu``). A Hugging Face gated MLP of SiLU (``GATED_MLPS``:
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) whose gate_up target fuses its two linears gets
its forward replaced: a step of at least ``Attachment.glu_rows`` rows (512) runs both base GEMMs,
the target's shrink, and one ``lora_expand_glu`` that writes ``silu(g + dg) * (u + du)`` over g,
then ``down_proj`` as before (its own hook adds its delta). A prefill's gate and up expands each
read and write a ``[T, inter]`` output that the model's SiLU and product then read and write again
(at 4096 rows of a Llama-8B shape, 235 MB each); here g and u are read once and h written once.
A step with no adapter row runs the same kernel with no delta (the plain fused activation), so
a row's result never depends on whether other rows of its step have adapters; it differs from
the model's own two kernels by rounding (h rounded once, where they round silu(g) and h). Smaller
steps, rows the step's plan does not cover, autograd, a paused attachment, and inputs of another
dtype or device than the linears' run the MLP's own forward. The replaced forward calls the two
linears' GEMMs itself (``F.linear`` on their weights): hooks of their own besides the
attachment's do not run at those steps, and an MLP whose modules carry accelerate's device hooks
(offloaded weights) is left as it is. ``glu_mlps`` lists the MLPs replaced; ``glu = False``
turns it off (for comparison).

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
_NONE = object()  # a module had no forward of its own on the instance
#: Rows of a step from which each member of a fused group runs its own slice, in place (the
#: default of ``Attachment.members_in_place_rows``).
MEMBERS_IN_PLACE_ROWS = 512
#: Rows of a step from which a gated MLP's activation runs with its gate / up delta folded in
#: (``Attachment.glu_rows``).
GLU_ROWS = 512
#: Gated MLP modules whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Hugging Face).
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
#: Rows of a step up to which the shrink rides on the base GEMM (``Attachment.shrink_in_base_rows``).
SHRINK_IN_BASE_ROWS = 64
#: Rows of a step up to which that GEMM reads only the A of the step's slots, gathered before the
#: base weight (``Attachment.compact_rows``): at most this many slots' A rows are kept there.
COMPACT_ROWS = 8


def shrink_in_base_fits(spec, device_is_cuda: bool) -> str | None:
    """Why the shrink cannot ride on the base GEMM for this spec (None: it can). On the CPU any
    spec without tensor parallelism fits (the NumPy reference runs the expand)."""
    if spec.tp_size != 1:
        return "tensor parallelism: a row-parallel linear's v would need its all-reduce first"
    if not device_is_cuda:
        return None
    from ..kernels import EXPAND_V_DTYPES, EXPAND_V_RANKS

    if spec.dtype not in EXPAND_V_DTYPES:
        return f"lora_expand_v serves {EXPAND_V_DTYPES}, the pool is {spec.dtype}"
    if spec.max_rank not in EXPAND_V_RANKS:
        return f"lora_expand_v serves rank widths {EXPAND_V_RANKS}, the pool's is {spec.max_rank}"
    for t in spec.targets:
        offs = t.out_offsets(1)
        if t.num_slices > 3:
            return f"target {t.name!r} has {t.num_slices} slices; lora_expand_v serves up to 3"
        widths = [b - a for a, b in zip(offs, offs[1:])]
        if any(w % 8 for w in widths):
            return f"target {t.name!r}: slice widths {widths} (multiples of 8 wanted)"
    return None


def gated_mlp_fits(mlp, target) -> str | None:
    """Why ``mlp`` (the module enclosing a gate_up target's two linears) cannot run its activation
    with the target's delta folded in (None: it can): a Hugging Face gated MLP of SiLU whose forward
    is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, the target's slices gate_proj then up_proj."""
    names = tuple(sl.name for sl in target.slices)
    if names != ("gate_proj", "up_proj"):
        return f"target {target.name!r} has slices {names}, not ('gate_proj', 'up_proj')"
    kind = type(mlp).__name__
    if kind not in GATED_MLPS:
        return f"{kind} is not one of the gated MLPs {GATED_MLPS}"
    act = type(getattr(mlp, "act_fn", None)).__name__
    if act not in ("SiLU", "SiLUActivation"):
        return f"{kind}'s act_fn is {act}, not SiLU"
    if not hasattr(mlp, "down_proj"):
        return f"{kind} has no down_proj"
    for m in (mlp, getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)):
        if getattr(m, "_hf_hook", None) is not None:  # accelerate moves its weights per call
            return f"{kind} carries accelerate's device hooks (offloaded weights)"
    return None


def torch_dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def as_backend_array(t, device_is_cuda: bool):
    """The array the pool's backend takes for a torch tensor, sharing its memory: the
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


class _BaseShrink:
    """One target at one layer whose shrink rides on its first linear's GEMM (module docstring):
    the extended weight ``[K*n*R + out_0 + S*n*R, in]`` (the compact blocks a small step's slots'
    A is gathered into, that linear's weight, the pool's A of the layer), and the outputs of one
    call kept for the group's other members."""

    def __init__(self, attachment: "Attachment", target: str, layer: int, mods: list):
        import torch

        pool = attachment.pool
        spec = pool.spec
        t = spec.target(target)
        self.attachment, self.target, self.layer, self.mods = attachment, target, layer, mods
        self.delta = pool.layer_delta(target, layer)
        m0 = mods[0]
        w = m0.weight
        #: one linear serving every slice of a fused target (Phi-3's qkv_proj): its output's columns
        self.split = t.num_slices > 1 and len(mods) == 1
        self.offs = t.out_offsets(1)
        self.out0, in_f = w.shape
        S, n, R = spec.num_slots, t.num_slices, spec.max_rank
        #: slots whose A a small step gathers before the base weight, and the rows they take
        self.K = min(COMPACT_ROWS, S - 1)
        self.block = n * R
        C = self.C = self.K * self.block
        with torch.no_grad():
            ext = torch.empty((C + self.out0 + S * n * R, in_f), dtype=w.dtype, device=w.device)
            ext[C:C + self.out0].copy_(w)
            self.bias = None
            if m0.bias is not None:  # zeros around the linear's own bias, which becomes its middle
                self.bias = torch.cat([m0.bias.new_zeros(C), m0.bias.detach(), m0.bias.new_zeros(S * n * R)])
        if pool.device.is_cuda:  # the kernel's module loads here, not inside a graph capture
            pool.backend.expand_v_fn(spec.dtype, R)
        tail = ext[C + self.out0:].view(S, n, R, in_f)
        like = pool.layer_weights(target, layer).a
        self.tail = _backend_view(tail, like, pool.device.is_cuda)
        #: [K, n, R, in] before the weight: the k-th slot with positions of a small step at K-1-k
        self.compact = _backend_view(ext[:C].view(self.K, n, R, in_f), like, pool.device.is_cuda)
        pool.bind_a(target, layer, self.tail)  # refuses a layer another attachment holds
        # same values; the linear's parameters become views of the arrays the GEMM reads, so an
        # in-place write to them (load_state_dict) reaches the GEMM too
        w.data = ext[C:C + self.out0]
        if self.bias is not None:
            m0.bias.data = self.bias[C:C + self.out0]
        self.ext = ext
        self.head_ptr = w.data_ptr()
        self._x = None
        self._outs = None
        self._left = 0

    def run(self, x, x2d) -> None:
        """The group's outputs for input ``x`` (rows ``x2d``): one GEMM with the extended weight,
        the other members' own GEMMs, then the expand into each. A step of at most
        ``compact_rows`` rows (kb of them) reads only the kb blocks before the weight, where the
        attachment gathered its slots' A (:meth:`Attachment._gather`); a larger one every slot's."""
        import torch
        import torch.nn.functional as F

        ext, C, out0 = self.ext, self.C, self.out0
        w = self.mods[0].weight
        if w.data_ptr() != self.head_ptr or w.dtype != ext.dtype:
            raise RuntimeError(f"{self.target}[{self.layer}]: the linear's weight is no longer a view of its "
                               "extended array (the model was moved or cast while attached): detach first")
        att = self.attachment
        plan = att.pool.current_plan()
        if plan is not None and plan.ready is not None:  # the CPU pool: its installs into A land first
            plan.wait_host()
        rows = x2d.shape[0]
        kb = rows if rows <= min(self.K, att.compact_rows) else 0
        if kb:  # rows [C - kb*n*R, C + out0): v first, then y
            att._gather(plan, kb)
            v0 = kb * self.block
            lo, hi, vcols, cols = C - v0, C + out0, slice(0, v0), slice(v0, v0 + out0)
        else:  # rows [C, end): y first, then every slot's v
            lo, hi, vcols, cols = C, None, slice(out0, None), slice(0, out0)
        wt = ext[lo:hi].t()
        out = torch.mm(x2d, wt) if self.bias is None else torch.addmm(self.bias[lo:hi], x2d, wt)
        head = out[:, cols]
        ys = [head] + [F.linear(x2d, m.weight, m.bias) for m in self.mods[1:]]
        slices = [head[:, a:b] for a, b in zip(self.offs, self.offs[1:])] if self.split else ys
        cuda = att.pool.device.is_cuda
        # the kernel before the expand on the stream is a GEMM of this group (writing y or v alone)
        self.delta.expand_v([as_backend_array(y, cuda) for y in slices], as_backend_array(out[:, vcols], cuda),
                            after_gemm=True, compact=kb)
        self._x, self._outs, self._left = x, ys, len(self.mods)

    def drop(self) -> None:
        """Forget outputs kept for members (a forward that raised or skipped one)."""
        self._x = self._outs = None

    def take(self, x, j: int):
        """Member ``j``'s output for input ``x`` (``[..., cols_j]``), None: not computed for it."""
        if self._x is not x:
            return None
        y = self._outs[j]
        self._left -= 1
        if self._left <= 0:
            self._x = self._outs = None
        return y.view(*x.shape[:-1], y.shape[1])

    def restore(self) -> None:
        """The linear's weight (and bias) in storage of their own, then the pool's A back in its
        own array."""
        self._x = self._outs = None
        if self.ext is None:
            return
        m0, C = self.mods[0], self.C
        m0.weight.data = self.ext[C:C + self.out0].clone()
        if self.bias is not None:
            m0.bias.data = self.bias[C:C + self.out0].clone()
        self.ext = None
        self.attachment.pool.unbind_a(self.target, self.layer, self.tail)


def _enclosing(model, paths: list[str]):
    """The innermost module holding every linear at ``paths`` whose forward runs (a container
    such as ``nn.ModuleList`` is called by its parent): a forward reaching any of them passes
    through it (a decoder's, where the model's ``forward`` is not what a generator calls)."""
    import torch

    parts = [p.split(".") for p in paths]
    common = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    common = common[:min(len(p) for p in parts) - 1]  # a module above the linears themselves
    while common:
        mod = model.get_submodule(".".join(common))
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            return mod
        common.pop()
    return model


def _backend_view(t, like, cuda: bool):
    """A torch tensor's memory as the pool's array type and dtype (``like``'s), no copy: on the
    CPU :func:`as_backend_array`'s NumPy view; on CUDA a CuPy array (the pool's own type)."""
    if not cuda:
        return as_backend_array(t, False)
    import cupy
    import torch

    raw = t.view(torch.int16) if t.element_size() == 2 else t
    return cupy.asarray(raw).view(like.dtype)


class Attachment:
    """A pool attached to a model's linears (see the module docstring); :meth:`detach` undoes it.

    ``sites`` lists every hooked linear. Use as a context manager to detach on exit.
    """

    def __init__(self, model, pool, overlap: bool | str | None = None, shrink_in_base: bool | str | None = None,
                 glu: bool | None = None):
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
        why = shrink_in_base_fits(pool.spec, pool.device.is_cuda)
        if shrink_in_base is None:
            shrink_in_base = "graphs" if pool.device.is_cuda and why is None else "never"
        if shrink_in_base not in modes:
            raise ValueError(f"shrink_in_base {shrink_in_base!r}: one of True / 'always', 'graphs', False / 'never'")
        base_mode = modes[shrink_in_base]
        if base_mode != "never" and why is not None:
            raise ValueError(f"shrink_in_base: {why}")
        if base_mode == "graphs" and not pool.device.is_cuda:
            raise ValueError(f"shrink_in_base='graphs' runs inside CUDA graph captures; the pool is on {pool.device.name}")
        #: When a small step's shrink rides on each target's first GEMM (module docstring):
        #: "always", "graphs" (inside CUDA graph captures) or "never".
        self.shrink_in_base_mode = base_mode
        #: Whether it may (each target's first linear extended, the pool's A bound there).
        self.shrink_in_base = base_mode != "never"
        #: Rows of a step up to which it does.
        self.shrink_in_base_rows = SHRINK_IN_BASE_ROWS
        #: Rows of a step up to which its GEMM reads only the step's slots' A, gathered once a step
        #: before each base weight (at most ``COMPACT_ROWS``, the slots kept there).
        self.compact_rows = COMPACT_ROWS
        self._gathers: dict[int, object] = {}  # row grouping -> the backend's gather over its targets
        self._gathered = None  # (plan, kb, capturing) of the last gather; None: a new forward began
        self._base: dict[tuple, _BaseShrink] = {}
        self._served: dict[int, object] = {}  # id(linear) -> the input its forward served whole
        self._patched = []
        if glu and not (pool.device.is_cuda and pool.spec.tp_size == 1):
            raise ValueError(f"glu runs lora_expand_glu on one CUDA device; the pool is on {pool.device.name} "
                             f"with tensor parallelism {pool.spec.tp_size}")
        #: Whether a gated MLP's activation runs with its gate / up delta folded in at steps of at
        #: least ``glu_rows`` rows (``glu_mlps`` lists the MLPs that may); set False to compare.
        self.glu = glu is not False and pool.device.is_cuda and pool.spec.tp_size == 1
        #: Rows of a step from which it does.
        self.glu_rows = GLU_ROWS
        #: The gated MLPs whose forward this attachment replaced (module docstring).
        self.glu_mlps: list[str] = []
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
            if self.shrink_in_base:
                mods: dict[tuple, dict] = {}
                for path, mod, t, layer, c0, c1, g, j in plan:
                    mods.setdefault((t.name, layer), {})[0 if j is None else j] = mod
                for (tname, layer), by_j in mods.items():
                    bs = self._base[(tname, layer)] = _BaseShrink(self, tname, layer, [by_j[k] for k in sorted(by_j)])
                    for k, mod in enumerate(bs.mods):
                        self._patched.append((mod, mod.__dict__.get("forward", _NONE)))
                        mod.forward = self._base_forward(bs, k, mod)
                pairs: dict[int, list] = {}
                for (tname, _layer), bs in self._base.items():
                    pairs.setdefault(pool.spec.target(tname).row_grouping, []).append((bs.tail, bs.compact))
                self._gathers = {g: pool.backend.gather_a(p) for g, p in pairs.items()}

                def new_forward(_mod, _args):  # a forward (or a capture of one) gathers anew
                    self._gathered = None

                self._handles.append(_enclosing(model, [p for p, *_ in plan]).register_forward_pre_hook(new_forward))
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
            if self.glu:
                self._attach_glu(model, plan, groups, required=bool(glu))
        except BaseException:
            self.detach()
            raise
        self._num_groups = len(groups)

    def _attach_glu(self, model, plan, groups: dict, required: bool) -> None:
        """Replace the forward of each gated MLP whose gate_up target fits (:func:`gated_mlp_fits`,
        and the backend's ``lora_expand_glu``); ``required``: ValueError where none does."""
        mods: dict[tuple, dict] = {}
        for _path, mod, t, _layer, _c0, _c1, g, j in plan:
            if g is not None:
                mods.setdefault(g, {})[j] = (mod, t)
        why = "no target fuses separate gate_proj and up_proj linears"
        for key, by_j in mods.items():
            mlp = model.get_submodule(key[0])
            t = by_j[0][1]
            why = gated_mlp_fits(mlp, t)
            if why is None and by_j[0][0].weight.get_device() != self.pool.backend.limits.device_id:
                why = f"{key[0]}'s weights are on {by_j[0][0].weight.device}, the pool on {self.pool.device.name}"
            if why is None:
                fits = getattr(groups[key].delta._launch, "glu_fits", None)
                why = "the backend has no lora_expand_glu" if fits is None else fits()
            if why is not None:
                continue
            self._patched.append((mlp, mlp.__dict__.get("forward", _NONE)))
            mlp.forward = self._glu_forward(groups[key], mlp, by_j[0][0], by_j[1][0])
            self.glu_mlps.append(key[0])
        if required and not self.glu_mlps:
            raise ValueError(f"glu=True: no gated MLP fits ({why})")

    def _glu_forward(self, group: "_FusedGroup", mlp, gate, up):
        """The MLP's forward at large steps: both base GEMMs, the target's shrink, one
        ``lora_expand_glu`` into gate's output, then ``down_proj`` (whose own hook adds its delta);
        its own forward otherwise (small steps, paused, autograd, another dtype or device)."""
        import torch
        import torch.nn.functional as F

        own = mlp.forward  # the forward it had (bound), kept for every other call
        in_f, inter = gate.in_features, gate.out_features
        delta = group.delta

        def forward(x, *args, **kwargs):
            if (args or kwargs or not self.glu or not self.enabled or torch.is_grad_enabled()
                    or x.dtype != gate.weight.dtype or x.device != gate.weight.device or x.shape[-1] != in_f
                    or x.numel() < self.glu_rows * in_f):
                return own(x, *args, **kwargs)
            x2d = x.reshape(-1, in_f)
            plan = self.pool.current_plan()
            if plan is not None and plan.rows.get(delta.grouping) != x2d.shape[0]:
                return own(x, *args, **kwargs)  # rows the addressing does not cover
            x2d = x2d.contiguous()
            g = F.linear(x2d, gate.weight, gate.bias)
            u = F.linear(x2d, up.weight, up.bias)
            if plan is not None:
                delta.shrink(x2d)
            delta.glu(g, u, g)
            return mlp.down_proj(g.view(*x.shape[:-1], inter))

        return forward

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

    def _base_applies(self, x, in_f: int) -> bool:
        """Whether this call's target runs its shrink inside its first GEMM (a small step with
        adapter rows, no autograd; with "graphs", inside a capture)."""
        if not self.shrink_in_base or not self.enabled:
            return False
        import torch

        if torch.is_grad_enabled() or x.numel() > self.shrink_in_base_rows * in_f:
            return False
        if self.shrink_in_base_mode == "graphs" and not torch.cuda.is_current_stream_capturing():
            return False
        return self.pool.current_plan() is not None

    def _gather(self, plan, kb: int) -> None:
        """Place the step's slots' A before every extended weight, at the first small-step
        target of each forward (a pre-hook on the module enclosing every target clears the key)
        and again whenever the plan (the object: a step's seq is the caller's and may repeat),
        kb or capturing changes (a call of one layer alone): a capture records it, so each
        replay gathers for its own step. Not covered: two captures in one step that each reach
        the targets without passing through that module (graphs of single layers); the second
        would record no gather, so such captures want ``compact_rows = 0``."""
        import torch

        capturing = self.pool.device.is_cuda and torch.cuda.is_current_stream_capturing()
        last = self._gathered
        if last is None or last[0] is not plan or last[1] != kb or last[2] != capturing:
            for g, gather in self._gathers.items():
                gather(plan.launch[g].slot_indptr, kb)
            self._gathered = (plan, kb, capturing)

    def _base_forward(self, bs: _BaseShrink, j: int, mod):
        """Member ``j``'s forward while its target's shrink may ride on the first GEMM: the
        group's outputs computed at the first member called with a new input, each member's
        taken at its call; otherwise the linear's own forward."""
        orig = mod.forward  # the class's, or one already set on the instance (kept, restored at detach)
        in_f = mod.in_features
        served = self._served

        def forward(x, *args, **kwargs):
            if args or kwargs or not self._base_applies(x, in_f):
                bs.drop()
                return orig(x, *args, **kwargs)
            y = bs.take(x, j)
            if y is None:
                bs.run(x, self._rows((x,), in_f))
                y = bs.take(x, j)
            served[id(mod)] = x  # the hooks add nothing for this call
            return y

        return forward

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
            if not self._forking() or not self._active() or self._base_applies(args[0], in_f):
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
            if self._served.pop(id(_mod), None) is args[0]:  # its forward added the delta
                return None
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
            if (group._x is not args[0] and self._forking() and self._active()
                    and not self._base_applies(args[0], in_f)):
                group.fork(args[0], self._rows(args, in_f))
            return None

        def hook(_mod, args, out):
            import torch

            if self._served.pop(id(_mod), None) is args[0]:  # its forward added the delta
                return None
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
        """Remove every hook (and give each first member's weight storage of its own and the pool
        its A again): the model computes exactly what it did before :func:`attach`."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m, before in reversed(self._patched):
            if before is _NONE:
                m.__dict__.pop("forward", None)
            else:
                m.forward = before
        self._patched = []
        base, self._base = list(self._base.values()), {}
        self._served.clear()
        failed = None
        for bs in base:  # each one, whatever another raises
            try:
                bs.restore()
            except Exception as e:  # noqa: BLE001 - the first is raised once all are done
                failed = failed or e
        for m in self._modules:
            _ATTACHED.discard(m)
        self._modules = []
        if failed is not None:
            raise failed

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


def attach(model, pool, overlap: bool | str | None = None, shrink_in_base: bool | str | None = None,
           glu: bool | None = None) -> Attachment:
    """Hook ``pool``'s targets onto ``model``'s linears (see the module docstring).

    ``overlap``: run each delta on a side stream beside its linear's GEMM: ``"graphs"`` (the
    default on a CUDA pool) inside CUDA graph captures only, ``True`` always, ``False`` never;
    refused on a pool that is not on CUDA.

    ``shrink_in_base``: a small step's shrink rides on each target's first GEMM (module
    docstring): ``"graphs"`` inside CUDA graph captures only, ``True`` (``"always"``) in eager
    calls too, ``False`` (``"never"``) not at all; None (the default): ``"graphs"`` where it fits
    on CUDA (:func:`shrink_in_base_fits`), never on the CPU. Asked for where it does not fit:
    ValueError saying why.

    ``glu``: at steps of at least ``Attachment.glu_rows`` rows (a prefill), each Hugging Face
    gated MLP of SiLU whose gate_up target fuses its separate gate_proj / up_proj runs its
    activation with that target's delta folded in (module docstring); None (the default): where
    it fits, on one CUDA device; True: the same, ValueError where no MLP fits; False: never.

    Refuses, before hooking anything: a target with no linear of its name (or of its slices'
    names) at some stack layer (``TargetMismatchError``), a linear whose shape on this rank or
    dtype differs from the target's (``ShapeMismatchError``), a linear attached already.
    """
    return Attachment(model, pool, overlap, shrink_in_base, glu)
