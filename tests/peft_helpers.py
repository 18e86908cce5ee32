"""Making small PEFT adapters for tests, and installing read adapters into slot arrays.

Import as ``from tests.peft_helpers import ...``. The API:

- ``tiny_llama(num_layers, seed)``: a random Llama (hidden 64, intermediate 128, 4 heads,
  2 kv heads, vocab 64), built from a config with no download.
- ``make_peft_adapter(path, r=..., lora_alpha=..., ...)``: wrap a tiny Llama with PEFT, give its
  LoRA A and B random weights (PEFT starts B at zero), ``save_pretrained(path)``; returns
  ``(path, peft_model)``.
- ``peft_delta(peft_model, module, x)``: PEFT's own LoRA contribution at one module,
  ``lora_layer(x) - base_layer(x)`` in float32.
- ``write_adapter(path, tensors, **config)``: an adapter dir from NumPy tensors and config
  fields (PEFT's defaults filled in), with no torch or PEFT involved.
- ``write_random_adapter(path, spec, r=..., ...)``: random PEFT-layout weights for every
  module of a spec's targets (fast; for store and pool tests).
- ``install_slots(spec, {slot: AdapterWeights})``: slot arrays shaped ``spec.a_shape`` /
  ``spec.b_shape`` with each adapter in its slot; ``.layer(l)`` gives a ``LayerWeights``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lora_cupy.adapter import AdapterWeights
from lora_cupy.backends.base import LayerWeights
from lora_cupy.dtypes import numpy_dtype
from lora_cupy.spec import PEFT_MODULES, LoraSpec, blocked_b

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 64, 128, 4, 2, 64
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"}
#: What PEFT writes for a plain LoRA (fields a test does not set).
DEFAULT_CONFIG = {
    "peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": None, "bias": "none",
    "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
    "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
    "lora_dropout": 0.0, "task_type": None,
}


def tiny_llama(num_layers: int = 2, seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` small enough to build in milliseconds."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=num_layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def randomize_lora(peft_model, seed: int = 0) -> None:
    """Give every LoRA A and B of ``peft_model`` random weights, in place."""
    import torch
    from peft.tuners.lora import LoraLayer

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in peft_model.modules():
            if not isinstance(mod, LoraLayer):
                continue
            for key in mod.lora_A:
                a, b = mod.lora_A[key].weight, mod.lora_B[key].weight  # [r, in], [out, r]
                a.copy_(torch.randn(a.shape, generator=g) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=g) / b.shape[1] ** 0.5)


def make_peft_adapter(path, *, r: int = 8, lora_alpha: float = 16, target_modules=PEFT_MODULES,
                      rank_pattern: Mapping[str, int] | None = None,
                      alpha_pattern: Mapping[str, float] | None = None, use_rslora: bool = False,
                      layers_to_transform: Iterable[int] | None = None, model=None,
                      num_layers: int = 2, seed: int = 0, **lora_kwargs):
    """Save a PEFT LoRA adapter with random A and B to ``path``; returns ``(path, peft_model)``.

    ``model`` is the base torch model to wrap (PEFT changes it in place); by default a fresh
    ``tiny_llama(num_layers, seed)``. Extra keyword arguments go to ``peft.LoraConfig``.
    """
    import peft

    if model is None:
        model = tiny_llama(num_layers, seed)
    config = peft.LoraConfig(
        r=r, lora_alpha=lora_alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
        use_rslora=use_rslora,
        layers_to_transform=None if layers_to_transform is None else list(layers_to_transform),
        **lora_kwargs)
    peft_model = peft.get_peft_model(model, config)
    randomize_lora(peft_model, seed + 1)
    peft_model.eval()
    path = Path(path)
    peft_model.save_pretrained(str(path))
    return path, peft_model


def lora_module_paths(peft_model) -> list[str]:
    """Paths (inside the base model, as in the spec) of every module PEFT put a LoRA on."""
    from peft.tuners.lora import LoraLayer

    return [name.removeprefix("base_model.model.") for name, mod in peft_model.named_modules()
            if isinstance(mod, LoraLayer)]


def peft_delta(peft_model, module: str, x: np.ndarray) -> np.ndarray:
    """PEFT's LoRA contribution at ``module`` for rows ``x[T, in]``: ``[T, out]`` float32."""
    import torch

    layer = peft_model.get_submodule(f"base_model.model.{module}")
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    with torch.no_grad():
        return (layer(xt) - layer.base_layer(xt)).numpy()


