"""Bulk L2 prefetch of a tensor's bytes (Hopper `cp.async.bulk.prefetch.L2`), launched on torch's current stream.

The Locks layer's selection and sparse decode are a few latency-bound launches that leave HBM mostly idle for
~20 µs; the layer's next kernel, the output projection, reads a hidden x hidden weight from HBM. Prefetching that
weight into L2 right after the score kernel moves its read into the idle window (`harness/lab/prefetch_probe.py`
measures it). A prefetch is a hint: nothing waits on it and a line evicted before use is simply read again, so it
can never change a result.

Each thread issues one bulk prefetch of CHUNK bytes, spread over as many programs as that takes (every SM's copy
engine issues its own); the kernel exits without waiting for the fills. `L2Prefetch` launches it on the caller's
stream (`inline`: one more node between the score kernel and the selection) or on a stream of its own forked there
and joined after the decode (`side`: a branch beside the selection in a captured graph).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch

from . import nvrtc

KERNEL_NAME = "locks_l2_prefetch"
ARCH = "sm_90a"
CHUNK = 1 << 16  # bytes a bulk prefetch (a 16-byte multiple)
THREADS = 32

SOURCE = rb"""
extern "C" __global__ void locks_l2_prefetch(const char* base, unsigned long long bytes) {
    const unsigned long long off = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * CHUNK;
    if (off < bytes) {
        const unsigned int size = (unsigned int)(bytes - off < CHUNK ? bytes - off : CHUNK);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(base + off), "r"(size) : "memory");
    }
}
"""

_FUNCTIONS: dict[int, object] = {}
_LOCK = threading.Lock()


def compile_cubin() -> bytes:
    """NVRTC: the prefetch kernel -> cubin bytes (no device needed)."""
    return nvrtc.compile_cubin(SOURCE, "l2_prefetch.cu", [f"--gpu-architecture={ARCH}", f"-DCHUNK={CHUNK}ull"])


def fits(tensor: torch.Tensor) -> str | None:
    """None where `prefetch` serves this tensor, else why not."""
    if not tensor.is_cuda or torch.cuda.get_device_capability(tensor.device) != (9, 0):
        return "not an sm_90 device"
    if not nvrtc.has_cuda_bindings():
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    if tensor.data_ptr() % 16:
        return "not 16-byte aligned"
    if not tensor.is_contiguous():
        return "not contiguous"
    return None


def load(device: torch.device) -> object:
    """The kernel on `device`, compiled and loaded on first use (before any graph capture)."""
    with _LOCK:
        if device.index not in _FUNCTIONS:
            _FUNCTIONS[device.index] = nvrtc.load_function(device, compile_cubin(), KERNEL_NAME)
        return _FUNCTIONS[device.index]


def programs(nbytes: int) -> int:
    """Programs of THREADS threads for one CHUNK-byte prefetch a thread."""
    return max(1, -(-nbytes // (CHUNK * THREADS)))


def prefetch(tensor: torch.Tensor) -> None:
    """Prefetch a contiguous CUDA tensor's bytes (rounded down to 16) into L2; a prefix of a tensor is a view of it."""
    nbytes = tensor.numel() * tensor.element_size() // 16 * 16
    if nbytes == 0:
        return
    values = [ctypes.c_void_p(tensor.data_ptr()), ctypes.c_ulonglong(nbytes)]
    nvrtc.launch(load(tensor.device), (programs(nbytes), 1, 1), THREADS, tensor.device, values, "l2 prefetch")


@functools.cache
def side_stream(device_index: int) -> torch.cuda.Stream:
    """One prefetch stream a device, shared by every layer (their prefetches never overlap: each is joined within
    its layer)."""
    return torch.cuda.Stream(device_index)


@dataclass
class L2Prefetch:
    """One tensor's prefetch, issued after the score kernel and joined after the decode (config.PREFETCH_MODES)."""

    tensor: torch.Tensor
    stream: torch.cuda.Stream | None = None  # None: inline on the caller's stream

    @classmethod
    def for_mode(cls, tensor: torch.Tensor, mode: str) -> L2Prefetch:
        """Load the kernel now (before any graph capture) and, for `side`, make its stream."""
        load(tensor.device)
        return cls(tensor, side_stream(tensor.device.index) if mode == "side" else None)

    def issue(self) -> None:
        if self.stream is None:
            prefetch(self.tensor)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.tensor.device))
        with torch.cuda.stream(self.stream):
            prefetch(self.tensor)

    def join(self) -> None:
        """The caller's stream waits for the side stream (a captured graph must rejoin every stream it forked)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.tensor.device).wait_stream(self.stream)
