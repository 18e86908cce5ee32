"""Every way an adapter directory can be wrong is a typed LoraError naming adapter, file, reason.

Bad files are written on purpose, one refusal each; a hypothesis test then corrupts a good
adapter at random (truncation, bytes in the header, lying header fields, wrong shapes, random
config JSON) and checks that reading only ever succeeds or raises a LoraError.
"""

from __future__ import annotations

import json
import pickle
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_cupy.errors import (
    AdapterFileError, AdapterNotFoundError, LoraError, NonFiniteWeightsError, PickleRefusedError,
    RankTooLargeError, ShapeMismatchError, TargetMismatchError, UnsupportedAdapterError)
from lora_cupy.peft import digest_of, read_peft_adapter
from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget
from tests.peft_helpers import DEFAULT_CONFIG, random_tensors, write_adapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q = "base_model.model.model.layers.1.self_attn.q_proj"


def spec(**kw) -> LoraSpec:
    targets = (LoraTarget("q_proj", 16, 16, 2),
               LoraTarget("qkv_proj", 16, 32, 2, (LoraSlice("k_proj", 16), LoraSlice("v_proj", 16))),
               LoraTarget("down_proj", 24, 16, 2))
    return LoraSpec(targets, **{"num_slots": 3, "max_rank": 4, "dtype": "float32", **kw})


def good(tmp_path, name="bad", **config) -> tuple[Path, dict]:
    """A valid adapter directory (rank 2) and its tensors."""
    tensors = random_tensors(spec(), np.random.default_rng(), r=2)
    return write_adapter(tmp_path / name, tensors, **{"r": 2, **config}), tensors


def refused(path, cls, file, reason, name=None, sp=None):
    """Read ``path``; assert a ``cls`` whose message names the adapter, ``file`` and ``reason``."""
    with pytest.raises(cls) as info:
        read_peft_adapter(path, sp or spec(), name=name)
    msg = str(info.value)
    adapter = name or Path(path).name
    assert f"adapter {adapter!r}" in msg, msg
    assert file in msg, msg
    assert reason.lower() in msg.lower(), msg
    return info.value