def write_adapter(path, tensors: Mapping[str, np.ndarray], **config) -> Path:
    """An adapter directory from ``{key: array}`` and config fields over ``DEFAULT_CONFIG``."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({**DEFAULT_CONFIG, **config}, indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def module_path(module: str, layer: int) -> str:
    """A Llama-style module path, e.g. ``model.layers.3.self_attn.q_proj``."""
    group = "self_attn" if module in _ATTENTION else "mlp"
    return f"model.layers.{layer}.{group}.{module}"


def random_tensors(spec: LoraSpec, rng: np.random.Generator, r: int = 4, modules=None, layers=None,
                   dtype="float32") -> dict[str, np.ndarray]:
    """Random ``lora_A [r, in]`` / ``lora_B [out, r]`` in PEFT's key layout for each slice
    module of the spec's targets (``modules`` picks some), at ``layers`` (default: all)."""
    dt = numpy_dtype(dtype)
    out = {}
    for t in spec.targets:
        for s in t.slices:
            if modules is not None and s.name not in modules:
                continue
            for layer in range(t.num_layers) if layers is None else layers:
                key = f"base_model.model.{module_path(s.name, layer)}"
                out[f"{key}.lora_A.weight"] = (rng.standard_normal((r, t.in_features))
                                               / np.sqrt(t.in_features)).astype(dt)
                out[f"{key}.lora_B.weight"] = (rng.standard_normal((s.out_features, r)) / np.sqrt(r)).astype(dt)
    return out


def write_random_adapter(path, spec: LoraSpec, *, r: int = 4, lora_alpha: float = 8, seed: int = 0,
                         modules=None, layers=None, dtype="float32", **config) -> Path:
    """An adapter directory with random weights for the spec's modules (see ``random_tensors``)."""
    tensors = random_tensors(spec, np.random.default_rng(seed), r, modules, layers, dtype)
    names = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    return write_adapter(path, tensors, r=r, lora_alpha=lora_alpha, target_modules=names, **config)


@dataclass
class SlotWeights:
    """One target's slot arrays: ``a[L, S, n, R, in]``, ``b`` as ``spec.b_shape``, ``ranks`` and
    ``scaling`` ``[L, S, n]``, as a pool holds them."""

    a: np.ndarray
    b: np.ndarray
    ranks: np.ndarray
    scaling: np.ndarray
    out_offsets: tuple[int, ...]

    def layer(self, layer: int) -> LayerWeights:
        return LayerWeights(self.a[layer], self.b[layer], self.scaling[layer], self.ranks[layer],
                            self.out_offsets)


def install_slots(spec: LoraSpec, adapters: Mapping[int, AdapterWeights]) -> dict[str, SlotWeights]:
    """Every target's slot arrays with ``adapters[s]`` copied into slot ``s`` (never slot 0)."""
    dt = numpy_dtype(spec.dtype)
    slots = {}
    for t in spec.targets:
        L, S, n = t.num_layers, spec.num_slots, t.num_slices
        sw = SlotWeights(np.zeros(spec.a_shape(t), dt), np.zeros(spec.b_shape(t), dt),
                         np.zeros((L, S, n), np.int32), np.zeros((L, S, n), np.float32),
                         t.out_offsets(spec.tp_size))
        for s, adapter in adapters.items():
            assert 1 <= s < S, f"slot {s} outside 1..{S - 1}"
            tw = adapter.targets.get(t.name)
            if tw is None:
                continue
            sw.a[:, s, :, :tw.rank] = tw.a
            if spec.b_blocked:
                sw.b[:, s] = blocked_b(tw.b, spec.max_rank)
            else:
                sw.b[:, s, :, :tw.rank] = tw.b
            sw.ranks[:, s] = tw.ranks
            sw.scaling[:, s] = tw.scaling
        slots[t.name] = sw
    return slots
