"""LoraSpec and LoraTarget: what a pool serves, and how many device bytes its slots take.

A target is one linear of the model's stack (``q_proj``, a fused ``qkv_proj``), present at
``num_layers`` stack layers. A fused target has output slices: each slice is the PEFT module
of the same name (``q_proj``, ``k_proj``, ``v_proj``), with an A, B, rank and scaling of its own,
and writes its own column range of y.

Slot weights, per target (``L`` layers, ``S`` slots, ``n`` slices, ``R`` max rank):
``A[L, S, n, R, in]`` and ``B[L, S, out, R]``, where slice ``j`` owns rows
``out_offsets[j]:out_offsets[j+1]`` of B; in a pool of a large ``max_rank`` (``b_layout``) B is
rank-blocked, ``[L, S, ceil(R / 16), out, 16]`` (:meth:`LoraSpec.b_shape`), so a small adapter's B is
contiguous. Under tensor parallelism a column-parallel target
keeps its rank's share of ``out`` (of every slice), a row-parallel target its share of ``in``;
the delta is linear in x, so a row-parallel rank's partial delta sums correctly in the
all-reduce that follows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .dtypes import itemsize, normalize_dtype

DEFAULT_CAPTURE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Ranks a block of a rank-blocked B holds (:meth:`LoraSpec.b_shape`).
B_RANK_BLOCK = 16
#: ``b_layout="auto"`` stores B rank-blocked above this many ranks: where a pool spans more than one
#: rank class (16, 64) of the planner. Measured on an H100 (raw_kernels/NOTES.md, "B rank-blocked"): a
#: pool of 128 running rank-16 adapters 1.1-2.1 us faster rank-blocked, a pool of 64 running rank-64
#: adapters 0.3-2.9 us slower.
B_BLOCKED_ABOVE = 64
#: Each ``LoraSpec.b_layout``: B is stored rank-blocked above this many ranks (never: None).
_BLOCKED_ABOVE = {"auto": B_BLOCKED_ABOVE, "blocked": B_RANK_BLOCK, "plain": None}
B_LAYOUTS = tuple(_BLOCKED_ABOVE)

#: PEFT module names a Llama-style model exposes, and the fused targets that hold them.
PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LoraSlice:
    """One output slice of a target: the PEFT module ``name`` writing ``out_features`` columns."""

    name: str
    out_features: int


@dataclass(frozen=True)
class LoraTarget:
    """One target linear: full (unsharded) features, slices, stack depth and TP sharding.

    ``row_grouping`` is how many of the step's tokens make one row this target sees
    (1: every token; see ``LoraAdapterPool.addressing``).
    """

    name: str
    in_features: int
    out_features: int
    num_layers: int
    slices: tuple[LoraSlice, ...] = ()
    sharding: str | None = None  # None, "column" or "row"
    row_grouping: int = 1

    def __post_init__(self):
        if not self.slices:
            object.__setattr__(self, "slices", (LoraSlice(self.name, self.out_features),))
        object.__setattr__(self, "slices", tuple(self.slices))
        if sum(s.out_features for s in self.slices) != self.out_features:
            raise ValueError(
                f"target {self.name!r}: slices {[s.out_features for s in self.slices]} "
                f"do not add up to out_features={self.out_features}"
            )
        if len({s.name for s in self.slices}) != len(self.slices):
            raise ValueError(f"target {self.name!r}: duplicate slice names")
        for what, v in (("in_features", self.in_features), ("num_layers", self.num_layers),
                        ("row_grouping", self.row_grouping)):
            if int(v) < 1:
                raise ValueError(f"target {self.name!r}: {what} must be >= 1, got {v}")
        if self.sharding not in (None, "column", "row"):
            raise ValueError(f"target {self.name!r}: sharding must be None, 'column' or 'row'")

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def local_in_features(self, tp_size: int = 1) -> int:
        """This rank's in features: a row-parallel target keeps 1/tp_size of them."""
        if self.sharding == "row":
            return _shard(self.in_features, tp_size, self.name, "in_features")
        return self.in_features

    def local_slice_out(self, tp_size: int = 1) -> tuple[int, ...]:
        """Each slice's out features on one rank: a column-parallel target shards every slice."""
        if self.sharding == "column":
            return tuple(_shard(s.out_features, tp_size, f"{self.name}.{s.name}", "out_features")
                         for s in self.slices)
        return tuple(s.out_features for s in self.slices)

    def local_out_features(self, tp_size: int = 1) -> int:
        return sum(self.local_slice_out(tp_size))

    def out_offsets(self, tp_size: int = 1) -> tuple[int, ...]:
        """Each slice's first column of y on one rank, plus the end: ``len == num_slices + 1``."""
        offs = [0]
        for n in self.local_slice_out(tp_size):
            offs.append(offs[-1] + n)
        return tuple(offs)

    def slice_index(self, module: str) -> int | None:
        for j, s in enumerate(self.slices):
            if s.name == module:
                return j
        return None