def raw_safetensors(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


# -- where the files are ---------------------------------------------------------------------
def test_missing_directory(tmp_path):
    refused(tmp_path / "nowhere", AdapterNotFoundError, "nowhere", "no such adapter directory")


def test_directory_without_adapter_files(tmp_path):
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", AdapterNotFoundError, "empty", "neither")


def test_path_that_is_not_a_directory(tmp_path):
    (tmp_path / "adapter.safetensors").write_bytes(b"0" * 16)
    refused(tmp_path / "adapter.safetensors", AdapterNotFoundError, "adapter.safetensors", "not a directory")


def test_missing_config(tmp_path):
    d, _ = good(tmp_path)
    (d / CONFIG).unlink()
    refused(d, AdapterFileError, CONFIG, "no adapter_config.json")


def test_missing_weights(tmp_path):
    d, _ = good(tmp_path)
    (d / WEIGHTS).unlink()
    refused(d, AdapterFileError, WEIGHTS, "no adapter_model.safetensors")


class _Touch:
    """Unpickling this creates ``marker``: proof of whether a pickle was ever loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("fname", ["adapter_model.bin", "adapter_model.pt", "weights.pth"])
def test_pickle_weights_refused_unopened(tmp_path, fname, monkeypatch):
    d, _ = good(tmp_path)
    (d / WEIGHTS).unlink()
    marker = tmp_path / "unpickled"
    (d / fname).write_bytes(pickle.dumps(_Touch(marker)))
    pickle.loads(pickle.dumps(_Touch(tmp_path / "probe")))
    assert (tmp_path / "probe").exists()  # the payload does act when unpickled
    import torch

    def forbidden(*a, **k):
        raise AssertionError("a pickle file was loaded")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    refused(d, PickleRefusedError, fname, "pickle")
    refused(d / fname, PickleRefusedError, fname, "pickle", name="direct")
    with pytest.raises(PickleRefusedError):
        digest_of(d / fname)
    assert not marker.exists()


# -- the config -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, reason", [
    ("{\"peft_type\": \"LORA\", \"r\": 4", "not valid JSON"),
    ("\xff\xfe not utf-8", "not valid JSON"),
    ("[1, 2, 3]", "expected a JSON object"),
    ("{\"peft_type\": \"LORA\", \"r\": \"8\"}", "r must be a positive integer"),
    ("{\"peft_type\": \"LORA\", \"r\": 0}", "r must be a positive integer"),
    ("{\"peft_type\": \"LORA\", \"lora_alpha\": NaN}", "lora_alpha must be a finite"),
    ("{\"peft_type\": \"LORA\", \"target_modules\": [1]}", "target_modules must be"),
    ("{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q(\": 2}}", "not a valid regular expression"),
    ("{\"peft_type\": \"LORA\", \"layers_to_transform\": [\"1\"]}", "layers_to_transform must be"),
    ("{\"peft_type\": \"LORA\", \"use_rslora\": \"yes\"}", "use_rslora must be"),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
])
def test_corrupt_config(tmp_path, text, reason):
    d, _ = good(tmp_path)
    (d / CONFIG).write_bytes(text.encode("latin-1"))
    refused(d, AdapterFileError, CONFIG, reason)


@pytest.mark.parametrize("field, value, reason", [
    ("peft_type", "IA3", "only LORA"),
    ("peft_type", None, "only LORA"),
    ("use_dora", True, "DoRA"),
    ("bias", "all", "bias='all'"),
    ("bias", "lora_only", "bias='lora_only'"),
    ("lora_bias", True, "lora_bias"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("layer_replication", [[0, 2], [1, 2]], "layer_replication"),
    ("alora_invocation_tokens", [5, 7], "alora_invocation_tokens"),
    ("target_parameters", ["mlp.experts.down_proj"], "target_parameters"),
])
def test_unsupported_config_features(tmp_path, field, value, reason):
    d, _ = good(tmp_path, **{field: value})
    refused(d, UnsupportedAdapterError, CONFIG, reason)


def test_module_the_config_does_not_target(tmp_path):
    d, _ = good(tmp_path, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], layers_to_transform=[1])
    refused(d, AdapterFileError, WEIGHTS, "does not target")


# -- the safetensors file -------------------------------------------------------------------
def test_truncated_weights(tmp_path):
    d, _ = good(tmp_path)
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[:-17])
    refused(d, AdapterFileError, WEIGHTS, "corrupt safetensors")
    (d / WEIGHTS).write_bytes(data[:5])
    refused(d, AdapterFileError, WEIGHTS, "too short")


@pytest.mark.parametrize("mutate, reason", [
    (lambda h, n: struct.pack("<Q", 2 ** 63) + h[8:], "header claims"),
    (lambda h, n: h[:8] + b"!" + h[9:], "not valid JSON"),
    (lambda h, n: struct.pack("<Q", 2) + b"[]" + h[8 + n:], "not a JSON object"),
])
def test_bad_header_bytes(tmp_path, mutate, reason):
    d, _ = good(tmp_path)
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(mutate(data, struct.unpack("<Q", data[:8])[0]))
    refused(d, AdapterFileError, WEIGHTS, reason)


@pytest.mark.parametrize("entry, reason", [
    ({"dtype": "F32", "shape": [2 ** 31, 2 ** 31], "data_offsets": [0, 2 ** 64]}, "data_offsets"),
    ({"dtype": "F32", "shape": [2 ** 20, 2 ** 20], "data_offsets": [0, 128]}, "does not fill"),
    ({"dtype": "F32", "shape": [2, 16], "data_offsets": [64, 0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [-2, 16], "data_offsets": [0, 128]}, "shape"),
    ({"dtype": "F32", "shape": [2, 16]}, "exactly dtype, shape and data_offsets"),
    ({"dtype": "F32", "shape": [2, 8], "data_offsets": [0, 64]}, "tensors end at byte 64 of 128"),
])
def test_lying_header_refused_without_allocating(tmp_path, entry, reason):
    d, _ = good(tmp_path)
    blob = raw_safetensors({f"{Q}.lora_A.weight": entry}, np.ones(32, np.float32).tobytes())
    (d / WEIGHTS).write_bytes(blob)
    t0 = time.perf_counter()
    refused(d, AdapterFileError, WEIGHTS, reason)
    assert time.perf_counter() - t0 < 1.0


def test_overlapping_tensors(tmp_path):
    d, _ = good(tmp_path)
    e = {"dtype": "F32", "shape": [2, 16], "data_offsets": [0, 128]}
    (d / WEIGHTS).write_bytes(raw_safetensors({f"{Q}.lora_A.weight": e, f"{Q}.lora_B.weight": e},
                                              np.ones(32, np.float32).tobytes()))
    refused(d, AdapterFileError, WEIGHTS, "overlaps")


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint16, np.bool_])
def test_non_float_weights(tmp_path, dtype):
    d, tensors = good(tmp_path)
    tensors[f"{Q}.lora_A.weight"] = (tensors[f"{Q}.lora_A.weight"] * 10).astype(dtype)
    write_adapter(d, tensors, r=2)
    refused(d, AdapterFileError, WEIGHTS, "not a float type")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights(tmp_path, bad):
    d, tensors = good(tmp_path)
    tensors[f"{Q}.lora_B.weight"][3, 1] = bad
    write_adapter(d, tensors, r=2)
    refused(d, NonFiniteWeightsError, WEIGHTS, "NaN or Inf")


@pytest.mark.parametrize("file_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16"])
def test_non_finite_16_bit_weights(tmp_path, file_dtype, bad, pool_dtype):
    """A 16-bit file's NaN / Inf (read off its exponent bits) is refused whatever the pool's
    dtype, one bad element among finite ones; the same file with it finite reads."""
    from lora_cupy.dtypes import numpy_dtype

    d, tensors = good(tmp_path)
    tensors = {k: v.astype(numpy_dtype(file_dtype)) for k, v in tensors.items()}
    write_adapter(d, tensors, r=2)
    read_peft_adapter(d, spec(dtype=pool_dtype))
    tensors[f"{Q}.lora_B.weight"][5, 1] = bad
    write_adapter(d, tensors, r=2)
    refused(d, NonFiniteWeightsError, WEIGHTS, "NaN or Inf", sp=spec(dtype=pool_dtype))


def test_weights_overflowing_bfloat16(tmp_path):
    """float32's largest values round up to Inf in bfloat16 (8 bits of mantissa)."""
    d, tensors = good(tmp_path)
    tensors[f"{Q}.lora_B.weight"][2, 0] = np.finfo(np.float32).max
    write_adapter(d, tensors, r=2)
    read_peft_adapter(d, spec())
    refused(d, NonFiniteWeightsError, WEIGHTS, "overflows bfloat16", sp=spec(dtype="bfloat16"))


def test_weights_overflowing_the_pool_dtype(tmp_path):
    d, tensors = good(tmp_path)
    tensors[f"{Q}.lora_A.weight"][0, 0] = 1e6  # finite in float32, inf in float16
    write_adapter(d, tensors, r=2)
    read_peft_adapter(d, spec())
    refused(d, NonFiniteWeightsError, WEIGHTS, "overflows float16", sp=spec(dtype="float16"))


def test_empty_adapter(tmp_path):
    d = write_adapter(tmp_path / "bad", {}, r=2)
    refused(d, AdapterFileError, WEIGHTS, "holds no weights")


# -- what the weights say against the spec --------------------------------------------------------
def test_rank_above_max_rank(tmp_path):
    d = write_adapter(tmp_path / "bad", random_tensors(spec(), np.random.default_rng(), r=6), r=6)
    refused(d, RankTooLargeError, WEIGHTS, "rank 6, above the pool's max_rank 4")


def test_module_without_target(tmp_path):
    d, tensors = good(tmp_path)
    rng = np.random.default_rng()
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = rng.standard_normal((2, 16))
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"] = rng.standard_normal((24, 2))
    write_adapter(d, tensors, r=2)
    refused(d, TargetMismatchError, WEIGHTS, "has no target")


@pytest.mark.parametrize("module, reason", [
    ("model.layers.2.self_attn.q_proj", "stack layer 2 is outside target 'q_proj'"),
    ("model.self_attn.q_proj", "no stack layer"),
])
def test_layer_outside_stack(tmp_path, module, reason):
    d, tensors = good(tmp_path)
    rng = np.random.default_rng()
    tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((2, 16))
    tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((16, 2))
    write_adapter(d, tensors, r=2)
    refused(d, TargetMismatchError, WEIGHTS, reason)


@pytest.mark.parametrize("part, shape", [
    ("lora_A", (2, 15)), ("lora_A", (3, 16)), ("lora_B", (17, 2)), ("lora_B", (16, 3)), ("lora_A", (2, 16, 1)),
])
def test_shape_mismatch(tmp_path, part, shape):
    d, tensors = good(tmp_path)
    tensors[f"{Q}.{part}.weight"] = np.random.default_rng().standard_normal(shape).astype(np.float32)
    write_adapter(d, tensors, r=2)
    refused(d, ShapeMismatchError, WEIGHTS, "do not match target 'q_proj'")


def test_rank_disagreeing_with_config(tmp_path):
    d, _ = good(tmp_path, rank_pattern={"layers.1.self_attn.q_proj": 3})
    refused(d, ShapeMismatchError, WEIGHTS, "rank 3 from adapter_config.json")


@pytest.mark.parametrize("drop", ["lora_A", "lora_B"])
def test_a_without_b(tmp_path, drop):
    d, tensors = good(tmp_path)
    del tensors[f"{Q}.{drop}.weight"]
    write_adapter(d, tensors, r=2)
    refused(d, AdapterFileError, WEIGHTS, f"no {drop} weight")


def test_same_module_twice(tmp_path):
    d, tensors = good(tmp_path)
    tensors[f"{Q}.lora_A.default.weight"] = tensors[f"{Q}.lora_A.weight"]
    write_adapter(d, tensors, r=2)
    refused(d, AdapterFileError, WEIGHTS, "are both lora_A")


def test_fused_and_slice_module_at_one_layer(tmp_path):
    d, tensors = good(tmp_path)
    rng = np.random.default_rng()
    key = "base_model.model.model.layers.0.self_attn.qkv_proj"
    tensors[f"{key}.lora_A.weight"] = rng.standard_normal((2, 16))
    tensors[f"{key}.lora_B.weight"] = rng.standard_normal((32, 2))
    write_adapter(d, tensors, r=2)
    refused(d, AdapterFileError, WEIGHTS, "both write slice")


@pytest.mark.parametrize("key, reason", [
    (f"{Q}.lora_magnitude_vector", "DoRA"),
    (f"{Q}.lora_B.bias", "bias"),
    (f"{Q}.base_layer.bias", "bias"),
    ("base_model.model.lm_head.weight", "modules_to_save"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding"),
])
def test_unsupported_tensors(tmp_path, key, reason):
    d, tensors = good(tmp_path)
    tensors[key] = np.random.default_rng().standard_normal(16).astype(np.float32)
    write_adapter(d, tensors, r=2)
    refused(d, UnsupportedAdapterError, WEIGHTS, reason)


# -- random corruption: only LoraError, never anything else -------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=12)
CONFIG_FIELDS = ["peft_type", "r", "lora_alpha", "target_modules", "exclude_modules", "rank_pattern",
                 "alpha_pattern", "use_rslora", "fan_in_fan_out", "layers_to_transform", "layers_pattern",
                 "bias", "use_dora", "modules_to_save"]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def read_only_lora_errors(path) -> None:
    """Read and digest ``path``: a refusal must be a LoraError; a success must be sound."""
    sp = spec()
    try:
        aw = read_peft_adapter(path, sp)
    except LoraError as e:
        assert str(e).startswith(f"adapter {Path(path).name!r}")
    else:
        assert aw.targets and len(aw.digest) == 64
        for name, tw in aw.targets.items():
            t = sp.target(name)
            assert tw.a.shape[:2] == (t.num_layers, t.num_slices) and tw.a.shape[3] == t.in_features
            assert tw.b.shape == (t.num_layers, t.out_features, tw.rank) and tw.rank <= sp.max_rank
            assert np.isfinite(tw.a).all() and np.isfinite(tw.b).all() and np.isfinite(tw.scaling).all()
    try:
        digest_of(path)
    except LoraError:
        pass


def with_adapter(fn):
    """Run ``fn(dir, weights_bytes)`` against a fresh good adapter in a temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        d, _ = good(Path(tmp), name="fuzzed")
        fn(d, (d / WEIGHTS).read_bytes())


@FAST
@given(frac=st.floats(0, 1, exclude_max=True))
def test_fuzz_truncated(frac):
    def run(d, blob):
        (d / WEIGHTS).write_bytes(blob[:int(frac * len(blob))])
        read_only_lora_errors(d)
    with_adapter(run)


@FAST
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_header_bytes(edits):
    def run(d, blob):
        n = struct.unpack("<Q", blob[:8])[0]
        buf = bytearray(blob)
        for pos, byte in edits:
            buf[int(pos * (8 + n))] = byte
        (d / WEIGHTS).write_bytes(bytes(buf))
        read_only_lora_errors(d)
    with_adapter(run)


SIZES = st.integers(-3, 40) | st.integers(2 ** 31, 2 ** 66)


@FAST
@given(which=st.integers(0, 100), field=st.sampled_from(["dtype", "shape", "data_offsets", "entry", "len"]),
       dtype=st.sampled_from(["F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "C64", ""]) | st.text(),
       shape=st.lists(SIZES, max_size=4) | JSON, offsets=st.lists(SIZES, min_size=2, max_size=3) | JSON,
       entry=JSON, extra=st.binary(max_size=64))
def test_fuzz_lying_header(which, field, dtype, shape, offsets, entry, extra):
    def run(d, blob):
        n = struct.unpack("<Q", blob[:8])[0]
        header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
        names = sorted(k for k in header if k != "__metadata__")
        key = names[which % len(names)]
        if field == "entry":
            header[key] = entry
        elif field == "len":
            data = data[:len(data) // 2] + extra
        else:
            header[key][field] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}[field]
        (d / WEIGHTS).write_bytes(raw_safetensors(header, data))
        read_only_lora_errors(d)
    with_adapter(run)


@FAST
@given(which=st.integers(0, 100), shape=st.lists(st.integers(0, 40), max_size=3),
       dtype=st.sampled_from([np.float32, np.float16, np.float64]))
def test_fuzz_wrong_shaped_tensors(which, shape, dtype):
    def run(d, blob):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(d / WEIGHTS))
        key = sorted(tensors)[which % len(tensors)]
        tensors[key] = np.random.default_rng(which).standard_normal(shape).astype(dtype)
        save_file(tensors, str(d / WEIGHTS))
        read_only_lora_errors(d)
    with_adapter(run)


@FAST
@given(whole=st.none() | JSON, fields=st.dictionaries(st.sampled_from(CONFIG_FIELDS), JSON, max_size=4))
def test_fuzz_config_json(whole, fields):
    def run(d, blob):
        config = whole if whole is not None else {**DEFAULT_CONFIG, "r": 2, **fields}
        (d / CONFIG).write_text(json.dumps(config))
        read_only_lora_errors(d)
    with_adapter(run)
