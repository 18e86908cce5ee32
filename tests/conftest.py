"""Shared test set-up: GPU tests run only where a CUDA device is."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device
        return False


#: Tests that compile a whole kernel family with NVRTC (minutes each for a tensor-core family on two
#: cores), and the family and architecture each needs beyond its parameters.
_FAMILY_TESTS = {"test_family_compiles": None,
                 "test_tensor_core_family_compiles_to_mma_and_cp_async": ("lora_mma_bfloat16", "sm_90"),
                 "test_code_sizes_count_every_kernel_of_a_family": ("lora_mma_bfloat16", "sm_90")}


def _compile_ahead(items) -> None:
    """Start the NVRTC compiles the selected family tests will ask for in worker processes, one a
    CPU, while the other tests run: each test then waits for its family's compile (the same
    function, source and options) rather than running the compiles one after another."""
    import importlib.util

    if importlib.util.find_spec("cupy_backends") is None:
        return
    pairs = []
    for item in items:
        name = getattr(item, "originalname", None) or item.name
        if name in _FAMILY_TESTS and not item.get_closest_marker("skip"):
            params = getattr(getattr(item, "callspec", None), "params", {})
            pairs.append((params["family"], params["arch"]) if _FAMILY_TESTS[name] is None else _FAMILY_TESTS[name])
    if pairs:
        from lora_cupy import kernels

        kernels.compile_ahead(dict.fromkeys(pairs))


def pytest_sessionfinish(session, exitstatus):
    import sys

    kernels = sys.modules.get("lora_cupy.kernels")
    if kernels is not None:
        kernels.cancel_ahead()  # a run stopped early does not wait for compiles no test asks for


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselected what will not run
def pytest_collection_modifyitems(config, items):
    if not config.option.collectonly:
        _compile_ahead(items)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a CUDA host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
