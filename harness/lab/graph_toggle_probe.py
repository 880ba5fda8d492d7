"""What switching between two recorded decode paths costs when the graph's own first kernel switches them off.

The dense crossover (issue "Never slower than dense") needs a decode graph captured once to run either the
sparse path or dense attention, chosen per step on the device. IF/ELSE conditional nodes cost +6.4 µs a layer
and kernels that return at once on a flag ~1 µs a node (`docs/decisions.md`). This probe prices the one
mechanism left inside a graph: device-updatable kernel nodes (CUDA 12.4+, `CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_
KERNEL_NODE`), which a kernel earlier in the same launch enables or disables (`cudaGraphKernelNodeSetEnabled`);
a disabled node runs as an empty one.

Graphs of L "layers" of tiny kernels (each block's thread 0 counts itself), DENSE_KERNELS a dense path and
SPARSE_KERNELS a sparse one, timed idle GPU to done (`graph_launch_probe.replay_times`):
- `dense`, `sparse`: one path alone (the floor of each choice);
- `toggled_dense`, `toggled_sparse`: both paths recorded as device-updatable nodes behind one planner kernel
  that enables the flagged path's nodes and disables the others, every replay;
- `kept_dense`, `kept_sparse`: the same, but the planner updates the nodes only when the flag changes (the steady
  state of a step that runs the path the step before ran);
- `mixed_dense`, `mixed_sparse`: only the sparse nodes device-updatable, the dense ones plain kernels that return
  at once unless flagged: the fallback if kernels launched by others (FlashInfer's, FA3's) can't be opted in,
  and can only be handed no work.
`--foreign` asks the question for kernels launched by others: every kernel is a torch add (one block), and the
toggled ones are opted into device updates after their capture (the capture's leaf walked back to the node before,
`cuGraphKernelNodeSetAttribute`), as the backend would have to do with FlashInfer's or FA3's decode kernels.
Each graph is uploaded (`cuGraphUpload`) before its first replay, as the driver asks of graphs whose nodes are
updated from the device, unless `--no-upload` (torch's replay alone: what a graph captured by vLLM gets).
The block counts of the first replays say which nodes ran: the mode's flag twice (do device-side updates persist
across launches?), then, where both paths are recorded, the other flag and back; a mode whose counts differ from
its flag fails the probe. The timed replays run with the mode's own flag.

    python3 -m locks_toolkit.harness.lab.graph_toggle_probe --layers 40 [--foreign] [--no-upload] --out toggle.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ...kernels.config import ConfigError

log = logging.getLogger(__name__)
SCHEMA = "locks.bench.graph_toggle/1"
DENSE_KERNELS = 2  # FlashInfer's / FA3's decode: the attention kernel and its split combine
SPARSE_KERNELS = 4  # Locks at 16K-32K: score, select (one launch), decode, merge
MODES = ("dense", "sparse", "toggled_dense", "toggled_sparse", "kept_dense", "kept_sparse", "mixed_dense", "mixed_sparse")
TOGGLED = ("toggled", "kept")  # both paths device-updatable; "kept": the planner updates only when the flag changes
DENSE, SPARSE = 0, 1  # the planner's flag values
THREADS = 128

SOURCE = rb"""
extern "C" __global__ void count_blocks(unsigned int* count) {
  if (threadIdx.x == 0) atomicAdd(count, 1u);
}
// A dense-path kernel handed no work: returns at once unless the step is flagged dense.
extern "C" __global__ void count_blocks_if(unsigned int* count, const int* flag, int path) {
  if (*flag != path) return;
  if (threadIdx.x == 0) atomicAdd(count, 1u);
}
// One block: enables the nodes of the flagged path and disables every other one. on_change: only when the flag
// differs from the one applied last (device-side updates stay in the executable graph until the host updates it).
extern "C" __global__ void plan_paths(const cudaGraphDeviceNode_t* nodes, const int* node_path, int num_nodes,
                                      const int* flag, int* applied, int on_change) {
  const int want = *flag;
  if (on_change && *applied == want) return;  // every thread reads before thread 0 writes below
  for (int i = threadIdx.x; i < num_nodes; i += blockDim.x) cudaGraphKernelNodeSetEnabled(nodes[i], node_path[i] == want);
  __syncthreads();
  if (threadIdx.x == 0) *applied = want;
}
"""

_DEVICE_UPDATABLE = 13  # CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE (cuda.h, CUDA 12.4+)


class _Updatable(ctypes.Structure):
    _fields_ = [("device_updatable", ctypes.c_int), ("dev_node", ctypes.c_void_p)]


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("updatable", _Updatable)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of cuLaunchKernelEx."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def device_runtime_library() -> str:
    """libcudadevrt.a, which code calling the device-side graph API links against: $LOCKS_CUDADEVRT, the CUDA
    toolkit's, or the pip CUDA runtime's."""
    candidates = [os.environ.get("LOCKS_CUDADEVRT", "")]
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if root:
            candidates += [os.path.join(root, "lib64", "libcudadevrt.a"), os.path.join(root, "lib", "libcudadevrt.a")]
    import site

    for packages in site.getsitepackages() + [site.getusersitepackages()]:
        candidates += sorted(glob.glob(os.path.join(packages, "nvidia", "*", "lib", "libcudadevrt.a")))
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    raise ConfigError("libcudadevrt.a not found (the device-side graph API links against it): install the CUDA "
                      "runtime wheel (pip install nvidia-cuda-runtime) or set LOCKS_CUDADEVRT to the file")


def build_cubin(arch: str = "sm_90") -> bytes:
    """SOURCE compiled relocatable by NVRTC and linked with the device runtime by nvJitLink (no device needed)."""
    from cuda.bindings import nvjitlink

    from ...kernels.nvrtc import compile_cubin

    relocatable = compile_cubin(SOURCE, "graph_toggle_probe.cu", [f"-arch={arch}", "-rdc=true"])
    handle = nvjitlink.create(1, [f"-arch={arch}"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, relocatable, len(relocatable), "graph_toggle_probe.cubin")
        nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, device_runtime_library())
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            log_size = nvjitlink.get_error_log_size(handle)
            text = bytearray(log_size)
            nvjitlink.get_error_log(handle, text)
            raise RuntimeError(f"nvJitLink could not link the probe: {text.decode(errors='replace')}") from exc
        linked = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, linked)
        return bytes(linked)
    finally:
        nvjitlink.destroy(handle)


@dataclass(frozen=True)
class Kernels:
    count: int  # CUfunction handles
    count_if: int
    plan: int


class Driver:
    """The driver calls the probe makes through libcuda itself: cuLaunchKernelEx with a launch attribute whose
    output (the device node handle) the caller reads back; the capture's graph walked back from its leaf, to make
    kernels launched by others (torch here; FlashInfer or FA3 in an engine) device-updatable after the fact; and
    cuGraphUpload."""

    def __init__(self) -> None:
        lib = self.lib = ctypes.CDLL("libcuda.so.1")
        p = ctypes.c_void_p
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), p, ctypes.POINTER(p), p]
        lib.cuGraphUpload.argtypes = [p, p]
        lib.cuStreamGetCaptureInfo_v3.argtypes = [p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                                                  ctypes.POINTER(p), ctypes.POINTER(ctypes.POINTER(p)), ctypes.POINTER(p),
                                                  ctypes.POINTER(ctypes.c_size_t)]
        lib.cuGraphNodeGetDependencies_v2.argtypes = [p, ctypes.POINTER(p), p, ctypes.POINTER(ctypes.c_size_t)]
        lib.cuGraphNodeGetType.argtypes = [p, ctypes.POINTER(ctypes.c_int)]
        lib.cuGraphKernelNodeSetAttribute.argtypes = [p, ctypes.c_int, ctypes.POINTER(_AttrValue)]
        lib.cuGraphKernelNodeGetAttribute.argtypes = [p, ctypes.c_int, ctypes.POINTER(_AttrValue)]

    def launch(self, function: int, grid: int, stream: int, args: Sequence[ctypes._SimpleCData],
               device_updatable: bool = False) -> int | None:
        """Launch on `stream`; returns the node's device handle when `device_updatable` (the stream must be capturing)."""
        attr = LaunchAttribute(id=_DEVICE_UPDATABLE)
        attr.value.updatable.device_updatable = 1
        config = LaunchConfig(grid, 1, 1, THREADS, 1, 1, 0, stream, ctypes.pointer(attr) if device_updatable else None,
                              1 if device_updatable else 0)
        values = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        _ok(self.lib.cuLaunchKernelEx(ctypes.byref(config), function, values, None), "cuLaunchKernelEx")
        return attr.value.updatable.dev_node if device_updatable else None

    def capture_leaf(self, stream: int) -> int | None:
        """The node the next work captured on `stream` will depend on (None at the start of the capture)."""
        status, capture_id, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
        deps, edges, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_void_p(), ctypes.c_size_t()
        _ok(self.lib.cuStreamGetCaptureInfo_v3(stream, ctypes.byref(status), ctypes.byref(capture_id), ctypes.byref(graph),
                                               ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count)),
            "cuStreamGetCaptureInfo")
        if status.value != _CAPTURE_ACTIVE:
            raise RuntimeError(f"stream {stream:#x} is not capturing (status {status.value})")
        if count.value > 1:
            raise RuntimeError(f"{count.value} capture dependencies: the probe's work must be one chain")
        return deps[0] if count.value else None

    def kernel_nodes_since(self, leaf: int | None, earlier: int | None) -> list[int]:
        """The kernel nodes captured after `earlier` up to `leaf`, oldest first (one chain of nodes)."""
        nodes, node = [], leaf
        while node is not None and node != earlier:
            kind = ctypes.c_int()
            _ok(self.lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
            if kind.value == _KERNEL_NODE:
                nodes.append(node)
            dep, count = ctypes.c_void_p(), ctypes.c_size_t(1)
            _ok(self.lib.cuGraphNodeGetDependencies_v2(node, ctypes.byref(dep), None, ctypes.byref(count)),
                "cuGraphNodeGetDependencies")
            node = dep.value if count.value else None
        return nodes[::-1]

    def make_updatable(self, node: int) -> int:
        """Opt a captured kernel node into device updates; its device handle."""
        value = _AttrValue()
        value.updatable.device_updatable = 1
        _ok(self.lib.cuGraphKernelNodeSetAttribute(node, _DEVICE_UPDATABLE, ctypes.byref(value)), "cuGraphKernelNodeSetAttribute")
        out = _AttrValue()
        _ok(self.lib.cuGraphKernelNodeGetAttribute(node, _DEVICE_UPDATABLE, ctypes.byref(out)), "cuGraphKernelNodeGetAttribute")
        return out.updatable.dev_node or 0

    def upload(self, graph_exec: int, stream: int) -> None:
        _ok(self.lib.cuGraphUpload(graph_exec, stream), "cuGraphUpload")


_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


def _ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver {what} failed with CUresult {code}")


def modes(foreign: bool) -> tuple[str, ...]:
    """The graphs a run times: with foreign kernels no mixed modes (every kernel is made device-updatable)."""
    return MODES[:6] if foreign else MODES


def expected_blocks(flag: int, layers: int, grid: int) -> dict:
    """Blocks of each path a replay flagged `flag` must count (every mode records the path its flag names)."""
    return {"flag": flag, "dense_blocks": DENSE_KERNELS * layers * grid * (flag == DENSE),
            "sparse_blocks": SPARSE_KERNELS * layers * grid * (flag == SPARSE)}


def updatable_nodes(mode: str, layers: int) -> int:
    """Device-updatable nodes of a `mode` graph: both paths' when toggled, the sparse path's when mixed."""
    if mode.startswith(TOGGLED):
        return (DENSE_KERNELS + SPARSE_KERNELS) * layers
    return SPARSE_KERNELS * layers if mode.startswith("mixed") else 0


def time_toggle_graphs(layers: int, grid: int, reps: int, upload: bool, foreign: bool = False) -> list[dict]:
    """One cell per mode (see the module docstring), with the blocks each path counted in one replay. `foreign`:
    every kernel is a torch add of one element (one block), made device-updatable after its capture."""
    import torch

    from ...kernels.nvrtc import load_function
    from .graph_launch_probe import replay_times

    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    cubin = build_cubin(f"sm_{major}{minor}")
    kernels = Kernels(*(int(load_function(device, cubin, name)) for name in ("count_blocks", "count_blocks_if", "plan_paths")))
    driver = Driver()
    counts = torch.zeros(2, dtype=torch.int32, device=device)  # blocks counted by the dense, sparse kernels
    totals = torch.zeros(2, dtype=torch.float32, device=device)  # the foreign kernels' counts
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    applied = torch.zeros(1, dtype=torch.int32, device=device)  # the flag the planner applied last
    table = torch.zeros(updatable_nodes("toggled_dense", layers), dtype=torch.int64, device=device)
    table_path = torch.zeros_like(table, dtype=torch.int32)
    ptr = lambda t, i=0: ctypes.c_void_p(t.data_ptr() + i * t.element_size())  # noqa: E731
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):  # warm torch's add kernel outside any capture
        totals[0:1].add_(0.0)
    torch.cuda.synchronize()
    cells = []
    for mode in modes(foreign):
        want = DENSE if mode == "dense" or mode.endswith("_dense") else SPARSE
        num_updatable = updatable_nodes(mode, layers)
        handles: list[int] = []
        paths: list[int] = []

        def launch(path: int) -> None:
            updatable = mode.startswith(TOGGLED) or (mode.startswith("mixed") and path == SPARSE)
            if foreign:
                before = driver.capture_leaf(stream.cuda_stream) if updatable else None
                totals[path:path + 1].add_(1.0)
                if updatable:
                    added = driver.kernel_nodes_since(driver.capture_leaf(stream.cuda_stream), before)
                    handles.extend(driver.make_updatable(node) for node in added)
                    paths.extend([path] * len(added))
                return
            if mode.startswith("mixed") and path == DENSE:  # a plain kernel with nothing to do unless flagged
                driver.launch(kernels.count_if, grid, stream.cuda_stream, [ptr(counts, DENSE), ptr(flag), ctypes.c_int(DENSE)])
                return
            handle = driver.launch(kernels.count, grid, stream.cuda_stream, [ptr(counts, path)], updatable)
            if updatable:
                handles.append(handle or 0)
                paths.append(path)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            if num_updatable:  # the planner reads the handle table at replay; it is filled after capture
                driver.launch(kernels.plan, 1, stream.cuda_stream, [ptr(table), ptr(table_path), ctypes.c_int(num_updatable),
                                                                    ptr(flag), ptr(applied), ctypes.c_int(mode.startswith("kept"))])
            for _ in range(layers):
                for path, kernels_per_layer in ((DENSE, DENSE_KERNELS), (SPARSE, SPARSE_KERNELS)):
                    if mode != ("sparse", "dense")[path]:
                        for _ in range(kernels_per_layer):
                            launch(path)
        if len(handles) != num_updatable or not all(handles):
            raise RuntimeError(f"{mode}: the driver returned {sum(map(bool, handles))} device node handles for "
                               f"{num_updatable} device-updatable kernels")
        if num_updatable:
            table[:num_updatable].copy_(torch.tensor(handles, dtype=torch.int64))
            table_path[:num_updatable].copy_(torch.tensor(paths, dtype=torch.int32))
        if upload:
            driver.upload(graph.raw_cuda_graph_exec(), stream.cuda_stream)
        applied.fill_(-1)
        replays = []
        # twice the mode's own flag (do device-side updates persist?), then, where both paths are recorded, the other
        # flag and back: the timed replays run with the mode's own
        for step_flag in (want, want) + ((1 - want, want) if num_updatable else ()):
            flag.fill_(step_flag)
            counts.zero_(), totals.zero_()
            graph.replay()
            torch.cuda.synchronize()
            ran = [int(v) for v in (totals if foreign else counts).tolist()]
            replays.append({"flag": step_flag, "dense_blocks": ran[DENSE], "sparse_blocks": ran[SPARSE]})
        cells.append({"layers": layers, "grid": 1 if foreign else grid, "mode": mode, "kernels": "torch" if foreign else "probe",
                      "upload": upload, "updatable_nodes": num_updatable, "replays": replays, **replay_times(graph, reps)})
        del graph
    return cells


