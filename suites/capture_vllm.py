"""Decode-step captures from the deployed engine: vLLM 0.24 with the Locks backend, greedy, batch 1.

The microscope then measures fidelity on exactly the queries and keys the deployed engine scores. The
Locks backend runs with a budget above every prompt's pages, so every page is selected and the engine
decodes as FullKV does, and with `debug_capture_layers` set to the model's global layers (eager only:
captures are taken in Python). The engine runs in a subprocess of its own (vLLM loads its plugins once
per process; the CPU platform's opt-in is an environment variable); the child writes the captures with
`torch.save` and the parent reads them as `DecodeCapture`s, the shape the transformers engine's capture
has, so the microscope takes either.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..kernels.config import PAGE_SIZE
from ..kernels.vllm_backend.debug import layer_index  # torch only: no vLLM import
from .engine_vllm import engine_length
from .models import DecodeCapture

logger = logging.getLogger(__name__)

ENGINE_TIMEOUT_S = 1800


def arm_for(device: str) -> str:
    """The harness arm that runs the Locks backend on `device` ("cpu": vLLM's CPU platform, else CUDA)."""
    return "locks-cpu" if device == "cpu" else "locks"


def capture_budget(prompts: Sequence[Sequence[int]], steps: int) -> int:
    """A budget that holds every page of the longest prompt after `steps` decode steps (so FullKV's output)."""
    longest = max(len(p) for p in prompts) + steps + 1
    return -(-longest // PAGE_SIZE) * PAGE_SIZE + PAGE_SIZE


def captures_from_engine(debug_captures: Sequence[dict], layers: Sequence[int], prompt_len: int, steps: int,
                         group: int) -> dict[str, torch.Tensor]:
    """One prompt's engine captures (kernels/vllm_backend/debug.py records, batch 1) -> the tensors of a
    DecodeCapture: queries [L, T, Hkv, G, d], outputs likewise, keys/values [L, Hkv, N, d] read from the
    final cache through the block table (pages are append-only), seq_lens [T]."""
    by_layer: dict[int, list[dict]] = {layer: [] for layer in layers}
    for capture in debug_captures:
        index = layer_index(capture["layer"])
        if index in by_layer:
            by_layer[index].append(capture)
    queries, outputs, keys, values = [], [], [], []
    for layer in layers:
        steps_seen = by_layer[layer]
        if len(steps_seen) != steps:
            raise RuntimeError(f"layer {layer}: {len(steps_seen)} decode captures, expected {steps} (an engine that "
                               "ran CUDA graphs or batched the prompt with another records none or more)")
        if any(c["q"].shape[0] != 1 for c in steps_seen):
            raise RuntimeError(f"layer {layer}: a decode step held more than one sequence; captures are batch 1")
        hkv = steps_seen[0]["k_cache"].shape[2]
        queries.append(torch.stack([c["q"][0].view(hkv, group, -1) for c in steps_seen]))
        outputs.append(torch.stack([c["out"][0].view(hkv, group, -1) for c in steps_seen]))
        last = steps_seen[-1]
        tokens = int(last["seq_lens"][0])
        blocks = last["block_table"][0, : -(-tokens // PAGE_SIZE)].long().to(last["k_cache"].device)

        def gathered(cache: torch.Tensor) -> torch.Tensor:  # [NB, B, Hkv, d] -> [Hkv, N, d]
            pages = cache[blocks].to("cpu", torch.float32)
            return pages.reshape(-1, pages.shape[2], pages.shape[3])[:tokens].permute(1, 0, 2).contiguous()

        keys.append(gathered(last["k_cache"]))
        values.append(gathered(last["v_cache"]))
    seq_lens = torch.tensor([int(c["seq_lens"][0]) for c in by_layer[layers[0]]], dtype=torch.long)
    expected = torch.arange(prompt_len + 1, prompt_len + steps + 1, dtype=torch.long)
    if not torch.equal(seq_lens, expected):
        raise RuntimeError(f"captured decode lengths {seq_lens.tolist()} are not {expected.tolist()}")
    return {"queries": torch.stack(queries).float(), "outputs": torch.stack(outputs).float(),
            "keys": torch.stack(keys), "values": torch.stack(values), "seq_lens": seq_lens}


def _child(model_dir: str, arm_name: str, budget: int, layers: list[int], group: int, steps: int,
           prompts: list[list[int]], out: str, dtype: str) -> None:
    """In the engine's own process: one eager engine, each prompt alone, captures saved to `out`."""
    from ..harness.arms import SparseKnobs, get_arm

    arm, knobs = get_arm(arm_name), SparseKnobs(budget)
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1", **arm.environment(knobs, None)})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ..kernels.vllm_backend import counters, debug

    kwargs = arm.engine_kwargs(knobs)
    kwargs["additional_config"]["locks"]["debug_capture_layers"] = layers
    longest = max(len(p) for p in prompts) + steps + 1
    size = engine_length(longest, longest + PAGE_SIZE, model_dir)  # a page of slack, where the positions allow it
    llm = LLM(model_dir, dtype=dtype, max_model_len=size, max_num_batched_tokens=size,
              enforce_eager=True, enable_prefix_caching=False, seed=0, **kwargs)
    results = []
    for ids in prompts:
        debug.clear()
        counters.reset()
        start = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, max_tokens=steps + 1),
                              use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        tensors = captures_from_engine(debug.captures, layers, len(ids), steps, group)
        results.append({**tensors, "generated_ids": list(output.outputs[0].token_ids), "seconds": seconds,
                        "counters": counters.snapshot()})
    debug.clear()
    torch.save(results, out)


def vllm_decode_captures(model_dir: str | Path, prompts: Sequence[Sequence[int]], steps: int, layers: Sequence[int],
                         group: int, device: str = "cpu", dtype: str = "float32") -> list[tuple[DecodeCapture, dict]]:
    """Greedy decode of each prompt in the deployed engine; per prompt its DecodeCapture and what the engine
    reported ({"seconds", "counters"}: the Locks counters show the sparse path ran on every global layer)."""
    budget = capture_budget(prompts, steps)
    with tempfile.TemporaryDirectory(prefix="locks-capture-") as scratch:
        out = Path(scratch) / "captures.pt"
        # the arguments go in a file: a 32K-token prompt as one argv string passes the OS limit (E2BIG)
        args = Path(scratch) / "args.json"
        args.write_text(json.dumps({"model_dir": str(model_dir), "arm_name": arm_for(device), "budget": budget,
                                    "layers": list(layers), "group": group, "steps": steps,
                                    "prompts": [list(map(int, p)) for p in prompts], "out": str(out), "dtype": dtype}))
        env = {k: v for k, v in os.environ.items() if k != "LOCKS_VLLM_CPU"}
        logger.info("capturing %d prompt(s) x %d decode steps in vLLM (%s, budget %d: every page)", len(prompts),
                    steps, arm_for(device), budget)
        proc = subprocess.run([sys.executable, "-m", __name__, str(args)], env=env, capture_output=True, text=True,
                              timeout=ENGINE_TIMEOUT_S)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the vLLM capture engine failed (exit {proc.returncode}):\n{tail}")
        results = torch.load(out, weights_only=False)
    captures = []
    for ids, result in zip(prompts, results):
        capture = DecodeCapture(layers=tuple(layers), queries=result["queries"], keys=result["keys"],
                                values=result["values"], outputs=result["outputs"], seq_lens=result["seq_lens"],
                                prompt_len=len(ids), generated_ids=result["generated_ids"],
                                prefill_seconds=float("nan"), decode_seconds=result["seconds"])
        captures.append((capture, {"seconds": result["seconds"], "counters": result["counters"]}))
    return captures


if __name__ == "__main__":
    _child(**json.loads(Path(sys.argv[1]).read_text()))
