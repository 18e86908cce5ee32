"""The driver structures of programmatic dependent launch (lora_cupy/backends/launch_ex.py) laid out
as cuda.h's ``CUlaunchConfig`` and ``CUlaunchAttribute`` on 64-bit hosts, and the support check."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from lora_cupy.backends import launch_ex


def test_structures_match_the_driver_layout():
    a, c = launch_ex.LaunchAttribute, launch_ex.LaunchConfig
    assert ctypes.sizeof(a) == 72  # id padded to 8 bytes, then the 64-byte value union
    assert a.value.offset == 8
    assert ctypes.sizeof(c) == 56
    assert [getattr(c, f).offset for f in ("grid_x", "block_x", "shared_mem_bytes", "stream", "attrs", "num_attrs")] \
        == [0, 12, 24, 32, 40, 48]
    attr = a(id=launch_ex.PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    raw = bytes(attr)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert not any(raw[12:])


def test_support_needs_compute_capability_9_and_the_driver(monkeypatch):
    monkeypatch.setattr(launch_ex, "_driver", lambda: None)
    assert not launch_ex.pdl_supported((9, 0))
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx"):
        launch_ex.PdlLauncher()
    monkeypatch.setattr(launch_ex, "_driver", lambda: (print, print))
    assert launch_ex.pdl_supported((9, 0)) and launch_ex.pdl_supported((10, 0))
    assert not launch_ex.pdl_supported((8, 9))


def test_attribute_id_and_value_size_are_cuda_hs():
    """The id and the union's size as the toolkit's cuda.h (found where NVRTC's headers are) says."""
    from lora_cupy.kernels import cuda_include_dirs

    headers = [Path(d) / "cuda.h" for d in cuda_include_dirs() if (Path(d) / "cuda.h").is_file()]
    assert headers, "no cuda.h beside the CUDA headers NVRTC compiles with"
    text = headers[0].read_text(errors="replace")
    m = re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*(\d+)", text)
    assert m and int(m.group(1)) == launch_ex.PROGRAMMATIC_STREAM_SERIALIZATION
    union = re.search(r"typedef union CUlaunchAttributeValue_union \{(.*?)\} CUlaunchAttributeValue;", text, re.S)
    assert union and "char pad[64];" in union.group(1)
