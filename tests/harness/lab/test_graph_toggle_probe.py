"""The graph-toggle probe off the GPU: its CUDA source compiles and links against the device runtime (NVRTC and
nvJitLink need no device), its launch structs match the driver's layout, and its bookkeeping of which nodes ran."""

from __future__ import annotations

import ctypes
import json

import pytest
from locks_toolkit.harness.lab import graph_toggle_probe as probe
from locks_toolkit.kernels.config import ConfigError


def test_the_probe_kernels_link_against_the_device_runtime():
    cubin = probe.build_cubin("sm_90")
    assert cubin[:4] == b"\x7fELF"
    for name in (b"count_blocks", b"count_blocks_if", b"plan_paths"):
        assert name in cubin
    # the planner's device-side graph update is resolved from libcudadevrt.a, not left undefined
    assert b"cudaGraphKernelNodeSetEnabled" in cubin


def test_launch_structs_have_the_driver_layout():
    """cuda.h: CUlaunchAttribute is {int id; char pad[4]; 64-byte value}, the device-updatable value {int; handle};
    CUlaunchConfig is six grid/block uints, the shared bytes, then the stream, attrs and their count."""
    assert ctypes.sizeof(probe.LaunchAttribute) == 72 and probe.LaunchAttribute.value.offset == 8
    assert probe._Updatable.dev_node.offset == 8
    assert (probe.LaunchConfig.stream.offset, probe.LaunchConfig.attrs.offset, probe.LaunchConfig.num_attrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(probe.LaunchConfig) == 56


def _cells(layers: int = 3, grid: int = 5, off_by: int = 0, foreign: bool = False) -> list[dict]:
    cells = []
    for i, mode in enumerate(probe.modes(foreign)):
        want = probe.DENSE if mode == "dense" or mode.endswith("_dense") else probe.SPARSE
        flags = [want, want] + ([1 - want, want] if probe.updatable_nodes(mode, layers) else [])
        replays = [probe.expected_blocks(f, layers, grid) for f in flags]
        if mode == "kept_sparse":  # dense kernels that ran on the replay after the flip back
            replays[-1] = {**replays[-1], "dense_blocks": replays[-1]["dense_blocks"] + off_by}
        cells.append({"layers": layers, "grid": grid, "mode": mode, "upload": True, "kernels": "torch" if foreign else "probe",
                      "updatable_nodes": probe.updatable_nodes(mode, layers), "replays": replays,
                      "idle_to_done_us": 10.0 * layers + i * layers})
    return cells


def test_each_mode_counts_only_its_flagged_path():
    assert probe.expected_blocks(probe.DENSE, 40, 132) == {"flag": probe.DENSE, "dense_blocks": 2 * 40 * 132, "sparse_blocks": 0}
    assert probe.expected_blocks(probe.SPARSE, 40, 132) == {"flag": probe.SPARSE, "dense_blocks": 0, "sparse_blocks": 4 * 40 * 132}
    assert probe.updatable_nodes("toggled_sparse", 40) == 240 and probe.updatable_nodes("kept_dense", 40) == 240
    assert probe.updatable_nodes("mixed_dense", 40) == 160
    assert probe.updatable_nodes("dense", 40) == 0


def test_summary_prices_each_switch_against_its_own_path_and_catches_a_wrong_count():
    fit = probe.summarize(_cells())
    assert fit["ran_as_flagged"]
    per_layer = fit["us_per_layer"]
    assert per_layer["dense"] == pytest.approx(10.0) and per_layer["toggled_sparse"] == pytest.approx(13.0)
    assert fit["toggled_dense_over_dense_us"] == pytest.approx(2.0) and fit["kept_sparse_over_sparse_us"] == pytest.approx(4.0)
    assert fit["mixed_sparse_over_sparse_us"] == pytest.approx(6.0)
    table = probe.markdown(_cells(), fit)
    assert "| toggled_sparse | 18 | 0 / 60 (sparse); 0 / 60 (sparse); 30 / 0 (dense); 0 / 60 (sparse) |" in table
    assert "| dense | 0 | 30 / 0 (dense); 30 / 0 (dense) |" in table and "toggled_dense over dense +2.00 µs" in table
    assert not probe.summarize(_cells(off_by=5))["ran_as_flagged"]  # dense kernels ran in a sparse-flagged replay
    with pytest.raises(ValueError, match="lack modes"):
        probe.summarize(_cells()[:-1])
    foreign = probe.summarize(_cells(foreign=True))  # kernels launched by others: no mixed graphs
    assert foreign["ran_as_flagged"] and set(foreign["us_per_layer"]) == set(probe.MODES[:6])
    assert "mixed_sparse_over_sparse_us" not in foreign


def test_the_device_runtime_can_be_named_and_bad_input_stops_before_the_gpu(tmp_path, monkeypatch):
    library = tmp_path / "libcudadevrt.a"
    library.write_bytes(b"!<arch>\n")
    monkeypatch.setenv("LOCKS_CUDADEVRT", str(library))
    assert probe.device_runtime_library() == str(library)
    out = tmp_path / "toggle.jsonl"
    assert probe.main(["--layers", "0", "--out", str(out)]) == 2 and not out.exists()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.main(["--out", str(out)]) == 2 and not out.exists()


def test_a_driver_refusal_is_kept_in_the_record(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def refuse(*_args, **_kwargs):
        raise RuntimeError("CUDA driver cuLaunchKernelEx failed with CUresult 1")

    monkeypatch.setattr(probe, "time_toggle_graphs", refuse)
    out = tmp_path / "toggle.jsonl"
    assert probe.main(["--out", str(out)]) == 1
    record = json.loads(out.read_text())
    assert record["schema"] == probe.SCHEMA and "CUresult 1" in record["error"] and "cells" not in record


def test_without_a_runtime_library_the_error_names_the_fix(monkeypatch):
    monkeypatch.setenv("LOCKS_CUDADEVRT", "")
    monkeypatch.setenv("CUDA_HOME", "")
    monkeypatch.setattr(probe.os.path, "isfile", lambda _path: False)
    with pytest.raises(ConfigError, match="LOCKS_CUDADEVRT"):
        probe.device_runtime_library()


class _FakeGraph:
    """libcuda's graph queries over a chain of nodes {id: (type, dependency or None)}."""

    def __init__(self, chain: dict[int, tuple[int, int | None]]):
        self.chain = chain

    def cuGraphNodeGetType(self, node, kind):
        kind._obj.value = self.chain[node][0]
        return 0

    def cuGraphNodeGetDependencies_v2(self, node, dep, _edges, count):
        parent = self.chain[node][1]
        count._obj.value = 0 if parent is None else 1
        if parent is not None:
            dep._obj.value = parent
        return 0


def test_the_nodes_a_foreign_launch_added_are_walked_back_to_the_node_before():
    driver = probe.Driver.__new__(probe.Driver)  # no libcuda here: the graph queries are faked
    # planner 10 <- kernel 11 <- memset 12 <- kernel 13: a launch that added 11..13 after the planner
    driver.lib = _FakeGraph({10: (0, None), 11: (0, 10), 12: (2, 11), 13: (0, 12)})
    assert driver.kernel_nodes_since(13, 10) == [11, 13]  # oldest first, the memset node left out
    assert driver.kernel_nodes_since(13, None) == [10, 11, 13]  # from the start of the capture
    assert driver.kernel_nodes_since(10, 10) == []
