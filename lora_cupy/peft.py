"""Reading PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter directory as PEFT's ``save_pretrained`` writes it is read, checked against a
:class:`~lora_cupy.spec.LoraSpec` and mapped onto its targets as :class:`AdapterWeights`.
Tensor keys look like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``
(``[r, in]``) and ``...lora_B.weight`` (``[out, r]``); a key with an adapter name inserted
(``lora_A.default.weight``) is read the same way. A module's rank and alpha follow the
config's ``rank_pattern`` / ``alpha_pattern`` as PEFT resolves them (a pattern key matches a
module path by ``re.match(rf"(.*\\.)?({key})$", path)``, first key in file order wins), and its
scaling is ``alpha / r`` or, with ``use_rslora``, ``alpha / sqrt(r)``.

``fan_in_fan_out`` transposes only the *base* weight (GPT-2's ``Conv1D``): PEFT's ``lora_A``
and ``lora_B`` are ``nn.Linear`` layers whatever the flag says, so the files hold ``[r, in]``
and ``[out, r]`` either way and nothing is transposed here.

Only safetensors is ever opened; a pickle file is refused by its name alone. The header is
checked against the file's length before any tensor is read, so a lying header cannot make
the reader allocate more than the file holds. Every refusal is a :class:`LoraError` subclass
naming the adapter, the file and the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .adapter import AdapterWeights, TargetWeights
from .dtypes import bfloat16, numpy_dtype
from .errors import (
    AdapterFileError,
    AdapterNotFoundError,
    LoraError,
    NonFiniteWeightsError,
    PickleRefusedError,
    RankTooLargeError,
    ShapeMismatchError,
    TargetMismatchError,
    UnsupportedAdapterError,
)
from .spec import LoraSpec, LoraTarget, layer_index

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
#: Weight files that would need unpickling: refused by name, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
#: Safetensors' own limit on a header's size; a config file larger than this is refused too.
MAX_HEADER_BYTES = 100_000_000
MAX_CONFIG_BYTES = 16 << 20
#: Safetensors dtypes read as weights, and their sizes in bytes.
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_NUMPY_DTYPES = {"F16": np.dtype("<f2"), "BF16": bfloat16, "F32": np.dtype("<f4"), "F64": np.dtype("<f8")}
#: An adapter whose tensors take at least this many bytes is hashed on a thread of its own beside
#: its assembly (hashlib lets go of the GIL). On a 2-core CPU a 21 MB float32 adapter read into
#: bfloat16, with its host tier image, took 30.5 ms that way against 44.6-45.8 ms one after the
#: other (medians of 10, alternating in one process).
_DIGEST_BESIDE_BYTES = 1 << 20
_PREFIX = "base_model.model."
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_KEY_RE = re.compile(
    r"^(?P<module>.+?)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")
#: Config fields that change the forward pass beyond ``B @ A``, and what each is called.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}


# -- the config ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PeftLoraConfig:
    """The fields of ``adapter_config.json`` that decide which modules hold weights and how
    much each adds. ``target_modules`` is a tuple of names, a regex string, or ``None``."""

    r: int = 8
    lora_alpha: float = 8.0
    target_modules: tuple[str, ...] | str | None = None
    exclude_modules: tuple[str, ...] | str | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None

    def rank(self, module: str) -> int:
        """The module's rank: ``rank_pattern``'s first matching key, else ``r``."""
        key = pattern_key(self.rank_pattern, module)
        return self.r if key is None else self.rank_pattern[key]

    def alpha(self, module: str) -> float:
        key = pattern_key(self.alpha_pattern, module)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scaling(self, module: str) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, for one module path."""
        r = self.rank(module)
        return self.alpha(module) / (math.sqrt(r) if self.use_rslora else r)

    def selects(self, module: str) -> bool:
        """Whether PEFT would have put a LoRA layer on ``module`` (a path inside the model)."""
        ex = self.exclude_modules
        if isinstance(ex, str):
            if re.fullmatch(ex, module):
                return False
        elif ex and (module in ex or any(module.endswith(f".{k}") for k in ex)):
            return False
        tm = self.target_modules
        if tm is None or tm == "all-linear":
            return True
        if isinstance(tm, str):
            return re.fullmatch(tm, module) is not None
        if module in tm:
            return True
        if not any(module.endswith(f".{k}") for k in tm):
            return False
        if not self.layers_to_transform:
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            for p in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
                if match is not None:
                    break
        return match is not None and int(match.group("idx")) in self.layers_to_transform


