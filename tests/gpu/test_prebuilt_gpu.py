"""Kernels built ahead (``lora-cupy check-kernels --prebuild DIR``, ``LORA_CUPY_PREBUILT=DIR``): a
family whose CUBIN matches its source loads from the directory and runs a delta against the float64
oracle; with no matching file (an edited source, another architecture) it compiles as without it."""

from __future__ import annotations

import pytest

from lora_cupy import kernels

from test_kernels import _gpu_count, backend_for, cp, run_cupy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]


@pytest.fixture
def fresh_modules():
    kernels._load.cache_clear()  # modules are memoized per family: load this test's own
    yield
    kernels._load.cache_clear()


def test_a_prebuilt_family_loads_and_runs(tmp_path, monkeypatch, make_case, check, fresh_modules):
    arch = f"sm_{cp().cuda.Device().compute_capability}"
    kernels.prebuild(tmp_path, arch, ["lora_delta"])
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(tmp_path))
    assert isinstance(kernels.load_module("lora_delta"), kernels.PrebuiltModule)
    case = make_case(T=37, in_f=77, slices=(61, 40), max_rank=13, ranks=(0, 1, 8, 13), dtype="float32", mix="zipf")
    check(case, run_cupy(backend_for(case.spec, kernel="simt"), case), "float32")


def test_no_matching_prebuilt_file_compiles(tmp_path, monkeypatch, fresh_modules):
    kernels.prebuild(tmp_path, "sm_80" if cp().cuda.Device().compute_capability != "80" else "sm_90", ["lora_delta"])
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(tmp_path))  # a CUBIN for another architecture only
    assert not isinstance(kernels.load_module("lora_delta"), kernels.PrebuiltModule)
