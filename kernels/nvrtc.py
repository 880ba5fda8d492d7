"""What the kernels written in CUDA C share: NVRTC compilation (no device needed), loading into torch's context,
and launching on torch's current stream (so CUDA graphs capture them like any other kernel), via cuda-bindings."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch


def compile_cubin(source: bytes, file_name: str, options: Sequence[str]) -> bytes:
    """NVRTC: CUDA C `source` -> cubin bytes for the architecture named in `options`."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source, file_name.encode(), 0, [], [])
    _nvrtc_ok(err, "create program")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            text = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC could not compile {file_name} ({err}):\n{text.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _nvrtc_ok(err, "cubin size")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _nvrtc_ok(err, "get cubin")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_ok(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what} failed: {err}")


def driver_ok(result, what: str):
    """cuda-bindings driver calls return (err, *values): raise on err, else the value (or values)."""
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver {what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def load_function(device: torch.device, cubin: bytes, name: str):
    """Load `cubin` into torch's (primary) context of `device` and return its kernel `name` (a CUfunction)."""
    from cuda.bindings import driver

    torch.cuda.init()
    with torch.cuda.device(device):
        driver_ok(driver.cuInit(0), "cuInit")
        if not int(driver_ok(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")):  # torch's primary context
            dev = driver_ok(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
            driver_ok(driver.cuCtxSetCurrent(driver_ok(driver.cuDevicePrimaryCtxRetain(dev), "retain")), "cuCtxSetCurrent")
        module = driver_ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        return driver_ok(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")


def launch(function, grid: tuple[int, int, int], threads: int, device: torch.device, values: Sequence[ctypes._SimpleCData],
           what: str) -> None:
    """cuLaunchKernel of `function` with ctypes argument `values`, on torch's current stream of `device`."""
    from cuda.bindings import driver

    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    driver_ok(driver.cuLaunchKernel(function, *grid, threads, 1, 1, 0, stream, ctypes.addressof(pointers), 0),
              f"cuLaunchKernel ({what})")