def pattern_key(patterns: Mapping[str, object], module: str) -> str | None:
    """The first key of ``rank_pattern`` / ``alpha_pattern`` matching a module path, as PEFT
    resolves it (``(.*\\.)?(key)$`` from the path's start), or ``None``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def parse_config(data: object, *, adapter: str | None = None, path: object = None) -> PeftLoraConfig:
    """A :class:`PeftLoraConfig` from ``adapter_config.json``'s parsed JSON, or a refusal:
    ``UnsupportedAdapterError`` for features other than plain LoRA, ``AdapterFileError`` for
    fields of the wrong type."""

    def bad(reason: str) -> AdapterFileError:
        return AdapterFileError(f"{CONFIG_NAME}: {reason}", adapter=adapter, path=path)

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    peft_type = data.get("peft_type")
    if peft_type != "LORA":
        raise UnsupportedAdapterError(f"peft_type is {peft_type!r}: only LORA adapters are read",
                                      adapter=adapter, path=path)
    for key, what in _UNSUPPORTED.items():
        if data.get(key):
            raise UnsupportedAdapterError(f"{what} is not supported", adapter=adapter, path=path)
    bias = data.get("bias", "none")
    if bias != "none":
        raise UnsupportedAdapterError(f"bias={bias!r} is not supported: only 'none'", adapter=adapter, path=path)

    def rank(v, what):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(f"{what} must be a positive integer, got {v!r}")
        return v

    def alpha(v, what):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= _FLOAT32_MAX:
            raise bad(f"{what} must be a finite float32 number, got {v!r}")
        return float(v)

    def names(v, what, allow_str=True):
        if v is None or (allow_str and isinstance(v, str)):
            return v
        if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
            raise bad(f"{what} must be {'a string or ' if allow_str else ''}a list of strings, got {v!r}")
        return tuple(v)

    def flag(v, what):
        if not isinstance(v, bool):
            raise bad(f"{what} must be true or false, got {v!r}")
        return v

    def patterns(v, what, value):
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise bad(f"{what} must be an object, got {v!r}")
        return {k: value(x, f"{what}[{k!r}]") for k, x in v.items()}

    layers = data.get("layers_to_transform")
    if layers is not None:
        layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
        if not isinstance(layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
            raise bad(f"layers_to_transform must be a layer index or a list of them, got {layers!r}")
        layers = tuple(layers)
    layers_pattern = names(data.get("layers_pattern"), "layers_pattern")
    cfg = PeftLoraConfig(
        r=rank(data.get("r", 8), "r"),
        lora_alpha=alpha(data.get("lora_alpha", 8), "lora_alpha"),
        target_modules=names(data.get("target_modules"), "target_modules"),
        exclude_modules=names(data.get("exclude_modules"), "exclude_modules"),
        rank_pattern=patterns(data.get("rank_pattern"), "rank_pattern", rank),
        alpha_pattern=patterns(data.get("alpha_pattern"), "alpha_pattern", alpha),
        use_rslora=flag(data.get("use_rslora", False), "use_rslora"),
        fan_in_fan_out=flag(data.get("fan_in_fan_out", False), "fan_in_fan_out"),
        layers_to_transform=layers,
        layers_pattern=(layers_pattern,) if isinstance(layers_pattern, str) else layers_pattern,
    )
    # Compile every pattern now, so a bad regex is refused here rather than mid-read.
    regexes = [rf"(.*\.)?({k})$" for k in (*cfg.rank_pattern, *cfg.alpha_pattern)]
    regexes += [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in cfg.layers_pattern or ()]
    regexes += [p for p in (cfg.target_modules, cfg.exclude_modules) if isinstance(p, str)]
    for rx in regexes:
        try:
            re.compile(rx)
        except (re.error, RecursionError, OverflowError, ValueError) as e:
            raise bad(f"pattern {rx!r} is not a valid regular expression ({e})") from None
    return cfg


def read_config(path: str | os.PathLike, adapter: str | None = None) -> PeftLoraConfig:
    """Parse and check ``adapter_config.json`` (at ``path``)."""
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise AdapterFileError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes",
                                   adapter=adapter, path=path)
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise AdapterFileError(f"cannot read {CONFIG_NAME}: {e.strerror or e}", adapter=adapter, path=path) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise AdapterFileError(f"{CONFIG_NAME} is not valid JSON: {e}", adapter=adapter, path=path) from None
    return parse_config(data, adapter=adapter, path=path)


# -- the safetensors file ------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: a float dtype, its shape, its byte range in the data, and
    where that range starts in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    offset: int


def read_header(path: str | os.PathLike, adapter: str | None = None) -> dict[str, TensorInfo]:
    """A safetensors file's tensors, its header checked against the file's length.

    Refuses (``AdapterFileError``) a short file, a header size past the file, a header that is
    not a JSON object of entries, dtypes other than F16/BF16/F32/F64, byte ranges that disagree
    with shape and dtype, overlap, or do not tile the data exactly.
    """

    def bad(reason: str) -> AdapterFileError:
        return AdapterFileError(f"corrupt safetensors: {reason}", adapter=adapter, path=path)

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes is too short for a header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise bad(f"header claims {n} bytes but the file holds {size - 8} after its length")
            raw = f.read(n)
    except OSError as e:
        raise AdapterFileError(f"cannot read {WEIGHTS_NAME}: {e.strerror or e}", adapter=adapter, path=path) from None
    if len(raw) != n:
        raise bad("the file changed while it was read")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_len = size - 8 - n
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ must map strings to strings")
    out: dict[str, TensorInfo] = {}
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r}: entry must hold exactly dtype, shape and data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in FLOAT_DTYPES:
            raise AdapterFileError(f"tensor {name!r}: dtype {dtype!r} is not a float type lora-cupy "
                                   f"reads ({', '.join(FLOAT_DTYPES)})", adapter=adapter, path=path)
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
                or not offsets[0] <= offsets[1] <= data_len):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} outside the {data_len} data bytes")
        if math.prod(shape) * FLOAT_DTYPES[dtype] != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r}: shape {shape} of {dtype} does not fill bytes {offsets}")
        out[name] = TensorInfo(dtype, tuple(shape), offsets[0], offsets[1], 8 + n + offsets[0])
    pos = 0
    for name, t in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != pos:
            raise bad(f"tensor {name!r} starts at byte {t.begin}, not {pos}: data overlaps or has a gap")
        pos = t.end
    if pos != data_len:
        raise bad(f"tensors end at byte {pos} of {data_len} data bytes")
    return out


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_tensors(path, header: Mapping[str, TensorInfo], adapter) -> dict[str, np.ndarray]:
    """Read every tensor of ``header`` with safetensors' NumPy API. BF16, which NumPy lacks,
    arrives from recent safetensors as ``ml_dtypes.bfloat16``; where safetensors cannot give
    it, its bytes are decoded from the file at the checked offsets instead."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            for name in header:
                try:
                    arr = f.get_tensor(name)
                except Exception:
                    if header[name].dtype != "BF16":
                        raise
                    arr = None
                if header[name].dtype == "BF16" and (arr is None or arr.dtype != bfloat16):
                    arr = _read_raw(path, header[name], adapter)
                out[name] = arr
    except LoraError:
        raise
    except Exception as e:  # SafetensorError, or anything else its parser raises
        raise AdapterFileError(f"corrupt safetensors: {e}", adapter=adapter, path=path) from None
    for name, info in header.items():
        arr = out[name]
        if arr.shape != info.shape or arr.dtype != _NUMPY_DTYPES[info.dtype]:
            raise AdapterFileError(f"corrupt safetensors: tensor {name!r} read as {arr.dtype} {arr.shape}, "
                                   f"header says {info.dtype} {info.shape}", adapter=adapter, path=path)
    return out


