"""What `--model` accepts, resolved once for every command (suites/model_source.py)."""

import json
import os
from pathlib import Path

import pytest
from locks_toolkit.kernels.config import ConfigError
from locks_toolkit.locks_cli.main import app
from locks_toolkit.suites import model_source
from locks_toolkit.suites.eval_runner import EvalConfig, EvalConfigError, check_model
from locks_toolkit.suites.fidelity import MicroscopeConfig
from locks_toolkit.suites.model_source import resolve_model_source, vllm_model_dir
from typer.testing import CliRunner


def test_each_form_of_model_resolves_to_its_kind(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    gguf = tmp_path / "m.GGUF"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source("gemma3-270m").kind == "package"
    assert resolve_model_source("tiny-llama").kind == "preset" and not resolve_model_source("tiny-llama").real_weights
    assert resolve_model_source(str(folder)) == model_source.ModelSource("hf_dir", str(folder.resolve()), folder.resolve())
    assert resolve_model_source(str(gguf)).kind == "gguf" and resolve_model_source(str(gguf)).path == gguf.resolve()
    assert resolve_model_source("google/gemma-3-270m").kind == "hub"


@pytest.mark.parametrize("make,message", [
    (lambda tmp: tmp / "nothing.gguf", "does not exist"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "has no config.json"),
    (lambda tmp: (tmp / "w.bin").write_bytes(b"x") and tmp / "w.bin", "is not a .gguf file"),
])
def test_a_model_that_names_nothing_loadable_is_refused_with_what_is_accepted(tmp_path, make, message):
    with pytest.raises(ValueError, match=message) as error:
        resolve_model_source(str(make(tmp_path)))
    assert "gemma3-270m" in str(error.value)


def _recording_export(exported: list):
    """A stand-in for export_hf_dir that writes only config.json and records each target."""

    def export(loaded, target):
        exported.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        return target

    return export


def test_a_gguf_converts_once_and_again_after_it_changes(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF v1")
    exported = []
    monkeypatch.setattr(model_source, "export_hf_dir", _recording_export(exported))
    monkeypatch.setattr(model_source, "load_transformers", lambda source, dtype=None: "loaded")
    source = resolve_model_source(str(gguf))
    first = vllm_model_dir(source, tmp_path / "cache")
    assert vllm_model_dir(source, tmp_path / "cache") == first and len(exported) == 1  # reused
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    assert vllm_model_dir(source, tmp_path / "cache") != first and len(exported) == 2  # an edited file converts again
    assert first.name.startswith("m-") and first.parent == tmp_path / "cache" / "locks-toolkit" / "gguf-hf"


def test_a_gguf_is_dequantized_once_and_later_loads_read_the_kept_folder(tmp_path, monkeypatch):
    import torch

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF v1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    loads, exported = [], []

    def fake_load(folder, gguf_name, source, dtype):
        loads.append((Path(folder), gguf_name))
        return f"model from {gguf_name or Path(folder).name}"

    monkeypatch.setattr(model_source, "load_hf_model", fake_load)
    monkeypatch.setattr(model_source, "export_hf_dir", _recording_export(exported))
    source = resolve_model_source(str(gguf))
    assert model_source.load_transformers(source) == "model from m.gguf" and exported == [model_source.converted_dir(gguf)]
    assert model_source.load_transformers(source) == f"model from {exported[0].name}"  # the folder, not the GGUF
    assert loads[1] == (exported[0], None) and len(exported) == 1
    assert vllm_model_dir(source) == exported[0]  # vLLM reads the same folder
    model_source.load_transformers(source, torch.bfloat16)
    assert len(exported) == 1  # another dtype reads the kept fp32 folder and exports nothing


def test_a_cache_that_cannot_be_written_only_costs_the_next_load_its_time(tmp_path, monkeypatch, caplog):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF v1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(model_source, "load_hf_model", lambda folder, name, source, dtype: "loaded")

    def full(loaded, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_source, "export_hf_dir", full)
    assert model_source.load_transformers(resolve_model_source(str(gguf))) == "loaded"
    assert "could not keep the dequantized m.gguf" in caplog.text


def test_engines_refuse_what_they_cannot_load_before_any_work(tmp_path):
    from locks_toolkit.suites.arms import parse_arms as arms

    config = EvalConfig(suite="ruler", tasks=("niah_single_1",), lengths=(4096,), samples=1, budgets=(64,),
                        arms=arms(["fullkv"]), model="tiny-llama", out=tmp_path / "o.jsonl")
    with pytest.raises(EvalConfigError, match="dummy weights only"):
        check_model(config)
    with pytest.raises(EvalConfigError, match="does not exist"):
        check_model(EvalConfig(**{**config.__dict__, "model": str(tmp_path / "x.gguf")}))
    with pytest.raises(ConfigError, match="is a preset"):
        MicroscopeConfig(model="tiny-llama")
    assert "--model gemma3-270m" in MicroscopeConfig().reproduce_command()


def test_bench_decode_refuses_a_missing_gguf_with_the_fix(tmp_path):
    result = CliRunner().invoke(app, ["bench", "decode", "--model", str(tmp_path / "gone.gguf"), "--dry-run"])
    assert result.exit_code != 0
    text = " ".join(result.stderr.split())
    assert "does not exist" in text and "hint:" in text


class _SplitTokenizer:
    """Encodes each word as `pieces` tokens (1-2: a subword tokenizer; 3+: what a broken conversion gives)."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces

    def encode(self, text: str) -> list[int]:
        return [1] + [7] * (self.pieces * len(text.split()))


@pytest.mark.parametrize("pieces, broken", [(1, False), (2, False), (3, True)])
def test_a_gguf_tokenizer_that_shreds_words_is_refused_with_the_fix(pieces, broken):
    from locks_toolkit.suites.models import TokenizerError, check_tokenizer

    if not broken:
        check_tokenizer(_SplitTokenizer(pieces), "m.gguf")
        return
    with pytest.raises(TokenizerError, match="m.gguf splits 26 plain English words into 79 tokens.*beside the GGUF file"):
        check_tokenizer(_SplitTokenizer(pieces), "m.gguf")


class _NewForward:
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs): ...


class _OldForward:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...


@pytest.mark.parametrize(("model", "keyword"), [(_NewForward(), "cache"), (_OldForward(), "past_key_values")])
def test_the_cache_goes_under_the_keyword_the_installed_transformers_reads(model, keyword):
    from locks_toolkit.suites.models import with_cache

    cache = object()
    assert with_cache(model, cache) == {keyword: cache, "use_cache": True}
