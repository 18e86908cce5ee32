"""Kernel launches with Hopper's programmatic dependent launch (PDL), through the driver's
``cuLaunchKernelEx`` (CuPy launches through ``cuLaunchKernel``, which takes no attributes).

A kernel launched with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may start
before the kernel queued just before it on the stream (its *primary*) has finished: once every
block of the primary has called ``griddepcontrol.launch_dependents`` or exited, rather than after
the primary's completion and memory flush. Its blocks must execute ``griddepcontrol.wait``
(``lora::wait_prior_grid`` in common.cuh) before touching anything the primary writes; what they
do before that (reading the step's addressing, the weights) overlaps the primary's tail and the
launch itself. A stream capture records the relaxed edge (a programmatic dependency), so a CUDA
graph replays it. On devices below compute capability 9.0, or a driver without the call,
:func:`pdl_supported` is False and callers launch the usual way.

The caller owns the contract: nothing the kernel reads before its wait may be written by the
primary. (A primary launched the usual way starts only after everything before it on the stream
has finished, so data written before the primary is safe to read.)
"""

from __future__ import annotations

import ctypes
import functools

#: ``CUlaunchAttributeID``: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: The first driver version whose stream capture records programmatic edges (CUDA 12.3).
MIN_DRIVER = 12030


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id (padded to 8 bytes), then a 64-byte union whose first int is
    ``programmaticStreamSerializationAllowed``."""

    _fields_ = [("id", ctypes.c_uint), ("_pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("_rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda's ``cuLaunchKernelEx`` and ``cuGetErrorName`` (None: no driver, or too old)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < MIN_DRIVER:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    name = lib.cuGetErrorName
    name.restype = ctypes.c_int
    name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return fn, name


def pdl_supported(compute_capability: tuple[int, int]) -> bool:
    """Whether launches on a device of this compute capability can take PDL here."""
    return compute_capability[0] >= 9 and _driver() is not None


class PdlLauncher:
    """Launches kernels with PDL: the attribute is built once, the config per launch (so threads
    launching at once do not share one)."""

    def __init__(self):
        drv = _driver()
        if drv is None:
            raise RuntimeError("cuLaunchKernelEx (CUDA 12.3 or later driver) is not available")
        self._launch, self._name = drv
        self._attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._attrs = ctypes.pointer(self._attr)

    def __call__(self, fn: int, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                 stream: int, params: int) -> None:
        """Launch function ``fn`` (a ``CUfunction``) with ``params`` (a ``void**`` of its
        arguments) on ``stream``; RuntimeError with the driver's error name if it refuses."""
        c = LaunchConfig(*grid, *block, smem, stream or None, self._attrs, 1)
        err = self._launch(ctypes.byref(c), fn, params, None)
        if err:
            text = ctypes.c_char_p()
            self._name(err, ctypes.byref(text))
            raise RuntimeError(f"cuLaunchKernelEx with programmatic stream serialization: "
                               f"{(text.value or b'?').decode()} ({err})")