def _read_raw(path, info: TensorInfo, adapter) -> np.ndarray:
    """One tensor decoded from the file's little-endian bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.end - info.begin)
    except OSError as e:
        raise AdapterFileError(f"cannot read {WEIGHTS_NAME}: {e.strerror or e}", adapter=adapter, path=path) from None
    if len(raw) != info.end - info.begin:
        raise AdapterFileError("corrupt safetensors: the file changed while it was read", adapter=adapter, path=path)
    return np.frombuffer(raw, _NUMPY_DTYPES[info.dtype]).reshape(info.shape)


def canonical_key(key: str) -> str:
    """A tensor key with any adapter name PEFT inserted removed (``lora_A.default.weight`` ->
    ``lora_A.weight``), so the digest does not depend on it."""
    m = _KEY_RE.match(key)
    if m is None or m.group("adapter") is None:
        return key
    return f"{m.group('module')}.{m.group('part')}.{m.group('param')}"


def _digest(tensors: Mapping[str, tuple[str, np.ndarray]]) -> str:
    """sha256 over ``{canonical name: (dtype, array)}`` in sorted name order: name, dtype,
    shape and little-endian bytes, each length-delimited."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        data = np.ascontiguousarray(arr)
        if data.dtype.byteorder == ">":
            data = data.byteswap().view(data.dtype.newbyteorder("<"))
        head = f"{name}\0{dtype}\0{','.join(map(str, arr.shape))}\0{data.nbytes}\0".encode()
        h.update(len(head).to_bytes(8, "little"))
        h.update(head)
        h.update(data.reshape(-1).view(np.uint8))
    return h.hexdigest()


