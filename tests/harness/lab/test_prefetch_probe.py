"""The prefetch probe on a CPU machine: one clear error naming where it runs. Its timings come from the GPU only
(`docs/lease/prefetch-ab.sh`); the kernel it times is `kernels/prefetch.py`'s (tests/kernels/test_prefetch.py)."""

from __future__ import annotations

from locks_toolkit.harness.lab import prefetch_probe


def test_without_an_sm90_gpu_it_exits_with_the_fix(capsys, tmp_path):
    out = tmp_path / "probe.jsonl"
    assert prefetch_probe.main(["--contexts", "16k", "--out", str(out)]) == 2
    assert "needs an sm_90 GPU" in capsys.readouterr().err and not out.exists()
