"""Attaching a pool to a Hugging Face model: each row of one mixed forward gets exactly what PEFT
gives it with that row's adapter alone; separate q/k/v and gate/up linears share one launch;
detach leaves every parameter and output bit-identical; bad models are refused by type.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lora_cupy.delta import LoraLayerDelta
from lora_cupy.errors import ShapeMismatchError, TargetMismatchError
from lora_cupy.integrations import attach, spec_for_adapters
from lora_cupy.integrations.peft_reference import PeftReference
from lora_cupy.pool import LoraAdapterPool
from lora_cupy.spec import LoraSpec
from tests.peft_helpers import make_peft_adapter, tiny_llama
from tests.pool_helpers import planned_step

VOCAB = 64


def tiny(kind: str):
    """A random 2-layer model of a Llama-style family: Llama, Qwen2 (q/k/v biases; with a sliding
    window on one layer), Mistral (a sliding window), Phi-3 (fused)."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB)
    torch.manual_seed(0)
    if kind == "llama":
        return tiny_llama(2, 0)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if kind == "qwen2-window":  # layer 0 full attention, layer 1 a sliding window of 4 positions
        cfg = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    if kind == "mistral":  # every layer a sliding window of 5 positions
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=5)).eval()
    if kind == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, pad_token_id=0)).eval()
    raise ValueError(kind)


def modules_of(kind: str) -> list[str]:
    if kind == "phi3":
        return ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "phi3"])
