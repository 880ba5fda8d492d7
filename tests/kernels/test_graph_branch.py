"""The device-side branch setter compiles for the H200 on a CPU machine (the branches themselves need a GPU:
`python -m locks_toolkit.harness.lab.graph_launch_probe --branches 40` runs and checks them there)."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings", reason="cuda-bindings comes with torch's CUDA wheels")


def test_the_branch_setter_compiles_for_sm90_with_the_graph_api_call():
    from cuda.bindings import nvrtc
    from locks_toolkit.kernels import graph_branch

    cubin = graph_branch.setter_cubin("sm_90a")
    assert cubin[:4] == b"\x7fELF" and graph_branch.SETTER_NAME.encode() in cubin
    # the same source without the device runtime's declaration does not compile: the test reads the compiler
    broken = graph_branch.SETTER_SOURCE.replace(b"extern \"C\" __device__ __cudart_builtin__", b"// ")
    err, prog = nvrtc.nvrtcCreateProgram(broken, b"broken.cu", 0, [], [])
    (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_90a"])
    nvrtc.nvrtcDestroyProgram(prog)
    assert err != nvrtc.nvrtcResult.NVRTC_SUCCESS


def test_branches_refuse_to_be_made_inside_a_capture(monkeypatch):
    import torch
    from locks_toolkit.kernels import graph_branch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before the graph's capture"):
        graph_branch.GraphBranches("cuda:0")