def summarize(cells: Sequence[dict]) -> dict:
    """µs per layer of each mode (idle to done), what the switch adds to the path it runs, and whether every
    replay counted exactly the blocks its flag asks for."""
    by_mode = {c["mode"]: c for c in cells}
    wanted = modes(any(c.get("kernels") == "torch" for c in cells))
    missing = [m for m in wanted if m not in by_mode]
    if missing:
        raise ValueError(f"toggle cells lack modes {missing}")
    layers = by_mode["dense"]["layers"]
    per_layer = {m: by_mode[m]["idle_to_done_us"] / layers for m in wanted}
    over = {f"{m}_over_{m.split('_')[1]}_us": per_layer[m] - per_layer[m.split("_")[1]] for m in wanted if "_" in m}
    ran_as_flagged = all(r == expected_blocks(r["flag"], c["layers"], c["grid"]) for c in cells for r in c["replays"])
    return {"layers": layers, "us_per_layer": per_layer, **over, "ran_as_flagged": ran_as_flagged}


def markdown(cells: Sequence[dict], fit: dict) -> str:
    lines = ["| graph | updatable nodes | blocks counted (dense / sparse) by replay, flag | replay + sync µs | µs per layer |",
             "|---|---:|---|---:|---:|"]
    names = {DENSE: "dense", SPARSE: "sparse"}
    for c in cells:
        ran = "; ".join(f"{r['dense_blocks']} / {r['sparse_blocks']} ({names[r['flag']]})" for r in c["replays"])
        lines.append(f"| {c['mode']} | {c['updatable_nodes']} | {ran} | {c['idle_to_done_us']:.1f} | "
                     f"{fit['us_per_layer'][c['mode']]:.2f} |")
    over = ", ".join(f"{key[:-3].replace('_over_', ' over ')} {value:+.2f} µs" for key, value in fit.items() if key.endswith("_us"))
    lines.append(f"\nper layer: {over}; ran as flagged: {fit['ran_as_flagged']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=40, help="layers of each probed graph")
    parser.add_argument("--grid", type=int, default=132, help="blocks of each tiny kernel (132: one per H200 SM)")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--no-upload", action="store_true", help="replay without cuGraphUpload first (as a vLLM graph)")
    parser.add_argument("--foreign", action="store_true",
                        help="torch's kernels instead of the probe's, made device-updatable after their capture")
    parser.add_argument("--out", help="JSONL file the record is appended to")
    args = parser.parse_args(argv)
    try:
        if args.layers < 1 or args.grid < 1 or args.reps < 1:
            raise ConfigError(f"--layers, --grid and --reps must be positive (got {args.layers}, {args.grid}, {args.reps})")
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("the graph-toggle probe needs a CUDA device (it times CUDA-graph replays); run it on the GPU")
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    from ..provenance import collect, reproduce_command

    record = {"schema": SCHEMA, "provenance": collect(reproduce_command(), schema=SCHEMA)}
    try:
        record["cells"] = time_toggle_graphs(args.layers, args.grid, args.reps, upload=not args.no_upload,
                                             foreign=args.foreign)
        record["fit"] = summarize(record["cells"])
    except (RuntimeError, ConfigError) as exc:  # the driver refused a step: keep its words in the record
        record["error"] = str(exc)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    if "fit" not in record:
        log.error("the toggle probe stopped: %s", record["error"])
        return 1
    sys.stdout.write(markdown(record["cells"], record["fit"]) + "\n")
    if not record["fit"]["ran_as_flagged"]:
        log.error("a graph ran other nodes than its flag asked for: %s", record["cells"])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