def family(request, tmp_path_factory):
    """(kind, base model, {adapter: dir}): three adapters of mixed ranks, one on a subset of modules."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"attach_{kind}")
    base = tiny(kind)
    mods = modules_of(kind)
    dirs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, (r, alpha, targets) in enumerate([(4, 8, mods), (8, 4, mods[:2] + mods[-1:]), (2, 5, mods)]):
            dirs[f"ad{k}"], _ = make_peft_adapter(root / f"ad{k}", r=r, lora_alpha=alpha, target_modules=targets,
                                                  model=copy.deepcopy(base), seed=10 * k)
    return kind, base, dirs


def test_mixed_batch_logits_equal_peft_per_row(family):
    kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=4)
    if kind != "phi3":  # separate projections become fused targets of slices
        assert {"qkv_proj", "gate_up_proj"} <= set(spec.target_names)
    ref = PeftReference(base, dirs)
    rows = [("a", "ad0"), ("b", None), ("c", "ad1"), ("d", "ad2"), ("e", "ad0")]
    ids = torch.randint(0, VOCAB, (len(rows), 7))
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool, \
            attach(base, pool):
        planned_step(pool, rows, ids.shape[1])
        with torch.inference_mode():
            got = base(input_ids=ids).logits
    for i, (_rid, adapter) in enumerate(rows):
        want = ref.logits(ids[i:i + 1], adapter)[0]
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
    base_logits = ref.logits(ids[:1], None)[0]
    assert (got[0] - base_logits).abs().max() > 1e-3, "adapter rows must differ from the base model"


def test_separate_projections_run_as_one_fused_launch(family, monkeypatch):
    kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=4)
    calls = []
    real = LoraLayerDelta.__call__

    def counting(self, y, x):
        calls.append(self.target)
        return real(self, y, x)

    monkeypatch.setattr(LoraLayerDelta, "__call__", counting)
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool, \
            attach(base, pool) as att:
        planned_step(pool, [("a", "ad0"), ("b", "ad1")], 3)
        with torch.inference_mode():
            base(input_ids=torch.randint(0, VOCAB, (2, 3)))
        assert att.fused_groups == (0 if kind == "phi3" else 2 * 2)  # qkv and gate_up at 2 layers
    # one launch per target and layer: 4 targets x 2 layers, not 7 linears x 2
    assert sorted(calls) == sorted(t for t in spec.target_names for _ in range(2))


def test_large_steps_run_each_member_in_place(family, monkeypatch):
    """From ``members_in_place_rows`` rows on, each member of a fused group runs its own slice
    straight into its own output (no scratch): the group's first member runs the whole target's
    shrink once, each member the expand of its own slice. Every row still equals PEFT with its
    adapter alone, the logits match the shared-scratch path's, and v is zero afterwards."""
    kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=4)
    ref = PeftReference(base, dirs)
    rows = [("a", "ad0"), ("b", None), ("c", "ad1"), ("d", "ad2")]
    ids = torch.randint(0, VOCAB, (len(rows), 5))
    calls = []
    real, real_shrink, real_expand = LoraLayerDelta.__call__, LoraLayerDelta.shrink, LoraLayerDelta.expand

    def counting(self, y, x):
        calls.append(("whole", self.target, self.member))
        return real(self, y, x)

    def counting_shrink(self, x):
        calls.append(("shrink", self.target, self.member))
        return real_shrink(self, x)

    def counting_expand(self, y):
        calls.append(("expand", self.target, self.member))
        return real_expand(self, y)

    got = {}
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool, \
            attach(base, pool) as att:
        planned_step(pool, rows, ids.shape[1])
        monkeypatch.setattr(LoraLayerDelta, "__call__", counting)
        monkeypatch.setattr(LoraLayerDelta, "shrink", counting_shrink)
        monkeypatch.setattr(LoraLayerDelta, "expand", counting_expand)
        for threshold in (10**9, len(rows) * ids.shape[1]):  # the shared scratch, then members in place
            att.members_in_place_rows = threshold
            calls.clear()
            with torch.inference_mode():
                got[threshold] = base(input_ids=ids).logits
        assert pool.backend.v is None and pool.open_halves is None
    # in place: one shrink per group, one expand per separate linear (its slice); fused models unchanged
    if kind == "phi3":
        assert [c for c in calls if c[0] != "whole"] == []
    else:
        groups = [("qkv_proj", 3), ("gate_up_proj", 2)]
        assert sorted(c for c in calls if c[0] == "shrink") == sorted([("shrink", t, None) for t, _ in groups] * 2)
        assert sorted(c for c in calls if c[0] == "expand") == \
            sorted([("expand", t, j) for t, n in groups for j in range(n)] * 2)
        assert sorted(t for p, t, m in calls if p == "whole") == ["down_proj"] * 2 + ["o_proj"] * 2
    small, large = got[10**9], got[len(rows) * ids.shape[1]]
    torch.testing.assert_close(large, small, rtol=1e-5, atol=1e-6)
    for i, (_rid, adapter) in enumerate(rows):
        torch.testing.assert_close(large[i], ref.logits(ids[i:i + 1], adapter)[0], rtol=1e-4, atol=1e-5)


def _before_attach(base):
    """(every parameter and buffer copied, input ids, the model's logits on them) before an attach."""
    params = {k: v.detach().clone() for k, v in base.state_dict().items()}
    ids = torch.randint(0, VOCAB, (3, 6))
    with torch.inference_mode():
        before = base(input_ids=ids).logits.clone()
    return params, ids, before


def test_attach_then_detach_is_bit_identical(family):
    _kind, base, dirs = family
    params, ids, before = _before_attach(base)
    spec = spec_for_adapters(base, dirs, num_slots=4)
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool:
        att = attach(base, pool)
        with torch.inference_mode():
            idle = base(input_ids=ids).logits.clone()  # no step planned: the hooks add nothing
        planned_step(pool, [("a", "ad0"), ("b", None), ("c", "ad2")], ids.shape[1])
        with torch.inference_mode():
            during = base(input_ids=ids).logits.clone()
            with att.paused():
                paused = base(input_ids=ids).logits.clone()
        att.detach()
        assert not att.attached
        with torch.inference_mode():
            after = base(input_ids=ids).logits.clone()  # the plan is still current: detached adds nothing
    for t in (idle, paused, after):
        assert np.array_equal(t.numpy().view(np.int32), before.numpy().view(np.int32))
    assert not torch.equal(during[0], before[0]) and not torch.equal(during[2], before[2])
    assert torch.equal(during[1], before[1])  # a base row: its delta is exactly zero
    for k, v in base.state_dict().items():
        assert np.array_equal(v.numpy().view(np.uint8), params[k].numpy().view(np.uint8)), k
    assert not base._forward_hooks and all(not m._forward_hooks for m in base.modules())


