"""One in-process vLLM 0.24 engine, stepped one engine step at a time.

Prompts are seeded random token ids (no tokenizer), sampling ignores EOS and never detokenizes, so
every request decodes until we abort it. Each `step()` is timed (with a device sync on CUDA) and the
tokens it emitted are counted per request from the engine's DELTA outputs, never by re-tokenizing.
Requires VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by the worker before vLLM is imported): only then is
`step()` a synchronous schedule-execute-sample round trip whose wall time is the step latency. With
tensor parallelism the engine core stays in this process and drives one worker process per rank
(vLLM's "mp" executor); `step()` still returns only once the sampled tokens are back. Facts that
live in the workers (backend, weights, Locks counters) are read on every rank (harness/ranks.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ..kernels.config import ConfigError
from . import ranks
from .arms import SparseKnobs, get_arm
from .plan import GRAPH_MODES, DecodePlan

log = logging.getLogger(__name__)


class EngineStall(RuntimeError):
    """The engine stopped making progress on our requests (KV exhausted, requests stuck waiting)."""


@dataclass
class PrefillLog:
    request_ids: list[str]
    ttft_ms: float  # add_request of the first request -> first token of the last one
    step_ms: list[float] = field(default_factory=list)


@dataclass
class DecodeLog:
    step_ms: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted per step over our batch
    step_requests: list[int] = field(default_factory=list)  # how many of our requests emitted

    def after(self, steps: int) -> "DecodeLog":
        """The log without its first `steps` steps."""
        return DecodeLog(self.step_ms[steps:], self.step_tokens[steps:], self.step_requests[steps:])


class EngineSession:
    """A vLLM `LLM` built from a plan for one (arm, context[, budget]); steps it and times each step."""

    def __init__(self, plan: DecodePlan, arm_name: str, model_dir: str, dummy_weights: bool,
                 knobs: SparseKnobs | None, vocab_size: int, max_model_len: int | None = None):
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.arm = get_arm(arm_name)
        self.plan = plan
        self.vocab_size = vocab_size
        self._counter = 0
        self.max_model_len = max_model_len or plan.effective_max_model_len
        compilation_config, enforce_eager = GRAPH_MODES[plan.graph_mode]
        kwargs = dict(
            model=model_dir,
            load_format="dummy" if dummy_weights else "auto",
            skip_tokenizer_init=True,
            dtype=plan.dtype,
            seed=plan.seed,
            max_model_len=self.max_model_len,
            max_num_seqs=max(plan.batch_sizes),
            max_num_batched_tokens=max(plan.max_num_batched_tokens, max(plan.batch_sizes)),
            enable_prefix_caching=False,  # a cached prefix would benchmark the cache, not attention
            enable_chunked_prefill=True,  # prompts longer than max_num_batched_tokens prefill in chunks
            async_scheduling=plan.async_scheduling,  # on: step() returns the previous step's tokens
            gpu_memory_utilization=plan.gpu_memory_utilization,
            compilation_config=compilation_config,
            enforce_eager=enforce_eager,
            disable_log_stats=True,
            tensor_parallel_size=plan.tensor_parallel_size,
            **self.arm.engine_kwargs(knobs),
        )
        if plan.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"  # one worker process per rank on this host
        if plan.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = plan.kv_cache_memory_bytes
        self.engine_kwargs = kwargs
        started = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.boot_s = time.perf_counter() - started
        self.engine = self.llm.llm_engine
        _check_scheduling(plan.async_scheduling, self.engine.vllm_config, self.close)
        self.sampling = SamplingParams(
            max_tokens=self.max_model_len,  # never reached: requests are aborted
            ignore_eos=True,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        # TP > 1: the ranks run in worker processes and step() has already waited for their tokens;
        # a sync here would only open a CUDA context on GPU 0 in this process.
        # Async scheduling: no sync either, it would wait for the step queued behind this one and undo
        # the overlap being measured (step() already blocks on the step whose tokens it returns).
        self._sync = _device_sync(self.arm.device if plan.tensor_parallel_size == 1 and not plan.async_scheduling else "none")

    # -- facts about the engine -------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int | None:
        return self.engine.vllm_config.cache_config.num_gpu_blocks

    @property
    def block_size(self) -> int:
        return self.engine.vllm_config.cache_config.block_size

    def blocks_needed(self, batch: int, context: int, decoded: int | None = None) -> int:
        """KV blocks `batch` requests of `context` tokens hold once each has decoded `decoded` tokens (default:
        all the decode room of the plan)."""
        decoded = self.plan.decode_tokens_for(context) if decoded is None else decoded
        return batch * -(-(context + decoded) // self.block_size)

    def _on_every_rank(self, func, *args) -> list | None:
        """`func(worker, *args)` on every TP rank (harness/ranks.py), in rank order; None if the RPC fails."""
        try:
            return list(self.llm.collective_rpc(func, args=args))
        except Exception as exc:  # noqa: BLE001 - internal API; a lost fact must not end the run
            log.warning("collective_rpc(%s) failed: %s", getattr(func, "__name__", func), exc)
            return None

    def backend_in_use(self) -> str | None:
        """Name of the attention backend the model runners actually built ("A|B" if ranks disagree)."""
        names = self._on_every_rank(ranks.rank_backend) or [None]
        if any(name is None for name in names):
            return None
        return names[0] if len(set(names)) == 1 else "|".join(names)

    def rank_facts(self) -> list | None:
        """Per rank: rank, device and the query/KV heads that rank holds."""
        return self._on_every_rank(ranks.rank_facts)

    def model_weights(self, tied_embeddings: bool) -> dict | None:
        """Parameter bytes of the model summed over ranks, with the busiest rank's (harness/ranks.py)."""
        return ranks.combine_weights(self._on_every_rank(ranks.rank_weights, tied_embeddings) or [])

    def read_counters(self) -> dict | None:
        """The arm's deployed-path counters summed over TP ranks; None when the arm has none."""
        if self.arm.counters is None:
            return None
        return ranks.sum_counters(self._on_every_rank(ranks.rank_counters, self.arm.counters) or [])

    # -- requests ----------------------------------------------------------------------------------
    def _prompt(self, context: int, tag: str):
        from vllm.inputs import TokensPrompt

        self._counter += 1
        rng = np.random.default_rng([self.plan.seed, self._counter])
        ids = rng.integers(10, max(11, min(self.vocab_size, 32000)), size=context, dtype=np.int64)
        return TokensPrompt(prompt_token_ids=ids.tolist())

    def _step(self) -> tuple[float, list]:
        started = time.perf_counter()
        outputs = self.engine.step()
        self._sync()
        return (time.perf_counter() - started) * 1e3, outputs

    def prefill(self, batch: int, context: int, tag: str) -> PrefillLog:
        """Add `batch` fresh requests of `context` tokens and step until each has its first token."""
        prompts = [self._prompt(context, tag) for _ in range(batch)]
        ids = [f"{tag}-{self._counter}-{i}" for i in range(batch)]
        started = time.perf_counter()
        for request_id, prompt in zip(ids, prompts):
            self.engine.add_request(request_id, prompt, self.sampling)
        pending = set(ids)
        log_ = PrefillLog(request_ids=ids, ttft_ms=0.0)
        chunk_steps = -(-batch * context // self.plan.max_num_batched_tokens)
        for _ in range(4 * chunk_steps + 16):
            step_ms, outputs = self._step()
            log_.step_ms.append(step_ms)
            for output in outputs:
                if output.request_id in pending and output.outputs and output.outputs[0].token_ids:
                    pending.discard(output.request_id)
            if not pending:
                log_.ttft_ms = (time.perf_counter() - started) * 1e3
                return log_
        self.abort(ids)
        raise EngineStall(f"{len(pending)} of {batch} requests got no first token after {len(log_.step_ms)} steps")

    def decode(self, request_ids: list[str], steps: int, on_step=None) -> DecodeLog:
        """Run `steps` engine steps on the live batch, counting tokens each of our requests emitted."""
        ours = set(request_ids)
        log_ = DecodeLog()
        for index in range(steps):
            step_ms, outputs = self._step()
            tokens = requests = 0
            for output in outputs:
                if output.request_id in ours and output.outputs:
                    emitted = len(output.outputs[0].token_ids)
                    tokens += emitted
                    requests += emitted > 0
            log_.step_ms.append(step_ms)
            log_.step_tokens.append(tokens)
            log_.step_requests.append(requests)
            if on_step is not None and on_step(index):
                break
        return log_

    def abort(self, request_ids: list[str], drain: bool = True) -> None:
        """Abort (never finish) the requests, so end-of-sequence effects never enter the numbers. drain: step
        until nothing is left so the scheduler releases the blocks; off when other requests stay live (their
        own settle steps let the scheduler drop the aborted ones)."""
        self.engine.abort_request(list(request_ids))
        if not drain:
            return
        for _ in range(4):  # let the scheduler release the blocks before the next measurement
            if not self.engine.has_unfinished_requests():
                return
            self.engine.step()

    def close(self) -> None:
        """Shut the engine down; with TP > 1 this waits until the rank processes have exited."""
        try:
            self.engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001 - teardown is best effort; the process exits next
            log.warning("engine shutdown failed: %s", exc)
        del self.llm


def _check_scheduling(asked: bool, vllm_config, close) -> None:
    """Refuse an engine whose async scheduling differs from the plan's: vLLM overrides the request on
    some platforms (its CPU platform always turns it off), and a record must say how its steps ran."""
    ran = bool(vllm_config.scheduler_config.async_scheduling)
    if ran != asked:
        close()
        platform = getattr(getattr(vllm_config, "device_config", None), "device_type", "?")
        raise ConfigError(f"vLLM ran async scheduling {'on' if ran else 'off'} on this platform ({platform}) although the "
                          f"plan asked for it {'on' if asked else 'off'}; set async_scheduling: {str(ran).lower()} "
                          f"(--{'async' if ran else 'sync'}-scheduling) for this machine")


def _device_sync(device: str):
    if device != "cuda":
        return lambda: None
    import torch

    return torch.cuda.synchronize
