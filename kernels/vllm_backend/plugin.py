"""vLLM entry point (`vllm.general_plugins`): register the Locks backend class paths.

Runs in every vLLM process (front end, engine core, workers); idempotent. Only class paths are
registered, so nothing CUDA- or FlashAttention-related is imported at plugin load.
Select with attention_backend="CUSTOM". On the CPU platform, which ignores the selection,
LOCKS_VLLM_CPU=1 (the one opt-in variable) overrides CPU_ATTN with the Locks CPU subclass.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CUDA_BACKEND_PATH = "locks_toolkit.kernels.vllm_backend.backend_cuda.LocksBackend"
CPU_BACKEND_PATH = "locks_toolkit.kernels.vllm_backend.backend_cpu.LocksCpuBackend"
CPU_OPT_IN_ENV = "LOCKS_VLLM_CPU"


def register() -> None:
    """Put the Locks backend under AttentionBackendEnum.CUSTOM (and CPU_ATTN when opted in)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: PLC0415

    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
    if os.environ.get(CPU_OPT_IN_ENV) == "1" and _on_cpu_platform():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND_PATH)
        logger.info("Locks: %s=1, CPU_ATTN resolves to %s", CPU_OPT_IN_ENV, CPU_BACKEND_PATH)


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform  # noqa: PLC0415

    return current_platform.is_cpu()