def _shard(n: int, tp_size: int, what: str, field_name: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what}: {field_name}={n} does not split over tp_size={tp_size}")
    return n // tp_size


@dataclass(frozen=True)
class LoraSpec:
    """What one pool serves: its targets, slots (slot 0 included), maximum rank, dtype, buckets.

    ``num_slots`` counts slot 0, the zero adapter, which is never handed out: a pool of
    ``num_slots`` holds ``num_slots - 1`` adapters at once.

    ``b_layout``: how B is stored (:meth:`b_shape`): ``"blocked"`` rank-blocked above 16 ranks, so
    a small adapter's B is contiguous in a pool of a large ``max_rank``; ``"plain"`` ``[out,
    max_rank]`` a slot, which full-width reads take best; ``"auto"`` (the default) rank-blocked
    above 64 ranks (:data:`B_BLOCKED_ABOVE`).

    ``module_prefix`` is where this pool's node sits in the model's module paths (after PEFT's
    ``base_model.model.``), e.g. ``"model.visual."`` for a vision encoder and
    ``"model.language_model."`` for the LLM of one model: an adapter's modules outside it belong
    to another node's pool and are skipped here, not refused. Empty: every module is this node's.
    """

    targets: tuple[LoraTarget, ...]
    num_slots: int
    max_rank: int
    dtype: str = "bfloat16"
    capture_buckets: tuple[int, ...] = DEFAULT_CAPTURE_BUCKETS
    tp_rank: int = 0
    tp_size: int = 1
    node: str = "llm"
    module_prefix: str = ""
    b_layout: str = "auto"
    _by_name: Mapping[str, LoraTarget] = field(default=None, init=False, repr=False, compare=False)
    _by_module: Mapping[str, tuple[LoraTarget, int | None]] = field(
        default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "capture_buckets", tuple(sorted({int(b) for b in self.capture_buckets})))
        if not self.targets:
            raise ValueError("a LoraSpec needs at least one target")
        if self.num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the zero adapter), got {self.num_slots}")
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {self.max_rank}")
        if self.b_layout not in B_LAYOUTS:
            raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {self.b_layout!r}")
        if not self.capture_buckets or self.capture_buckets[0] < 1:
            raise ValueError(f"capture_buckets must be positive token counts, got {self.capture_buckets}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} outside tp_size={self.tp_size}")
        by_name: dict[str, LoraTarget] = {}
        by_module: dict[str, tuple[LoraTarget, int | None]] = {}
        for t in self.targets:
            if t.name in by_name:
                raise ValueError(f"duplicate target {t.name!r}")
            by_name[t.name] = t
            t.local_in_features(self.tp_size), t.local_slice_out(self.tp_size)  # checks sharding
            names = [(t.name, None)] if t.num_slices > 1 else []
            names += [(s.name, j) for j, s in enumerate(t.slices)]
            for module, j in names:
                if module in by_module and by_module[module][0] is not t:
                    raise ValueError(f"module {module!r} belongs to two targets")
                by_module[module] = (t, j)
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_by_module", by_module)

    # -- lookups -------------------------------------------------------------------------
    def target(self, name: str) -> LoraTarget:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no target {name!r}; targets: {sorted(self._by_name)}") from None

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.targets)

    def owns_module(self, module_path: str) -> bool:
        """Whether a module path (after ``base_model.model.``) belongs to this pool's node."""
        return module_path.startswith(self.module_prefix)

    def module_target(self, module: str) -> tuple[LoraTarget, int | None] | None:
        """The target (and slice index) a PEFT module name maps onto; ``None`` for no target.

        The slice index is ``None`` when ``module`` names a whole fused target (an adapter
        trained on a fused ``qkv_proj``): its B then spans every slice.
        """
        return self._by_module.get(module)

    @property
    def max_tokens(self) -> int:
        return self.capture_buckets[-1]

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest capture bucket holding ``num_tokens`` rows."""
        for b in self.capture_buckets:
            if num_tokens <= b:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest capture bucket {self.max_tokens}")

    # -- sizes ---------------------------------------------------------------------------
    def a_shape(self, target: LoraTarget) -> tuple[int, ...]:
        """``[layers, slots, slices, max_rank, in]`` on this rank."""
        return (target.num_layers, self.num_slots, target.num_slices, self.max_rank,
                target.local_in_features(self.tp_size))

    @property
    def b_blocked(self) -> bool:
        """Whether B is stored rank-blocked (:meth:`b_shape`): never at 16 ranks or fewer (the two
        layouts are one there), else as ``b_layout`` says."""
        above = _BLOCKED_ABOVE[self.b_layout]
        return above is not None and self.max_rank > above

    def b_shape(self, target: LoraTarget) -> tuple[int, ...]:
        """``[layers, slots, out, max_rank]`` on this rank; rank-blocked where :attr:`b_blocked`,
        ``[layers, slots, ceil(max_rank / 16), out, 16]`` (ranks past ``max_rank`` zero): block ``i``
        holds ranks ``16 i .. 16 i + 15`` of every column, so a slot's adapter of rank ``r`` is
        ``ceil(r / 16)`` contiguous blocks whatever the pool's ``max_rank`` (in ``[out, max_rank]``
        a rank-16 adapter's column is 32 bytes of every ``2 * max_rank``, and DRAM serves whole lines)."""
        L, S, out = target.num_layers, self.num_slots, target.local_out_features(self.tp_size)
        if self.b_blocked:
            return (L, S, -(-self.max_rank // B_RANK_BLOCK), out, B_RANK_BLOCK)
        return (L, S, out, self.max_rank)

    def target_bytes(self, target: LoraTarget) -> int:
        """Device bytes of one target's slot weights, ranks (int32) and scalings (float32)."""
        weights = (math.prod(self.a_shape(target)) + math.prod(self.b_shape(target))) * itemsize(self.dtype)
        meta = target.num_layers * self.num_slots * target.num_slices * 8
        return weights + meta

    def device_bytes(self) -> int:
        """Device bytes every target's slots take on one rank (the addressing buffers aside)."""
        return sum(self.target_bytes(t) for t in self.targets)

    def slot_bytes(self) -> int:
        """Device bytes one slot's weights take, over every target and layer."""
        return self.device_bytes() // self.num_slots

    # -- construction from a model ---------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        model,
        target_modules: Iterable[str] = PEFT_MODULES,
        *,
        num_slots: int,
        max_rank: int,
        dtype: str | None = None,
        fuse: bool = False,
        slice_sizes: Mapping[str, Sequence[int]] | None = None,
        sharding: Mapping[str, str] | None = None,
        **kwargs,
    ) -> "LoraSpec":
        """A spec from a torch model's linear layers, by PEFT-style target names.

        Modules are found by the last component of their names inside ``...layers.<i>...``;
        the stack depth is one past the largest layer index. ``fuse=True`` groups separate
        ``q_proj/k_proj/v_proj`` (``gate_proj/up_proj``) into one fused target of slices, as a
        serving engine that fuses those weights sees them. A model that is fused already
        (a ``qkv_proj`` linear) names its slices by ``slice_sizes={"qkv_proj": (q, k, v)}``;
        without them it is one slice. ``sharding`` maps target names to "column" or "row".
        """
        import torch

        wanted = set(target_modules)
        for fused, parts in FUSED_TARGETS.items():
            if fused in wanted:
                wanted |= set(parts) if fuse else set()
        found: dict[str, dict] = {}
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in wanted:
                continue
            layer = layer_index(name)
            if layer is None:
                continue
            info = found.setdefault(leaf, {"in": mod.in_features, "out": mod.out_features, "layers": set()})
            if (info["in"], info["out"]) != (mod.in_features, mod.out_features):
                raise ValueError(f"module {leaf!r} has different shapes at different layers")
            info["layers"].add(layer)
        if not found:
            raise ValueError(f"no linear layer of the model matches {sorted(wanted)}")
        sharding = dict(sharding or {})
        slice_sizes = dict(slice_sizes or {})
        targets: list[LoraTarget] = []
        used: set[str] = set()
        if fuse:
            for fused, parts in FUSED_TARGETS.items():
                if all(p in found for p in parts):
                    infos = [found[p] for p in parts]
                    if len({i["in"] for i in infos}) != 1:
                        raise ValueError(f"cannot fuse {parts}: different in_features")
                    targets.append(LoraTarget(
                        fused, infos[0]["in"], sum(i["out"] for i in infos),
                        max(max(i["layers"]) for i in infos) + 1,
                        tuple(LoraSlice(p, i["out"]) for p, i in zip(parts, infos)),
                        sharding.get(fused)))
                    used.update(parts)
        for leaf, info in found.items():
            if leaf in used:
                continue
            sizes = slice_sizes.get(leaf)
            parts = FUSED_TARGETS.get(leaf)
            slices = ()
            if sizes is not None:
                names = parts if parts and len(parts) == len(sizes) else [f"{leaf}.{k}" for k in range(len(sizes))]
                slices = tuple(LoraSlice(n, int(s)) for n, s in zip(names, sizes))
            targets.append(LoraTarget(leaf, info["in"], info["out"], max(info["layers"]) + 1,
                                      slices, sharding.get(leaf)))
        order = {n: k for k, n in enumerate((*FUSED_TARGETS, *PEFT_MODULES))}
        targets.sort(key=lambda t: (order.get(t.name, len(order)), t.name))
        if dtype is None:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return cls(tuple(targets), num_slots=num_slots, max_rank=max_rank, dtype=dtype, **kwargs)


def layer_index(module_path: str) -> int | None:
    """The stack layer in a module path such as ``model.layers.3.self_attn.q_proj``."""
    m = _LAYER_RE.search(module_path + ".")
    return None if m is None else int(m.group(1))


# -- B's layout ---------------------------------------------------------------------------------
def pool_layout_b(b, spec: LoraSpec):
    """``b[..., out, max_rank]`` as a pool of ``spec`` stores it (:meth:`LoraSpec.b_shape`): as it is,
    or rank-blocked (a copy, :func:`blocked_b`) where :attr:`LoraSpec.b_blocked`."""
    return blocked_b(b, spec.max_rank) if spec.b_blocked else b


def blocked_b(b, max_rank: int):
    """``b[..., out, r]`` (``r <= max_rank``; NumPy or torch) in the rank-blocked layout of a pool of
    ``max_rank`` above 16, ``[..., ceil(max_rank / 16), out, 16]``, ranks past ``r`` zero (a new
    C-contiguous array)."""
    *lead, out, r = b.shape
    if max_rank <= B_RANK_BLOCK or r > max_rank:
        raise ValueError(f"a rank-blocked B is for a max_rank above {B_RANK_BLOCK} holding the rank "
                         f"{r}, not {max_rank}")
    shape = (*lead, -(-max_rank // B_RANK_BLOCK), out, B_RANK_BLOCK)
    dst = b.new_zeros(shape) if type(b).__module__.startswith("torch") else np.zeros(shape, b.dtype)
    put_blocked(dst, b)
    return dst


def put_blocked(dst, b) -> None:
    """Write ``b[..., out, r]`` into the leading ranks of a rank-blocked ``dst[..., RB, out, 16]``
    (``r <= 16 * RB``): rank ``k`` of column ``c`` at ``dst[..., k // 16, c, k % 16]``; the rest of
    ``dst`` is left as it is."""
    r = b.shape[-1]
    for i in range(-(-r // B_RANK_BLOCK)):
        k0 = i * B_RANK_BLOCK
        dst[..., i, :, :min(B_RANK_BLOCK, r - k0)] = b[..., k0:k0 + B_RANK_BLOCK]