def digest_of(path: str | os.PathLike, name: str | None = None) -> str:
    """The sha256 digest of an adapter's weights (a directory, or its safetensors file): the
    same as :func:`read_peft_adapter` gives, whatever the file's tensor order or metadata."""
    path = Path(path)
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    name = name if name is not None else (path.name if path.is_dir() else path.parent.name)
    _refuse_pickle_name(weights, name)
    if not weights.is_file():
        raise AdapterFileError(f"no {WEIGHTS_NAME}", adapter=name, path=weights)
    header = read_header(weights, name)
    arrays = _read_tensors(weights, header, name)
    return _canonical_digest(header, arrays, name, weights)


def _canonical_digest(header, arrays, adapter, path) -> str:
    canon: dict[str, tuple[str, np.ndarray]] = {}
    for key, arr in arrays.items():
        c = canonical_key(key)
        if c in canon:
            raise AdapterFileError(f"tensors {key!r} and another both name {c!r}", adapter=adapter, path=path)
        canon[c] = (header[key].dtype, arr)
    return _digest(canon)


def _refuse_pickle_name(path: Path, adapter: str) -> None:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise PickleRefusedError(f"{path.name} is a pickle file: only safetensors is read "
                                 "(convert it with safetensors)", adapter=adapter, path=path)


# -- the adapter ---------------------------------------------------------------------------
@dataclass
class _Module:
    """One LoRA module of the file: where it lands in the spec, and its tensors' keys."""

    path: str  # module path inside the model, e.g. model.layers.0.self_attn.q_proj
    target: LoraTarget
    slice: int | None  # None: the module spans every slice of a fused target
    layer: int
    keys: dict[str, str] = field(default_factory=dict)  # "lora_A" / "lora_B" -> tensor key


def read_peft_adapter(path: str | os.PathLike, spec: LoraSpec, name: str | None = None) -> AdapterWeights:
    """Read a PEFT adapter directory and map it onto ``spec``'s targets, on ``spec.tp_rank``.

    Weights arrive in the spec's dtype, each target's rank padded to the adapter's largest
    there; ``ranks`` / ``scaling`` are per stack layer and slice (0 where the adapter adds
    nothing). A module naming a whole fused target stores a copy of its A per slice and its B
    split by slice. Every refusal is a :class:`LoraError` subclass naming adapter, file, reason.
    """
    path = Path(path)
    name = name if name is not None else path.name
    if not path.exists():
        raise AdapterNotFoundError("no such adapter directory", adapter=name, path=path)
    if not path.is_dir():
        _refuse_pickle_name(path, name)
        raise AdapterNotFoundError("not a directory: an adapter is a directory holding "
                                   f"{CONFIG_NAME} and {WEIGHTS_NAME}", adapter=name, path=path)
    weights_path, config_path = path / WEIGHTS_NAME, path / CONFIG_NAME
    if not weights_path.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise PickleRefusedError(f"weights are pickle files {pickles}: only {WEIGHTS_NAME} is read "
                                     "(convert them with safetensors)", adapter=name, path=path / pickles[0])
        if not config_path.is_file():
            raise AdapterNotFoundError(f"directory holds neither {CONFIG_NAME} nor {WEIGHTS_NAME}",
                                       adapter=name, path=path)
        raise AdapterFileError(f"no {WEIGHTS_NAME} beside {CONFIG_NAME}", adapter=name, path=weights_path)
    if not config_path.is_file():
        raise AdapterFileError(f"no {CONFIG_NAME} beside {WEIGHTS_NAME}", adapter=name, path=config_path)
    config = read_config(config_path, name)
    header = read_header(weights_path, name)
    modules = _map_modules(header, config, spec, name, weights_path)
    for m in modules:
        _check_shapes(m, header, config, spec, name, weights_path)
    arrays = _read_tensors(weights_path, header, name)
    if sum(a.nbytes for a in arrays.values()) < _DIGEST_BESIDE_BYTES:
        digest = _canonical_digest(header, arrays, name, weights_path)
        targets = _assemble(modules, arrays, config, spec, name, weights_path)
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="lora-adapter-digest") as beside:
            hashing = beside.submit(_canonical_digest, header, arrays, name, weights_path)
            try:
                targets = _assemble(modules, arrays, config, spec, name, weights_path)
            except BaseException:
                hashing.result()  # the digest's refusal first, as when it ran before the assembly
                raise
            digest = hashing.result()
    return AdapterWeights(name=name, path=str(path), digest=digest, targets=targets)


