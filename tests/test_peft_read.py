"""Reading PEFT adapters: pattern resolution, scaling, fan_in_fan_out, dtypes, padding, digest."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from lora_cupy.dtypes import numpy_dtype
from lora_cupy.peft import digest_of, parse_config, pattern_key, read_config, read_peft_adapter
from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget
from tests.peft_helpers import (
    make_peft_adapter, module_path, peft_delta, random_tensors, tiny_llama, write_adapter)


def small_spec(**kw) -> LoraSpec:
    """q_proj and v_proj (2 layers) and a fused gate_up_proj, small features."""
    targets = (LoraTarget("q_proj", 24, 24, 2, sharding=kw.pop("q_sharding", None)),
               LoraTarget("v_proj", 24, 8, 2),
               LoraTarget("gate_up_proj", 24, 40, 2, (LoraSlice("gate_proj", 20), LoraSlice("up_proj", 20)),
                          sharding=kw.pop("gu_sharding", None)))
    return LoraSpec(targets, **{"num_slots": 3, "max_rank": 8, "dtype": "float32", **kw})


def llama_paths(num_layers=3):
    return [n for n, _ in tiny_llama(num_layers).named_modules() if n]


# -- config: patterns, target selection, scaling ------------------------------------------------
PATTERN_KEYS = [
    ["q_proj"], ["v_proj", "q_proj"], ["layers.1.self_attn.q_proj", "q_proj"], ["model.layers.0.mlp.down_proj"],
    [r"layers\.[12]\..*_proj", "proj"], ["self_attn.(q|k)_proj", "mlp"], ["_proj"], ["layers.2.mlp.up_proj"],
]


@pytest.mark.parametrize("keys", PATTERN_KEYS, ids=str)
def test_pattern_key_resolves_as_peft(keys):
    from peft.utils.other import get_pattern_key

    for path in llama_paths():
        want = get_pattern_key(keys, path)  # PEFT answers the path itself when no key matches
        assert pattern_key(dict.fromkeys(keys, 1), path) == (want if want in keys else None), path


SELECT_CONFIGS = [
    {"target_modules": ["q_proj", "down_proj"]},
    {"target_modules": r".*\.layers\.[02]\.self_attn\.(q|v)_proj"},
    {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [0, 2]},
    {"target_modules": ["k_proj"], "layers_to_transform": 1},
    {"target_modules": ["q_proj", "gate_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
    {"target_modules": ["o_proj"], "layers_to_transform": [1, 2], "layers_pattern": ["blocks", "layers"]},
    {"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["model.layers.1.self_attn.v_proj"]},
    {"target_modules": ["q_proj", "v_proj"], "exclude_modules": r".*layers\.0\..*"},
    {"target_modules": ["model.layers.2.mlp.down_proj"]},
]


@pytest.mark.parametrize("kw", SELECT_CONFIGS, ids=lambda kw: json.dumps(kw))
def test_target_selection_matches_peft(kw):
    import peft
    from peft.tuners.tuners_utils import check_target_module_exists

    lc = peft.LoraConfig(r=4, **kw)
    ours = parse_config(json.loads(json.dumps(lc.to_dict(), default=list)))
    chosen = 0
    for path in llama_paths():
        want = bool(check_target_module_exists(lc, path))
        assert ours.selects(path) == want, path
        chosen += want
    assert chosen > 0


def test_rank_alpha_and_scaling_match_peft_modules(tmp_path):
    """Each PEFT module's r and scaling, with rank/alpha patterns, with and without rsLoRA."""
    from peft.tuners.lora import LoraLayer

    rng = np.random.default_rng()
    for rslora in (False, True):
        r, alpha = int(rng.integers(2, 9)), float(rng.integers(1, 33))
        rp = {"q_proj": int(rng.integers(1, 9)), "model.layers.1.mlp.down_proj": int(rng.integers(1, 9))}
        ap = {"layers.0.self_attn.v_proj": float(rng.integers(1, 20)), "up_proj": 2.5}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path, pm = make_peft_adapter(tmp_path / f"rs{rslora}", r=r, lora_alpha=alpha, rank_pattern=rp,
                                         alpha_pattern=ap, use_rslora=rslora)
        cfg = read_config(path / "adapter_config.json")
        seen_patterns = set()
        for name, mod in pm.named_modules():
            if not isinstance(mod, LoraLayer):
                continue
            p = name.removeprefix("base_model.model.")
            assert cfg.rank(p) == mod.r["default"], p
            assert cfg.scaling(p) == pytest.approx(mod.scaling["default"], rel=1e-12), p
            want_r, want_alpha = rp.get(pattern_key(rp, p), r), ap.get(pattern_key(ap, p), alpha)
            assert cfg.scaling(p) == pytest.approx(want_alpha / (math.sqrt(want_r) if rslora else want_r))
            seen_patterns |= {pattern_key(rp, p), pattern_key(ap, p)}
        assert seen_patterns >= {*rp, *ap}  # every pattern key was exercised
        spec = LoraSpec.from_model(tiny_llama(), num_slots=2, max_rank=8, dtype="float32")
        aw = read_peft_adapter(path, spec)
        for t in spec.targets:
            for layer in range(t.num_layers):
                p = module_path(t.name, layer)
                assert aw.targets[t.name].ranks[layer, 0] == cfg.rank(p)
                assert aw.targets[t.name].scaling[layer, 0] == np.float32(cfg.scaling(p))


