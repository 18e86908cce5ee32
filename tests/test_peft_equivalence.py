"""Adapters read by ``read_peft_adapter`` add exactly what PEFT's own LoRA layers add.

Several PEFT adapters (rank and alpha patterns, rsLoRA, a regex ``target_modules``,
``layers_to_transform``) are saved from tiny random models, read onto a spec, installed into
slot arrays and run through the NumPy reference delta on one batch of rows spread over the
slots (slot 0 among them); each row must get PEFT's ``lora_layer(x) - base_layer(x)`` for its
adapter. Fused specs, tensor-parallel shards and an adapter trained on a fused ``qkv_proj``
must agree too.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lora_cupy.addressing import group_by_slot
from lora_cupy.backends.reference import reference_delta
from lora_cupy.peft import read_peft_adapter
from lora_cupy.spec import LoraSpec
from tests.peft_helpers import (
    HIDDEN, INTERMEDIATE, install_slots, lora_module_paths, make_peft_adapter, module_path, peft_delta,
    tiny_llama)

NUM_LAYERS = 3
RTOL = 1e-4
#: Slot -> the PEFT adapter it holds: (r, alpha, extra LoraConfig arguments).
ADAPTERS = {
    1: (4, 8, {}),
    2: (8, 16, {"rank_pattern": {"q_proj": 2, "model.layers.1.mlp.down_proj": 12},
                "alpha_pattern": {"layers.0.self_attn.v_proj": 5, "up_proj": 3.5}}),
    3: (16, 8, {"use_rslora": True, "target_modules": ["q_proj", "v_proj", "gate_proj"]}),
    4: (3, 6, {"layers_to_transform": [1], "target_modules": ["k_proj", "o_proj", "down_proj"]}),
    5: (5, 7, {"target_modules": r".*\.layers\.[02]\.(self_attn\.(q|k)_proj|mlp\.up_proj)"}),
}
NUM_SLOTS = 7  # slot 6 stays empty: rows there must get nothing


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory):
    """slot -> (adapter dir, peft model), each from the same random base model."""
    root = tmp_path_factory.mktemp("peft_equiv")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for slot, (r, alpha, kw) in ADAPTERS.items():
            out[slot] = make_peft_adapter(root / f"adapter{slot}", r=r, lora_alpha=alpha,
                                          num_layers=NUM_LAYERS, seed=slot, **kw)
    return out


def make_spec(fuse=False, tp_rank=0, tp_size=1, sharding=None):
    return LoraSpec.from_model(tiny_llama(NUM_LAYERS), num_slots=NUM_SLOTS, max_rank=16, dtype="float32",
                               fuse=fuse, tp_rank=tp_rank, tp_size=tp_size, sharding=sharding)


def batch_rows(rng, num_slots, n=17):
    """A row -> slot map covering every slot, slot 0 included, shuffled."""
    rows = np.concatenate([np.arange(num_slots), rng.integers(0, num_slots, n - num_slots)])
    rng.shuffle(rows)
    return rows


def run_delta(spec, slots, target, layer, x, rows):
    """The reference delta of ``rows``' slots, starting from random y: returns y_after - y_before."""
    rng = np.random.default_rng(layer)
    token_order, slot_indptr = group_by_slot(rows, spec.num_slots)
    y0 = rng.standard_normal((x.shape[0], target.local_out_features(spec.tp_size))).astype(np.float32)
    y = y0.copy()
    reference_delta(y, x, slots[target.name].layer(layer), token_order, slot_indptr)
    return y - y0


def sharded_delta(specs, slots, target, layer, x, rows):
    """The full ``[T, out]`` delta from every tensor-parallel rank's share: a row target's
    partial deltas (each rank sees its columns of x) sum; a column target's ranks each write
    their share of every slice's columns."""
    tp = len(specs)
    if target.sharding == "row":
        n = target.local_in_features(tp)
        return sum(run_delta(specs[k], slots[k], target, layer, np.ascontiguousarray(x[:, k * n:(k + 1) * n]), rows)
                   for k in range(tp))
    full, local = target.out_offsets(), target.out_offsets(tp)
    got = np.zeros((x.shape[0], target.out_features), np.float32)
    for k in range(tp):
        part = run_delta(specs[k], slots[k], target, layer, x, rows)
        for j in range(target.num_slices):
            w = local[j + 1] - local[j]
            got[:, full[j] + k * w:full[j] + (k + 1) * w] = part[:, local[j]:local[j + 1]]
    return got


def expected_delta(peft_adapters, target, layer, x, rows):
    """PEFT's contribution for each row's adapter, slices concatenated: ``[T, out]`` float64."""
    out = np.zeros((x.shape[0], target.out_features))
    offs = target.out_offsets()
    for slot, (_, pm) in peft_adapters.items():
        sel = rows == slot
        if not sel.any():
            continue
        paths = set(lora_module_paths(pm))
        for j, s in enumerate(target.slices):
            path = module_path(s.name, layer)
            if path in paths:
                out[sel, offs[j]:offs[j + 1]] = peft_delta(pm, path, x[sel])
    return out


