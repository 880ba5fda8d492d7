"""Engine (b) without a GPU: its LLM arguments are ones the Locks backend accepts, and it refuses
to start without CUDA with one clear error."""

from __future__ import annotations

import pytest
import torch

from locks_toolkit.kernels.vllm_backend.settings import parse_settings
from locks_toolkit.suites import engine_vllm
from locks_toolkit.suites.arms import parse_arm
from locks_toolkit.suites.engine_vllm import ByteTokenizer, VllmEngine, VllmUnavailableError
from locks_toolkit.suites.eval_runner import EvalConfigError, Request, config_from_mapping


def _engine(preset: bool) -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # skip the CUDA check: only the argument building is tested
    engine.model_name, engine.preset, engine.combine = ("tiny-llama" if preset else "/models/x"), preset, "group_max"
    engine.dummy_weights, engine.max_model_len, engine.gpu_memory_utilization = True, None, 0.5
    return engine


@pytest.mark.parametrize("label, budget", [("locks:r4i8", 256), ("quest", 64), ("oracle", 128), ("centroid", 512)])
def test_sparse_arm_kwargs_parse_as_backend_settings(label, budget):
    kwargs = _engine(preset=False)._llm_kwargs(Request(parse_arm(label), budget), max_len=5000)
    assert kwargs["attention_backend"] == "CUSTOM" and kwargs["load_format"] == "dummy"
    settings = parse_settings(kwargs["additional_config"]["locks"]).locks
    assert settings.scorer == parse_arm(label).scorer
    assert settings.selection.budget_tokens == budget and settings.selection.combine == "group_max"
    assert kwargs["block_size"] == 16 and kwargs["max_model_len"] == 5000


def test_dense_arm_uses_stock_backend_and_preset_gets_a_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    kwargs = _engine(preset=True)._llm_kwargs(Request(parse_arm("fullkv"), None), max_len=4200)
    assert "attention_backend" not in kwargs and "additional_config" not in kwargs
    assert kwargs["skip_tokenizer_init"] is True and kwargs["model"].endswith(tuple("0123456789abcdef"))


def test_arm_the_backend_does_not_serve():
    with pytest.raises(ValueError, match="not served by the vLLM backend"):
        _engine(preset=False)._llm_kwargs(Request(parse_arm("moment"), 64), max_len=100)


def test_an_unserved_arm_fails_before_anything_runs(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from locks_toolkit.locks_cli.main import app

    raw = {"suite": "ruler", "tasks": "niah_single_1", "lengths": "1k", "budgets": "64", "model": "tiny-llama",
           "out": str(tmp_path / "o.jsonl"), "engine": "vllm", "arms": "fullkv,quest,moment"}  # fmt: skip
    with pytest.raises(EvalConfigError, match=r"^arm moment is not served by the vLLM backend; use one of"):
        config_from_mapping(raw)
    assert config_from_mapping({**raw, "engine": "transformers"}).arms[-1].label == "moment"

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was loaded before the arms were checked")

    monkeypatch.setattr(engine_vllm, "load_vllm_engine", no_engine)
    result = CliRunner().invoke(app, ["eval", "run", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "1k",
                                      "--arms", "fullkv,moment", "--budgets", "64", "--engine", "vllm",
                                      "--model", "tiny-llama", "--out", raw["out"]])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "not served by the vLLM backend" in " ".join(result.output.split())
    assert not (tmp_path / "o.jsonl").exists()


def test_no_cuda_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VllmUnavailableError, match="needs a CUDA GPU"):
        engine_vllm.load_vllm_engine("tiny-llama", dummy_weights=True)


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "The special magic number is 7421935.\nnext"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("\n") == [ByteTokenizer.newline_id]


def test_engine_processes_are_spawned_unless_the_user_chose(monkeypatch):
    """A forked engine core cannot use CUDA once this process has (the H200 eval run failed so)."""
    from types import SimpleNamespace

    from locks_toolkit.suites.engine_hf import StopRule

    seen = []

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.append(engine_vllm.os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))

        def generate(self, prompts, params):
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], text="", stop_reason=None,
                                                             finish_reason="length")]) for _ in prompts]

    engine = _engine(preset=False)
    engine.vllm = SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: kw)
    engine.tokenizer = ByteTokenizer()
    monkeypatch.setattr(engine_vllm, "_free_gpu", lambda: None)
    instance = SimpleNamespace(instance_id="i0", prompt="abc")
    request = Request(parse_arm("fullkv"), None)
    stop = StopRule(max_new_tokens=2, newline=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert len(list(engine.run([instance], {"i0": [request]}, stop))) == 1
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    list(engine.run([instance], {"i0": [request]}, stop))
    assert seen == ["spawn", "fork"]