def test_attach_refuses_a_model_that_does_not_fit(family):
    _kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=3)
    with LoraAdapterPool(spec, "cpu") as pool:
        other = LoraSpec.from_model(tiny_llama(3, 1), ["o_proj"], num_slots=3, max_rank=4, dtype="float32")
        with LoraAdapterPool(other, "cpu") as deeper, pytest.raises(TargetMismatchError, match="layer"):
            attach(base, deeper)  # a 3-layer target on a 2-layer model
        with attach(base, pool), pytest.raises(ValueError, match="attached"):
            attach(base, pool)
        bf16 = copy.deepcopy(base).to(torch.bfloat16)
        with pytest.raises(ShapeMismatchError, match="bfloat16"):
            attach(bf16, pool)
    nothing = LoraSpec.from_model(base, ["o_proj"], num_slots=3, max_rank=4, dtype="float32")
    bare = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with LoraAdapterPool(nothing, "cpu") as pool, pytest.raises(TargetMismatchError, match="o_proj"):
        attach(bare, pool)
    with LoraAdapterPool(spec, "cpu") as pool:
        for mode in (True, "always", "graphs"):
            with pytest.raises(ValueError, match="second CUDA stream; the pool is on cpu"):
                attach(base, pool, overlap=mode)
        with pytest.raises(ValueError, match="one of True"):
            attach(base, pool, overlap="sometimes")
        with attach(base, pool) as att:
            assert att.overlap_mode == "never" and not att.overlap and att.side is None  # in line on the CPU
            assert not any(m._forward_pre_hooks for m in base.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in base.modules())  # a refusal hooks nothing


