"""The three element types the pool serves, on the host (NumPy, ml_dtypes) and in kernels."""

from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

_NUMPY = {"float16": np.dtype(np.float16), "bfloat16": bfloat16, "float32": np.dtype(np.float32)}
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def normalize_dtype(dtype) -> str:
    """``"float16" | "bfloat16" | "float32"`` from a name, a NumPy or a torch dtype."""
    name = str(getattr(dtype, "name", dtype)).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in _NUMPY:
        raise ValueError(f"unsupported dtype {dtype!r}: use float16, bfloat16 or float32")
    return name


def numpy_dtype(dtype) -> np.dtype:
    return _NUMPY[normalize_dtype(dtype)]


def itemsize(dtype) -> int:
    return numpy_dtype(dtype).itemsize


def torch_dtype(dtype):
    import torch

    return getattr(torch, normalize_dtype(dtype))


def from_torch(t) -> np.ndarray:
    """A CPU torch tensor as a NumPy array of the same dtype (bfloat16 through ml_dtypes)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray):
    """A NumPy array as a CPU torch tensor sharing its memory (bfloat16 through int16)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