class _ConvNet:
    """A two-layer stack of GPT-2 style ``Conv1D`` linears (weights stored ``[in, out]``)."""

    @staticmethod
    def build(nx, nf, layers=2):
        import torch
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        net = torch.nn.Module()
        net.model = torch.nn.Module()
        net.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            blk = torch.nn.Module()
            blk.mlp = torch.nn.Module()
            blk.mlp.c_fc = Conv1D(nf, nx)
            net.model.layers.append(blk)
        return net


def test_fan_in_fan_out_conv1d_matches_peft(tmp_path):
    """fan_in_fan_out transposes only the base weight: the LoRA A/B files are [r, in] / [out, r]."""
    nx, nf = 48, 80
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path, pm = make_peft_adapter(tmp_path / "conv", r=5, lora_alpha=10, model=_ConvNet.build(nx, nf),
                                     target_modules=["c_fc"], fan_in_fan_out=True)
    assert json.loads((path / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    spec = LoraSpec((LoraTarget("c_fc", nx, nf, 2),), num_slots=2, max_rank=8, dtype="float32")
    tw = read_peft_adapter(path, spec).targets["c_fc"]
    x = np.random.default_rng().standard_normal((7, nx)).astype(np.float32)
    for layer in range(2):
        got = tw.scaling[layer, 0] * (x @ tw.a[layer, 0].T) @ tw.b[layer].T
        want = peft_delta(pm, f"model.layers.{layer}.mlp.c_fc", x)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


# -- weights: dtypes, padding, keys, sharding ------------------------------------------------------
@pytest.mark.parametrize("file_dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("spec_dtype", ["float32", "float16", "bfloat16"])
def test_file_dtypes_convert_to_spec_dtype(tmp_path, file_dtype, spec_dtype):
    spec = small_spec(dtype=spec_dtype)
    f64 = random_tensors(spec, np.random.default_rng(), r=3, dtype="float32")
    fdt = np.float64 if file_dtype == "float64" else numpy_dtype(file_dtype)
    tensors = {k: v.astype(fdt) for k, v in f64.items()}
    aw = read_peft_adapter(write_adapter(tmp_path / "a", tensors, r=3, lora_alpha=6), spec)
    sdt = numpy_dtype(spec_dtype)
    q = aw.targets["q_proj"]
    assert q.a.dtype == sdt and q.b.dtype == sdt
    key = f"base_model.model.{module_path('q_proj', 1)}"
    np.testing.assert_array_equal(q.a[1, 0].astype(np.float64),
                                  tensors[f"{key}.lora_A.weight"].astype(sdt).astype(np.float64))
    np.testing.assert_array_equal(q.b[1].astype(np.float64),
                                  tensors[f"{key}.lora_B.weight"].astype(sdt).astype(np.float64))


def test_rank_padding_and_untouched_layers(tmp_path):
    spec = small_spec()
    rng = np.random.default_rng()
    tensors = random_tensors(spec, rng, r=5, modules={"q_proj", "gate_proj"}, layers=[1])
    tensors.update(random_tensors(spec, rng, r=2, modules={"up_proj"}, layers=[0]))
    pattern = {"model.layers.0.mlp.up_proj": 2}
    aw = read_peft_adapter(write_adapter(tmp_path / "a", tensors, r=5, lora_alpha=4, rank_pattern=pattern), spec)
    assert set(aw.targets) == {"q_proj", "gate_up_proj"}  # v_proj untouched: no entry
    gu = aw.targets["gate_up_proj"]
    assert gu.rank == 5 and gu.a.shape == (2, 2, 5, 24) and gu.b.shape == (2, 40, 5)
    np.testing.assert_array_equal(gu.ranks, [[0, 2], [5, 0]])
    np.testing.assert_array_equal(gu.scaling, np.float32([[0, 4 / 2], [4 / 5, 0]]))
    assert not gu.a[0, 1, 2:].any() and not gu.b[0, 20:, 2:].any()  # beyond rank 2: zero
    assert not gu.a[0, 0].any() and not gu.b[0, :20].any()  # gate_proj at layer 0: nothing
    up = tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    np.testing.assert_array_equal(gu.b[0, 20:, :2], up)
    assert aw.max_rank == 5 and aw.name == "a" and aw.path == str(tmp_path / "a")
    assert read_peft_adapter(tmp_path / "a", spec, name="other").name == "other"


def test_adapter_name_in_keys_reads_the_same(tmp_path):
    spec = small_spec()
    tensors = random_tensors(spec, np.random.default_rng(), r=4)
    named = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
             for k, v in tensors.items()}
    plain = read_peft_adapter(write_adapter(tmp_path / "plain", tensors, r=4), spec)
    other = read_peft_adapter(write_adapter(tmp_path / "named", named, r=4), spec)
    assert plain.digest == other.digest
    for t in plain.targets:
        np.testing.assert_array_equal(plain.targets[t].a, other.targets[t].a)
        np.testing.assert_array_equal(plain.targets[t].b, other.targets[t].b)


def test_digest_depends_on_weights_not_layout(tmp_path):
    from safetensors.numpy import save_file

    spec = small_spec()
    tensors = random_tensors(spec, np.random.default_rng(), r=4)
    d1 = write_adapter(tmp_path / "one", tensors, r=4)
    d2 = write_adapter(tmp_path / "two", dict(reversed(tensors.items())), r=4, lora_alpha=3)
    save_file(dict(reversed(tensors.items())), str(d2 / "adapter_model.safetensors"), metadata={"format": "pt"})
    assert (d1 / "adapter_model.safetensors").read_bytes() != (d2 / "adapter_model.safetensors").read_bytes()
    read = read_peft_adapter(d1, spec)
    assert read.digest == digest_of(d1) == digest_of(d1 / "adapter_model.safetensors") == digest_of(d2)
    changed = dict(tensors)
    key = next(iter(changed))
    changed[key] = changed[key].copy()
    changed[key].flat[0] = np.nextafter(changed[key].flat[0], np.float32(np.inf))
    assert digest_of(write_adapter(tmp_path / "three", changed, r=4)) != read.digest
    as16 = {k: v.astype(np.float16) for k, v in tensors.items()}
    assert digest_of(write_adapter(tmp_path / "four", as16, r=4)) != read.digest


def test_digest_hashed_beside_the_assembly_reads_the_same(tmp_path, monkeypatch):
    """An adapter large enough is hashed on a thread beside its assembly: the same digest and
    weights as one after the other; a refusal of either still reaches the caller, the digest's
    first where both refuse (as when it ran before the assembly)."""
    import lora_cupy.peft as peft_mod
    from lora_cupy.errors import AdapterFileError, NonFiniteWeightsError

    spec = small_spec(dtype="bfloat16")
    tensors = random_tensors(spec, np.random.default_rng(), r=4)
    d = write_adapter(tmp_path / "a", tensors, r=4)
    threads = []
    real_pool = peft_mod.ThreadPoolExecutor
    monkeypatch.setattr(peft_mod, "ThreadPoolExecutor", lambda *a, **k: threads.append(1) or real_pool(*a, **k))
    monkeypatch.setattr(peft_mod, "_DIGEST_BESIDE_BYTES", 1 << 40)
    serial = read_peft_adapter(d, spec)
    assert threads == []
    monkeypatch.setattr(peft_mod, "_DIGEST_BESIDE_BYTES", 0)
    beside = read_peft_adapter(d, spec)
    assert threads == [1]
    assert beside.digest == serial.digest == digest_of(d)
    for t in serial.targets:
        for field in ("a", "b", "ranks", "scaling"):
            np.testing.assert_array_equal(getattr(beside.targets[t], field), getattr(serial.targets[t], field))

    bad = dict(tensors)
    key = next(k for k in bad if "lora_B" in k)
    bad[key] = bad[key].copy()
    bad[key][1, 1] = np.nan  # refused by the assembly
    d_bad = write_adapter(tmp_path / "bad", bad, r=4)
    with pytest.raises(NonFiniteWeightsError):
        read_peft_adapter(d_bad, spec)

    def refusing_digest(header, arrays, adapter, path):
        raise AdapterFileError("planted digest refusal", adapter=adapter, path=path)

    monkeypatch.setattr(peft_mod, "_canonical_digest", refusing_digest)
    for where in (d, d_bad):  # the assembly passing, then refusing too
        with pytest.raises(AdapterFileError, match="planted digest refusal"):
            read_peft_adapter(where, spec)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards(tmp_path, tp_size):
    """Column: each slice's B rows split per rank; row: A's in-columns split; A/B else whole."""
    spec1 = small_spec()
    tensors = random_tensors(spec1, np.random.default_rng(), r=3)
    d = write_adapter(tmp_path / "a", tensors, r=3)
    full = read_peft_adapter(d, spec1)
    for k in range(tp_size):
        sp = small_spec(tp_rank=k, tp_size=tp_size, q_sharding="row", gu_sharding="column")
        part = read_peft_adapter(d, sp)
        assert part.digest == full.digest
        n = 24 // tp_size
        np.testing.assert_array_equal(part.targets["q_proj"].a, full.targets["q_proj"].a[..., k * n:(k + 1) * n])
        np.testing.assert_array_equal(part.targets["q_proj"].b, full.targets["q_proj"].b)
        w = 20 // tp_size
        gu, fgu = part.targets["gate_up_proj"], full.targets["gate_up_proj"]
        np.testing.assert_array_equal(gu.a, fgu.a)
        np.testing.assert_array_equal(gu.b[:, :w], fgu.b[:, k * w:(k + 1) * w])
        np.testing.assert_array_equal(gu.b[:, w:], fgu.b[:, 20 + k * w:20 + (k + 1) * w])
        assert gu.b.shape == (2, 2 * w, 3)


def test_whole_fused_module_splits_b_by_slice(tmp_path):
    """A module naming the fused target (gate_up_proj): A copied per slice, B rows split."""
    spec = small_spec()
    rng = np.random.default_rng()
    key = "base_model.model.model.layers.1.mlp.gate_up_proj"
    a, b = rng.standard_normal((4, 24)).astype(np.float32), rng.standard_normal((40, 4)).astype(np.float32)
    aw = read_peft_adapter(write_adapter(tmp_path / "a", {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b},
                                         r=4, lora_alpha=2, target_modules=["gate_up_proj"]), spec)
    gu = aw.targets["gate_up_proj"]
    np.testing.assert_array_equal(gu.ranks, [[0, 0], [4, 4]])
    np.testing.assert_array_equal(gu.a[1, 0], a)
    np.testing.assert_array_equal(gu.a[1, 1], a)
    np.testing.assert_array_equal(gu.b[1], b)
    assert not gu.a[0].any() and not gu.b[0].any()


def test_bf16_decoded_where_safetensors_numpy_cannot(tmp_path, monkeypatch):
    """Older safetensors give NumPy no bf16: the reader decodes those bytes itself, the same."""
    import safetensors

    spec = small_spec(dtype="bfloat16")
    tensors = {k: v.astype(numpy_dtype("bfloat16"))
               for k, v in random_tensors(spec, np.random.default_rng(), r=3).items()}
    d = write_adapter(tmp_path / "a", tensors, r=3)
    direct = read_peft_adapter(d, spec)
    real = safetensors.safe_open
    refused = []

    class NoBf16:
        def __init__(self, *args, **kw):
            self._f = real(*args, **kw)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def get_tensor(self, name):
            if self._f.get_slice(name).get_dtype() == "BF16":
                refused.append(name)
                raise TypeError("data type 'bfloat16' not understood")
            return self._f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", NoBf16)
    decoded = read_peft_adapter(d, spec)
    assert sorted(refused) == sorted(tensors)
    assert decoded.digest == direct.digest == digest_of(d)
    for t in direct.targets:
        np.testing.assert_array_equal(decoded.targets[t].a, direct.targets[t].a)
        np.testing.assert_array_equal(decoded.targets[t].b, direct.targets[t].b)