def test_a_forward_raising_between_members_leaves_no_v_behind():
    """A large step's forward that raises after q_proj's shrink and expand but before k_proj's:
    the pool zeroes the open shrink's v before the next delta, so the next step (planned anew,
    other rows) gets exactly what a fresh attachment gives; an expand with no shrink open is
    refused."""
    import copy as _copy

    base = tiny("llama")
    root = Path(tempfile.mkdtemp())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dirs = {f"ad{k}": make_peft_adapter(root / f"ad{k}", r=4 + 4 * k, lora_alpha=8,
                                            target_modules=modules_of("llama"), model=_copy.deepcopy(base),
                                            seed=3 + k)[0] for k in range(2)}
    spec = spec_for_adapters(base, dirs, num_slots=3)
    first, then = [("a", "ad0"), ("b", "ad1")], [("c", "ad1")]
    ids, ids2 = torch.randint(0, VOCAB, (len(first), 4)), torch.randint(0, VOCAB, (len(then), 6))
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool:
        planned_step(pool, then, ids2.shape[1], seq=1)
        with attach(base, pool) as att, torch.inference_mode():
            att.members_in_place_rows = 1
            want = base(input_ids=ids2).logits
        planned_step(pool, first, ids.shape[1], seq=2)
        with attach(base, pool) as att:
            att.members_in_place_rows = 1
            k_proj = base.model.layers[0].self_attn.k_proj
            boom = k_proj.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
            with pytest.raises(RuntimeError, match="boom"), torch.inference_mode():
                base(input_ids=ids)
            boom.remove()
            assert pool.open_halves == ("qkv_proj", 0, {1, 2}) and pool.backend.v is not None
            planned_step(pool, [("d", "ad1")], ids2.shape[1], seq=3)  # another step: other rows, other length
            with torch.inference_mode():
                got = base(input_ids=ids2).logits
            assert pool.open_halves is None and pool.backend.v is None
            with pytest.raises(RuntimeError, match="no shrink"):
                pool.layer_delta("qkv_proj", 1, member=0).expand(np.zeros((6, 32), np.float32))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_shrink_in_base_gemm_logits_equal_peft_per_row(family, monkeypatch):
    """``shrink_in_base``: a small step runs one GEMM per target with the pool's A rows appended to
    its first linear's weight and one expand_v per target and layer (no whole delta); every row
    still equals PEFT with its adapter alone, and a step above ``shrink_in_base_rows`` takes the
    usual path to the same logits."""
    kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=4)
    ref = PeftReference(base, dirs)
    rows = [("a", "ad0"), ("b", None), ("c", "ad1"), ("d", "ad2"), ("e", "ad0")]
    ids = torch.randint(0, VOCAB, (len(rows), 7))
    calls = []
    real_whole, real_v = LoraLayerDelta.__call__, LoraLayerDelta.expand_v

    def whole(self, y, x):
        calls.append(("whole", self.target))
        return real_whole(self, y, x)

    def expand_v(self, ys, v, **kw):
        calls.append(("expand_v", self.target))
        return real_v(self, ys, v, **kw)

    monkeypatch.setattr(LoraLayerDelta, "__call__", whole)
    monkeypatch.setattr(LoraLayerDelta, "expand_v", expand_v)
    got = {}
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool, \
            attach(base, pool, shrink_in_base=True) as att:
        assert att.shrink_in_base
        planned_step(pool, rows, ids.shape[1])
        for limit in (64, 4):  # 35 rows: through the extended GEMM, then the usual way
            att.shrink_in_base_rows = limit
            calls.clear()
            with torch.inference_mode():
                got[limit] = base(input_ids=ids).logits
            want_calls = sorted((("expand_v" if limit == 64 else "whole"), t) for t in spec.target_names for _ in range(2))
            assert sorted(calls) == want_calls, limit
    torch.testing.assert_close(got[64], got[4], rtol=1e-4, atol=1e-5)
    for i, (_rid, adapter) in enumerate(rows):
        torch.testing.assert_close(got[64][i], ref.logits(ids[i:i + 1], adapter)[0], rtol=1e-4, atol=1e-5)


def test_a_small_step_reads_only_its_slots_a_gathered_before_the_weight(family, monkeypatch):
    """A step of at most ``compact_rows`` rows: the GEMM reads only the A of the step's slots, which
    the attachment gathers once a forward before each extended weight; logits equal PEFT's per row
    and the every-slot GEMM's. With the gather left out (and the gathered rows zeroed) they do not."""
    kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=4)
    ref = PeftReference(base, dirs)
    rows = [("a", "ad2"), ("b", None), ("c", "ad0")]
    ids = torch.randint(0, VOCAB, (len(rows), 1))
    seen, real_v = [], LoraLayerDelta.expand_v

    def expand_v(self, ys, v, **kw):
        seen.append((kw.get("compact"), v.shape[1]))
        return real_v(self, ys, v, **kw)

    monkeypatch.setattr(LoraLayerDelta, "expand_v", expand_v)
    got = {}
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool, \
            attach(base, pool, shrink_in_base=True) as att:
        planned_step(pool, rows, ids.shape[1])
        for compact in (8, 0):
            att.compact_rows = compact
            seen.clear()
            with torch.inference_mode():
                got[compact] = base(input_ids=ids).logits
            if compact:  # 3 rows, 2 slots with positions: v holds 3 blocks of n*R columns
                assert seen and all(kb == 3 for kb, _ in seen), seen
            else:
                assert seen and all(kb == 0 for kb, _ in seen), seen
        torch.testing.assert_close(got[8], got[0], rtol=1e-4, atol=1e-5)
        for i, (_rid, adapter) in enumerate(rows):
            torch.testing.assert_close(got[8][i], ref.logits(ids[i:i + 1], adapter)[0], rtol=1e-4, atol=1e-5)
        att.compact_rows = 8
        for bs in att._base.values():
            bs.compact[...] = 0
        monkeypatch.setattr(att, "_gathers", {})
        with torch.inference_mode():
            stale = base(input_ids=ids).logits
        assert not torch.allclose(stale[0], got[8][0], rtol=1e-4, atol=1e-5), "the gather changed nothing"
        torch.testing.assert_close(stale[1], got[8][1], rtol=1e-4, atol=1e-5)  # the base row