def assert_close(got, want, what):
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_reference_delta_matches_peft(peft_adapters, fuse):
    spec = make_spec(fuse)
    read = {s: read_peft_adapter(d, spec) for s, (d, _) in peft_adapters.items()}
    slots = install_slots(spec, read)
    rng = np.random.default_rng()
    rows = batch_rows(rng, NUM_SLOTS)
    checked = 0
    for t in spec.targets:
        for layer in range(t.num_layers):
            x = rng.standard_normal((len(rows), t.in_features)).astype(np.float32)
            got = run_delta(spec, slots, t, layer, x, rows)
            want = expected_delta(peft_adapters, t, layer, x, rows)
            assert not got[np.isin(rows, (0, 6))].any(), "rows on slot 0 or an empty slot changed"
            assert_close(got, want, f"{t.name} layer {layer}")
            checked += np.abs(want).sum() > 0
    assert checked == sum(t.num_layers for t in spec.targets)  # every target and layer adds something


def test_fused_spec_equals_unfused(peft_adapters):
    unfused, fused = make_spec(False), make_spec(True)
    su = install_slots(unfused, {s: read_peft_adapter(d, unfused) for s, (d, _) in peft_adapters.items()})
    sf = install_slots(fused, {s: read_peft_adapter(d, fused) for s, (d, _) in peft_adapters.items()})
    rng = np.random.default_rng()
    rows = batch_rows(rng, NUM_SLOTS)
    for t in fused.targets:
        if t.num_slices == 1:
            continue
        for layer in range(t.num_layers):
            x = rng.standard_normal((len(rows), t.in_features)).astype(np.float32)
            got = run_delta(fused, sf, t, layer, x, rows)
            parts = [run_delta(unfused, su, unfused.target(s.name), layer, x, rows) for s in t.slices]
            assert_close(got, np.concatenate(parts, axis=1), f"{t.name} layer {layer}")


def test_tensor_parallel_shards_sum_to_peft(peft_adapters):
    """Column targets: each rank's columns of every slice; row targets: partial deltas sum."""
    sharding = {"qkv_proj": "column", "gate_up_proj": "column", "o_proj": "row", "down_proj": "row"}
    tp = 2
    specs = [make_spec(True, k, tp, sharding) for k in range(tp)]
    slots = [install_slots(sp, {s: read_peft_adapter(d, sp) for s, (d, _) in peft_adapters.items()})
             for sp in specs]
    rng = np.random.default_rng()
    rows = batch_rows(rng, NUM_SLOTS)
    for t in specs[0].targets:
        for layer in range(t.num_layers):
            x = rng.standard_normal((len(rows), t.in_features)).astype(np.float32)
            want = expected_delta(peft_adapters, t, layer, x, rows)
            got = sharded_delta(specs, slots, t, layer, x, rows)
            assert_close(got, want, f"{t.name} layer {layer} tp={tp}")


def tiny_phi3():
    """A random Phi-3: fused ``qkv_proj`` and ``gate_up_proj`` linears."""
    import torch
    import transformers

    cfg = transformers.Phi3Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                  pad_token_id=0)
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_adapter_on_fused_module(tmp_path, tp_size):
    """An adapter trained on a fused qkv_proj / gate_up_proj: one A for every slice, B split."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path, pm = make_peft_adapter(tmp_path / "phi3", r=6, lora_alpha=9, model=tiny_phi3(),
                                     target_modules=["qkv_proj", "gate_up_proj", "o_proj"])
    head = HIDDEN // 4
    sizes = {"qkv_proj": (HIDDEN, 2 * head, 2 * head), "gate_up_proj": (INTERMEDIATE, INTERMEDIATE)}
    specs = [LoraSpec.from_model(tiny_phi3(), ("qkv_proj", "gate_up_proj", "o_proj"), num_slots=3, max_rank=8,
                                 dtype="float32", slice_sizes=sizes, tp_rank=k, tp_size=tp_size,
                                 sharding={"qkv_proj": "column", "gate_up_proj": "column", "o_proj": "row"})
             for k in range(tp_size)]
    read = [read_peft_adapter(path, sp) for sp in specs]
    qkv = read[0].targets["qkv_proj"]
    assert qkv.ranks.tolist() == [[6, 6, 6]] * 2
    np.testing.assert_array_equal(qkv.a[:, 0], qkv.a[:, 2])  # one A, copied per slice
    slots = [install_slots(sp, {2: a}) for sp, a in zip(specs, read)]
    rng = np.random.default_rng()
    rows = batch_rows(rng, 3, 9)
    for t in specs[0].targets:
        for layer in range(2):
            x = rng.standard_normal((len(rows), t.in_features)).astype(np.float32)
            leaf = t.name
            group = "mlp" if leaf == "gate_up_proj" else "self_attn"
            want = np.zeros((len(rows), t.out_features))
            want[rows == 2] = peft_delta(pm, f"model.layers.{layer}.{group}.{leaf}", x[rows == 2])
            got = sharded_delta(specs, slots, t, layer, x, rows)
            assert_close(got, want, f"{t.name} layer {layer} tp={tp_size}")
