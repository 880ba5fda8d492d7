"""Engine (b) without a GPU: the one per-request engine's LLM arguments and request settings are ones the
Locks backend accepts, and its streaming (each prompt prefilled once by its first request, then every other
request of it; the next prompts while earlier ones decode) hands each request its own output. The real CPU engine end to end: test_eval_vllm_engine.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from locks_toolkit.kernels.vllm_backend.settings import REQUEST_SETTINGS_PROCESSOR, parse_settings
from locks_toolkit.suites import engine_vllm
from locks_toolkit.suites.arms import parse_arm
from locks_toolkit.suites.engine_hf import StopRule
from locks_toolkit.suites.engine_vllm import ByteTokenizer, VllmEngine, request_settings
from locks_toolkit.suites.eval_runner import EvalConfigError, Request, config_from_mapping


def _engine(preset: bool, device: str = "cuda") -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # skip loading vLLM and a tokenizer: only the argument building is tested
    engine.model_name, engine.preset, engine.combine = ("tiny-llama" if preset else "/models/x"), preset, "group_max"
    engine.dummy_weights, engine.max_model_len, engine.gpu_memory_utilization = True, None, 0.5
    engine.device, engine._llm = device, None
    return engine


def test_the_engine_is_one_per_request_locks_engine_with_prefix_caching():
    kwargs, env = _engine(preset=False)._llm_kwargs("r4i8", 2048, max_len=5000)
    assert kwargs["attention_config"] == {"backend": "CUSTOM"} and kwargs["load_format"] == "dummy"
    assert kwargs["logits_processors"] == [REQUEST_SETTINGS_PROCESSOR]
    assert kwargs["enable_prefix_caching"] and kwargs["enforce_eager"] and kwargs["block_size"] == 16
    settings = parse_settings(kwargs["additional_config"]["locks"]).locks
    assert settings.summary.name == "r4i8" and settings.selection.budget_tokens == 2048
    assert settings.selection.combine == "group_max" and kwargs["max_model_len"] == 5000
    assert "LOCKS_VLLM_CPU" not in env


def test_on_a_machine_without_cuda_the_engine_is_the_cpu_platform(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    kwargs, env = _engine(preset=True, device="cpu")._llm_kwargs("r8i4", 512, max_len=4200)
    assert env["LOCKS_VLLM_CPU"] == "1" and kwargs["dtype"] == "float32" and "gpu_memory_utilization" not in kwargs
    assert kwargs["skip_tokenizer_init"] is True and kwargs["model"].endswith(tuple("0123456789abcdef"))


def test_the_engine_is_sized_within_the_models_positions(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768}')
    engine = _engine(preset=False)
    engine.model_name, engine.max_model_len = str(tmp_path), 32768 + 1024
    assert engine._engine_length(32768) == 32768  # a 32K RULER prompt + its generation fills the model exactly
    assert engine._engine_length(4000) == 32768
    engine.max_model_len = None
    assert engine._engine_length(4000) == 4016
    with pytest.raises(ValueError, match="holds 32768 positions; use shorter --lengths"):
        engine._engine_length(32769)
    engine.model_name = str(tmp_path / "absent")
    assert engine._engine_length(40000) == 40016


def test_gpu_memory_reaches_the_engine_and_a_bad_share_is_refused(tmp_path):
    from locks_toolkit.suites.eval_runner import load_eval_engine

    raw = {"suite": "ruler", "tasks": "niah_single_1", "lengths": "1k", "arms": "fullkv", "model": "tiny-llama",
           "out": str(tmp_path / "o.jsonl"), "engine": "vllm"}  # fmt: skip
    engine = load_eval_engine(config_from_mapping({**raw, "gpu_memory": 0.4}))
    engine.device = "cuda"  # the share is vLLM's on a GPU; the CPU engine sizes its cache otherwise
    assert engine._llm_kwargs("r8i4", 256, 2048)[0]["gpu_memory_utilization"] == 0.4
    assert load_eval_engine(config_from_mapping(raw)).gpu_memory_utilization == 0.85
    with pytest.raises(EvalConfigError, match=r"in \(0, 1\] \(got 1.5\); pass e.g. --gpu-memory 0.6"):
        config_from_mapping({**raw, "gpu_memory": 1.5})


@pytest.mark.parametrize("label, budget", [("locks:r4i8", 256), ("quest", 64), ("oracle", 128), ("centroid", 512),
                                           ("fullkv", None)])  # fmt: skip
def test_each_request_carries_its_arm_and_budget_as_the_backend_reads_them(label, budget):
    pytest.importorskip("vllm")
    from locks_toolkit.kernels.vllm_backend.request_settings import parse_request_selection

    selection = parse_request_selection(request_settings(Request(parse_arm(label), budget)))
    assert selection.scorer == (parse_arm(label).scorer or "dense") and selection.budget_tokens == budget


def test_arm_the_backend_does_not_serve():
    with pytest.raises(ValueError, match="not served by the vLLM backend"):
        engine_vllm.check_backend_arms([parse_arm("fullkv"), parse_arm("quest"), parse_arm("moment")])


def test_an_unserved_arm_fails_before_anything_runs(tmp_path, monkeypatch):
    from locks_toolkit.locks_cli.main import app
    from typer.testing import CliRunner

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


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "The special magic number is 7421935.\nnext"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("\n") == [ByteTokenizer.newline_id]


class _FakeCore:
    """vLLM's LLMEngine as the stream drives it: a request finishes after `max_tokens` steps, its output echoing
    its prompt and settings; `_FakeLLM.calls` holds the prompts added before each step."""

    vllm_config = None

    def __init__(self) -> None:
        self.added: list = []
        self.live: dict = {}  # request id -> [steps left, prompt, params]
        self.serial = 0

    def add(self, prompt, params) -> str:
        """As LLM.enqueue adds a request: it returns the internal id, the outputs carry the counter alone."""
        request_id, self.serial = str(self.serial), self.serial + 1
        self.added.append((prompt, params))
        self.live[request_id] = [params["max_tokens"], prompt, params]
        return f"{request_id}-a1b2c3d4"

    def step(self):
        _FakeLLM.calls.append([prompt for prompt, _ in self.added])
        _FakeLLM.max_tokens.append([params["max_tokens"] for _, params in self.added])
        self.added = []
        done = []
        for request_id, state in list(self.live.items()):
            state[0] -= 1
            if state[0] == 0:
                del self.live[request_id]
                text = f"{_text(state[1])} {state[2]['extra_args']}"
                done.append(SimpleNamespace(request_id=request_id, finished=True, outputs=[
                    SimpleNamespace(token_ids=[1], text=text, stop_reason=None, finish_reason="length")]))
        return done


class _FakeLLM:
    calls: list = []
    env: list = []
    max_tokens: list = []
    core = _FakeCore

    def __init__(self, **kwargs):
        _FakeLLM.env.append((engine_vllm.os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
                             engine_vllm.os.environ.get("VLLM_PLUGINS")))  # fmt: skip
        self.llm_engine = self.core()

    def enqueue(self, prompts, params, use_tqdm=True):
        return [self.llm_engine.add(prompt, sp) for prompt, sp in zip(prompts, params)]


def _steps() -> list[list[str]]:
    """The prompts added before each step that had any."""
    return [[_text(p) for p in call] for call in _FakeLLM.calls if call]


def _text(prompt) -> str:
    return ByteTokenizer().decode(prompt["prompt_token_ids"])


def _fake_engine(monkeypatch) -> VllmEngine:
    engine = _engine(preset=False)
    engine.vllm = SimpleNamespace(LLM=_FakeLLM, SamplingParams=lambda **kw: kw)
    engine.tokenizer = ByteTokenizer()
    monkeypatch.setattr(engine_vllm, "_free_gpu", lambda: None)
    _FakeLLM.calls.clear()
    _FakeLLM.env.clear()
    _FakeLLM.max_tokens.clear()
    return engine


def test_each_prompt_is_prefilled_once_then_every_other_request_reads_the_cache(monkeypatch):
    engine = _fake_engine(monkeypatch)
    instances = [SimpleNamespace(instance_id=f"i{n}", prompt=f"prompt {n}") for n in range(2)]
    requests = [Request(parse_arm("fullkv"), None), Request(parse_arm("locks:r8i4"), 64), Request(parse_arm("quest"), 128)]
    results = list(engine.run(instances, {i.instance_id: requests for i in instances}, StopRule(2, newline=False)))
    assert _steps() == [["prompt 0", "prompt 1"], ["prompt 0"] * 2 + ["prompt 1"] * 2]  # one request a prompt first
    assert len(results) == 6
    for instance, request, generation, _ in results:  # every output went back to its own request
        assert generation.text == f"{instance.prompt} {request_settings(request)}"
    monkeypatch.setenv("VLLM_PLUGINS", "before")
    list(engine.run(instances[:1], {"i0": requests[:1]}, StopRule(2, newline=False)))
    assert engine_vllm.os.environ["VLLM_PLUGINS"] == "before"  # the engine's environment is set only while it starts


def test_an_instance_whose_prompt_is_cached_goes_in_while_others_still_prefill_or_decode(monkeypatch):
    engine = _fake_engine(monkeypatch)
    instances = [SimpleNamespace(instance_id=key, prompt=key) for key in ("quick", "slow")]
    requests = [Request(parse_arm("fullkv"), None), Request(parse_arm("locks:r8i4"), 64)]
    stops = {"quick": StopRule(1, newline=False), "slow": StopRule(3, newline=False)}
    results = list(engine.run(instances, {i.instance_id: requests for i in instances}, stops))
    # quick's other request goes in after step 1, while slow's first one still runs; slow's after step 3
    assert [call for call in ([_text(p) for p in c] for c in _FakeLLM.calls)] == [["quick", "slow"], ["quick"], [],
                                                                                  ["slow"], [], []]  # fmt: skip
    assert [(i.instance_id, r.arm.label) for i, r, _, _ in results] == [
        ("quick", "fullkv"), ("quick", "locks:r8i4"), ("slow", "fullkv"), ("slow", "locks:r8i4")]


def test_summary_formats_get_an_engine_each_and_formatless_arms_join_the_first(monkeypatch):
    engine = _fake_engine(monkeypatch)
    instance = SimpleNamespace(instance_id="i0", prompt="p")
    requests = [Request(parse_arm("fullkv"), None), Request(parse_arm("locks:r8i4"), 64),
                Request(parse_arm("locks:r4i8"), 64), Request(parse_arm("oracle"), 64)]  # fmt: skip
    results = list(engine.run([instance], {"i0": requests}, StopRule(2, newline=False)))
    assert len(_FakeLLM.env) == 2 and sorted(r.arm.label for _, r, _, _ in results) == sorted(r.arm.label for r in requests)
    assert [len(batch) for batch in _steps()] == [1, 2, 1]  # r8i4 engine: fullkv first, then oracle + locks


def test_one_engine_serves_every_group_of_a_run_until_a_longer_context_needs_a_new_one(monkeypatch):
    engine = _fake_engine(monkeypatch)
    request = Request(parse_arm("fullkv"), None)
    stop = StopRule(max_new_tokens=2, newline=False)
    for prompt in ("short one", "short two", "x" * 200):  # three (task, length) groups; the last one is longer
        instance = SimpleNamespace(instance_id=prompt, prompt=prompt)
        list(engine.run([instance], {prompt: [request]}, stop))
    assert len(_FakeLLM.env) == 2 and len(_steps()) == 3
    assert engine._llm[1] == 200 + 2 + 16  # sized for the longest prompt and its generation


def test_engine_processes_are_spawned_unless_the_user_chose(monkeypatch):
    """A forked engine core cannot use CUDA once this process has (the H200 eval run failed so)."""
    engine = _fake_engine(monkeypatch)
    instance = SimpleNamespace(instance_id="i0", prompt="abc")
    request = Request(parse_arm("fullkv"), None)
    stop = StopRule(max_new_tokens=2, newline=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert len(list(engine.run([instance], {"i0": [request]}, stop))) == 1
    engine.close()
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    list(engine.run([instance], {"i0": [request]}, stop))
    assert [method for method, _ in _FakeLLM.env] == ["spawn", "fork"] and _FakeLLM.env[0][1] == "locks_toolkit"


def test_a_length_past_the_models_positions_is_refused_before_an_engine_starts(tmp_path):
    from locks_toolkit.suites.eval_runner import load_eval_engine

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    config = config_from_mapping({"suite": "ruler", "tasks": "niah_single_1", "lengths": "4k,8k", "arms": "fullkv",
                                  "model": str(tmp_path), "out": str(tmp_path / "o.jsonl"), "engine": "vllm"})  # fmt: skip
    with pytest.raises(EvalConfigError, match="length 8192 is past the 4096 positions .* pass --lengths up to 4096"):
        load_eval_engine(config)


class _SmallCore(_FakeCore):
    """An engine whose KV cache holds 3 blocks of 16 tokens."""

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=3, block_size=16))


class _SmallCacheLLM(_FakeLLM):
    core = _SmallCore


def test_open_prompts_stay_within_half_the_cache_each_request_with_its_instances_stop_rule(monkeypatch):
    engine = _fake_engine(monkeypatch)
    engine.vllm.LLM = _SmallCacheLLM
    prompts = {"a": "x" * 10, "b": "y" * 10, "c": "z" * 30, "d": "w" * 5}  # half the cache: 24 tokens open at once
    instances = [SimpleNamespace(instance_id=key, prompt=text) for key, text in prompts.items()]
    requests = [Request(parse_arm("fullkv"), None), Request(parse_arm("locks:r8i4"), 64)]
    stops = {key: StopRule(max_new_tokens=n, newline=False) for key, n in zip(prompts, (3, 4, 5, 6))}
    results = list(engine.run(instances, {key: requests for key in prompts}, stops))
    assert len(results) == 8 and len(_FakeLLM.env) == 1  # one engine for the whole run
    # a + b fit 24 tokens and open together; c alone is longer than that and opens once both closed; d (5
    # tokens) waits for c, since 30 + 5 > 24
    x, y, z, w = prompts.values()
    assert _steps() == [[x, y], [x], [y], [z], [z], [w], [w]]
    assert [n for n in _FakeLLM.max_tokens if n] == [[3, 4], [3], [4], [5], [5], [6], [6]]
    for instance, request, generation, _ in results:
        assert generation.text == f"{instance.prompt} {request_settings(request)}"


class _FewSeqsCore(_FakeCore):
    """An engine that schedules 2 requests a step: 4 unfinished requests keep the next instances out."""

    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=2))


class _FewSeqsLLM(_FakeLLM):
    core = _FewSeqsCore


def test_instances_open_while_their_unfinished_requests_stay_under_twice_the_engines_rows(monkeypatch):
    engine = _fake_engine(monkeypatch)
    engine.vllm.LLM = _FewSeqsLLM
    instances = [SimpleNamespace(instance_id=key, prompt=key) for key in ("a", "b", "c", "d")]
    requests = [Request(parse_arm("fullkv"), None), Request(parse_arm("locks:r8i4"), 64)]
    stops = {"a": StopRule(1, newline=False), "b": StopRule(3, newline=False), "c": StopRule(1, newline=False),
             "d": StopRule(1, newline=False)}  # fmt: skip
    results = list(engine.run(instances, {i.instance_id: requests for i in instances}, stops))
    # a and b open with 4 requests unfinished, so c waits for a's first request to finish, and d for a's second
    # (then c's second goes in beside it); without the bound all four would open in the first step
    assert _steps() == [["a", "b"], ["a", "c"], ["c", "d"], ["b", "d"]]
    assert len(results) == 8


def test_the_stream_window_bounds_tokens_and_rows_each_only_when_known():
    window = engine_vllm.StreamWindow(tokens=100, rows=4)
    assert window.admits(100, 3) and not window.admits(101, 0) and not window.admits(50, 4)
    assert engine_vllm.StreamWindow().admits(10**9, 10**6)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=16),
        scheduler_config=SimpleNamespace(max_num_seqs=256))))  # fmt: skip
    assert engine_vllm._window(llm) == engine_vllm.StreamWindow(tokens=80, rows=512)
    assert engine_vllm._window(SimpleNamespace()) == engine_vllm.StreamWindow()


class _StrangerCore(_FakeCore):
    def step(self):
        return [SimpleNamespace(request_id="elsewhere", finished=True, outputs=[])]


class _StrangerLLM(_FakeLLM):
    core = _StrangerCore


def test_an_output_of_a_request_the_run_did_not_send_is_an_error_not_a_wrong_record(monkeypatch):
    engine = _fake_engine(monkeypatch)
    engine.vllm.LLM = _StrangerLLM
    instance = SimpleNamespace(instance_id="i0", prompt="p")
    with pytest.raises(RuntimeError, match="finished request 'elsewhere', which this run did not send"):
        list(engine.run([instance], {"i0": [Request(parse_arm("fullkv"), None)]}, StopRule(2, newline=False)))


def test_prompt_ids_encode_a_batch_with_a_fast_tokenizer_as_one_at_a_time_would():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<unk>", "the", "needle", "is", "in", "hay"]
    core = Tokenizer(models.WordLevel({w: n for n, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers.processors import TemplateProcessing

    core.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    calls = []

    class Counted(PreTrainedTokenizerFast):
        def __call__(self, text, **kwargs):
            calls.append(len(text) if isinstance(text, list) else 1)
            return super().__call__(text, **kwargs)

    fast = Counted(tokenizer_object=core, bos_token="<bos>", unk_token="<unk>")
    instances = [SimpleNamespace(instance_id="a", prompt="the needle is in hay"),
                 SimpleNamespace(instance_id="b", prompt="hay is hay x"),
                 SimpleNamespace(instance_id="c", prompt="ignored", token_ids=(5, 6))]  # fmt: skip
    ids = engine_vllm.prompt_ids(instances, fast)
    assert calls == [2]  # one batch for the two texts; c brings its own ids
    calls.clear()
    assert ids == {"a": fast.encode("the needle is in hay"), "b": fast.encode("hay is hay x"), "c": [5, 6]}
    assert ids["a"][0] == 0 and ids["b"][-1] == 1  # the special token and the unknown word, as encode gives them
    slow = ByteTokenizer()
    assert engine_vllm.prompt_ids(instances[:1], slow) == {"a": slow.encode("the needle is in hay")}


def test_the_stream_pace_logs_rates_and_tokens_a_step_once_a_window_of_engine_time_gathered():
    pace = engine_vllm.StreamPace(every=1.0)
    for _ in range(3):
        pace.finished(tokens=8)
    assert pace.step(0.4, open_instances=2, open_requests=9) is None
    line = pace.step(0.6, open_instances=2, open_requests=7)
    assert line == ("stream: 3.0 cells/s, 24 tokens/s; 2 steps of 500.0 ms, 12.0 tokens a step; "
                    "2 instances open, 7 requests unfinished")  # fmt: skip
    assert pace.step(0.5, open_instances=1, open_requests=1) is None  # a new window starts after each line
    assert pace.steps == 1 and pace.cells == 0