def test_a_layer_called_alone_gathers_for_each_new_plan(family):
    """A decoder layer's MLP called alone (no pre-hook on the way) in two steps of the same seq (a
    caller's number, which may repeat) with different adapters: the second gathers its own slot's
    A, so the compact GEMM agrees with the every-slot one (the key is the plan object, not its seq)."""
    kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=4)
    mlp = base.model.layers[0].mlp
    x = torch.randn(1, 1, base.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool, \
            attach(base, pool, shrink_in_base=True) as att, torch.inference_mode():
        planned_step(pool, [("a", "ad0")], 1, seq=0)
        first = mlp(x).clone()
        planned_step(pool, [("b", "ad2")], 1, seq=0)
        got = mlp(x).clone()
        att.compact_rows = 0
        want = mlp(x).clone()
    assert not torch.allclose(first, want, rtol=1e-4, atol=1e-5), "the two adapters give one output"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_shrink_in_base_detach_is_bit_identical_and_gives_the_pool_its_a_back(family):
    _kind, base, dirs = family
    params, ids, before = _before_attach(base)
    spec = spec_for_adapters(base, dirs, num_slots=4)
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool:
        att = attach(base, pool, shrink_in_base=True)
        q = base.model.layers[0].self_attn
        first = q.q_proj if hasattr(q, "q_proj") else q.qkv_proj
        assert first.weight.untyped_storage().nbytes() > first.weight.numel() * first.weight.element_size()
        with torch.inference_mode():
            idle = base(input_ids=ids).logits.clone()  # no step planned: the linears as they are
        planned_step(pool, [("a", "ad0"), ("b", None), ("c", "ad2")], ids.shape[1])
        with torch.inference_mode():
            during = base(input_ids=ids).logits.clone()
        att.detach()
        assert not any(w.bound for w in pool._slot_weights.targets.values())
        with torch.inference_mode():
            after = base(input_ids=ids).logits.clone()
        # the pool serves the same deltas from its own A again
        with attach(base, pool, shrink_in_base=False), torch.inference_mode():
            again = base(input_ids=ids).logits.clone()
    for t in (idle, after):
        assert np.array_equal(t.numpy().view(np.int32), before.numpy().view(np.int32))
    assert not torch.equal(during[0], before[0])
    torch.testing.assert_close(again, during, rtol=1e-4, atol=1e-5)
    for k, v in base.state_dict().items():
        assert np.array_equal(v.numpy().view(np.uint8), params[k].numpy().view(np.uint8)), k
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), f"{k} still a view of a larger array"
    assert all("forward" not in m.__dict__ for m in base.modules())


def test_shrink_in_base_fits_says_why_not():
    from lora_cupy.integrations.attach import shrink_in_base_fits

    spec = LoraSpec.from_model(tiny_llama(2, 0), ["q_proj", "o_proj"], num_slots=3, max_rank=16, dtype="bfloat16")
    assert shrink_in_base_fits(spec, True) is None and shrink_in_base_fits(spec, False) is None
    odd = LoraSpec.from_model(tiny_llama(2, 0), ["o_proj"], num_slots=3, max_rank=12, dtype="bfloat16")
    assert "rank widths" in shrink_in_base_fits(odd, True)
    fp32 = LoraSpec.from_model(tiny_llama(2, 0), ["o_proj"], num_slots=3, max_rank=16, dtype="float32")
    assert "serves" in shrink_in_base_fits(fp32, True) and shrink_in_base_fits(fp32, False) is None
    import dataclasses

    tp = dataclasses.replace(spec, tp_size=2)
    assert "tensor parallelism" in shrink_in_base_fits(tp, False)


