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


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a CUDA host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
