"""Two-way branches inside a captured CUDA graph, picked on the device at every replay (conditional nodes).

A decode graph is recorded once and replayed every step, so a choice between two attention paths made per
step (dense when the batch is short, sparse otherwise) must live in the graph. Recording both paths makes
every replay pay the untaken path's launches (~1 µs per kernel node on the H200, `graph_launch_probe`);
an IF/ELSE conditional node (CUDA >= 12.8) launches only the branch its handle selects. Torch 2.11 does
not expose conditional nodes, so they are added through cuda-bindings while torch captures:

    branches = GraphBranches(device)            # before the capture: its table must not be captured
    with torch.cuda.graph(graph):
        branches.set_all(flag)                  # one kernel: every branch below reads flag[0] != 0
        for layer in layers:
            with branches.if_else() as (then, otherwise):
                with then: dense(layer)         # recorded into the IF body
                with otherwise: sparse(layer)   # recorded into the ELSE body
    branches.publish()                          # once after capture, before the first replay

The bodies are recorded on a side stream into the node's child graphs; what they launch must not allocate
(torch's allocator does not know those captures). One handle belongs to one node; `set_all` writes every
handle of the object from one flag in one launch, so a step of L layers adds one kernel, not L.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import torch

from . import nvrtc

SETTER_NAME = "locks_set_branches"
SETTER_SOURCE = rb"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);
// Every handle takes the same value: 1 (the IF body) where flag[0] != 0, else 0 (the ELSE body).
// The table and its count are device memory: `publish` fills them after capture, which fixed the arguments.
extern "C" __global__ void locks_set_branches(const cudaGraphConditionalHandle* handles, const int* count, const int* flag) {
  const unsigned int value = flag[0] != 0;
  const int n = count[0];
  for (int i = threadIdx.x; i < n; i += blockDim.x) cudaGraphSetConditional(handles[i], value);
}
"""
SETTER_THREADS = 128
MAX_BRANCHES = 4096  # handles one object holds (two per layer of a deep model is far below)


def setter_cubin(arch: str = "sm_90a") -> bytes:
    """NVRTC: the handle-setting kernel for `arch` (no device needed)."""
    return nvrtc.compile_cubin(SETTER_SOURCE, "graph_branch.cu", [f"--gpu-architecture={arch}"])


@functools.cache
def _setter(device_index: int):
    major, minor = torch.cuda.get_device_capability(device_index)
    return nvrtc.load_function(torch.device("cuda", device_index), setter_cubin(f"sm_{major}{minor}"), SETTER_NAME)


class _Body:
    """Records what runs inside it into one child graph of a conditional node."""

    def __init__(self, graph, side: torch.cuda.Stream) -> None:
        self._graph = graph
        self._side = side

    def __enter__(self) -> None:
        from cuda.bindings import driver

        # no wait on the outer stream: an event from a capturing stream would join the side stream to that capture
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        nvrtc.driver_ok(driver.cuStreamBeginCaptureToGraph(nvrtc.stream_handle(self._side), self._graph, None, None, 0, mode),
                        "cuStreamBeginCaptureToGraph")
        self._context = torch.cuda.stream(self._side)
        self._context.__enter__()

    def __exit__(self, *exc) -> None:
        from cuda.bindings import driver

        self._context.__exit__(*exc)
        nvrtc.driver_ok(driver.cuStreamEndCapture(nvrtc.stream_handle(self._side)), "cuStreamEndCapture (a branch body)")


class GraphBranches:
    """IF/ELSE conditional nodes of one graph under capture, all set from one device flag by `set_all`."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("create GraphBranches before the graph's capture (its handle table would be captured)")
        self._side = torch.cuda.Stream(self.device)  # records the bodies, one after another
        self._handles: list[int] = []
        self._table = torch.zeros(MAX_BRANCHES, dtype=torch.int64, device=self.device)  # filled by publish()
        self._table_count = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._published = 0
        _setter(self.device.index or 0)  # load the kernel now: module loads are not allowed during a capture

    def set_all(self, flag: torch.Tensor) -> None:
        """Launch (on the current stream, so inside the capture) the kernel that points every branch of this
        object at its IF body where flag[0] != 0 (int32, on the device), else at its ELSE body. Branches added
        after this call are covered too: the kernel reads the handle table that `publish` fills."""
        if flag.dtype != torch.int32 or flag.device != self.device or flag.numel() < 1:
            raise ValueError(f"the branch flag must be an int32 tensor on {self.device}; got {flag.dtype} on {flag.device}")
        values = [ctypes.c_void_p(self._table.data_ptr()), ctypes.c_void_p(self._table_count.data_ptr()),
                  ctypes.c_void_p(flag.data_ptr())]
        nvrtc.launch(_setter(self.device.index or 0), (1, 1, 1), SETTER_THREADS, self.device, values, "branch setter")

    @contextlib.contextmanager
    def if_else(self) -> Iterator[tuple[_Body, _Body]]:
        """Add an IF/ELSE node after what the current stream has captured so far; yields the two bodies to
        record into (`with then: ...`, `with otherwise: ...`); later captured work depends on the node."""
        from cuda.bindings import driver

        if len(self._handles) >= MAX_BRANCHES:
            raise RuntimeError(f"one GraphBranches holds at most {MAX_BRANCHES} branches")
        stream = nvrtc.stream_handle(torch.cuda.current_stream(self.device))
        info = nvrtc.driver_ok(driver.cuStreamGetCaptureInfo(stream), "cuStreamGetCaptureInfo")
        status, _, graph, deps, edges, num_deps = info
        if status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise RuntimeError("GraphBranches.if_else needs the current stream to be capturing a CUDA graph")
        ctx = nvrtc.driver_ok(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        # default 0 at every launch: a replay whose setter did not run takes the ELSE body
        handle = nvrtc.driver_ok(driver.cuGraphConditionalHandleCreate(graph, ctx, 0, driver.CU_GRAPH_COND_ASSIGN_DEFAULT),
                                 "cuGraphConditionalHandleCreate")
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
        params.conditional.size = 2  # IF/ELSE: body 0 when the value is nonzero, body 1 when it is 0
        params.conditional.ctx = ctx
        node = nvrtc.driver_ok(driver.cuGraphAddNode(graph, deps[:num_deps], edges[:num_deps] if edges else None,
                                                     num_deps, params), "cuGraphAddNode (conditional)")
        then_graph, else_graph = params.conditional.phGraph_out[0], params.conditional.phGraph_out[1]
        nvrtc.driver_ok(driver.cuStreamUpdateCaptureDependencies(
            stream, [node], None, 1, driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES),
            "cuStreamUpdateCaptureDependencies")
        self._handles.append(int(handle))
        yield _Body(then_graph, self._side), _Body(else_graph, self._side)

    def publish(self) -> None:
        """Write the handles added so far into the table `set_all` reads (outside any capture)."""
        if self._published == len(self._handles):
            return
        # handles are unsigned 64-bit: store their bits in int64
        bits = [h - (1 << 64) if h >= 1 << 63 else h for h in self._handles]
        self._table[: len(bits)].copy_(torch.tensor(bits, dtype=torch.int64))
        self._table_count.fill_(len(bits))
        self._published = len(bits)
