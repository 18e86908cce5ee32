"""LoraSpec / LoraTarget: construction, validation, sizes, and building from a torch model."""

from __future__ import annotations

import math

import pytest
import torch

from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget, layer_index


def qkv(num_layers=2, sharding=None):
    return LoraTarget("qkv_proj", 64, 64 + 32 + 32, num_layers,
                      (LoraSlice("q_proj", 64), LoraSlice("k_proj", 32), LoraSlice("v_proj", 32)), sharding)


def test_single_slice_default_and_offsets():
    t = LoraTarget("o_proj", 64, 48, 3)
    assert t.slices == (LoraSlice("o_proj", 48),)
    assert t.out_offsets() == (0, 48)
    assert qkv().out_offsets() == (0, 64, 96, 128)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="x", in_features=8, out_features=10, num_layers=1, slices=(LoraSlice("a", 4),)), "add up"),
    (dict(name="x", in_features=0, out_features=4, num_layers=1), "in_features"),
    (dict(name="x", in_features=8, out_features=4, num_layers=0), "num_layers"),
    (dict(name="x", in_features=8, out_features=4, num_layers=1, sharding="diagonal"), "sharding"),
    (dict(name="x", in_features=8, out_features=8, num_layers=1,
          slices=(LoraSlice("a", 4), LoraSlice("a", 4))), "duplicate"),
])
def test_bad_target_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraTarget(**kwargs)


def test_spec_validation():
    t = LoraTarget("o_proj", 64, 64, 2)
    with pytest.raises(ValueError, match="num_slots"):
        LoraSpec((t,), num_slots=1, max_rank=8)
    with pytest.raises(ValueError, match="max_rank"):
        LoraSpec((t,), num_slots=4, max_rank=0)
    with pytest.raises(ValueError, match="dtype"):
        LoraSpec((t,), num_slots=4, max_rank=8, dtype="int8")
    with pytest.raises(ValueError, match="duplicate"):
        LoraSpec((t, t), num_slots=4, max_rank=8)
    with pytest.raises(ValueError, match="split"):
        LoraSpec((LoraTarget("o_proj", 66, 64, 2, sharding="row"),), num_slots=4, max_rank=8, tp_size=4)


def test_sizes_and_module_lookup():
    spec = LoraSpec((qkv(3), LoraTarget("o_proj", 64, 64, 3)), num_slots=5, max_rank=16, dtype="bf16")
    assert spec.dtype == "bfloat16"
    q = spec.target("qkv_proj")
    assert spec.a_shape(q) == (3, 5, 3, 16, 64) and spec.b_shape(q) == (3, 5, 128, 16)
    weights = 2 * (3 * 5 * 3 * 16 * 64 + 3 * 5 * 128 * 16) + 2 * (3 * 5 * 64 * 16 + 3 * 5 * 64 * 16)
    meta = 8 * (3 * 5 * 3 + 3 * 5 * 1)
    assert spec.device_bytes() == weights + meta
    assert spec.slot_bytes() == spec.device_bytes() // 5
    assert spec.module_target("k_proj") == (q, 1)
    assert spec.module_target("qkv_proj") == (q, None)
    assert spec.module_target("o_proj")[1] == 0
    assert spec.module_target("down_proj") is None
    assert spec.bucket_for(3) == 4 and spec.bucket_for(4096) == 4096
    with pytest.raises(ValueError):
        spec.bucket_for(4097)
    with pytest.raises(KeyError, match="o_proj"):
        spec.target("nope")


def test_tensor_parallel_shards():
    col, row = qkv(2, "column"), LoraTarget("o_proj", 64, 64, 2, sharding="row")
    spec = LoraSpec((col, row), num_slots=3, max_rank=4, tp_rank=1, tp_size=2)
    assert spec.b_shape(col) == (2, 3, 64, 4)
    assert col.out_offsets(2) == (0, 32, 48, 64)
    assert spec.a_shape(row) == (2, 3, 1, 4, 32) and spec.b_shape(row) == (2, 3, 64, 4)


def test_layer_index():
    assert layer_index("base_model.model.model.layers.12.mlp.down_proj") == 12
    assert layer_index("lm_head") is None


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    return LlamaForCausalLM(cfg)


def test_from_model_separate_and_fused():
    model = tiny_llama()
    spec = LoraSpec.from_model(model, num_slots=4, max_rank=8)
    assert spec.dtype == "float32"
    assert set(spec.target_names) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    k = spec.target("k_proj")
    assert (k.in_features, k.out_features, k.num_layers) == (64, 32, 3)
    assert spec.target("down_proj").in_features == 96
    fused = LoraSpec.from_model(model, num_slots=4, max_rank=8, fuse=True, dtype="float16",
                                sharding={"qkv_proj": "column", "o_proj": "row"})
    assert set(fused.target_names) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    q = fused.target("qkv_proj")
    assert [s.name for s in q.slices] == ["q_proj", "k_proj", "v_proj"]
    assert q.out_offsets() == (0, 64, 96, 128) and q.sharding == "column"
    assert fused.target("gate_up_proj").out_offsets() == (0, 96, 192)
    assert fused.module_target("up_proj") == (fused.target("gate_up_proj"), 1)


def test_from_model_already_fused_and_subset():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(32, 64, bias=False)
            self.o_proj = torch.nn.Linear(32, 32, bias=False)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(2))

    spec = LoraSpec.from_model(Net(), ["qkv_proj"], num_slots=3, max_rank=4,
                               slice_sizes={"qkv_proj": (32, 16, 16)})
    assert spec.target_names == ("qkv_proj",)
    assert spec.module_target("v_proj")[1] == 2
    with pytest.raises(ValueError, match="no linear"):
        LoraSpec.from_model(Net(), ["down_proj"], num_slots=3, max_rank=4)
    assert math.prod(spec.a_shape(spec.target("qkv_proj"))) == 2 * 3 * 3 * 4 * 32
