"""The L2 prefetch kernel on a CPU machine: NVRTC compiles it for sm_90 into one bulk L2 prefetch a thread and no
load or store (it moves nothing through the SM), the launch covers every byte once, and `fits` says why a tensor
is not served. Whether it pays is measured on the GPU (`harness/lab/prefetch_probe.py`, `docs/lease/prefetch-ab.sh`)."""

from __future__ import annotations

import re

import pytest
import torch
from locks_toolkit.harness.lab.compile_report import _cuobjdump
from locks_toolkit.kernels import prefetch


def test_compiles_to_one_bulk_prefetch_and_no_memory_access():
    sass = _cuobjdump(prefetch.compile_cubin(), "-sass")
    opcodes = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\d\s+)?([A-Z][A-Z0-9_.]*)", sass)
    assert opcodes.count("UBLKPF.L2") == 1
    assert not [op for op in opcodes if op.startswith(("LDG", "STG", "LD.", "ST.", "ATOM", "RED"))]


@pytest.mark.parametrize("nbytes", [16, prefetch.CHUNK, prefetch.CHUNK + 16, 32 << 20, (32 << 20) + 48])
def test_the_launch_gives_every_chunk_one_thread(nbytes):
    threads = prefetch.programs(nbytes) * prefetch.THREADS
    chunks = -(-nbytes // prefetch.CHUNK)
    assert chunks <= threads < chunks + prefetch.THREADS


def test_a_cpu_tensor_is_declined_with_the_reason():
    assert prefetch.fits(torch.zeros(4, 4)) == "not an sm_90 device"
