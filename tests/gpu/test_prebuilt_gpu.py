"""Kernels built ahead (``lora-cupy check-kernels --prebuild DIR``, ``LORA_CUPY_PREBUILT=DIR``): a
family whose CUBIN matches its source loads from the directory and runs a delta against the float64
oracle; with no matching file (an edited source, another architecture) it compiles as without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lora_cupy import kernels

from test_kernels import _gpu_count, backend_for, cp, run_cupy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]


@pytest.fixture
def fresh_modules():
    kernels._load.cache_clear()  # modules are memoized per family: load this test's own
    yield
    kernels._load.cache_clear()


def _device_arch():
    return kernels.device_arch(cp().cuda.Device().compute_capability)


def _from(mod, where) -> bool:
    """Whether ``mod`` is a CUBIN loaded from the directory ``where``."""
    return isinstance(mod, kernels.PrebuiltModule) and mod.path.parent == where


def test_a_prebuilt_family_loads_and_runs(tmp_path, monkeypatch, make_case, check, fresh_modules):
    kernels.prebuild(tmp_path, _device_arch(), ["lora_delta"])
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(tmp_path))
    assert _from(kernels.load_module("lora_delta"), tmp_path)
    case = make_case(T=37, in_f=77, slices=(61, 40), max_rank=13, ranks=(0, 1, 8, 13), dtype="float32", mix="zipf")
    check(case, run_cupy(backend_for(case.spec, kernel="simt"), case), "float32")


def test_no_matching_prebuilt_file_compiles(tmp_path, monkeypatch, fresh_modules):
    other = "sm_80" if _device_arch() != "sm_80" else "sm_90a"
    kernels.prebuild(tmp_path, other, ["lora_delta"])
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(tmp_path))  # a CUBIN for another architecture only
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    assert not _from(kernels.load_module("lora_delta"), tmp_path)


def test_an_architecture_specific_build_is_cached_and_read_back(tmp_path, monkeypatch, make_case, check, fresh_modules):
    """On Hopper (sm_90a, which CuPy's own compile cannot target) a family compiles through the
    project's NVRTC into the cache directory, runs, and loads from there in a later process (here: the
    memo cleared, NVRTC made to fail) with no second compile; a damaged cache file is built again."""
    if not _device_arch().endswith("a"):
        pytest.skip(f"{_device_arch()} compiles through CuPy's RawModule")
    monkeypatch.delenv(kernels.PREBUILT_ENV, raising=False)
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    mod = kernels.load_module("lora_delta")
    assert _from(mod, tmp_path) and mod.path.name.startswith(f"lora_delta.{_device_arch()}.")
    case = make_case(T=37, in_f=77, slices=(61, 40), max_rank=13, ranks=(0, 1, 8, 13), dtype="float32", mix="zipf")
    check(case, run_cupy(backend_for(case.spec, kernel="simt"), case), "float32")
    kernels._load.cache_clear()

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(kernels, "_nvrtc", no_compile)
    assert kernels.load_module("lora_delta").path == mod.path
    # a damaged cache file, which the driver refuses: a new process (CuPy keeps a path it has loaded
    # for the process's life) removes it, builds the family again and loads it
    mod.path.write_bytes(b"\x7fELF damaged")
    env = {**os.environ, kernels.CACHE_ENV: str(tmp_path)}
    env.pop(kernels.PREBUILT_ENV, None)
    code = "from lora_cupy import kernels as k; m = k.load_module('lora_delta'); print(m.path.stat().st_size)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 1000 and len(mod.path.read_bytes()) > 1000
