"""A Hugging Face Llama-style model as one tensor-parallel rank holds it.

Column-parallel q/k/v and gate/up keep their rows ``rank``/``world`` of the output features;
row-parallel o and down keep their columns of the input features, and their partial outputs are
summed over the ranks by an all-reduce after them. ``LLAMA_SHARDING`` is the same split for
``LoraSpec.from_model(..., sharding=...)``, so a pool's deltas shard alike (column-parallel: B
split on out; row-parallel: A split on in, the delta added before the all-reduce, which is why
the all-reduce hooks are registered after :func:`~lora_cupy.integrations.attach`).
"""

from __future__ import annotations

#: The targets' tensor-parallel sharding of a Llama-style model (fused q/k/v and gate/up).
LLAMA_SHARDING = {"qkv_proj": "column", "gate_up_proj": "column", "o_proj": "row", "down_proj": "row"}


def _column(layer):
    return (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
            layer.mlp.up_proj)


def _row(layer):
    return (layer.self_attn.o_proj, layer.mlp.down_proj)


def shard_llama(model, rank: int, world: int):
    """``model`` (changed in place, and returned) as rank ``rank`` of ``world`` holds it."""
    import torch

    def keep(lin, dim: int) -> None:
        n = lin.weight.shape[dim] // world
        if n * world != lin.weight.shape[dim]:
            raise ValueError(f"{lin.weight.shape[dim]} features do not split over {world} ranks")
        w = lin.weight.data.narrow(dim, rank * n, n).clone()
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        lin.out_features, lin.in_features = w.shape

    layers = model.model.layers
    if any(lin.bias is not None for layer in layers for lin in (*_column(layer), *_row(layer))):
        # a column's bias would need narrowing, a row's adding on one rank only: refused before any change
        raise ValueError("shard_llama takes linears without biases (attention_bias / mlp_bias False)")
    for layer in layers:
        for lin in _column(layer):
            keep(lin, 0)
        for lin in _row(layer):
            keep(lin, 1)
    return model


def all_reduce_after(model, group=None) -> list:
    """The row-parallel linears' all-reduce over ``group``, as forward hooks: register them after
    the pool's (``attach``), so each rank's delta is in its partial sum. Returns the handles."""
    import torch.distributed as dist

    def hook(_mod, _args, out):
        dist.all_reduce(out, group=group)
        return out

    return [m.register_forward_hook(hook) for layer in model.model.layers
            for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