def _map_modules(header, config: PeftLoraConfig, spec: LoraSpec, adapter, path) -> list[_Module]:
    """Each tensor key onto its module and the module onto a target, slice and stack layer."""

    def refuse(cls, reason):
        return cls(reason, adapter=adapter, path=path)

    if not header:
        raise refuse(AdapterFileError, "the adapter holds no weights")
    by_path: dict[str, _Module] = {}
    for key in header:
        if "lora_magnitude_vector" in key:
            raise refuse(UnsupportedAdapterError, f"tensor {key!r} is a DoRA magnitude: DoRA is not supported")
        if "lora_embedding" in key:
            raise refuse(UnsupportedAdapterError, f"tensor {key!r}: LoRA on an embedding is not supported")
        m = _KEY_RE.match(key)
        if m is None:
            what = "a bias" if key.endswith(".bias") else "not a LoRA A or B weight (modules_to_save?)"
            raise refuse(UnsupportedAdapterError, f"tensor {key!r} is {what}: only lora_A/lora_B weights are read")
        if m.group("param") == "bias":
            raise refuse(UnsupportedAdapterError, f"tensor {key!r} is a LoRA bias: bias is not supported")
        module = m.group("module").removeprefix(_PREFIX)
        if not spec.owns_module(module):
            continue  # another node's module (an encoder's, for the LLM's pool): its pool reads it
        part = m.group("part")
        mod = by_path.get(module)
        if mod is None:
            found = spec.module_target(module.rsplit(".", 1)[-1])
            if found is None:
                raise refuse(TargetMismatchError, f"module {module!r} has no target in the spec "
                             f"(targets: {', '.join(spec.target_names)})")
            layer = layer_index(module)
            target, j = found
            if layer is None:
                raise refuse(TargetMismatchError, f"module {module!r} names no stack layer (no 'layers.<i>.' "
                             f"in its path) of target {target.name!r}")
            if layer >= target.num_layers:
                raise refuse(TargetMismatchError, f"module {module!r}: stack layer {layer} is outside target "
                             f"{target.name!r}'s {target.num_layers} layers")
            if not _selects(config, module, adapter, path):
                raise refuse(AdapterFileError, f"module {module!r} holds weights but {CONFIG_NAME} does not "
                             "target it (target_modules / exclude_modules / layers_to_transform)")
            mod = by_path[module] = _Module(module, target, j, layer)
        if part in mod.keys:
            raise refuse(AdapterFileError, f"tensors {mod.keys[part]!r} and {key!r} are both {part} of {module!r}")
        mod.keys[part] = key
    seen: dict[tuple[str, int, int], str] = {}
    for mod in by_path.values():
        for part in ("lora_A", "lora_B"):
            if part not in mod.keys:
                other = next(iter(mod.keys.values()))
                raise refuse(AdapterFileError, f"module {mod.path!r} has {other!r} but no {part} weight")
        for j in range(mod.target.num_slices) if mod.slice is None else (mod.slice,):
            prev = seen.setdefault((mod.target.name, mod.layer, j), mod.path)
            if prev != mod.path:
                raise refuse(AdapterFileError, f"modules {prev!r} and {mod.path!r} both write slice "
                             f"{mod.target.slices[j].name!r} of target {mod.target.name!r} at layer {mod.layer}")
    return list(by_path.values())


def _selects(config: PeftLoraConfig, module: str, adapter, path) -> bool:
    try:
        return config.selects(module)
    except (re.error, RecursionError) as e:  # compiled at parse time; kept as a backstop
        raise AdapterFileError(f"{CONFIG_NAME}: cannot match {module!r} ({e})", adapter=adapter, path=path) from None