def test_shrink_in_base_modes_on_the_cpu(family):
    """On the CPU the default is never; True is "always"; "graphs" (no captures here) and an
    unknown mode are refused before anything is hooked."""
    _kind, base, dirs = family
    spec = spec_for_adapters(base, dirs, num_slots=4)
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool:
        with attach(base, pool) as att:
            assert att.shrink_in_base_mode == "never" and not att.shrink_in_base
        with attach(base, pool, shrink_in_base=True) as att:
            assert att.shrink_in_base_mode == "always" and att.shrink_in_base
        for mode, match in (("graphs", "graph captures; the pool is on cpu"), ("sometimes", "one of True")):
            with pytest.raises(ValueError, match=match):
                attach(base, pool, shrink_in_base=mode)
        assert not any(w.bound for w in pool._slot_weights.targets.values())
    assert all(not m._forward_hooks and "forward" not in m.__dict__ for m in base.modules())


def test_shrink_in_base_guards(family):
    """A second model's attachment to the same pool cannot take the layers' A (refused, the first
    keeps serving); a bias written in place while attached reaches the extended GEMM and stays
    after detach; a weight swapped under the attachment is refused at the next step; a forward
    set on a linear's instance is kept and restored; detaching after the pool closed returns."""
    kind, shared, dirs = family
    base = copy.deepcopy(shared)  # its parameters are written below
    spec = spec_for_adapters(base, dirs, num_slots=4)
    ref = PeftReference(base, dirs)
    rows = [("a", "ad0"), ("b", None), ("c", "ad1")]
    ids = torch.randint(0, VOCAB, (len(rows), 5))
    other = copy.deepcopy(base)
    q = base.model.layers[0].self_attn
    first = q.q_proj if hasattr(q, "q_proj") else q.qkv_proj
    calls = []
    own = first.forward
    first.forward = lambda x: (calls.append(1), own(x))[1]  # an instance forward set before attach
    pool = LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()})
    try:
        att = attach(base, pool, shrink_in_base=True)
        with pytest.raises(ValueError, match="another array already"):
            attach(other, pool, shrink_in_base=True)
        assert all(not m._forward_hooks and "forward" not in m.__dict__ for m in other.modules())
        planned_step(pool, rows, ids.shape[1])
        with torch.inference_mode():
            got = base(input_ids=ids).logits
        for i, (_rid, adapter) in enumerate(rows):
            torch.testing.assert_close(got[i], ref.logits(ids[i:i + 1], adapter)[0], rtol=1e-4, atol=1e-5)
        assert not calls  # the extended GEMM served the linear
        if first.bias is not None:  # Qwen2's q_proj: an in-place write reaches the GEMM
            with torch.no_grad():
                first.bias.add_(0.5)
            with torch.inference_mode():
                moved = base(input_ids=ids).logits
            att.shrink_in_base_rows = 0  # the usual path, same weights
            with torch.inference_mode():
                usual = base(input_ids=ids).logits
            att.shrink_in_base_rows = 64
            torch.testing.assert_close(moved, usual, rtol=1e-4, atol=1e-5)
            assert not torch.allclose(moved, got)
            bias_after = first.bias.detach().clone()
        keep = first.weight.data
        first.weight.data = keep.clone()  # as a move or a cast while attached would
        with pytest.raises(RuntimeError, match="detach first"), torch.inference_mode():
            base(input_ids=ids)
        first.weight.data = keep
        pool.close()
        att.detach()  # the pool is closed: still returns, every weight in storage of its own
    finally:
        pool.close()
    assert first.__dict__["forward"] is not None
    with torch.inference_mode():
        base(input_ids=ids)
    assert calls, "the instance forward was not restored"
    if first.bias is not None:
        assert torch.equal(first.bias.detach(), bias_after)
    for p in base.parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