def _check_shapes(m: _Module, header, config: PeftLoraConfig, spec: LoraSpec, adapter, path) -> None:
    """A ``[r, in]`` and B ``[out, r]`` (full, unsharded features) with r the config's rank."""
    a, b = header[m.keys["lora_A"]].shape, header[m.keys["lora_B"]].shape
    t = m.target
    out = t.out_features if m.slice is None else t.slices[m.slice].out_features
    r = config.rank(m.path)
    if a != (r, t.in_features) or b != (out, r):
        raise ShapeMismatchError(
            f"module {m.path!r}: lora_A {list(a)} and lora_B {list(b)} do not match target {t.name!r} "
            f"(expected lora_A [{r}, {t.in_features}] and lora_B [{out}, {r}], rank {r} from {CONFIG_NAME})",
            adapter=adapter, path=path)
    if r > spec.max_rank:
        raise RankTooLargeError(f"module {m.path!r} has rank {r}, above the pool's max_rank {spec.max_rank}",
                                adapter=adapter, path=path)


def _assemble(modules: list[_Module], arrays, config: PeftLoraConfig, spec: LoraSpec,
              adapter, path) -> dict[str, TargetWeights]:
    """Per target: this rank's shards of every module, rank-padded, in the spec's dtype."""
    dt = numpy_dtype(spec.dtype)
    tp, k = spec.tp_size, spec.tp_rank
    by_target: dict[str, list[_Module]] = {}
    for m in modules:
        by_target.setdefault(m.target.name, []).append(m)
    targets = {}
    for tname, mods in by_target.items():
        t = spec.target(tname)
        R = max(config.rank(m.path) for m in mods)
        in_local = t.local_in_features(tp)
        full_offs, local_offs = t.out_offsets(1), t.out_offsets(tp)
        a = np.zeros((t.num_layers, t.num_slices, R, in_local), dt)  # [L, n, R, in]
        b = np.zeros((t.num_layers, t.local_out_features(tp), R), dt)  # [L, out, R]
        ranks = np.zeros((t.num_layers, t.num_slices), np.int32)
        scaling = np.zeros((t.num_layers, t.num_slices), np.float32)
        for m in mods:
            r = config.rank(m.path)
            wa = _converted(arrays[m.keys["lora_A"]], m.keys["lora_A"], dt, adapter, path)  # [r, in]
            wb = _converted(arrays[m.keys["lora_B"]], m.keys["lora_B"], dt, adapter, path)  # [out, r]
            if t.sharding == "row":
                wa = wa[:, k * in_local:(k + 1) * in_local]
            base = 0 if m.slice is None else full_offs[m.slice]
            for j in range(t.num_slices) if m.slice is None else (m.slice,):
                part = wb[full_offs[j] - base:full_offs[j + 1] - base]  # this slice's rows, [out_j, r]
                n_local = local_offs[j + 1] - local_offs[j]
                if t.sharding == "column":
                    part = part[k * n_local:(k + 1) * n_local]
                a[m.layer, j, :r] = wa
                b[m.layer, local_offs[j]:local_offs[j + 1], :r] = part
                ranks[m.layer, j] = r
                scaling[m.layer, j] = config.scaling(m.path)
        targets[tname] = TargetWeights(a=a, b=b, ranks=ranks, scaling=scaling)
    return targets


#: The exponent bits of the 16-bit floats: all set is an Inf or a NaN.
_EXPONENT_BITS = {np.dtype(np.float16): 0x7C00, np.dtype(bfloat16): 0x7F80}


def _any_nonfinite(arr: np.ndarray) -> bool:
    """Whether ``arr`` holds a NaN or an Inf: a 16-bit float's read off its exponent bits (no
    float32 copy: a bfloat16 array's own ``isfinite`` runs several times slower)."""
    bits = _EXPONENT_BITS.get(arr.dtype)
    if bits is None:
        return not np.isfinite(arr).all()
    return bool(((arr.view(np.uint16) & bits) == bits).any())


def _converted(arr: np.ndarray, key: str, dt: np.dtype, adapter, path) -> np.ndarray:
    """``arr`` in the pool's dtype, refusing NaN / Inf in the file or after the cast."""
    if _any_nonfinite(arr):
        raise NonFiniteWeightsError(f"tensor {key!r} holds NaN or Inf", adapter=adapter, path=path)
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(dt)
    if out.dtype != arr.dtype and _any_nonfinite(out):
        raise NonFiniteWeightsError(f"tensor {key!r} overflows {dt.name}", adapter=adapter, path=path)
    return out
